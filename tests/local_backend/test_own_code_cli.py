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
    result = re.search(r"^\[localhost node0 rank0\] TRAIN_RESULT (\{.*\})$", text, re.MULTILINE)
    assert result and json.loads(result.group(1))["global_step"] == 6, text[-3000:]
    assert "[localhost node1 rank1] " in text  # live logs of both nodes, by rank
    assert (out / "model.safetensors").exists()
    rec = recorded(m.group(1))
    assert rec["state"] == "COMPLETED"
    beats = Path(rec["run_dir"]) / "heartbeats"  # both ranks stepped, each in its own rank: really distributed
    for r in (0, 1):
        lines = [json.loads(x) for x in (beats / f"rank{r}.jsonl").read_text().splitlines()]
        assert any(x["event"] == "step" and x["rank"] == r for x in lines), lines[-5:]


def test_a_trainer_without_use_cpu_on_a_cpu_cluster_is_still_one_distributed_run(tmp_path, tiny_model, job_guard):
    """2 nodes, a Trainer script told use_cpu=false on a CPU cluster: transformers alone would leave each rank
    training alone on all the data (it only warns). The ranks are told ACCELERATE_USE_CPU=true at start-up
    (hooks/orchestrate_world.py), which TrainingArguments reads: the run is distributed. Were it not, the hooks'
    Trainer check would fail every rank with `TrainsAlone: this rank's Trainer is not distributed`."""
    rc, text = submit("examples/own_code/my_job.yaml", f"run.args.model_name_or_path={tiny_model}",
                      f"run.args.output_dir={tmp_path / 'out'}", "run.args.max_steps=6", "run.args.use_cpu=false")
    assert rc == 0 and "TrainsAlone" not in text, text[-4000:]
    result = re.search(r"^\[localhost node0 rank0\] TRAIN_RESULT (\{.*\})$", text, re.MULTILINE)
    assert result and json.loads(result.group(1))["global_step"] == 6, text[-3000:]


def test_trl_sft_subcommand_on_two_local_nodes(tmp_path, tiny_model, job_guard):
    out = tmp_path / "out"
    rc, text = submit("examples/own_code/trl_sft.yaml", f"run.args.model_name_or_path={tiny_model}",
                      f"run.args.output_dir={out}", "run.args.max_steps=4")
    assert rc == 0, text[-4000:]
    m = re.search(r"^job (\S+) COMPLETED", text, re.MULTILINE)
    assert m, text[-3000:]
    assert "world      2 node(s) x 1 process(es) = 2" in text, text[:3000]
    assert " -m trl.scripts.sft " in text and "--use_cpu true" in text
    assert "[localhost node0 rank0] " in text and "[localhost node1 rank1] " in text  # live logs of both nodes
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


def test_module_entry_point_on_two_local_nodes(tmp_path, job_guard):
    """`run: {module: ...}`: a package of the user's in the directory they submit from, run as `python -m` on every
    rank (it never imports orchestrate; a plain gloo loop with its own optimizer)."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import os, sys\nimport torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nmodel = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(int(sys.argv[1])):\n"
        "    loss = model(torch.ones(2, 4)).sum()\n    opt.zero_grad(); loss.backward(); opt.step()\n"
        "sys.stdout.write(f'MODULE_RANK {dist.get_rank()} of {dist.get_world_size()} as {__name__}\\n')\n"
        "dist.destroy_process_group()\n")
    (tmp_path / "job.yaml").write_text("run: {module: mypkg.train, args: ['3']}\nhealth: {stall_timeout: 120}\n")
    r = run([PYTHON, "-m", "orchestrator.cli", "submit", "job.yaml", "--nodes", "2"],
            env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=600, stderr=None)
    text = r.stdout
    assert r.returncode == 0, text[-4000:]
    m = re.search(r"^job (\S+) COMPLETED", text, re.MULTILINE)
    assert m and "(own code: module mypkg.train, " in text, text[-3000:]
    assert "[localhost node0 rank0] MODULE_RANK 0 of 2 as __main__" in text, text[-3000:]
    assert "[localhost node1 rank1] MODULE_RANK 1 of 2 as __main__" in text, text[-3000:]
    rec = recorded(m.group(1))
    assert rec["state"] == "COMPLETED"
    for rank in (0, 1):  # the optimizer-step hook's records: the module writes none
        assert [x["step"] for x in heartbeats(Path(rec["run_dir"]), rank) if x["event"] == "step"] == [1, 2, 3]
