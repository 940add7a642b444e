#!/usr/bin/env bash
# Run the whole suite: the static checks (scripts/lint.sh: ruff, import-linter, mypy), then pytest.
# pytest runs even when lint failed (both results are shown); the exit status is non-zero if either failed.
# Under CI=true, tests that need sshd / SLURM / root must run, not skip.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
bash scripts/lint.sh
lint_rc=$?
.venv/bin/python -m pytest tests -q -rs --durations=25 --timeout=900 "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "run_tests: no tests collected" >&2; exit 1; fi
if [ $lint_rc -ne 0 ]; then echo "run_tests: lint failed (scripts/lint.sh, see above)" >&2; [ $rc -eq 0 ] && rc=1; fi
exit $rc
