#!/usr/bin/env python3
"""Own code, time to first step (issue #12; not CI): `orchestrate submit my_job.yaml --nodes 2` (local backend, with
the zero-code hooks in the ranks) vs hand-run per-node `accelerate launch --config_file nodeR.yaml train.py ...`
with the same rendered configs, interleaved (ABBA), same run. The user script (tests/faults/user_train.py plus a
callback of its own that prints when its first optimizer step ended) is the same for both.

    python bench/bench_own_code.py [--repeat 8] [--steps 4]
    python bench/bench_own_code.py --backend ssh [--repeat 8]   # 2 real sshd hosts on loopback (needs root)
    python bench/bench_own_code.py --bare                        # a third side: ours with the ranks' hooks and
                                                                 # pre-flight off (ORCHESTRATE_HOOKS=0,
                                                                 # health.preflight_timeout: 0): the dispatch alone

With `--backend ssh` the two nodes are sshd hosts (scripts/sshd_hosts.py, a shared filesystem: `shared_fs: true`)
and the hand-run is what a user types for a multi-node run without a scheduler: per node, at the same time,
`ssh host 'cd REPO && GLOO_SOCKET_IFNAME=lo python -m accelerate.commands.launch --config_file nodeR.yaml train.py
...'` (OpenSSH, key auth, the same rendered configs). Dispatch then covers the ssh connection and the remote shell
on the hand-run's side too.

Reports each side's median, the ratio of medians and the paired ratios' median and range (goal <= 1.0), and where
the time goes, per side, from the kernel's process start times: dispatch (submit -> each node's `accelerate launch`
process exists; for the hand-run, which starts them itself, just the process creation, < 0.01 s; over ssh, the moment
its remote shell hands over to python, after the host's shell start-up files: `launcher_began`), launcher (-> the
last rank process exists: accelerate and torchrun start-up, rendezvous), ranks (-> first optimizer step ended on
rank 0: imports, orchestrate's pre-flight and hooks, model and data, the step). Results: bench/results/own_code.json
(own_code_ssh.json with --backend ssh).

CPU, per run, read when rank 0's first step ends (/proc): the machine's idle core-seconds since t0 (both sides), and
the CPU-seconds orchestrate's own processes used by then (ours: the submitting CLI and the node agents; with --backend
ssh the agents run on the same machine too). On this 2-core machine the hand-run keeps the cores busy most of the way,
so ours' own CPU has little idle time to hide in (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
def first_step_script(user: Path) -> str:
    """A wrapper that runs `user` (a Trainer script) as __main__ and prints USER_FIRST_STEP <time> on rank 0 when its
    first optimizer step has ended."""
    return '''
import os, sys, time, runpy
def _start(pid="self"):  # when the kernel created the process (field 22 of /proc/PID/stat, against /proc/uptime)
    ticks = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
    return time.time() - (float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
# this rank's start, and its parent's: torchrun's agent, which is the `accelerate launch` process itself
print(f"USER_PROC_START {_start():.6f} {os.environ.get('RANK')} {_start(os.getppid()):.6f}", flush=True)
from transformers import TrainerCallback, Trainer
class FirstStep(TrainerCallback):
    done = False
    def on_step_end(self, args, state, control, **kw):
        if not FirstStep.done and args.process_index == 0:
            FirstStep.done = True
            print(f"USER_FIRST_STEP {time.time():.6f}", flush=True)
_init = Trainer.__init__
def init(self, *a, **k):
    _init(self, *a, **k)
    self.add_callback(FirstStep())
Trainer.__init__ = init
runpy.run_path(%r, run_name="__main__")
''' % str(user)


def first_step(text: str) -> float:
    m = re.search(r"USER_FIRST_STEP (\d+\.\d+)", text)
    assert m, text[-3000:]
    return float(m.group(1))


def rank_start(text: str, ranks: int = 2) -> float:
    """When the last rank's process was created (each rank prints USER_PROC_START)."""
    found = [float(x) for x in re.findall(r"USER_PROC_START (\d+\.\d+)", text)]
    assert len(found) == ranks, text[-3000:]
    return max(found)


def launcher_starts(text: str, ranks: int = 2) -> list[float]:
    """When each rank's parent (its node's `accelerate launch` process) was created."""
    found = [float(x) for x in re.findall(r"USER_PROC_START \d+\.\d+ \S+ (\d+\.\d+)", text)]
    assert len(found) == ranks, text[-3000:]
    return found


def launcher_began(text: str, nodes: int = 2) -> list[float]:
    """Over ssh, when each node's hand-run `accelerate launch` began: its ANCHOR_EXEC time. The process's kernel start
    time is not it: bash runs the last command of `a && b` in its own process (exec), whose start time is then the
    shell's fork by sshd, before the host's shell start-up files (~/.bashrc: here `pyenv init`, ~0.15 s) and python's
    own start ran, which would count them in the hand-run's launcher phase but in our dispatch (our agent starts
    the launcher after them). Both sides' dispatch now ends where the launcher's python begins."""
    found = [float(x) for x in re.findall(r"ANCHOR_EXEC (\d+\.\d+)", text)]
    assert len(found) == nodes, text[-3000:]
    return found


def phases(t0: float, launchers: list[float], ranks: float, first: float) -> dict[str, float]:
    return {"dispatch": max(launchers) - t0, "launcher": ranks - max(launchers), "ranks": first - ranks,
            "total": first - t0}


TICK = os.sysconf("SC_CLK_TCK")


def idle_core_s() -> float:
    """Idle (and I/O-wait) time of all CPUs since boot, in core-seconds (/proc/stat)."""
    v = open("/proc/stat").readline().split()[1:]
    return (int(v[3]) + int(v[4])) / TICK


def cpu_s(pid: int) -> float:
    """User + system CPU-seconds of a live process (0 when it is gone)."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / TICK


def run_until_first_step(procs: list[subprocess.Popen], at_first) -> list[str]:
    """Read every process's output to its end; call at_first(output so far) once, when a line says rank 0's first
    step has ended. Returns each process's output."""
    import threading
    outs: list[list[str]] = [[] for _ in procs]
    lock, seen = threading.Lock(), []

    def read(i: int) -> None:
        for line in procs[i].stdout:
            outs[i].append(line)
            if "USER_FIRST_STEP" in line:
                with lock:
                    if not seen:
                        seen.append(True)
                        at_first("".join(x for o in outs for x in o))
    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for p in procs:
        p.wait(timeout=60)
    return ["".join(o) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--backend", choices=("local", "ssh"), default="local")
    ap.add_argument("--base-ip", default="127.0.32.2", help="--backend ssh: the first host's address")
    ap.add_argument("--port", type=int, default=2232, help="--backend ssh: the hosts' sshd port")
    ap.add_argument("--bare", action="store_true", help="also run ours with the ranks' hooks and pre-flight off "
                    "(side 'bare', paired against the hand-run like ours)")
    args = ap.parse_args()
    if args.bare and args.backend != "local":
        ap.error("--bare is for --backend local (an SSH host's agent does not get this process's environment)")
    env = {**os.environ, **OFFLINE}
    tmp = Path(tempfile.mkdtemp(prefix="bench-own-"))
    env["ORCHESTRATE_HOME"] = str(tmp / "home")
    sys.path.insert(0, str(REPO))
    os.environ.update(OFFLINE)
    from recipes.tiny import resolve_model_path
    model = resolve_model_path("tiny-llama")
    script = tmp / "train.py"
    script.write_text(first_step_script(REPO / "tests" / "faults" / "user_train.py"))
    data = REPO / "recipes" / "data" / "sft_tiny.jsonl"

    def job(tag: str, bare: bool = False) -> Path:
        p = tmp / f"{tag}.yaml"
        spec: dict = {"run": {"script": str(script), "args": [model, str(data), str(tmp / tag / "out"),
                                                              str(args.steps)]}}
        if bare:
            spec["health"] = {"preflight_timeout": 0}
        p.write_text(json.dumps(spec))
        return p

    cli = [sys.executable, "-m", "orchestrator.cli"]
    tb = None
    where: list[str] = []  # --cluster FILE, with --backend ssh
    if args.backend == "ssh":
        sys.path.insert(0, str(REPO / "scripts"))
        import sshd_hosts
        why = sshd_hosts.prerequisites()
        if why:
            print(f"bench_own_code: {why}", file=sys.stderr)
            return 2
        tb = sshd_hosts.up(2, tmp / "sshd", base_ip=args.base_ip, port=args.port)
        (tmp / "cluster.yaml").write_text(json.dumps(tb.cluster("bench", shared_fs=True)))
        where = ["--cluster", str(tmp / "cluster.yaml")]
    try:
        def ours(i: int, bare: bool = False) -> dict[str, float]:
            cpu: dict[str, float] = {}
            side_env = {**env, "ORCHESTRATE_HOOKS": "0"} if bare else env  # (the agents pass it on to the ranks)
            idle0, t0 = idle_core_s(), time.time()
            p = subprocess.Popen([*cli, "submit", str(job(f"{'bare' if bare else 'ours'}{i}", bare)), "--nodes", "2",
                                  *where], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=side_env,
                                 cwd=REPO)

            def at_first(text: str) -> None:  # the machine's idle time and our processes' CPU, by the first step
                cpu["idle_core_s"] = idle_core_s() - idle0
                rd = Path(re.search(r"run dir (\S+)", text).group(1))
                agents = [json.loads((rd / "nodes" / str(n) / "agent.json").read_text())["agent_pid"] for n in range(2)]
                cpu["own_cpu_s"] = cpu_s(p.pid) + sum(cpu_s(a) for a in agents)
            out = run_until_first_step([p], at_first)[0]
            assert p.returncode == 0, out[-5000:]
            run_dir = Path(re.search(r"run dir (\S+)", out).group(1))
            # (with ssh, shared_fs: true: the hosts use this same run dir)
            launchers = [json.loads((run_dir / "nodes" / str(n) / "agent.json").read_text())["proc_start"]
                         for n in range(2)]
            parents = launcher_starts(out)  # the ranks' parents are the launchers the agents started
            assert all(abs(a - b) < 0.05 for a, b in zip(sorted(launchers), sorted(parents), strict=True)), (
                launchers, parents)
            return {**phases(t0, launchers, rank_start(out), first_step(out)), **cpu}

        anchor_failures: list[list[int]] = []

        def anchor(i: int) -> dict[str, float]:
            d = tmp / f"anchor{i}"
            r = subprocess.run([*cli, "render", str(job(f"anchor{i}")), "--nodes", "2", *where, "--out", str(d)],
                               capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
            assert r.returncode == 0, r.stderr
            node_env = {**env, "GLOO_SOCKET_IFNAME": "lo"}
            cpu: dict[str, float] = {}
            idle0, t0 = idle_core_s(), time.time()
            argvs = [[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                      str(d / "nodes" / str(rank) / "accelerate.yaml"), str(script), model, str(data),
                      str(tmp / f"anchor{i}" / "out"), str(args.steps)] for rank in range(2)]
            if tb is not None:  # per node: ssh host 'cd REPO && GLOO_SOCKET_IFNAME=lo python -m accelerate.commands...'
                offline = " ".join(f"{k}={v}" for k, v in OFFLINE.items())
                # ANCHOR_EXEC: bash's clock (a builtin, no process) as the remote shell hands over to python, i.e.
                # after the host's shell start-up files ran (see launcher_began)
                argvs = [["ssh", *tb.ssh_options(), f"{tb.user}@{host}",
                          f"cd {shlex.quote(str(REPO))} && echo ANCHOR_EXEC $EPOCHREALTIME && "
                          f"GLOO_SOCKET_IFNAME=lo {offline} {shlex.join(argv)}"]
                         for host, argv in zip(tb.hosts, argvs, strict=True)]
            procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=node_env)
                     for argv in argvs]
            outs = run_until_first_step(procs, lambda _text: cpu.update(idle_core_s=idle_core_s() - idle0,
                                                                        own_cpu_s=0.0))
            first = first_step(outs[0])  # (asserts that the first step was reached)
            if any(p.returncode != 0 for p in procs):
                # after its first step: what is measured stands. Seen once here over ssh (its output not kept): a
                # launcher waited out torchelastic's 300 s exit barrier, which a node whose worker failed never
                # reaches (a rank that dies at exit, e.g. pytorch#190489, which ours' hooks settle, does that)
                anchor_failures.append([p.returncode for p in procs])
                print(f"hand-run {i}: launchers exited {[p.returncode for p in procs]} after the first step; its "
                      "time to first step counts", flush=True)
            text = outs[0] + outs[1]
            forks = launcher_starts(text)
            began = launcher_began(text) if tb is not None else forks
            return {**phases(t0, began, rank_start(text), first), **cpu, "shell_fork": max(forks) - t0}

        # as installed by pip (which byte-compiles): orchestrate's own modules load from .pyc in the CLI, the node
        # agents and the ranks' hooks, whatever PYTHONDONTWRITEBYTECODE says (the user's script is compiled alike on
        # both sides)
        subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(REPO / d) for d in ("orchestrator", "launchers",
                                                                                          "recipes"))],
                       check=True)
        ours(99)  # warm the caches (model, datasets, page cache) for both sides
        sides = {"anchor": anchor, "ours": ours, **({"bare": lambda i: ours(i, bare=True)} if args.bare else {})}
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for i in range(args.repeat):  # interleaved, ABBA (which side goes first alternates): drift hits all alike
            for side in (list(sides) if i % 2 == 0 else list(reversed(sides))):
                runs[side].append(sides[side](i))
            print(f"run {i}: " + "; ".join(f"{side} {r[-1]['total']:.2f}s (" + ", ".join(
                f"{k} {v:.2f}" for k, v in r[-1].items() if k != "total") + ")" for side, r in runs.items()),
                flush=True)
        cores = os.cpu_count() or 1
        med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
        paired = sorted(o["total"] / a["total"] for o, a in zip(runs["ours"], runs["anchor"], strict=True))
        extra = {k: sorted(o[k] - a[k] for o, a in zip(runs["ours"], runs["anchor"], strict=True))
                 for k in ("dispatch", "launcher", "ranks")}
        # busy core-seconds up to the first step (cores x time - idle), paired: how much more CPU work ours' window held
        busy = {side: [cores * r["total"] - r["idle_core_s"] for r in rs] for side, rs in runs.items()}
        busy_extra = sorted(o - a for o, a in zip(busy["ours"], busy["anchor"], strict=True))
        idle_share = {side: statistics.median(r["idle_core_s"] / (cores * r["total"]) for r in rs)
                      for side, rs in runs.items()}
        result = {"repeat": args.repeat, "steps": args.steps, "machine": f"{cores} cores",
                  "backend": args.backend,
                  "first_step_s": {side: m["total"] for side, m in med.items()}, "phases_median_s": med,
                  "ratio": med["ours"]["total"] / med["anchor"]["total"],
                  "paired_ratio_median": statistics.median(paired), "paired_ratio_range": [paired[0], paired[-1]],
                  "paired_extra_s_median": {k: statistics.median(v) for k, v in extra.items()},
                  "paired_extra_s_range": {k: [v[0], v[-1]] for k, v in extra.items()},
                  "idle_share_median": idle_share, "paired_busy_core_s_extra_median": statistics.median(busy_extra),
                  "paired_busy_core_s_extra_range": [busy_extra[0], busy_extra[-1]],
                  "hand_run_failures_after_first_step": anchor_failures, "runs": runs}
        if "bare" in runs:  # hooks and pre-flight off: what is left is the dispatch
            bare = sorted(o["total"] / a["total"] for o, a in zip(runs["bare"], runs["anchor"], strict=True))
            bare_ranks = sorted(o["ranks"] - a["ranks"] for o, a in zip(runs["bare"], runs["anchor"], strict=True))
            result.update(bare_paired_ratio_median=statistics.median(bare), bare_paired_ratio_range=[bare[0], bare[-1]],
                          bare_paired_ranks_extra_s_median=statistics.median(bare_ranks))
        print(f"own code, time to first step (median of {args.repeat}): ours {med['ours']['total']:.2f}s, hand-run "
              f"accelerate launch {med['anchor']['total']:.2f}s, ratio of medians {result['ratio']:.3f}; paired median "
              f"{result['paired_ratio_median']:.3f}, range {paired[0]:.3f}-{paired[-1]:.3f} (goal <= 1.0)")
        print("ours minus hand-run, paired, median (range): " + ", ".join(
            f"{k} {statistics.median(v):+.2f}s ({v[0]:+.2f} to {v[-1]:+.2f})" for k, v in extra.items()))
        if "bare" in runs:
            print(f"ours with the ranks' hooks and pre-flight off (bare): median {med['bare']['total']:.2f}s; paired "
                  f"ratio to the hand-run, median {result['bare_paired_ratio_median']:.3f} (range "
                  f"{result['bare_paired_ratio_range'][0]:.3f}-{result['bare_paired_ratio_range'][1]:.3f}); ranks "
                  f"phase minus the hand-run's, paired median {result['bare_paired_ranks_extra_s_median']:+.2f}s")
        own = [r["own_cpu_s"] for r in runs["ours"]]
        print(f"CPU by the first step, on {cores} cores: idle share (median) ours {idle_share['ours']:.1%}, hand-run "
              f"{idle_share['anchor']:.1%}; orchestrate's own processes (CLI + agents) {statistics.median(own):.2f} "
              f"CPU-s ({min(own):.2f}-{max(own):.2f}); busy core-s, ours minus hand-run, paired "
              f"{statistics.median(busy_extra):+.2f} ({busy_extra[0]:+.2f} to {busy_extra[-1]:+.2f})")
        out = REPO / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / ("own_code.json" if tb is None else "own_code_ssh.json")).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        if tb is not None:
            sshd_hosts.down(tmp / "sshd")


if __name__ == "__main__":
    sys.exit(main())
