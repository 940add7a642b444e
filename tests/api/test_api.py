"""The public Python API (issue #36, docs/api.md) on real jobs of the local backend: `import orchestrator` pulls
nothing heavy; a bad job mapping raises one ConfigError with every problem and starts nothing; a 2-node job of the
user's own script, submitted from Python as a mapping, is waited for, and its status (the same data as
`orchestrate status --json`), logs and result read; a job submitted by the CLI is attached to from Python, a Ctrl-C
of a wait leaves it running, and Job.cancel() stops every process of it (store CANCELLED); an attached submit
(detach=False) is cancelled by Ctrl-C; a sweep runs from Python. The SSH job through the API:
tests/ssh/test_ssh_api.py; the SFT recipe, its checkpoint and an evaluation chained: tests/api/test_api_docs.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

import orchestrator
from helpers import (OFFLINE_ENV, PYTHON, cli, job_pids, live, looping_job, spawn, supervisor_pid, wait_gone,
                     wait_until)

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "recipes/configs/sft_tiny.yaml"  # (only rendered here)
HEAVY = ("torch", "transformers", "trl", "deepspeed", "accelerate", "paramiko", "submitit", "omegaconf", "rich",
         "yaml", "sqlite3")


def test_import_is_cheap_and_every_public_name_resolves():
    code = ("import json, sys, orchestrator\n"
            f"print(json.dumps([m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith('orchestrator.')"
            "]))\n")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert json.loads(out) == [], out
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name) is not None, name
    assert isinstance(orchestrator.Job("x"), orchestrator.Job)
    with pytest.raises(AttributeError):
        orchestrator.nope  # noqa: B018


def test_a_bad_job_mapping_raises_every_problem_at_once_and_starts_nothing(monkeypatch):
    from orchestrator.store import JobStore
    monkeypatch.chdir(REPO)
    before = len(JobStore().list(None))
    with pytest.raises(orchestrator.ConfigError) as e:
        orchestrator.submit({"recipe": "sft", "model": {"name_or_path": "tiny-llama"},
                             "data": {"path": "recipes/data/sft_tiny.jsonl"},
                             "trainer": {"max_steps": "many", "learning_rat": 1e-3}, "launch": {"nodes": 0}},
                            overrides={"health.stall_timeout": -5})
    where = {p.where: p.message for p in e.value.problems}
    assert set(where) == {"launch.nodes", "health.stall_timeout", "trainer.max_steps", "trainer.learning_rat"}, where
    assert "did you mean 'learning_rate'" in where["trainer.learning_rat"]
    assert e.value.exit_code == 2
    with pytest.raises(orchestrator.ConfigError) as e:  # the overrides' own shape is checked too
        orchestrator.render(SFT, overrides="trainer.max_steps=3")  # type: ignore[arg-type]
    assert e.value.problems[0].where == "overrides"
    assert len(JobStore().list(None)) == before


TRAIN = """\
import os, sys
import torch, torch.distributed as dist
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(int(args["--steps"])):
    x = torch.randn(16, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"STEP {step + 1} LOSS {loss.item():.4f}", flush=True)
if dist.get_rank() == 0:
    os.makedirs(args["--output_dir"], exist_ok=True)
    torch.save(model.module.state_dict(), os.path.join(args["--output_dir"], "model.pt"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_two_node_job_from_python_status_logs_result_and_the_cli_agrees(tmp_path, monkeypatch, job_guard):
    """Your own script (it never imports orchestrate), given as a mapping; its steps come from the zero-code
    optimizer hook's heartbeats. (docs/api.md's "train, then evaluate" runs the SFT recipe and its checkpoint.)"""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    job = orchestrator.submit({"name": "api-train", "run": {"script": "train.py", "args": {"steps": 3}}},
                              nodes=2, overrides={"run.args.output_dir": str(out), "health.stall_timeout": 120})
    assert time.monotonic() - t0 < 60 and job.state in ("PENDING", "QUEUED", "RUNNING"), job.state  # detached
    assert supervisor_pid(os.environ["ORCHESTRATE_HOME"], job.id) is not None  # the job's own supervisor runs it
    st = job.wait(timeout=600, raise_on_failure=True)
    assert st.state == "COMPLETED" and st.done and st.exit_code == 0, st
    assert [(n.node, n.end) for n in st.nodes] == [(0, "done"), (1, "done")], st.nodes
    assert [(r.rank, r.step) for r in st.ranks] == [(0, 3), (1, 3)], st.ranks

    res = job.result()
    assert res.state == "COMPLETED" and res.steps == 3, res
    assert res.output_dir == str(out) and res.checkpoint == str(out) and (out / "model.pt").is_file(), res
    assert job.output_dir == out and job.run_dir.is_dir() and job.id.startswith("api-train-")

    rank1 = list(job.logs(rank=1))
    assert [x for x in rank1 if " STEP " in x][-1].startswith("[localhost node1 rank1] STEP 3 LOSS "), rank1
    assert all(x.startswith("[localhost node1 rank1] ") for x in rank1), rank1[:5]
    every = list(job.logs())
    assert any(x.startswith("[localhost node0 rank0] STEP 3 ") for x in every) and len(every) > len(rank1)
    assert list(job.logs(follow=True, grep="^STEP 3 ")), "follow of an ended job ends"

    # the CLI is a client of the same API: the same status data, the same log lines, the same row in ls
    cli_st = json.loads(cli("status", job.id, "--json").stdout)
    fresh = job.status().data
    for key in ("state", "nodes", "exit_code", "root_cause", "run_dir", "restarts"):
        assert cli_st[key] == fresh[key], key
    assert [(r["rank"], r["step"]) for r in cli_st["ranks"]] == [(r.rank, r.step) for r in st.ranks]
    assert cli("logs", job.id, "--rank", "1").stdout.splitlines() == rank1
    ls = {row["id"]: row for row in json.loads(cli("ls", "--json").stdout)}
    assert ls[job.id] == job.summary()
    assert job in orchestrator.jobs(limit=5) and job in orchestrator.jobs(state="COMPLETED")
    assert orchestrator.Job.attach(job.id[:-2]) == job  # a unique prefix is enough


def _interrupt_a_wait(job_id: str) -> str:
    """A Python process that waits for the job, interrupted by Ctrl-C (SIGINT): what it printed."""
    code = ("import orchestrator\ntry:\n"
            f"    job = orchestrator.Job.attach({job_id!r})\n"
            "    print('WAITING', flush=True)\n"
            "    job.wait()\n"
            "except KeyboardInterrupt:\n    print('INTERRUPTED', flush=True)\n")
    # (spawn: SIGINT at its default in the child whatever pytest inherited, e.g. ignored under a background CI run)
    p = spawn([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, **OFFLINE_ENV})
    assert p.stdout is not None and p.stdout.readline().strip() == "WAITING"
    time.sleep(0.5)  # (in its wait: the job runs forever)
    p.send_signal(signal.SIGINT)
    return p.communicate(timeout=30)[0]


@pytest.mark.slow
def test_attach_to_a_cli_job_a_ctrl_c_of_the_wait_leaves_it_and_cancel_stops_it(tmp_path, job_guard):
    job_file = looping_job(tmp_path)
    r = cli("submit", job_file, "--nodes", "2", "--detach", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = re.search(r"^job (\S+) RUNNING", r.stdout, re.M).group(1)
    job = orchestrator.Job.attach(job_id)
    wait_until(lambda: sum("LOOPING" in x for x in job.logs()) == 2, 60, 0.2, "both ranks looping")
    pids = job_pids(job.run_dir)
    assert len(live(pids)) >= 2, pids
    with pytest.raises(TimeoutError):
        job.wait(timeout=1)
    assert "INTERRUPTED" in _interrupt_a_wait(job_id)
    assert job.state == "RUNNING" and len(live(pids)) == len(pids), "Ctrl-C of a wait must not touch the job"

    assert job.cancel() == "CANCELLED"
    wait_gone(pids, 15)
    st = job.wait(timeout=30)
    assert st.state == "CANCELLED" and "orchestrate cancel" in (st.root_cause or ""), st
    assert supervisor_pid(os.environ["ORCHESTRATE_HOME"], job_id) is None
    with pytest.raises(orchestrator.JobFailed) as e:
        job.wait(raise_on_failure=True)
    assert e.value.status.state == "CANCELLED"
    assert job.cancel() == "CANCELLED"  # (an ended job: its state)


@pytest.mark.slow
def test_an_attached_submit_from_python_is_cancelled_by_ctrl_c(tmp_path, job_guard):
    job_file = looping_job(tmp_path)
    code = ("import orchestrator\n"
            f"job = orchestrator.submit({str(job_file)!r}, nodes=2, detach=False)\n"
            "print('ENDED', job.id, job.state, flush=True)\n")
    p = job_guard.spawn([PYTHON, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        cwd=tmp_path, env={**os.environ, **OFFLINE_ENV})
    from orchestrator.store import JobStore
    found = wait_until(lambda: [r for r in JobStore().list(5) if r.state == "RUNNING" and
                                Path(r.recipe).name == "job.yaml" and str(tmp_path) in r.recipe], 60, 0.2,
                       "the attached job running")
    job = orchestrator.Job(found[0].id)
    wait_until(lambda: sum("LOOPING" in x for x in job.logs()) == 2, 60, 0.2, "both ranks looping")
    pids = job_pids(job.run_dir)
    assert supervisor_pid(os.environ["ORCHESTRATE_HOME"], job.id) == p.pid  # this process supervises it
    p.send_signal(signal.SIGINT)
    text = p.communicate(timeout=60)[0]
    assert f"ENDED {job.id} CANCELLED" in text, text[-3000:]
    wait_gone(pids, 15)
    assert "Ctrl-C" in (job.status().root_cause or "")


@pytest.mark.slow
def test_a_sweep_from_python(tmp_path, monkeypatch, job_guard):
    script = tmp_path / "point.py"
    script.write_text("import os, sys\nargs = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
                      "print('POINT', args['--width'], 'RANK', os.environ['RANK'], flush=True)\n")
    job = {"name": "api-sweep", "run": {"script": str(script), "args": {"width": 8, "output_dir": str(tmp_path / "o")}},
           "health": {"stall_timeout": 120}}
    monkeypatch.chdir(tmp_path)
    sw = orchestrator.sweep(job, {"run.args.width": [16, 32]}, nodes=2, max_parallel=2)
    rows = sw.wait(timeout=300, raise_on_failure=True)
    assert sorted(r["state"] for r in rows) == ["COMPLETED", "COMPLETED"], rows
    assert [p["overrides"] for p in sw.points] == [["run.args.width=16"], ["run.args.width=32"]]
    for point, width in zip(sw.jobs, (16, 32), strict=True):
        said = [x for x in point.logs() if " POINT " in x]
        assert sorted(said) == [f"[localhost node0 rank0] POINT {width} RANK 0",
                                f"[localhost node1 rank1] POINT {width} RANK 1"], said
    assert orchestrator.Sweep.attach(sw.id).table() == sw.table()
    assert json.loads(cli("sweep", sw.id, "--json").stdout)["points"] == sw.table()
