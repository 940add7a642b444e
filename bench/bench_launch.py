#!/usr/bin/env python3
"""Launch overhead and teardown over SSH (not CI): `orchestrate submit` 2-node vs hand-run per-node
`accelerate launch` over ssh, same config, same hosts, in one run.

    python bench/bench_launch.py [--repeat 5] [--steps 6]

- time to first training step (command start -> rank 0's first step heartbeat), ours vs anchor,
  median of `repeat`, as a ratio (goal <= 1.0), with when each phase was reached (seconds after the command),
  for every run: ours planned / preflight (connect + probe of all hosts) / copied / agents_started (exec), then
  for both rank_process (launcher start done: the rank's process exists) / boot (interpreter up) / dist (torch
  imported, rendezvous done) / train_begin (model, data, trainer built) / first_step;
- teardown: one rank SIGKILLed mid-training -> every process of the job gone on every node (goal <= 1.5 s),
  with when each role (agent, launcher, rank, per node) was gone.

    python bench/bench_launch.py --only teardown --repeat 3   # one of the two
Needs root (real sshd hosts on loopback, scripts/sshd_hosts.py). Results: bench/results/launch.json.
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
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

import sshd_hosts  # noqa: E402
import yaml  # noqa: E402

from orchestrator import api  # noqa: E402
from orchestrator import running  # noqa: E402
from orchestrator.node.proctools import alive, group_members, marked, marked_ranks  # noqa: E402


def heartbeats(run_dir: Path) -> list[dict]:
    out = []
    for p in (run_dir / "heartbeats").glob("rank*.jsonl"):
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def first(recs: list[dict], event: str, rank: int = 0) -> float | None:
    ts = [r["t"] for r in recs if r.get("rank") == rank and r.get("event") == event]
    return min(ts) if ts else None


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


def prepare(cluster: Path, tmp: Path, tag: str, steps: int, run_dir: str | None = None):
    return api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(cluster), nodes=2, cwd=REPO, run_dir=run_dir,
                       overrides=[f"trainer.max_steps={steps}", "trainer.logging_steps=1", "checkpoint.resume=never",
                                  f"trainer.output_dir={tmp / 'out' / tag}", "health.stall_timeout=120"])


def remote_run_dir(tb, host: str, job_id: str) -> Path:
    return Path(tb.dir) / "work" / host / "runs" / job_id


def rank_phases(recs: list[dict], t0: float, rank: int = 0) -> dict:
    """When rank `rank` was created, booted, had its process group, began training and stepped, from t0."""
    boot = next((r for r in recs if r.get("rank") == rank and r.get("event") == "boot"), {})
    out = {"rank_process": boot.get("proc_start"), "boot": first(recs, "boot", rank), "dist": first(recs, "dist", rank),
           "train_begin": first(recs, "start", rank), "first_step": first(recs, "step", rank)}
    return {k: (v - t0 if v else None) for k, v in out.items()}


def ours(tb, cluster: Path, tmp: Path, i: int, steps: int) -> dict:
    t0 = time.time()
    prep = prepare(cluster, tmp, f"ours{i}", steps)
    res = running.submit(prep)
    assert res.state == "COMPLETED", res.root_cause
    local = Path(api._home()) / "runs" / prep.plan.job_id
    tl = json.loads((local / "handle.json").read_text())["data"]["timeline"]
    agents = [json.loads((remote_run_dir(tb, h, prep.plan.job_id) / f"nodes/{r}/agent.json").read_text())
              for r, h in enumerate(tb.hosts[:2])]
    at = {"planned": tl["submitted"] - t0, "preflight": tl["preflight_done"] - t0, "copied": tl["copied"] - t0,
          "agents_exec": tl["agents_exec"] - t0, "agents_process": max(a["agent_proc_start"] for a in agents) - t0,
          "agents_started": max(a["started"] for a in agents) - t0, **rank_phases(heartbeats(local), t0)}
    return {"first_step_s": at["first_step"], "at": at}


def anchor(tb, cluster: Path, tmp: Path, i: int, steps: int) -> dict:
    """Hand-run: per node, `ssh host 'env ... accelerate launch --config_file nodeR.yaml -m recipes.run ...'`."""
    d = tmp / f"anchor{i}"
    prep = prepare(cluster, tmp, f"anchor{i}", steps, run_dir=str(d))
    api.write_files(prep.files, d)
    (d / "heartbeats").mkdir(exist_ok=True)
    t0 = time.time()
    procs = []
    for r, host in enumerate(tb.hosts[:2]):
        cmd = (f"cd {REPO} && GLOO_SOCKET_IFNAME=lo ORCHESTRATE_ACCELERATOR=cpu "
               f"ORCHESTRATE_HEARTBEAT_DIR={d}/heartbeats "
               f"{tb.python} -m accelerate.commands.launch --config_file {d}/nodes/{r}/accelerate.yaml "
               f"-m recipes.run {d}/recipe.yaml")
        procs.append(subprocess.Popen(["ssh", *tb.ssh_options(), f"{tb.user}@{host}", cmd], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    rcs = [p.wait(timeout=600) for p in procs]
    assert rcs == [0, 0], rcs
    at = rank_phases(heartbeats(d), t0)
    return {"first_step_s": at["first_step"], "at": at}


def teardown(tb, cluster: Path, tmp: Path, i: int) -> float:
    prep = prepare(cluster, tmp, f"kill{i}", 500)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=running.submit(prep)))
    t.start()
    jid = prep.plan.job_id
    local = Path(api._home()) / "runs" / jid
    wait_for(lambda: first(heartbeats(local), "step"), 180, "first step")
    infos = [json.loads((remote_run_dir(tb, h, jid) / f"nodes/{r}/agent.json").read_text())
             for r, h in enumerate(tb.hosts[:2])]
    victim = wait_for(lambda: marked_ranks(infos[1]["token"]).get(1), 30, "rank 1 pid")
    roles = {}  # pid -> "node R <role>": when each one vanished tells where the teardown time goes
    for r, a in enumerate(infos):
        ranks = {pid: g for g, pid in marked_ranks(a["token"]).items()}
        for p in set(marked(a["token"]) + group_members(a["pgid"])):
            roles[p] = f"node{r} " + (f"rank{ranks[p]}" if p in ranks else "launcher" if p == a["pid"] else "other")
        roles[a["agent_pid"]] = f"node{r} agent"
    gone_at: dict[str, float] = {}
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)

    def all_gone() -> bool:
        now = time.monotonic() - t0
        live = {role for p, role in roles.items() if alive(p)}
        for role in set(roles.values()) - live - set(gone_at):
            gone_at[role] = now  # the first poll at which every process of that role was gone
        return not any(alive(p) for p in roles) and not any(marked(a["token"]) for a in infos)
    wait_for(all_gone, 60, "every process gone")
    gone = time.monotonic() - t0
    t.join(60)
    assert box["r"].state == "FAILED", box["r"]
    print(f"  teardown {i}: all gone {gone:.2f}s; " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(
        gone_at.items(), key=lambda kv: kv[1])), flush=True)
    return gone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--base-ip", default="127.0.30.2")
    ap.add_argument("--port", type=int, default=2224)
    ap.add_argument("--only", choices=("launch", "teardown"), default=None, help="run one of the two measurements")
    args = ap.parse_args()
    why = sshd_hosts.prerequisites()
    if why:
        print(f"bench_launch: {why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    os.environ["ORCHESTRATE_HOME"] = str(tmp / "home")
    tb = sshd_hosts.up(2, tmp / "sshd", base_ip=args.base_ip, port=args.port)
    try:
        cluster = tmp / "cluster.yaml"
        cluster.write_text(yaml.safe_dump({"kind": "ssh", "name": "bench", "accelerator": "cpu",
                                           "network_interface": "lo", "ssh": tb.ssh_block()}))
        running.submit(prepare(cluster, tmp, "warm", 2))  # warm caches (tiny model, trl field list, page cache)
        runs = {"ours": [], "anchor": []}
        for i in range(args.repeat if args.only != "teardown" else 0):  # interleaved, so drift hits both alike
            runs["anchor"].append(anchor(tb, cluster, tmp, i, args.steps))
            runs["ours"].append(ours(tb, cluster, tmp, i, args.steps))
            print(f"run {i}: ours {runs['ours'][-1]['at']} anchor {runs['anchor'][-1]['at']}", flush=True)
        kills = [teardown(tb, cluster, tmp, i) for i in range(args.repeat if args.only != "launch" else 0)]
    finally:
        sshd_hosts.down(tmp / "sshd")
    result: dict = {"repeat": args.repeat, "steps": args.steps}
    if runs["ours"]:
        med = {k: statistics.median(r["first_step_s"] for r in v) for k, v in runs.items()}
        phases = {who: {k: round(statistics.median(r["at"][k] for r in runs[who]), 3) for k in runs[who][0]["at"]
                        if all(r["at"][k] is not None for r in runs[who])} for who in runs}
        paired = sorted(o["first_step_s"] / a["first_step_s"] for o, a in zip(runs["ours"], runs["anchor"],
                                                                              strict=True))
        result.update(first_step_s={k: round(v, 3) for k, v in med.items()},
                      ratio=round(med["ours"] / med["anchor"], 3),
                      paired_ratio_median=round(statistics.median(paired), 3),
                      paired_ratio_range=[round(paired[0], 3), round(paired[-1], 3)],
                      phases_median_s_since_command=phases, runs=runs)
        print(f"time to first step (median of {args.repeat}): ours {med['ours']:.2f}s, hand-run accelerate launch "
              f"over ssh {med['anchor']:.2f}s, ratio of medians {result['ratio']:.3f}; paired ratios: median "
              f"{result['paired_ratio_median']:.3f}, range {paired[0]:.3f}-{paired[-1]:.3f} (goal <= 1.0)")
        for who, at in phases.items():
            print(f"{who}, reached (median s after the command): " + ", ".join(f"{k} {v:.2f}" for k, v in at.items()))
    if kills:
        result.update(teardown_after_sigkill_s=[round(k, 3) for k in kills],
                      teardown_median_s=round(statistics.median(kills), 3))
        print(f"teardown after a SIGKILLed rank, to the last process gone: median {result['teardown_median_s']:.2f}s "
              f"(all: {result['teardown_after_sigkill_s']}; goal <= 1.5 s)")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "launch.json" if not args.only else f"launch-{args.only}.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
