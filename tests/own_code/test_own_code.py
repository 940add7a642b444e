"""A user's own training scripts (tests/own_code/train_*.py, which never import orchestrate) under a real
`accelerate launch` of 2 processes (torchrun path, gloo on CPU) with only the hooks directory on PYTHONPATH and
the environment the node agent sets: per-step heartbeats on every rank, save-on-signal, automatic resume; and a
built-in recipe with the hooks on its path still writes each record once."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from own_code_helpers import CONTRACT_FIELDS, DATA, REPO, base_env, free_port, records, wait_for

pytestmark = pytest.mark.slow


def _result(out: str, prefix: str) -> list[dict]:
    return [json.loads(x[len(prefix):]) for x in out.splitlines() if x.startswith(prefix)]


def tb_events(path: Path):
    """The Event records of a TensorBoard event file (TFRecord framing: length, its CRC, data, the data's CRC)."""
    from tensorboardX.proto import event_pb2
    data, i = path.read_bytes(), 0
    while i < len(data):
        n = struct.unpack("<Q", data[i:i + 8])[0]
        yield event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4


def _steps(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["event"] == "step"]


def test_hf_trainer_script_gets_heartbeats_on_every_rank(launch_user, tiny_model, tmp_path):
    hb = tmp_path / "hb"
    run = launch_user("train_hf.py", [tiny_model, str(DATA), str(tmp_path / "out"), "15"],
                      env={"ORCHESTRATE_HEARTBEAT_DIR": hb})
    rc = run.wait(timeout=300)
    out = run.output
    assert rc == 0, out[-4000:]
    assert _result(out, "USER_RESULT ")[0]["global_step"] == 15
    # none from the launcher process; each rank's exit record (orchestrate_hooks) beside its heartbeats
    assert sorted(os.listdir(hb)) == ["rank0.exit", "rank0.jsonl", "rank1.exit", "rank1.jsonl"]
    for rank in (0, 1):
        recs = records(hb / f"rank{rank}.jsonl")
        assert all(set(r) - {"proc_start", "compute_s"} == CONTRACT_FIELDS and r["rank"] == rank for r in recs)
        assert sum("compute_s" in r for r in recs) >= 13, recs  # the straggler evidence from step 2 on
        assert [r["event"] for r in recs] == ["boot", "start"] + ["step"] * 15 + ["end"], recs
        steps = _steps(recs)
        # the Trainer's records win: one per optimizer step, none from the optimizer-step hook
        assert [r["step"] for r in steps] == list(range(1, 16))
        assert all(isinstance(r["loss"], float) and r["max_steps"] == 15 for r in steps)
        tokens = [r["tokens"] for r in steps]
        assert tokens == sorted(tokens) and tokens[0] > 0  # the user's include_num_input_tokens_seen
    first = [r["loss"] for r in _steps(records(hb / "rank0.jsonl"))]
    assert first[-1] < first[0]


def test_hf_trainer_signal_saves_then_auto_resume(launch_user, tiny_model, tmp_path):
    hb, out_dir = tmp_path / "hb", tmp_path / "out"
    args = [tiny_model, str(DATA), str(out_dir)]
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = {"ORCHESTRATE_JOB_ID": "job-tb", "REPORT_TO": "tensorboard,mlflow",  # (the user's own report_to)
           "MLFLOW_TRACKING_URI": mlflow_uri}
    run = launch_user("train_hf.py", args + ["100000"], env={"ORCHESTRATE_HEARTBEAT_DIR": hb, **job}, tag="pre")
    wait_for(lambda: all(len(_steps(records(hb / f"rank{r}.jsonl"))) >= 3 for r in (0, 1)), 240, run,
             "3 steps on both ranks")
    ranks = run.ranks("train_hf.py")
    assert len(ranks) == 2, ranks
    for proc in ranks:  # what SLURM does ahead of the time limit (the launcher itself ignores USR2 under the agent)
        proc.send_signal(signal.SIGUSR2)
    rc = run.wait(timeout=240)
    out = run.output
    assert rc != 0, out[-3000:]  # a preempted run is not a finished run
    ckpts = sorted(out_dir.glob("checkpoint-*"), key=lambda d: int(d.name.split("-")[1]))
    assert len(ckpts) == 1 and (ckpts[0] / "optimizer.pt").exists(), out[-3000:]
    saved = int(ckpts[0].name.split("-")[1])
    assert saved >= 3
    # the hooks' save callback recorded who wrote it (docs/CONTRACT.md "Checkpoints"): rank 0 only, once
    assert json.loads((ckpts[0] / "orchestrate.json").read_text())["job_id"] == "job-tb"
    assert json.loads((ckpts[0] / "orchestrate.json").read_text())["step"] == saved
    for rank in (0, 1):
        recs = records(hb / f"rank{rank}.jsonl")
        assert recs[-1]["event"] == "preempted" and recs[-1]["step"] == saved, recs[-4:]
        assert any(r["event"] == "save_start" and r["step"] == saved for r in recs)
        assert any(r["event"] == "save" and r["step"] == saved for r in recs)
        assert "end" not in [r["event"] for r in recs]
    # every rank left with 128+SIGUSR2 after saving (torchrun's failure report lists each rank's exit code)
    assert out.count("exitcode  : 140") == 2 and "exitcode  : -" not in out, out[-3000:]
    assert "USER_RESULT" not in out  # the rest of the script did not run for an unfinished job

    hb2 = tmp_path / "hb2"
    run = launch_user("train_hf.py", args + [str(saved + 3)],
                      env={"ORCHESTRATE_HEARTBEAT_DIR": hb2, "ORCHESTRATE_RESUME": "auto", **job}, tag="post")
    rc = run.wait(timeout=300)
    out = run.output
    assert rc == 0, out[-4000:]
    assert f"resuming from {ckpts[0]} (ORCHESTRATE_RESUME=auto)\n" in out  # its own: no other job named
    assert _result(out, "USER_RESULT ")[0]["global_step"] == saved + 3
    for rank in (0, 1):
        recs = records(hb2 / f"rank{rank}.jsonl")
        named = [r for r in recs if r["event"] == "tracking"]  # rank 0 only: the MLflow run it resumed
        assert [(r["tracker"], r["resumed"]) for r in named] == ([("mlflow", True)] if rank == 0 else []), named
        recs = [r for r in recs if r["event"] != "tracking"]
        steps = _steps(recs)
        assert [r["step"] for r in steps] == [saved + 1, saved + 2, saved + 3], recs
        assert recs[1]["event"] == "start" and recs[1]["step"] == saved and recs[-1]["event"] == "end"
    # MLflow: both attempts in ONE run (found again by its tag orchestrate.job_id), the losses of the second going on
    # from the checkpoint's step (docs/tracking.md)
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.tags["orchestrate.job_id"] == "job-tb" and run.info.status == "FINISHED"
    (named,) = [r for r in records(hb2 / "rank0.jsonl") if r["event"] == "tracking"]
    assert named["run_id"] == run.info.run_id and named["tracking_uri"] == mlflow_uri
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: (m.timestamp, m.step))
    assert [m.step for m in history] == list(range(1, saved + 4)), [m.step for m in history]
    # TensorBoard: both attempts in ONE run, <output_dir>/runs/<job id> (transformers' default: a dir per start),
    # written by rank 0 only; the second attempt's losses go on from the checkpoint's step
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:  # (transformers 4: its own dir per start, left alone)
        return
    assert [d.name for d in (out_dir / "runs").iterdir()] == ["job-tb"]
    files = sorted((out_dir / "runs" / "job-tb").glob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime)
    assert len(files) == 2, files
    loss_steps = [[e.step for e in tb_events(f) for v in e.summary.value if v.tag == "train/loss"] for f in files]
    assert loss_steps[0][:3] == [1, 2, 3] and loss_steps[1] == [saved + 1, saved + 2, saved + 3], loss_steps


def test_plain_torch_loop_gets_one_record_per_optimizer_step(launch_user, tmp_path):
    hb = tmp_path / "hb"
    run = launch_user("train_plain.py", ["30", "--two-optimizers"], env={"ORCHESTRATE_HEARTBEAT_DIR": hb})
    rc = run.wait(timeout=300)
    out = run.output
    assert rc == 0, out[-4000:]
    results = _result(out, "PLAIN_RESULT ")
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all("orchestrator" not in r["modules"] for r in results), results  # the hooks import no package
    assert sorted(os.listdir(hb)) == ["rank0.exit", "rank0.jsonl", "rank1.exit", "rank1.jsonl"]
    for rank in (0, 1):
        recs = records(hb / f"rank{rank}.jsonl")
        assert recs[0]["event"] == "boot"
        assert [(r["event"], r["step"]) for r in recs[1:]] == [("step", s) for s in range(1, 31)], recs
        assert all(r["rank"] == rank and set(r) - {"compute_s"} == CONTRACT_FIELDS for r in recs[1:])


def test_rank_that_ended_well_is_not_aborted_at_interpreter_exit(launch_user, tmp_path):
    """torch's exit race (pytorch#190489): a gloo worker that frees its last work object after a DDP script's final
    barrier needs the GIL; when finalization has begun by then, the thread is ended inside a C++ destructor and the
    rank dies of SIGABRT ("terminate called without an active exception") after doing all its work. The script ends
    the riskiest way: a long switch interval, nothing after the barrier, no heartbeat left to flush at exit (whose
    write would release the GIL by chance). Unhooked, this ending aborted 4 of 8 runs here (gdb: the worker in
    take_gil -> pthread_exit from ~AsyncBarrierWork); every hooked run must end 0 (_settle_at_exit)."""
    for i in range(3):
        run = launch_user("train_plain.py", ["5", "--switch-interval", "5", "--no-destroy"], tag=f"exit{i}",
                          env={"ORCHESTRATE_HEARTBEAT_DIR": tmp_path / f"hb{i}", "ORCHESTRATE_HEARTBEAT_FLUSH_S": "0"})
        rc = run.wait(timeout=300)
        out = run.output
        assert rc == 0 and "terminate called" not in out, out[-4000:]
        assert sorted(r["rank"] for r in _result(out, "PLAIN_RESULT ")) == [0, 1]


def test_builtin_recipe_with_hooks_on_path_writes_each_record_once(tiny_model, tmp_path):
    """If the agent puts the hooks on every launch's PYTHONPATH, the recipes' own callbacks rule (no doubles)."""
    cfg = yaml.safe_load((REPO / "recipes" / "configs" / "sft_tiny.yaml").read_text())
    cfg["data"]["path"] = str(DATA)
    cfg["trainer"].update(output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=2)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    hb = tmp_path / "hb"
    p = subprocess.run([sys.executable, "-m", "recipes.run", str(recipe)], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=base_env(ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
                                                 ORCHESTRATE_ACCELERATOR="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(hb / "rank0.jsonl")
    assert [r["event"] for r in recs] == ["boot", "dist", "start"] + ["step"] * 4 + ["end"], recs
    assert [r["step"] for r in _steps(recs)] == [1, 2, 3, 4]
    assert json.loads((hb / "rank0.exit").read_text())["code"] == 0  # recipes.run names its own exit code
