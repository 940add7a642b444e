"""The MLflow rules of the ranks' tracker hooks (orchestrator/node/hooks/orchestrate_tracking.py, docs/tracking.md)
against a real MLflow sqlite store, in real processes started with the hooks on PYTHONPATH (as a rank is): rank 0's
top-level start_run finds the job's run again in a new process; what the user chose is left alone; other ranks are
not touched. And the pure pieces: the URI as written down, the run dir's tracking record, status's line."""

from __future__ import annotations

import json
import subprocess
import sys

from own_code_helpers import base_env

from orchestrator.cli.views import tracking_text
from orchestrator.node.hooks.orchestrate_tracking import public_uri
from orchestrator.node.rundir import RunDir

SCRIPT = r"""
import json, sys, mlflow
out = {}
with mlflow.start_run() as run:
    out["job_run"] = run.info.run_id
    mlflow.log_metric("loss", 1.0, step=int(sys.argv[1]))
    with mlflow.start_run(nested=True) as child:  # nested: the user's own
        out["nested"] = child.info.run_id
if sys.argv[2] == "own":
    with mlflow.start_run(run_id=out["job_run"]) as again:  # a run id given: used as given
        out["given"] = again.info.run_id
    with mlflow.start_run(run_name="mine") as other:  # a second top-level run of rank 0: the job's run again
        out["second"] = other.info.run_id
print("TRACKING " + json.dumps(out), flush=True)
"""


def _rank(tmp_path, uri: str, rank: int, step: int, mode: str = "") -> tuple[dict, str]:
    env = base_env(ORCHESTRATE_HEARTBEAT_DIR=tmp_path / "hb", ORCHESTRATE_JOB_ID="job-m", RANK=str(rank),
                   ORCHESTRATE_RUN_DIR=tmp_path, MLFLOW_TRACKING_URI=uri)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(step), mode], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("TRACKING "))
    return json.loads(line[len("TRACKING "):]), p.stderr


def test_rank0_resumes_the_jobs_run_and_leaves_the_users_choices_alone(tmp_path):
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "plan.json").write_text(json.dumps({"cluster_name": "lab", "cluster_kind": "ssh", "nodes": 2,
                                                    "world_size": 4, "effective_batch": None}))
    first, err = _rank(tmp_path, uri, 0, 1)
    assert f"orchestrate: MLflow run {first['job_run']} of job job-m (created; experiment 0, tracking URI {uri})" in err
    again, err = _rank(tmp_path, uri, 0, 2, "own")  # a new process: the restart
    assert f"MLflow run {first['job_run']} of job job-m (resumed;" in err
    assert again["job_run"] == again["given"] == again["second"] == first["job_run"]
    assert len({first["nested"], again["nested"], first["job_run"]}) == 3
    other, _ = _rank(tmp_path, uri, 1, 3)  # rank 1: not the job's run
    assert other["job_run"] != first["job_run"]

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(first["job_run"])
    assert run.data.tags["orchestrate.job_id"] == "job-m" and run.data.tags["orchestrate.cluster"] == "lab"
    assert {k: v for k, v in run.data.params.items()} == {  # once; a fact the plan lacks is left out
        "orchestrate.job_id": "job-m", "orchestrate.cluster": "lab", "orchestrate.backend": "ssh",
        "orchestrate.nodes": "2", "orchestrate.world_size": "4"}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
    tagged = client.search_runs(["0"], "tags.`orchestrate.job_id` = 'job-m'")
    assert [r.info.run_id for r in tagged] == [first["job_run"]]
    named = [json.loads(x) for x in (tmp_path / "hb" / "rank0.jsonl").read_text().splitlines()]
    named = [r for r in named if r["event"] == "tracking"]
    assert [(r["run_id"], r["resumed"]) for r in named] == [(first["job_run"], False), (first["job_run"], True),
                                                           (first["job_run"], True)]
    assert not (tmp_path / "hb" / "rank1.jsonl").exists() or "tracking" not in (tmp_path / "hb" / "rank1.jsonl"
                                                                                 ).read_text()


def test_uri_written_without_credentials_and_the_record_status_reads(tmp_path):
    assert public_uri("sqlite:////data/mlflow.db") == "sqlite:////data/mlflow.db"
    assert public_uri("https://alice:s3cret@mlflow.lab:5000/x?token=abc") == "https://***@mlflow.lab:5000/x?***"
    assert public_uri("databricks") == "databricks"
    rd = RunDir(tmp_path)
    assert rd.tracking() == {}
    rec = {"event": "tracking", "tracker": "mlflow", "run_id": "abc", "experiment_id": "1",
           "tracking_uri": "http://mlflow.lab:5000", "t": 5.0}
    assert rd.write_tracking(rec) and not rd.write_tracking(dict(rec, t=9.0))  # written when it changes only
    assert rd.tracking() == {"mlflow": {"run_id": "abc", "experiment_id": "1", "tracking_uri": "http://mlflow.lab:5000",
                                        "t": 5.0}}
    assert not rd.write_tracking({"event": "tracking", "tracker": "mlflow"})  # no run named: nothing kept
    assert tracking_text("mlflow", rd.tracking()["mlflow"]) == (
        "mlflow   run abc (experiment 1, http://mlflow.lab:5000)  http://mlflow.lab:5000/#/experiments/1/runs/abc")
