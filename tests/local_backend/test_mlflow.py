"""MLflow continuity (issue #36 item 3, docs/tracking.md), on the local backend with real training and a real MLflow
sqlite tracking store: a job whose rank 0 (the one that logs) is SIGKILLed once after a checkpoint and restarted by
the supervisor is ONE MLflow run, with the metrics of both attempts on one continuous step axis (the restart goes on
from the checkpoint's step), the job's facts logged once as params, and `status` naming the run. The built-in SFT
recipe logs to MLflow because MLFLOW_TRACKING_URI is set (no report_to given)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import OFFLINE_ENV, PYTHON, cli_status, saved_rank, wait_until

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 40


def _mlflow_runs(client) -> list:
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _logged(client, step: int) -> bool:
    """Some run of the store has its loss of `step` (MLflow logs asynchronously: what a killed process had queued is
    lost, which is MLflow's matter, not the job's)."""
    return any(m.step >= step for r in _mlflow_runs(client) for m in client.get_metric_history(r.info.run_id, "loss"))


@pytest.mark.slow
def test_a_restarted_job_is_one_mlflow_run_with_a_continuous_step_axis(tmp_path, job_guard):
    home, out = tmp_path / "home", tmp_path / "out"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job_guard.home(home)
    env = {"ORCHESTRATE_HOME": str(home), "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "orchestrate-ci"}
    argv = [PYTHON, "-m", "orchestrator.cli", "submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2",
            f"trainer.max_steps={MAX_STEPS}", "trainer.save_strategy=steps", "trainer.save_steps=3",
            "trainer.logging_steps=1", "health.max_restarts=1", f"trainer.output_dir={out}"]
    p = job_guard.spawn(argv, cwd=REPO, env={**os.environ, **OFFLINE_ENV, **env},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    run_dir, pid = saved_rank(home, 0, 3)
    job = run_dir.name
    wait_until(lambda: _logged(client, 3), 60, 0.1, "step 3's loss in the tracking store")
    os.kill(pid, signal.SIGKILL)  # the process that logs to MLflow dies without ending its run
    killed_ms = time.time() * 1000
    text = p.communicate(timeout=600)[0]
    assert p.returncode == 0, text[-4000:]
    assert re.search(rf"^job {job}: restart 1/1 from the latest checkpoint", text, re.MULTILINE), text[-4000:]

    runs = _mlflow_runs(client)
    assert len(runs) == 1, [(r.info.run_id, r.data.tags) for r in runs]  # ONE run for both attempts
    run = runs[0]
    rid = run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.tags["orchestrate.job_id"] == job and run.data.tags["mlflow.runName"] == job
    plan = json.loads((run_dir / "plan.json").read_text())
    assert {k: v for k, v in run.data.params.items() if k.startswith("orchestrate.")} == {
        "orchestrate.job_id": job, "orchestrate.cluster": "local", "orchestrate.backend": "local",
        "orchestrate.nodes": "2", "orchestrate.world_size": "2",
        "orchestrate.effective_batch": str(plan["effective_batch"])}
    # rank 0 said which run, created by the first attempt and resumed by the restart
    assert re.search(rf"rank0\] orchestrate: MLflow run {rid} of job {job} \(created; ", text), text[-4000:]
    assert re.search(rf"rank0\] orchestrate: MLflow run {rid} of job {job} \(resumed; ", text), text[-4000:]

    # one step axis: attempt 1 from step 1, the restart from after its checkpoint to the end, the union gap-free
    history = sorted(client.get_metric_history(rid, "loss"), key=lambda m: m.timestamp)
    first = [m.step for m in history if m.timestamp < killed_ms]
    second = [m.step for m in history if m.timestamp >= killed_ms]
    assert first and second, [(m.step, m.timestamp) for m in history]
    assert first == list(range(1, len(first) + 1)) and len(first) >= 3, first
    ckpt = int(re.search(r"resuming from \S*checkpoint-(\d+)", text).group(1))
    assert 3 <= ckpt and second == list(range(ckpt + 1, MAX_STEPS + 1)), (ckpt, second)

    # status names the run (RUN_DIR/tracking.json, from rank 0's "tracking" heartbeat record)
    st, shown = cli_status(job, env={"ORCHESTRATE_HOME": str(home)})
    assert st["tracking"]["mlflow"]["run_id"] == rid and st["tracking"]["mlflow"]["tracking_uri"] == uri
    exp = run.info.experiment_id
    assert f"mlflow   run {rid} (experiment {exp}, {uri})" in shown.splitlines(), shown
