"""What the operator commands show, as data and as plain text (pure; the CLI adds rich when on a TTY).

`job_status(record, run_dir files)` gathers per-node and per-rank facts (agent, exit, heartbeats);
`status_text`, `jobs_text` and `sparkline` turn them into deterministic text for golden tests.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from orchestrator.health import HealthMonitor, read_all

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 24) -> str:
    if not values:
        return ""
    if len(values) > width:  # keep the shape: sample evenly, always including the last value
        step = (len(values) - 1) / (width - 1)
        values = [values[round(i * step)] for i in range(width)]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARKS[0] * len(values)
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / (hi - lo) * (len(SPARKS) - 1) + 0.5))] for v in values)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def job_status(record: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """Everything `orchestrate status` shows, as plain data (also the --json output)."""
    now = time.time() if now is None else now
    run_dir = Path(record["run_dir"])
    plan = _read_json(run_dir / "plan.json")
    heartbeats = read_all(run_dir / "heartbeats")
    monitor = HealthMonitor(plan.get("health") or {}, int(plan.get("world_size") or record["world_size"]), now)
    for rec in heartbeats:
        monitor.feed(rec, float(rec.get("t") or now))
    nodes = []
    for node in plan.get("node_plans") or []:
        r = node["node_rank"]
        agent = _read_json(run_dir / "nodes" / str(r) / "agent.json")
        exit_ = _read_json(run_dir / "nodes" / str(r) / "exit.json")
        nodes.append({"node": r, "host": agent.get("host") or node.get("host") or "", "ranks": node["ranks"],
                      "exit_code": exit_.get("returncode"), "stop_reason": exit_.get("stop_reason") or None})
    ranks = []
    for st in monitor.snapshot():
        ranks.append({"rank": st.rank, "host": st.host, "step": st.step, "max_steps": st.max_steps,
                      "loss": st.loss, "tokens": st.tokens, "event": st.event,
                      "heartbeat_age_s": round(now - st.t, 1) if st.t else None,
                      "losses": [loss for _, loss in st.losses]})
    return {"job": record["id"], "state": record["state"], "backend": record["backend"], "handle": record["handle"],
            "cluster": record["cluster"], "nodes": nodes, "ranks": ranks, "restarts": record.get("restarts") or 0,
            "exit_code": record.get("exit_code"), "root_cause": record.get("root_cause"), "run_dir": record["run_dir"],
            "created": record["created"], "updated": record["updated"]}


def _fmt_loss(v: float | None) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) else "-"


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def status_text(st: dict[str, Any]) -> str:
    lines = [f"job      {st['job']}", f"state    {st['state']}" + (f"  (exit {st['exit_code']})"
                                                                     if st["exit_code"] is not None else ""),
             f"backend  {st['backend']}  {st['handle'] or ''}".rstrip(), f"cluster  {st['cluster']}",
             f"restarts {st['restarts']}", f"run dir  {st['run_dir']}"]
    if st.get("scheduler"):
        lines.append(f"sched    {st['scheduler']}")
    if st["root_cause"]:
        lines.append(f"cause    {st['root_cause']}")
    lines.append("")
    lines.append(f"{'NODE':<5} {'HOST':<20} {'RANKS':<9} {'EXIT':<5} NOTE")
    for n in st["nodes"]:
        ranks = f"{n['ranks'][0]}-{n['ranks'][-1]}" if n["ranks"] else "-"
        code = "-" if n["exit_code"] is None else str(n["exit_code"])
        lines.append(f"{n['node']:<5} {n['host'][:20]:<20} {ranks:<9} {code:<5} {n['stop_reason'] or ''}".rstrip())
    if st["ranks"]:
        lines.append("")
        lines.append(f"{'RANK':<5} {'HOST':<20} {'STEP':>10} {'LOSS':>8} {'BEAT':>6}  LOSS CURVE")
        for r in st["ranks"]:
            step = f"{r['step']}/{r['max_steps']}" if r["max_steps"] else str(r["step"])
            lines.append(f"{r['rank']:<5} {r['host'][:20]:<20} {step:>10} {_fmt_loss(r['loss']):>8} "
                         f"{_age(r['heartbeat_age_s']):>6}  {sparkline(r['losses'])}".rstrip())
    return "\n".join(lines)


def jobs_text(records: list[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    if not records:
        return "no jobs yet"
    lines = [f"{'JOB':<44} {'STATE':<10} {'BACKEND':<7} {'NODES':>5} {'STEP':>7} {'AGE':>6}"]
    for r in records:
        step = r.get("step")
        lines.append(f"{r['id'][:44]:<44} {r['state']:<10} {r['backend']:<7} {r['nodes']:>5} "
                     f"{('-' if step is None else str(step)):>7} {_age(now - r['created']):>6}")
    return "\n".join(lines)


def last_step(run_dir: str) -> int | None:
    """The furthest step any rank reported (cheap: reads only the end of each heartbeat file)."""
    best = None
    for path in Path(run_dir, "heartbeats").glob("rank*.jsonl"):
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 4096))
                tail = f.read().splitlines()
        except OSError:
            continue
        for line in reversed(tail):
            try:
                step = json.loads(line).get("step")
            except ValueError:
                continue
            if isinstance(step, int):
                best = step if best is None else max(best, step)
                break
    return best
