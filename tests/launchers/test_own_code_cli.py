"""Own code end to end on the local backend (issue #12): the shipped examples/own_code jobs - a Hugging Face Trainer
script that never imports orchestrate, and `trl: sft` - submitted through the CLI on 2 local nodes reach COMPLETED,
with live logs from both nodes and the job recorded in the store. Slow."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from helpers import OFFLINE_ENV, PYTHON, heartbeats, run

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
    assert "world      2 node(s) x 1 process(es) = 2" in text, text[:3000]
    assert " -m trl.scripts.sft " in text and "--use_cpu true" in text
    assert "[localhost node0] " in text and "[localhost node1] " in text  # live logs of both nodes
    assert (out / "model.safetensors").exists()
    rec = recorded(m.group(1))
    assert rec["state"] == "COMPLETED"
    losses = {}
    for rank in (0, 1):  # written by the zero-code hooks into TRL's SFTTrainer: TRL's script writes none
        recs = heartbeats(Path(rec["run_dir"]), rank)
        steps = [x for x in recs if x["event"] == "step"]
        assert [x["step"] for x in steps] == [1, 2, 3, 4] and recs[-1]["event"] == "end", recs
        logged = [x["loss"] for x in steps if x["step"] % 2 == 0]  # the example logs every 2 steps
        assert len(logged) == 2 and all(isinstance(v, float) and math.isfinite(v) for v in logged), steps
        losses[rank] = logged
    assert losses[0] == losses[1], losses  # the Trainer logs the loss averaged over the ranks: one run, not two
