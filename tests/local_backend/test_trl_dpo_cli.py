"""`run: {trl: dpo, args: ...}` end to end on the local backend (issue #12): TRL's own `trl dpo` script (python -m
trl.scripts.dpo under accelerate launch, which never imports orchestrate) on the tiny model and the repo's shipped
preference data (recipes/data/dpo_tiny.jsonl, what recipes/configs/dpo_tiny.yaml trains on), submitted through the CLI
on 2 local nodes: COMPLETED, per-step heartbeats with the loss from every rank (written by the zero-code hooks), the
loss starting at ln 2 (policy == reference: a real DPO loss) and moving off it, the job recorded in the store. Slow."""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import OFFLINE_ENV, PYTHON, heartbeats, run

REPO = Path(__file__).resolve().parents[2]
DPO_DATA = REPO / "recipes" / "data" / "dpo_tiny.jsonl"
MAX_STEPS = 4

pytestmark = pytest.mark.slow


def test_trl_dpo_subcommand_on_two_local_nodes(tmp_path, tiny_model, job_guard):
    # `trl dpo --dataset_name X` calls datasets.load_dataset(X): a local X must be a directory of data files (a .jsonl
    # path is "Couldn't find any data file"), and recipes/data/ also holds the SFT data: give the DPO file its own.
    data = tmp_path / "dpo_data"
    data.mkdir()
    shutil.copy(DPO_DATA, data / "train.jsonl")
    out = tmp_path / "out"
    job = tmp_path / "trl_dpo.yaml"
    job.write_text(yaml.safe_dump({
        "run": {"trl": "dpo", "args": {
            "model_name_or_path": tiny_model, "dataset_name": str(data), "output_dir": str(out),
            "max_steps": MAX_STEPS, "per_device_train_batch_size": 4, "learning_rate": 1.0e-3, "beta": 0.1,
            "max_length": 128, "lr_scheduler_type": "constant", "logging_steps": 1, "save_strategy": "no",
            "report_to": "none", "dataloader_num_workers": 0, "activation_checkpointing": False, "seed": 42}},
        "launch": {"profile": "multi_gpu", "nodes": 1, "procs_per_node": 1},
        "health": {"stall_timeout": 300}}))
    r = run([PYTHON, "-m", "orchestrator.cli", "submit", str(job), "--nodes", "2"],
            env={**os.environ, **OFFLINE_ENV}, cwd=REPO, timeout=900, stderr=None)
    text = r.stdout
    assert r.returncode == 0, text[-4000:]
    m = re.search(r"^job (\S+) COMPLETED", text, re.MULTILINE)
    assert m, text[-3000:]
    assert "world      2 node(s) x 1 process(es) = 2" in text, text[:3000]
    assert " -m trl.scripts.dpo " in text and "--use_cpu true" in text, text[:3000]
    assert "[localhost node0 rank0] " in text and "[localhost node1 rank1] " in text  # live logs of both nodes
    assert "Training completed." in text and (out / "model.safetensors").exists(), text[-3000:]

    from orchestrator.store import JobStore
    rec = JobStore().get(m.group(1))
    assert rec is not None and rec.state == "COMPLETED", rec
    run_dir = Path(rec.run_dir)
    losses = {}
    for rank in (0, 1):  # written by the zero-code hooks into TRL's DPOTrainer: TRL's script writes none
        recs = heartbeats(run_dir, rank)
        assert recs and all(x["rank"] == rank for x in recs), recs
        steps = [x for x in recs if x["event"] == "step"]
        assert [x["step"] for x in steps] == list(range(1, MAX_STEPS + 1)), recs
        assert all(x["max_steps"] == MAX_STEPS for x in steps) and recs[-1]["event"] == "end", recs
        assert all(isinstance(x["loss"], float) and math.isfinite(x["loss"]) for x in steps), steps
        losses[rank] = [x["loss"] for x in steps]
    # DPO's loss at step 1 is -log(sigmoid(0)) = ln 2 (the policy still equals its reference), then it moves off it
    assert abs(losses[0][0] - math.log(2)) < 1e-3, losses
    assert losses[0][-1] < losses[0][0] - 1e-3, losses
    assert losses[0] == losses[1], losses  # the Trainer logs the loss averaged over the ranks: one run, not two
    assert "rewards/margins" in text  # TRL's DPO metrics in the live log
