"""An emulated job at a small scale of issue #29, driven as a user does (the CLI's `submit` in a process of its own),
for tests/local_backend/test_scale_local.py, tests/ssh/test_ssh_scale.py and tests/slurm/test_slurm_scale.py;
bench/bench_teardown.py runs the big sizes. Every node's ranks are emulated (orchestrator.node.emulate); agents,
records, backend and Supervisor are real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.node.proctools import alive, marked

REPO = Path(__file__).resolve().parents[1]
JOB_YAML = "run:\n  script: %s\nlaunch: {procs_per_node: %d}\n"


def wait_for(pred, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def netns_processes(prefix: str, keep: tuple[str, ...] = ("slurmd",)) -> dict[str, list[str]]:
    """"pid:comm" of every live process in each network namespace /run/netns/<prefix>* (SLURM's node namespaces),
    except the daemons named in `keep`; a namespace with none is left out ({} once every node is clean). One scan of
    /proc (no `ip netns pids` per namespace): cheap enough to poll every few milliseconds."""
    inodes = {}
    for name in os.listdir("/run/netns") if os.path.isdir("/run/netns") else ():
        if name.startswith(prefix):
            try:
                inodes[f"net:[{os.stat(f'/run/netns/{name}').st_ino}]"] = name
            except OSError:
                pass
    out: dict[str, list[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ns = inodes.get(os.readlink(f"/proc/{pid}/ns/net"))
            if ns is None:
                continue
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm not in keep and alive(int(pid)):
            out.setdefault(ns, []).append(f"{pid}:{comm}")
    return out


def threads(pid: int) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("Threads:")))


def run_and_kill(tmp: Path, nodes: int, ppn: int = 8, cluster: Path | None = None, start_timeout: float = 60.0,
                 gone_timeout: float = 20.0, runs: Path | None = None, netns: str | None = None) -> dict:
    """Submit an emulated nodes x ppn job, wait until every agent started and every rank heartbeat, kill node
    nodes // 2's emulated launcher; returns what was seen (threads of the submitter, seconds until the last process of
    the job was gone, the outcome, ...). Everything it started is gone when it returns.
    `runs`: the folder the job's run dir appears in (default ORCHESTRATE_HOME/runs; SLURM: the cluster's workdir/runs,
    which must hold no other run). `netns`: the node namespaces' prefix (SLURM): "gone" also waits for every process
    but slurmd in them to be gone, and `in_netns` says which namespaces ran a process of the job before the kill."""
    (tmp / "train.py").write_text("raise SystemExit('emulated: never run')\n")
    (tmp / "job.yaml").write_text(JOB_YAML % (tmp / "train.py", ppn))
    home = tmp / "home"
    argv = [sys.executable, "-m", "orchestrator.cli", "submit", str(tmp / "job.yaml"), "--nodes", str(nodes)]
    if cluster is not None:
        argv += ["--cluster", str(cluster)]
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "ORCHESTRATE_EMULATE": "rate=2,steps=100000",
           "PYTHONPATH": str(REPO)}
    log = open(tmp / "submit.log", "w")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    seen: dict[int, str] = {}
    try:
        def records():
            assert proc.poll() is None, (tmp / "submit.log").read_text()[-2000:]
            where = runs or home / "runs"
            rd = next(iter(where.iterdir()), None) if where.is_dir() else None
            if rd is None:
                return None
            try:
                return rd, [json.loads((rd / "nodes" / str(r) / "agent.json").read_text()) for r in range(nodes)]
            except (OSError, ValueError):
                return None
        rd, agents = wait_for(records, start_timeout, f"{nodes} node agents")
        pending = set(range(nodes * ppn))

        def all_beat() -> bool:
            for g in list(pending):
                try:
                    if b'"event": "step"' in (rd / "heartbeats" / f"rank{g}.jsonl").read_bytes()[:4096]:  # (not boot)
                        pending.discard(g)
                except OSError:
                    pass
            return not pending
        wait_for(all_beat, start_timeout, "every rank's first heartbeat", every=0.3)
        for a in agents:
            seen[a["agent_pid"]] = f"agent{a['node_rank']}"
            seen[a["pid"]] = f"launch{a['node_rank']}"
            for p in marked(a["token"]):
                seen.setdefault(p, f"marked{a['node_rank']}")
        n_threads = threads(proc.pid)
        n_fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        in_netns = sorted(netns_processes(netns)) if netns else []
        victim = nodes // 2
        t_kill = time.time()
        t0 = time.monotonic()
        os.kill(agents[victim]["pid"], signal.SIGKILL)
        wait_for(lambda: not any(alive(p) for p in seen) and not any(marked(a["token"]) for a in agents)
                 and not (netns and netns_processes(netns)), gone_timeout, "every process of the job gone", every=0.01)
        gone = time.monotonic() - t0
        rc = proc.wait(timeout=60)
        outcome = json.loads((rd / "outcome.json").read_text())
        return {"rc": rc, "gone_s": gone, "threads": n_threads, "fds": n_fds, "victim": victim, "outcome": outcome,
                "decision_s": (outcome["teardown_at"] - t_kill) if outcome.get("teardown_at") else None,
                "processes": len(seen), "agents": sorted(a["node_rank"] for a in agents), "in_netns": in_netns,
                "run_dir": rd, "log": (tmp / "submit.log").read_text()}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if netns and runs is not None:  # a SLURM job outlives its killed submitter: cancel it by name (its id)
                for rd in runs.iterdir() if runs.is_dir() else ():
                    subprocess.run(["scancel", "--name", rd.name], capture_output=True, timeout=30)
        for p in seen:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        log.close()
