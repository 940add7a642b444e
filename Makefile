# The two commands of the README. Both work on a fresh clone: they create .venv first.
.PHONY: setup demo test test-fast bench clean

setup:
	bash scripts/setup.sh

# A real tiny training run on this machine: tiny Llama built locally, shipped data, loss falls.
demo: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/orchestrate submit recipes/configs/sft_tiny.yaml

# The whole suite: unit, golden, local multi-node, recipes, real sshd hosts and a real SLURM cluster (as root).
test: setup
	bash scripts/run_tests.sh

test-fast: setup
	.venv/bin/python -m pytest tests/unit -q

clean:
	rm -rf .venv outputs .pytest_cache
