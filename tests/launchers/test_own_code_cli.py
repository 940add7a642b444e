"""Own code end to end on the local backend (issue #12): the shipped examples/own_code jobs - a Hugging Face Trainer
script that never imports orchestrate, and `trl: sft` - submitted through the CLI on 2 local nodes reach COMPLETED,
with live logs from both nodes and the job recorded in the store. Slow."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from helpers import OFFLINE_ENV, PYTHON, run

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def submit(job: str, *overrides: str) -> tuple[int, str]:
    r = run([PYTHON, "-m", "orchestrator.cli", "submit", job, "--nodes", "2", *overrides],
            env={**os.environ, **OFFLINE_ENV}, cwd=REPO, timeout=900, stderr=None)
    return r.returncode, r.stdout


def recorded(job_id: str) -> dict:
    from orchestrator.store import JobStore
    rec = JobStore().get(job_id)
    return rec.to_dict() if rec is not None else {}


def test_own_trainer_script_on_two_local_nodes(tmp_path, tiny_model, job_guard):
    out = tmp_path / "out"
    rc, text = submit("examples/own_code/my_job.yaml", f"run.args.model_name_or_path={tiny_model}",
                      f"run.args.output_dir={out}", "run.args.max_steps=6")
    assert rc == 0, text[-4000:]
    m = re.search(r"^job (\S+) COMPLETED", text, re.MULTILINE)
    assert m, text[-3000:]
    assert "world      2 node(s) x 1 process(es) = 2" in text and "(own code: script " in text
    result = re.search(r"^\[localhost node0\] TRAIN_RESULT (\{.*\})$", text, re.MULTILINE)
    assert result and json.loads(result.group(1))["global_step"] == 6, text[-3000:]
    assert "[localhost node1] " in text  # live logs of both nodes
    assert (out / "model.safetensors").exists()
    assert recorded(m.group(1))["state"] == "COMPLETED"


def test_trl_sft_subcommand_on_two_local_nodes(tmp_path, tiny_model, job_guard):
    out = tmp_path / "out"
    rc, text = submit("examples/own_code/trl_sft.yaml", f"run.args.model_name_or_path={tiny_model}",
                      f"run.args.output_dir={out}", "run.args.max_steps=4")
    assert rc == 0, text[-4000:]
    m = re.search(r"^job (\S+) COMPLETED", text, re.MULTILINE)
    assert m, text[-3000:]
    assert " -m trl.scripts.sft " in text and "--use_cpu true" in text
    assert (out / "model.safetensors").exists()
    assert recorded(m.group(1))["state"] == "COMPLETED"
