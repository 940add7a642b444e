"""Real training through the CLI on the local backend: the README's demo (one node) and a 2-node run whose
gradients are proven synced (same parameters on every rank AND different first batches per rank)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def submit(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", "recipes/configs/sft_tiny.yaml", *args,
                        f"trainer.output_dir={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    m = re.search(r"^\[\S+ node0\] ORCHESTRATE_RESULT (\{.*\})$", r.stdout, re.MULTILINE)
    return r, (json.loads(m.group(1)) if m else {})


@pytest.mark.slow
def test_demo_single_node_trains_and_reports(tmp_path):
    r, res = submit(tmp_path, "trainer.max_steps=12", "trainer.save_steps=6", "trainer.save_strategy=steps")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert res["world_size"] == 1 and res["global_step"] == 12
    assert res["final_loss"] < res["first_loss"]
    m = re.search(r"job \S+ COMPLETED: loss ([\d.]+) -> ([\d.]+) over 12 steps; checkpoint: (\S+)", r.stdout)
    assert m, r.stdout[-2000:]
    assert Path(m.group(3)).is_dir() and m.group(3).endswith("checkpoint-12")
    assert re.search(r"^progress: step \d+/12 \(\d+%\) \| loss [\d.]+ \| [\d,]+ tok/s", r.stdout, re.MULTILINE), \
        r.stdout[-2000:]


@pytest.mark.slow
def test_two_local_nodes_train_with_synced_gradients(tmp_path):
    r, res = submit(tmp_path, "--nodes", "2", "trainer.max_steps=10")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "world      2 node(s) x 1 process(es) = 2" in r.stdout
    assert res["world_size"] == 2 and res["global_step"] == 10
    ranks = res["ranks"]
    assert len({x["param_sha"] for x in ranks}) == 1, ranks  # every rank ends with the same parameters
    assert len({x["first_batch_sha"] for x in ranks}) == 2, ranks  # ...having seen different data
    assert res["final_loss"] < res["first_loss"]
    assert "[localhost node1]" in r.stdout


@pytest.mark.slow
@pytest.mark.deepspeed
def test_dpo_zero3_on_two_local_nodes(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", "recipes/configs/dpo_tiny.yaml", "--nodes",
                        "2", "--profile", "zero3", "trainer.max_steps=4", f"trainer.output_dir={tmp_path / 'out'}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "profile    zero3 -> DEEPSPEED" in r.stdout
    m = re.search(r"^\[\S+ node0\] ORCHESTRATE_RESULT (\{.*\})$", r.stdout, re.MULTILINE)
    res = json.loads(m.group(1))
    assert res["world_size"] == 2 and res["global_step"] == 4
    # ZeRO-3: each rank holds half of the parameters
    assert all(x["local_param_numel"] < x["full_param_numel"] for x in res["ranks"]), res["ranks"]
    assert res["first_loss"] != res["final_loss"]
