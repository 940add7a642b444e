#!/usr/bin/env python3
"""Teardown at scale, with real node agents (issue #29; not CI; a small size runs in
tests/local_backend/test_scale_local.py): a job of N nodes x 8 emulated ranks (orchestrator.node.emulate: one stdlib
process per node writes every rank's heartbeats through the real writer, `--rate` per second), submitted with the
real CLI (`orchestrate submit`, a process of its own) on
- `local`: N node agents on this machine;
- `ssh`: N loopback sshd hosts (scripts/sshd_hosts.py, shared filesystem), one real agent per host over paramiko;
- `slurm`: a real SLURM cluster of max(--sizes) nodes, one slurmd per network namespace (scripts/slurm_cluster.sh with
  its own --dir and --subnet, not the tests' one; brought up and down here), one job of N nodes x 1 task, each task a
  real agent (the emulation reaches it through sbatch's exported environment); restarts off (slurm.max_restarts 0) so
  the killed node ends the job.

Once every node's agent has started and every rank has a heartbeat, the submitting process is sampled from /proc over
`--window` seconds of heartbeats (CPU share, threads, open fds, RSS), then ONE node's emulated launcher (its pid in
RUN_DIR/nodes/<r>/agent.json) is SIGKILLed, and timed:
- decision: kill -> the supervisor told every other node to stop (outcome.json "teardown_at");
- gone: kill -> the LAST process of the job is gone: every node's agent, emulator and (SSH) `setsid` wrapper, and
  anything still carrying a node's marker (the hosts are on loopback: their pids are visible here, checked before
  the kill: each agent's environment must carry its node's token); SLURM: also every process but slurmd inside the
  node namespaces (slurmstepd, the task, srun included);
- the job's record: FAILED, naming the killed node.

    .venv/bin/python bench/bench_teardown.py [--backends local ssh] [--sizes 2 8 64 256] [--repeat 3]
        [--rate 1] [--window 5] [--plot bench/results/teardown.png] [--merge]
    .venv/bin/python bench/bench_teardown.py --backends slurm --sizes 2 8 16 --merge --plot bench/results/teardown.png

Needs root for the SSH hosts and the SLURM cluster. Writes bench/results/teardown.json (--merge: keeps what the file
holds for the backends not run, replacing only the rows of those run; the plot is drawn from the merged summary).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

import scale_job  # noqa: E402  (tests/scale_job.py: the CI test's driver of the same job)
from scale_job import netns_processes  # noqa: E402
from orchestrator.node.proctools import alive, marked  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
JOB_YAML = "run:\n  script: %s\nlaunch: {procs_per_node: %d}\n"
CLK = os.sysconf("SC_CLK_TCK")


SLURM_DIR, SLURM_SUBNET = "/tmp/orchestrate-slurm-bench", "10.203.41"  # not the tests' cluster (/tmp/orchestrate-slurm)


def proc_sample(pid: int) -> dict:
    """CPU seconds (user + system; and of its waited-for children: SLURM's squeue/sacct polls), threads, open fds and
    RSS of `pid`, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"cpu_s": (int(rest[11]) + int(rest[12])) / CLK, "child_cpu_s": (int(rest[13]) + int(rest[14])) / CLK,
            "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1)}


def wait_for(pred, timeout: float, what: str, every: float = 0.2):
    try:
        return scale_job.wait_for(pred, timeout, what, every)
    except AssertionError as e:
        raise RuntimeError(str(e)) from None


def has_step(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b'"step"' in f.read(4096)
    except OSError:
        return False


class Run:
    """One submit of an emulated N x ppn job and its kill."""

    def __init__(self, home: Path, work: Path, nodes: int, ppn: int, rate: float, cluster: Path | None,
                 runs: Path | None = None):
        self.home, self.work, self.nodes, self.ppn = home, work, nodes, ppn
        runs = runs or home / "runs"  # where the run dir appears (SLURM: the cluster's workdir)
        before = set(os.listdir(runs)) if runs.is_dir() else set()
        argv = [sys.executable, "-m", "orchestrator.cli", "submit", str(work / "job.yaml"), "--nodes", str(nodes)]
        if cluster is not None:
            argv += ["--cluster", str(cluster)]
        env = {**os.environ, **OFFLINE, "ORCHESTRATE_HOME": str(home), "PYTHONPATH": str(REPO),
               "ORCHESTRATE_EMULATE": f"rate={rate:g},steps=100000"}
        self.out = open(work / f"submit-{nodes}-{time.time():.0f}.log", "w")
        self.t_submit = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        new = wait_for(lambda: set(os.listdir(runs)) - before if runs.is_dir() else None, 60, "the run dir")
        self.rd = runs / sorted(new)[0]

    def records(self) -> list[dict] | None:
        """Every node's agent.json once all exist (else None)."""
        out = []
        for r in range(self.nodes):
            try:
                out.append(json.loads((self.rd / "nodes" / str(r) / "agent.json").read_text()))
            except (OSError, ValueError):
                return None
        return out

    def wait_running(self, timeout: float) -> list[dict]:
        if self.proc.poll() is not None:
            raise RuntimeError(f"submit ended early ({self.proc.returncode}): {self.tail()}")
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"submit ended ({self.proc.returncode}) before every agent started: {self.tail()}")
            return self.records()
        agents = wait_for(ready, timeout, f"{self.nodes} agents")
        t_agents = time.monotonic() - self.t_submit
        pending = {g for g in range(self.nodes * self.ppn)}
        hb = self.rd / "heartbeats"

        def all_beat() -> bool:
            for g in list(pending):
                if has_step(hb / f"rank{g}.jsonl"):
                    pending.discard(g)
            return not pending
        wait_for(all_beat, timeout, "every rank's first heartbeat", every=0.5)
        self.started = {"agents_s": round(t_agents, 2), "heartbeats_s": round(time.monotonic() - self.t_submit, 2)}
        return agents

    def tail(self) -> str:
        self.out.flush()
        return Path(self.out.name).read_text()[-1500:]


def job_pids(agents: list[dict], rd: Path) -> dict[int, str]:
    """pid -> role of every process of the job this machine can see: each node's agent and launch (the emulator),
    the SSH wrapper (`setsid -w`, from handle.json), and whatever carries a node's marker."""
    roles: dict[int, str] = {}
    for a in agents:
        r = a["node_rank"]
        roles[a["agent_pid"]] = f"agent{r}"
        roles[a["pid"]] = f"launch{r}"
        for p in marked(a["token"]):
            roles.setdefault(p, f"marked{r}")
    try:
        handle = json.loads((rd / "handle.json").read_text())
        nodes = handle.get("data", {}).get("nodes", [])
        for n in nodes if isinstance(nodes, list) else ():  # (SLURM's handle: a node count)
            if n.get("wrapper_pid"):
                roles[int(n["wrapper_pid"])] = f"wrapper{n['rank']}"
    except (OSError, ValueError):
        pass
    return roles


def check_visible(agents: list[dict]) -> None:
    """Every agent's pid runs here and carries its node's token: the hosts' processes are this machine's."""
    for a in agents:
        try:
            env = Path(f"/proc/{a['pid']}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        if not alive(a["agent_pid"]) or f"ORCHESTRATE_JOB_TOKEN={a['token']}".encode() not in env:
            raise RuntimeError(f"node {a['node_rank']}: agent pid {a['agent_pid']} / launch {a['pid']} not visible "
                               "here with its token")


def one(args, backend: str, n: int, i: int, home: Path, work: Path, cluster: Path | None,
        netns: str | None = None) -> dict:
    """One run; `netns`: the SLURM node namespaces' prefix (gone = also nothing but slurmd left in them)."""
    runs = work / "slurm-work" / "runs" if netns else None
    run = Run(home, work, n, args.ppn, args.rate, cluster, runs)
    kept: dict[int, str] = {}
    try:
        agents = run.wait_running(args.start_timeout)
        check_visible(agents)
        in_netns = len(netns_processes(netns)) if netns else None  # node namespaces running the job's processes
        time.sleep(1.0)  # every node in its steady heartbeat phase
        a = proc_sample(run.proc.pid)
        t = time.monotonic()
        time.sleep(args.window)
        b = proc_sample(run.proc.pid)
        dt = time.monotonic() - t
        cpu, child_cpu = (b["cpu_s"] - a["cpu_s"]) / dt, (b["child_cpu_s"] - a["child_cpu_s"]) / dt
        roles = job_pids(agents, run.rd)
        kept = dict(roles)
        victim_node = n // 2
        victim = agents[victim_node]["pid"]
        t_kill_wall, t0 = time.time(), time.monotonic()
        os.kill(victim, signal.SIGKILL)
        gone_at: dict[str, float] = {}
        left = set(roles)
        in_ns: dict[str, list[str]] = {}
        while time.monotonic() - t0 < args.gone_timeout:
            now = time.monotonic() - t0
            for p in [p for p in left if not alive(p)]:
                left.discard(p)
                gone_at[roles[p]] = now
            in_ns = netns_processes(netns) if netns else {}
            if netns and not in_ns and "netns_clean" not in gone_at:
                gone_at["netns_clean"] = now
            if not left and not in_ns:
                break
            time.sleep(0.005 if not netns else 0.02)
        gone = time.monotonic() - t0
        leftovers: list = [p for p in left] + [p for a in agents for p in marked(a["token"])] + \
            [p for ps in in_ns.values() for p in ps]
        rc = run.proc.wait(timeout=120)
        submit_exit = time.monotonic() - t0
        outcome = json.loads((run.rd / "outcome.json").read_text())
        ok = outcome["state"] == "FAILED" and f"node {victim_node} " in outcome["root_cause"] and rc != 0
        decision = (outcome["teardown_at"] - t_kill_wall) if outcome.get("teardown_at") else None
        try:
            victim_exit = json.loads((run.rd / "nodes" / str(victim_node) / "exit.json").read_text())["time"] \
                - t_kill_wall
        except (OSError, ValueError, KeyError):
            victim_exit = None
        last = sorted(gone_at.items(), key=lambda kv: kv[1])[-3:]
        ends = {e["node"]: e["end"] for e in outcome.get("nodes", [])}
        others_stopped = len(ends) == n and all(e == "stopped" for r, e in ends.items() if r != victim_node)
        extra = {} if netns is None else {"submit_children_cpu_pct": round(100 * child_cpu, 2), "netns_used": in_netns,
                                          "others_stopped": others_stopped,
                                          "others_exit_s": others_exit(run.rd, n, t_kill_wall)}
        row = {"backend": backend, "nodes": n, "ranks": n * args.ppn, "run": i, **run.started,
               "submit_cpu_pct": round(100 * cpu, 2), "heartbeats_per_s": n * args.ppn * args.rate,
               "threads": b["threads"], "fds": b["fds"], "rss_mb": b["rss_mb"],
               "victim_agent_exit_s": round(victim_exit, 3) if victim_exit is not None else None,
               "decision_s": round(decision, 3) if decision is not None else None,
               "gone_s": round(gone, 3) if not left and not in_ns else None,
               "left": sorted(p for p in leftovers if isinstance(p, int))
               + [p for p in leftovers if isinstance(p, str)],
               "submit_exit_s": round(submit_exit, 3), "processes": len(roles), "last_gone": last,
               "state": outcome["state"], "root_cause": outcome["root_cause"][:200], "record_ok": ok, "rc": rc, **extra}
        print(json.dumps(row), flush=True)
        return row
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGTERM)
            try:
                run.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(run.proc.pid, signal.SIGKILL)
        for p in kept:  # only what this run started
            if alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if netns and run.proc.returncode not in (None, 0, 1):  # a submitter that did not end the job itself
            subprocess.run(["scancel", "--name", run.rd.name], capture_output=True, timeout=30)
        run.out.close()


def slurm_up(nodes: int, work: Path) -> tuple[Path, str]:
    """A SLURM cluster of `nodes` nodes of its own (SLURM_DIR, SLURM_SUBNET), SLURM_CONF set for the submits; returns
    the cluster file (the testbed's slurm_local.yaml, this interpreter, a workdir of its own, no restarts) and the
    node namespaces' prefix."""
    import yaml
    r = subprocess.run([str(REPO / "scripts" / "slurm_cluster.sh"), "up", "--nodes", str(nodes), "--dir", SLURM_DIR,
                        "--subnet", SLURM_SUBNET, "--gpus", "0"], capture_output=True, text=True, timeout=300)
    print(r.stdout.strip(), file=sys.stderr, flush=True)
    if r.returncode != 0:
        raise RuntimeError(f"slurm_cluster.sh up failed: {r.stdout[-800:]} {r.stderr[-1500:]}")
    state = dict(line.split("=", 1) for line in Path(SLURM_DIR, "cluster.env").read_text().split() if "=" in line)
    os.environ["SLURM_CONF"] = state["SLURM_CONF"]
    c = yaml.safe_load((REPO / "cluster_configs" / "slurm_local.yaml").read_text())
    c["name"] = "slurm_bench"
    c["slurm"].update(python=sys.executable, workdir=str(work / "slurm-work"), max_restarts=0)
    path = work / "cluster-slurm.yaml"
    path.write_text(yaml.safe_dump(c))
    return path, state["NS_PREFIX"]


def slurm_down() -> None:
    subprocess.run([str(REPO / "scripts" / "slurm_cluster.sh"), "down", "--dir", SLURM_DIR], capture_output=True,
                   timeout=300)


def others_exit(rd: Path, n: int, t_kill: float) -> float | None:
    """Kill -> the last of the other nodes' agents had ended (their exit.json times; SLURM: its --kill-on-bad-exit)."""
    try:
        times = [json.loads((rd / "nodes" / str(r) / "exit.json").read_text())["time"] for r in range(n) if r != n // 2]
    except (OSError, ValueError, KeyError):
        return None
    return round(max(times) - t_kill, 3) if times else None


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["backend"], r["nodes"]) for r in rows}):
        rs = [r for r in rows if (r["backend"], r["nodes"]) == key]
        s = {"backend": key[0], "nodes": key[1], "ranks": rs[0]["ranks"], "runs": len(rs)}
        for k in ("gone_s", "decision_s", "others_exit_s", "victim_agent_exit_s", "submit_exit_s", "submit_cpu_pct",
                  "submit_children_cpu_pct", "threads", "fds", "rss_mb", "agents_s", "heartbeats_s"):
            v = [r[k] for r in rs if r.get(k) is not None]
            if v:
                s[k] = round(statistics.median(v), 3)
                s[k + "_range"] = [min(v), max(v)]
        s["all_gone"] = all(r["gone_s"] is not None for r in rs)
        s["records_ok"] = all(r["record_ok"] for r in rs)
        if any("others_stopped" in r for r in rs):
            s["others_stopped"] = all(r.get("others_stopped") for r in rs)
        out.append(s)
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for backend, marker in (("local", "o"), ("ssh", "s"), ("slurm", "^")):
        rs = [s for s in summary if s["backend"] == backend and "gone_s" in s]
        if not rs:
            continue
        x = [s["nodes"] for s in rs]
        y = [s["gone_s"] for s in rs]
        err = [[s["gone_s"] - s["gone_s_range"][0] for s in rs], [s["gone_s_range"][1] - s["gone_s"] for s in rs]]
        ax.errorbar(x, y, yerr=err, marker=marker, capsize=3, label=f"{backend}: kill -> last process gone")
        d = [s for s in rs if "decision_s" in s]
        ax.plot([s["nodes"] for s in d], [s["decision_s"] for s in d], marker=marker, linestyle=":",
                label=f"{backend}: kill -> supervisor's stop")
    ax.axhline(2.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes (hosts) x 8 emulated ranks")
    ax.set_ylabel("seconds after one node's launcher is SIGKILLed")
    ax.set_title("teardown at scale (median, range)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["local", "ssh"], choices=("local", "ssh", "slurm"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 64, 256])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ppn", type=int, default=8, help="emulated ranks per node")
    ap.add_argument("--rate", type=float, default=1.0, help="heartbeats per second per rank")
    ap.add_argument("--window", type=float, default=5.0, help="seconds of heartbeats the submitter is sampled over")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--gone-timeout", type=float, default=60.0)
    ap.add_argument("--base-ip", default="127.0.40.2")
    ap.add_argument("--port", type=int, default=2226)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "teardown.json"))
    ap.add_argument("--plot", default=None, help="a PNG of teardown time versus nodes")
    ap.add_argument("--merge", action="store_true", help="keep what --out holds for the backends not run")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-teardown-"))
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    (work / "train.py").write_text("raise SystemExit('emulated: never run')\n")
    (work / "job.yaml").write_text(JOB_YAML % (work / "train.py", args.ppn))
    rows: list[dict] = []
    tb = None
    slurm = False
    try:
        for backend in args.backends:
            cluster, netns = None, None
            if backend == "slurm":
                slurm = True
                cluster, netns = slurm_up(max(args.sizes), work)
            if backend == "ssh":
                import sshd_hosts
                import yaml
                why = sshd_hosts.prerequisites()
                if why:
                    print(f"bench_teardown: ssh skipped: {why}", file=sys.stderr)
                    continue
                tb = sshd_hosts.up(max(args.sizes), tmp / "sshd", base_ip=args.base_ip, port=args.port, timeout=120)
            for n in args.sizes:
                if tb is not None and backend == "ssh":
                    cluster = work / f"cluster-{n}.yaml"
                    cluster.write_text(yaml.safe_dump(tb.cluster("bench", hosts=tb.hosts[:n], shared_fs=True,
                                                                 connect_timeout=30)))
                for i in range(args.repeat):
                    try:
                        rows.append(one(args, backend, n, i, home, work, cluster, netns))
                    except RuntimeError as e:
                        print(f"{backend} {n} run {i}: {e}", file=sys.stderr, flush=True)
                        rows.append({"backend": backend, "nodes": n, "ranks": n * args.ppn, "run": i,
                                     "error": str(e)[:500], "gone_s": None, "record_ok": False})
            if tb is not None:
                sshd_hosts.down(tmp / "sshd")
                tb = None
            if slurm:
                slurm_down()
                slurm = False
    finally:
        if tb is not None:
            import sshd_hosts
            sshd_hosts.down(tmp / "sshd")
        if slurm:
            slurm_down()
    summary = summarize([r for r in rows if "error" not in r])
    for s in summary:
        print(json.dumps(s), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    data = {"when": when, "cpus": os.cpu_count(), "ppn": args.ppn, "rate": args.rate, "window_s": args.window,
            "summary": summary, "runs": rows}
    if args.merge and Path(args.out).exists():  # the other backends' rows as they were; these backends' replaced
        data, ran = json.loads(Path(args.out).read_text()), set(args.backends)
        data["summary"] = [s for s in data["summary"] if s["backend"] not in ran] + summary
        data["runs"] = [r for r in data["runs"] if r.get("backend") not in ran] + rows
        data.setdefault("measured", {}).update({b: {"when": when, "cpus": os.cpu_count(), "ppn": args.ppn,
                                                    "rate": args.rate, "window_s": args.window,
                                                    "sizes": args.sizes, "repeat": args.repeat} for b in ran})
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.plot:
        plot(data["summary"], Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
