"""orchestrator/node/hostgc.py, the host side of `orchestrate gc`, on a real staging cache built here by the host side
of staging itself (orchestrator/node/stagecache.py's Server: put the blobs, build the trees and the jobs' links), and
run the way the submitter runs it on a host: `python -c SOURCE WORKDIR` with the request on stdin."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.node import hostgc, stagecache

SOURCE = Path(hostgc.__file__).read_text()
PKG = "a" * 64  # the node package's tree (named by plan.json's node_package)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tree_sha(files: dict[str, bytes]) -> str:
    return _sha(json.dumps(sorted((k, _sha(v)) for k, v in files.items())).encode())


def stage(work: Path, job: str, trees: dict[str, dict[str, bytes]], package: str | None = PKG,
          output_key: str | None = None) -> dict[str, str]:
    """Stage `trees` ({label: {rel: content}}) for `job` into `work` through stagecache's own ops, as a submit does;
    returns {label: tree sha}. The job's plan.json names `package` (whose tree is staged too, with one file)."""
    srv = stagecache.Server(str(work), io.BytesIO(), io.BytesIO())
    all_trees = dict(trees)
    if package:
        all_trees["package"] = {"orchestrator/__init__.py": b"# node package\n"}
    shas, blobs, payload, specs = {}, [], b"", {}
    for label, files in all_trees.items():
        th = package if label == "package" and package else _tree_sha(files)
        shas[label] = th
        specs[th] = [[rel, _sha(data), len(data), 0o644] for rel, data in sorted(files.items())]
        for data in files.values():
            if [_sha(data), len(data)] not in blobs:
                blobs.append([_sha(data), len(data)])
                payload += data
    srv.rin = io.BytesIO(payload)
    assert srv.op_put({"blobs": blobs})["bad"] == []
    links = {f"runs/{job}/staged/{label}": th for label, th in shas.items() if label != "package"}
    if output_key:
        links[f"runs/{job}/output"] = f"outputs/{output_key}"
    srv.op_build({"trees": specs, "links": links})
    run = work / "runs" / job
    run.mkdir(parents=True, exist_ok=True)
    (run / "plan.json").write_text(json.dumps({"job_id": job, "node_package": package or ""}))
    (run / "logs").mkdir(exist_ok=True)
    (run / "logs" / "node0.log").write_text("x" * 1000)
    return shas


def gc(work: Path, remove: list[str], dry_run: bool = False, outputs: bool = False) -> dict:
    p = subprocess.run([sys.executable, "-c", SOURCE, str(work)], input=json.dumps(
        {"remove": remove, "dry_run": dry_run, "outputs": outputs}) + "\n", capture_output=True, text=True, timeout=60,
        cwd="/")
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)


def blobs(work: Path) -> set[str]:
    return {p.name for p in (work / "cache" / "blobs").iterdir() if len(p.name) == 64}


def trees(work: Path) -> set[str]:
    return {p.name for p in (work / "cache" / "trees").iterdir()}


SHARED, ONLY_A, ONLY_B = b"print('shared by both jobs')\n", b"A's own data " * 100, b"B's own data " * 50


def test_removes_a_job_and_only_what_no_other_run_dir_names_dry_run_lists_the_same(tmp_path):
    work = tmp_path / "work"
    a = stage(work, "job-a", {"code": {"train.py": SHARED, "a.txt": ONLY_A}}, output_key="k-a")
    stage(work, "job-b", {"code": {"train.py": SHARED, "b.txt": ONLY_B}}, output_key="k-b")
    (work / "outputs" / "k-a" / "checkpoint-1").mkdir(parents=True)
    (work / "outputs" / "k-a" / "checkpoint-1" / "w.bin").write_bytes(b"w" * 4096)
    before_blobs, before_trees = blobs(work), trees(work)

    dry = gc(work, ["job-a"], dry_run=True)
    assert blobs(work) == before_blobs and trees(work) == before_trees and (work / "runs" / "job-a").is_dir()
    real = gc(work, ["job-a"])
    assert real == dry  # exactly what the dry run listed
    by_what = {i["what"]: i for i in real["items"]}
    assert set(by_what) == {"run dir", "cache"}  # outputs only when asked
    assert by_what["run dir"]["path"] == str((work / "runs" / "job-a").resolve())
    assert by_what["cache"]["trees"] == [a["code"]]  # not the package (job-b names it too), not b's tree
    assert by_what["cache"]["blobs"] == [_sha(ONLY_A)] and by_what["cache"]["bytes"] == len(ONLY_A)
    assert not (work / "runs" / "job-a").exists() and (work / "runs" / "job-b" / "plan.json").is_file()
    assert blobs(work) == before_blobs - {_sha(ONLY_A)}
    assert trees(work) == before_trees - {a["code"]}
    assert not (work / "cache" / "blobs" / (_sha(ONLY_A) + ".ok")).exists()
    assert (work / "runs" / "job-b" / "staged" / "code" / "train.py").read_bytes() == SHARED  # b's links intact
    assert (work / "outputs" / "k-a" / "checkpoint-1" / "w.bin").is_file()  # output dirs stay unless asked
    # the last job goes: everything staged goes with it, the package too; its output dir only with outputs=True
    last = gc(work, ["job-b"], outputs=True)
    assert {i["what"] for i in last["items"]} == {"run dir", "cache", "outputs"}
    assert blobs(work) == set() and trees(work) == set() and not (work / "outputs" / "k-b").exists()
    assert (work / "outputs" / "k-a").is_dir()  # (job-a's was not asked for when job-a went)


def test_a_job_whose_agent_runs_is_refused_and_keeps_everything_it_names(tmp_path):
    work = tmp_path / "work"
    stage(work, "job-a", {"data": {"d.jsonl": ONLY_A}})
    run = work / "runs" / "job-a"
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run.resolve()), "--node-rank",
                              "0"])
    try:
        (run / "nodes" / "0").mkdir(parents=True)
        (run / "nodes" / "0" / "agent.json").write_text(json.dumps({"node_rank": 0, "agent_pid": agent.pid}))
        out = gc(work, ["job-a", "job-nothere"])
        assert out["items"] == [] and "still runs on this host" in out["refused"]["job-a"], out
        assert out["missing"] == ["job-nothere"]
        assert run.is_dir() and _sha(ONLY_A) in blobs(work)
    finally:
        agent.kill()
        agent.wait()
    out = gc(work, ["job-a"])  # the agent is gone (its pid may be reused by now: the command line must name the run)
    assert [i["what"] for i in out["items"]] == ["run dir", "cache"] and not run.exists()


def test_a_live_staging_session_keeps_the_cache_whole(tmp_path):
    """A submit staging into this workdir right now may link a tree that only a removed job named: while a stagecache
    server serves it, gc removes run dirs but nothing of the cache."""
    work = tmp_path / "work"
    stage(work, "job-a", {"data": {"d.jsonl": ONLY_A}})
    srv = subprocess.Popen([sys.executable, "-c", Path(stagecache.__file__).read_text(), "serve", str(work)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        out = gc(work, ["job-a"])
        assert [i["what"] for i in out["items"]] == ["run dir"] and "staging" in out["note"], out
        assert _sha(ONLY_A) in blobs(work)
    finally:
        srv.stdin.close()
        srv.wait(10)


def test_bad_ids_a_missing_workdir_and_one_gc_at_a_time(tmp_path):
    work = tmp_path / "work"
    stage(work, "job-a", {"data": {"d.jsonl": ONLY_A}})
    out = gc(work, ["../etc", "job-a/.."])
    assert set(out["refused"]) == {"../etc", "job-a/.."} and out["items"] == []
    assert gc(tmp_path / "nowhere", ["x"])["missing"] == ["x"]
    import fcntl
    fd = os.open(work.resolve() / hostgc.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        p = subprocess.run([sys.executable, "-c", SOURCE, str(work)], input='{"remove": ["job-a"]}\n',
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and "another gc" in json.loads(p.stdout)["error"]
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["stagecache", "hostgc"])
def test_host_programs_import_only_the_standard_library(name):
    """They run as `python -c SOURCE` on hosts without orchestrate."""
    src = Path(stagecache.__file__).with_name(f"{name}.py").read_text()
    assert "orchestrator" not in "".join(ln for ln in src.splitlines() if ln.startswith(("import", "from")))
