"""GPU health during the job (issue #34 item 6), with no GPU: the stand-in nvidia-smi (tests/fakes/nvidia-smi, its
health map rewritten mid-job) and a stand-in kernel log (tests/fakes/dmesg, ORCHESTRATE_DMESG) under real jobs whose
ranks need no GPU (tests/faults/beat_loop.py under a GPU plan; the ranks' network pre-flight off), the watch polling
every second (health.gpu_watch_s: 1):

- local, 2 nodes on 2 fake GPUs (node 0 GPU 0, node 1 GPU 1): an XID 79 stamped at boot stays outside the
  pre-flight's look-back (health.xid_lookback_s: 10) and the job starts; the same XID on GPU 1 stamped mid-job
  ends the job within seconds, the root cause naming node 1, its host and GPU 1 (node 0's watch of GPU 0 says
  nothing);
- SSH, 3 hosts for 2 nodes: host b's GPU 0 gets uncorrectable ECC errors mid-job; the attempt ends naming b and GPU 0,
  the restart runs on a and the spare c and completes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from helpers import Submit, cli, steps_seen, wait_until

REPO = Path(__file__).resolve().parents[2]
FAKES = REPO / "tests" / "fakes"


def _job(tmp_path: Path, steps: int, procs: int, **health) -> Path:
    job = tmp_path / "watch.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests" / "faults" / "beat_loop.py"),
                                           "args": [str(steps), "0.1"]},
                                   "launch": {"nodes": 2, "procs_per_node": procs},
                                   "health": {"preflight_timeout": 0, "gpu_watch_s": 1, **health}}))
    return job


def _xid(t: float, bus: int, code: int = 79) -> str:
    return f"[{t:12.6f}] NVRM: Xid (PCI:0000:{bus:02x}:00): {code}, pid=4242, GPU has fallen off the bus.\n"


def test_an_xid_mid_job_ends_it_naming_host_and_gpu(fake_local_gpus, tmp_path, job_guard):
    fake_local_gpus(2)
    home, log = tmp_path / "home", tmp_path / "kern.log"
    log.write_text(_xid(0.5, 0x11))  # GPU 1 (bus 11) at boot: not this job's trouble
    env = {"ORCHESTRATE_HOME": str(home), "ORCHESTRATE_LEASE_DIR": str(tmp_path / "leases"),
           "ORCHESTRATE_DMESG": str(FAKES / "dmesg"), "FAKE_DMESG_FILE": str(log)}
    job_guard.home(home)
    t0 = time.monotonic()
    sub = Submit([_job(tmp_path, 600, 1, xid_lookback_s=10)], REPO, env, job_guard)
    run_dir = home / "runs" / sub.job_id()
    wait_until(lambda: steps_seen(run_dir, 1) >= 3 or sub.proc.poll() is not None, 60, 0.1, "node 1's steps")
    assert sub.proc.poll() is None, sub.text[-3000:]  # the old XID did not stop the pre-flight or the watch
    with log.open("a") as f:
        f.write(_xid(time.monotonic(), 0x11))
    t_fault = time.monotonic()
    rc = sub.wait(60)
    ended = time.monotonic() - t_fault
    host = json.loads((run_dir / "plan.json").read_text())["node_plans"][1]["host"]
    cause = f"node 1 ({host}) failed: GPU watch: XID 79 (GPU has fallen off the bus) on GPU 1 of {host}"
    assert rc == 1 and "FAILED" in sub.text and cause in sub.text, sub.text[-3000:]
    assert "GpuHealthError: GPU watch: XID 79" in (run_dir / "logs" / "node1.log").read_text()
    st = json.loads(cli("status", run_dir.name, "--json", env=env).stdout)
    assert st["state"] == "FAILED" and cause in st["root_cause"], st
    watch1, watch0 = (json.loads((run_dir / "nodes" / str(n) / "gpu_watch.json").read_text()) for n in (1, 0))
    assert watch1["used"] == [1] and watch1["fault"] and "GPU 1" in watch1["fault"], watch1
    assert watch0["used"] == [0] and not watch0["findings"] and watch0["polls"] >= 2, watch0
    exit1 = json.loads((run_dir / "nodes" / "1" / "exit.json").read_text())
    assert exit1["returncode"] == 74 and exit1["gpu_fault"] == watch1["fault"], exit1
    print(f"XID written -> job ended in {ended:.1f} s (gpu_watch_s 1); whole test {time.monotonic() - t0:.1f} s")
    assert ended < 15, ended


def test_ecc_errors_mid_job_take_the_host_out_and_the_restart_runs_on_the_spare(gpu_testbed, gpu_hosts, tmp_path,
                                                                                 job_guard):
    a, b, c = gpu_testbed.hosts[:3]
    health = tmp_path / "health.json"
    _, cluster = gpu_hosts({a: 2, b: 2, c: 2}, health_file=health)
    home = tmp_path / "home"
    job_guard.home(home)
    env = {"ORCHESTRATE_HOME": str(home)}
    t0 = time.monotonic()
    sub = Submit([_job(tmp_path, 25, 2, max_restarts=1), "--cluster", cluster], REPO, env, job_guard)
    run_dir = home / "runs" / sub.job_id()
    wait_until(lambda: steps_seen(run_dir, 2) >= 2 or sub.proc.poll() is not None, 90, 0.1, "host b's steps")
    t_fault = time.monotonic()
    assert sub.proc.poll() is None, sub.text[-3000:]
    tmp = health.with_suffix(".tmp")
    tmp.write_text(json.dumps({b: {"0": {"ecc.errors.uncorrected.volatile.total": 2}}}))
    os.replace(tmp, health)  # (whole: the fake reads it on every call)
    wait_until(lambda: (run_dir / "restarts.jsonl").exists(), 60, 0.1, "the restart decision")
    t_restart = time.monotonic()
    rc = sub.wait(120)
    print(f"first steps {t_fault - t0:.1f} s, ECC written -> restart decided {t_restart - t_fault:.1f} s, restart -> "
          f"COMPLETED {time.monotonic() - t_restart:.1f} s (gpu_watch_s 1)")
    assert rc == 0 and "COMPLETED" in sub.text, sub.text[-4000:]
    cause = f"node 1 ({b}) failed: GPU watch: uncorrectable ECC errors rose 0->2 on GPU 0 of {b}"
    attempts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(x["decision"], x["host"], x["kind"], x["exclude"]) for x in attempts] == [("restart", b, "health", b)], \
        attempts
    assert attempts[0]["reason"].startswith(cause), attempts[0]["reason"]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [n["host"] for n in plan["node_plans"]] == [a, c], plan["node_plans"]  # the spare took b's place
    st = json.loads(cli("status", run_dir.name, "--json", env=env).stdout)
    assert st["state"] == "COMPLETED" and st["restarts"] == 1 and list(st["excluded"]) == [b], st


def test_the_node_reads_throttle_stamps_and_an_unreadable_log(fake_local_gpus, tmp_path, monkeypatch):
    """orchestrator.node.gpus.health against the stand-ins: the throttle field (and a driver that lacks it: the rest
    is still read), the kernel log's XIDs with their stamps and the node's clock, an unreadable log and why."""
    from orchestrator.node import gpus
    fake_local_gpus(2)
    log = tmp_path / "kern.log"
    log.write_text(_xid(12.5, 0x10, 48))
    monkeypatch.setenv("ORCHESTRATE_DMESG", str(FAKES / "dmesg"))
    monkeypatch.setenv("FAKE_DMESG_FILE", str(log))
    h = gpus.health()
    assert [g["throttle"] for g in h["gpus"]] == ["0x0000000000000000"] * 2 and h["error"] is None, h
    assert [(e["t"], e["pci_bus"], e["xid"]) for e in h["xid"]] == [(12.5, "0000:10:00", 48)]
    assert abs(h["clock"] - time.monotonic()) < 30
    monkeypatch.setenv("FAKE_NVIDIA_NO_THROTTLE", "1")
    monkeypatch.setenv("FAKE_DMESG_FAIL", "1")
    h = gpus.health()
    assert [(g["index"], g["ecc_uncorrected_volatile"], g.get("throttle")) for g in h["gpus"]] == [(0, 0, None),
                                                                                                  (1, 0, None)], h
    assert h["xid"] is None and "Operation not permitted" in h["xid_error"], h


def test_an_unreadable_kernel_log_is_said_once_by_the_pre_flight_and_once_by_each_watch(fake_local_gpus, tmp_path):
    fake_local_gpus(2)
    home = tmp_path / "home"
    env = {"ORCHESTRATE_HOME": str(home), "ORCHESTRATE_LEASE_DIR": str(tmp_path / "leases"),
           "ORCHESTRATE_DMESG": str(FAKES / "dmesg"), "FAKE_DMESG_FAIL": "1"}
    r = cli("submit", _job(tmp_path, 30, 1), env=env, cwd=REPO, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "COMPLETED" in r.stdout, out[-3000:]
    why = "the kernel log could not be read (dmesg: read kernel buffer failed: Operation not permitted): XID errors " \
          "are not checked"
    assert out.count(f"orchestrate: warning: GPU health: localhost: {why}") == 1, out[-3000:]  # the pre-flight
    run_dir = next((home / "runs").iterdir())
    for n in (0, 1):
        rec = json.loads((run_dir / "nodes" / str(n) / "gpu_watch.json").read_text())
        log = (run_dir / "logs" / f"node{n}.log").read_text()
        assert rec["polls"] >= 2 and rec["warnings"] == [f"{rec['host']}: {why}"] and rec["fault"] is None, rec
        assert log.count(why) == 1, log[-2000:]
