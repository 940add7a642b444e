"""What the operator commands show, as data and as plain text (pure; `tty` renders the same data as rich
tables on a terminal).

`job_status(record, run_dir files)` gathers per-node and per-rank facts (agent, exit, heartbeats) and
`rank_rows` joins them into one row per rank; `status_text`, `jobs_text` and `sparkline` turn them into
deterministic text for scripts and golden tests; `fmt_*` are the cell formats both renderings share.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from orchestrator.core.health import HealthMonitor, HealthSpec
from orchestrator.node.heartbeat import read_tails
from orchestrator.node.rundir import parse_exit
from orchestrator.types import exit_signal, exit_text, is_terminal

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
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def job_status(record: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """Everything `orchestrate status` shows, as plain data (also the --json output)."""
    now = time.time() if now is None else now
    run_dir = Path(record["run_dir"])
    plan = _read_json(run_dir / "plan.json")
    heartbeats = read_tails(run_dir / "heartbeats")  # bounded: each rank's latest records, not whole files
    world = int(plan.get("world_size") or record["world_size"])
    monitor = HealthMonitor(HealthSpec.from_dict(plan.get("health")), world, now)
    for rec in heartbeats:
        monitor.feed(rec, float(rec.get("t") or now))
    data = _read_json(run_dir / "handle.json").get("data")
    listed = data.get("nodes") if isinstance(data, dict) else None  # (SSH: one entry per node; SLURM: a count)
    handle_nodes = {n.get("rank"): n for n in (listed if isinstance(listed, list) else []) if isinstance(n, dict)}
    outcome = _read_json(run_dir / "outcome.json") if is_terminal(record["state"]) else {}
    judged = {n.get("node"): n for n in outcome.get("nodes") or [] if isinstance(n, dict)}
    nodes = []
    for node in plan.get("node_plans") or []:
        r = node["node_rank"]
        agent = _read_json(run_dir / "nodes" / str(r) / "agent.json")
        exit_ = _read_json(run_dir / "nodes" / str(r) / "exit.json")
        # how it ended: as the supervisor judged it (outcome.json: in agreement with the cause), else by its agent's
        # own record, else not known here ("")
        rec = parse_exit(exit_)
        end, code, note = (rec.end(), rec.returncode, rec.note()) if rec else ("", None, "")
        if r in judged:
            end, code, note = judged[r].get("end") or end, judged[r].get("exit_code"), judged[r].get("note") or ""
        # the host as the job names it (the cluster file's; the machine's own name only where the plan had none,
        # as on SLURM before the allocation)
        nodes.append({"node": r, "host": node.get("host") or agent.get("host") or "", "ranks": node["ranks"],
                      "end": end or None, "exit_code": code, "signal": exit_signal(code), "note": note or None,
                      "stop_reason": exit_.get("stop_reason") or None,
                      "outputs": (handle_nodes.get(r) or {}).get("outputs")})  # host:path where not shared
    evidence = monitor.evidence()
    named = [s for s in (_read_json(run_dir / "stragglers.json").get("named") or []) if isinstance(s, dict)]
    slow = {s.get("rank"): s for s in named}
    host_of = {rank: n["host"] for n in nodes for rank in n["ranks"] if n["host"]}
    ranks = []
    for st in monitor.snapshot():
        ranks.append({"rank": st.rank, "host": host_of.get(st.rank) or st.host, "step": st.step,
                      "max_steps": st.max_steps, "loss": st.loss, "tokens": st.tokens, "event": st.event,
                      "heartbeat_age_s": round(now - st.t, 1) if st.t else None,
                      "losses": [loss for _, loss in st.loss_curve()],
                      "compute_s": round(evidence[st.rank], 6) if st.rank in evidence else None,
                      "straggler": slow.get(st.rank)})
    return {"job": record["id"], "state": record["state"], "backend": record["backend"], "handle": record["handle"],
            "cluster": record["cluster"], "nodes": nodes, "ranks": ranks, "restarts": record.get("restarts") or 0,
            "exit_code": record.get("exit_code"),
            "exit_signal": exit_signal(record.get("exit_code")) if record["state"] == "FAILED" else None,
            "root_cause": record.get("root_cause"), "run_dir": record["run_dir"],
            "created": record["created"], "updated": record["updated"], "fetched": _fetched(run_dir),
            "container": _container(run_dir, plan), "excluded": _excluded(run_dir), "stragglers": named,
            "attempts": _attempts(run_dir), "resumed_from": _resumed_from(run_dir), "queue": _queue(run_dir, record),
            "tracking": _tracking(run_dir), "diagnosis": _diagnosis(run_dir)}


def _tracking(run_dir: Path) -> dict[str, Any]:
    """{tracker: {"run_id", "experiment_id", "tracking_uri", "t"}}: the job's one tracker run (MLflow) as rank 0 named
    it (RUN_DIR/tracking.json, docs/tracking.md); {} when none."""
    from orchestrator.node.rundir import RunDir
    return RunDir(run_dir).tracking()


def tracking_text(tracker: str, rec: dict[str, Any]) -> str:
    """'mlflow   run ID (experiment E, URI)', and the run's page where the tracking URI is a server's."""
    uri, exp, run = str(rec.get("tracking_uri") or ""), rec.get("experiment_id"), rec.get("run_id")
    page = f"  {uri.rstrip('/')}/#/experiments/{exp}/runs/{run}" if uri.startswith(("http://", "https://")) else ""
    return f"{tracker:<8} run {run} (experiment {exp}, {uri}){page}"


def _diagnosis(run_dir: Path) -> dict[str, Any] | None:
    """A hang's analysis (RUN_DIR/diagnosis.json, core.hangs): the root cause, culprits, the collective and the
    stack classes (the largest 8); every rank's last collectives stay in the file."""
    from orchestrator.node.rundir import RunDir
    d = _read_json(run_dir / RunDir.DIAGNOSIS)
    if not d.get("root_cause"):
        return None
    return {"root_cause": d["root_cause"], "culprits": (d.get("culprits") or [])[:64],
            "collective": d.get("collective"), "desync": d.get("desync"), "stopped": (d.get("stopped") or [])[:64],
            "no_answer": (d.get("no_answer") or [])[:64],
            "stack_classes": [dict(c, ranks=(c.get("ranks") or [])[:16]) for c in (d.get("stack_classes") or [])[:8]
                              if isinstance(c, dict)],
            "file": str(run_dir / RunDir.DIAGNOSIS)}


def _attempts(run_dir: Path) -> list[dict[str, Any]]:
    """Every attempt that ended before the last one, with why and what was decided (RUN_DIR/restarts.jsonl): on
    SLURM a crash is retried within health.max_restarts, and a job that then completes still shows what failed."""
    from orchestrator.node.rundir import RunDir
    return [{"attempt": a.attempt, "decision": a.decision, "reason": a.reason, "step": a.step, "host": a.host,
             "kind": a.kind, "exclude": a.exclude} for a in RunDir(run_dir).attempts()]


def _resumed_from(run_dir: Path) -> dict[str, Any] | None:
    """{path, job, step}: another job's checkpoint this job began from, as its checkpoint.resume asked
    (RUN_DIR/resumed_from.json, api.check_resume); None for a job that began fresh or from its own."""
    rec = _read_json(run_dir / "resumed_from.json")
    return {k: rec.get(k) for k in ("path", "job", "step")} if rec.get("path") else None


def resuming_text(prepared) -> str:
    """What `submit` / `render` say of a job that will continue another job's checkpoint as asked ("" otherwise)."""
    r, mode = prepared.resumed_from, prepared.recipe.checkpoint.resume
    return resumed_text(r, verb="resuming") + (f" (checkpoint.resume: {mode})" if mode == "latest" else
                                               " (named by checkpoint.resume)") if r else ""


def resumed_text(r: dict[str, Any], verb: str = "resumed") -> str:
    """'resumed from checkpoint-120 of job X (step 120): PATH' for a {path, job, step} record ('from ...': no verb)."""
    from orchestrator.core.resume import Checkpoint
    return f"{verb} " * bool(verb) + f"from {Checkpoint(r['path'], r.get('job'), r.get('step')).of()}: {r['path']}"


def _queue(run_dir: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """A QUEUED job: {"position" (in this store's queue, when the caller knows it), "waiting_for", "since", "holders":
    [{"host", "what", "holder": {"job", "submitter", "pid", "since", ...}}] of each busy lease}."""
    if record["state"] != "QUEUED":
        return None
    q = _read_json(run_dir / "queue.json")
    return {"position": record.get("queue_position"), "waiting_for": q.get("waiting_for"), "since": q.get("since"),
            "holders": [b for b in q.get("busy") or [] if isinstance(b, dict)]}


def queue_text(st: dict[str, Any]) -> str | None:
    """What a QUEUED job waits for, and its place in this store's queue (`status`)."""
    q = st.get("queue")
    if not q:
        return None
    return (f"#{q['position']} in this store's queue for these hosts; " if q.get("position") else "") + \
        f"waiting: {q.get('waiting_for') or 'leased hosts'}"


def state_label(r: dict[str, Any]) -> str:
    """The state as `ls` shows it: a QUEUED job with its place in this store's queue (`QUEUED #2`)."""
    pos = r.get("queue_position")
    return f"{r['state']} #{pos}" if r["state"] == "QUEUED" and pos else r["state"]


def _excluded(run_dir: Path) -> dict[str, str]:
    """Hosts the restart policy took out of the job, with why (RUN_DIR/restarts.jsonl)."""
    from orchestrator.node.rundir import RunDir
    return RunDir(run_dir).excluded()


def _container(run_dir: Path, plan: dict[str, Any]) -> dict[str, Any] | None:
    """The job's container: the image reference, the runtime and, per host, the image's id / digest and the stack's
    versions in it (RUN_DIR/container.json from the pre-flight; on SLURM each node agent's nodes/<R>/container.json)."""
    if not plan.get("container"):
        return None
    rec = _read_json(run_dir / "container.json")
    hosts = dict(rec.get("hosts") or {})
    for node in plan.get("node_plans") or []:
        hosts.update(_read_json(run_dir / "nodes" / str(node["node_rank"]) / "container.json").get("hosts") or {})
    return {"runtime": plan["container"].get("runtime"), "image": plan["container"].get("image"), "hosts": hosts}


def _fetched(run_dir: Path) -> str | None:
    f = _read_json(run_dir / "fetched.json")
    if not f:
        return None
    errs = "".join(f"; {h}: {e}" for h, e in (f.get("errors") or {}).items())
    return f"{f.get('files', 0)} file(s), {f.get('bytes', 0) / 1e6:.1f} MB fetched back{errs}"


EVENT_STATE = {"boot": "starting", "dist": "starting", "start": "starting", "step": "training", "save_start": "saving",
               "save": "training", "end": "done", "preempted": "preempted", "tracking": "starting"}


def _rank_state(node: dict[str, Any] | None, hb: dict[str, Any] | None, job_state: str) -> str:
    """What a rank is doing: its node's recorded exit first (stopped = torn down by the agent), else its last
    heartbeat; a rank of an ended job that left neither is `stopped`, one with no heartbeat yet `waiting`."""
    event = hb["event"] if hb else ""
    end = node.get("end") if node else None
    if end in ("failed", "stopped", "hung", "lost"):
        return end
    if end in ("done", "preempted"):
        return "preempted" if event == "preempted" or end == "preempted" else "done"
    if event in ("end", "preempted") or (hb is not None and not is_terminal(job_state)):
        return EVENT_STATE.get(event, event or "running")
    return "stopped" if is_terminal(job_state) else "waiting"


def rank_rows(st: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rank of a `job_status` dict, node facts joined in (ranks without a node plan last)."""
    beats = {r["rank"]: r for r in st["ranks"]}
    pairs = [(n, rank) for n in st["nodes"] for rank in n["ranks"]]
    pairs += [(None, rank) for rank in sorted(set(beats) - {rank for _, rank in pairs})]
    rows = []
    for node, rank in pairs:
        hb = beats.get(rank)
        rows.append({"node": node["node"] if node else None, "rank": rank,
                     "host": (hb and hb["host"]) or (node and node["host"]) or "",
                     "state": _rank_state(node, hb, st["state"]), "exit_code": node["exit_code"] if node else None,
                     **{k: hb[k] if hb else None for k in ("step", "max_steps", "loss", "heartbeat_age_s")}})
    return rows


SHOWN = 64  # a job of more ranks (nodes) shows the ones worth a look, and a summary line; all: `status --json`
PICK = 8  # how many of the slowest steps and the oldest heartbeats a big job shows


def notable_ranks(st: dict[str, Any], rows: list[dict[str, Any]] | None = None
                  ) -> tuple[list[dict[str, Any]], str | None]:
    """The rank rows `status` shows, and a summary line when they are not all: up to SHOWN rows are shown as they are;
    of a bigger job rank 0, the ranks of nodes that exited non-zero, the slow ones (stragglers), the PICK lowest
    steps and the PICK oldest heartbeats, in rank order."""
    rows = rank_rows(st) if rows is None else rows
    if len(rows) <= SHOWN:
        return rows, None
    slow = {s.get("rank") for s in st.get("stragglers") or []}
    keep = {rows[0]["rank"]} | {r["rank"] for r in rows if r["exit_code"] not in (None, 0) or r["rank"] in slow}
    stepped = [r for r in rows if r["step"] is not None]
    keep |= {r["rank"] for r in sorted(rows, key=lambda r: (r["step"] is not None, r["step"] or 0))[:PICK]}
    aged = [r for r in rows if r["heartbeat_age_s"] is not None]
    keep |= {r["rank"] for r in sorted(aged, key=lambda r: -r["heartbeat_age_s"])[:PICK]}
    shown = [r for r in rows if r["rank"] in keep][:SHOWN]
    steps = sorted(r["step"] for r in stepped)
    text = f"{len(rows)} ranks"
    if steps:
        text += f": step {steps[0]}-{steps[-1]} (median {steps[len(steps) // 2]})"
    if aged:
        ages = sorted(r["heartbeat_age_s"] for r in aged)
        text += f", last heartbeat {fmt_age(ages[0])}-{fmt_age(ages[-1])} ago"
    if len(stepped) < len(rows):
        text += f", {len(rows) - len(stepped)} without a step yet"
    return shown, text + f"; {len(shown)} shown: rank 0, failed, slow, the lowest steps, the oldest heartbeats " \
                         f"(every rank: status --json)"


def notable_nodes(st: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The node rows `status` shows: all up to SHOWN; of more, the ones that did not end done or exit 0 (failed,
    stopped, hung, lost, ...), and a count per end."""
    nodes = st["nodes"]
    if len(nodes) <= SHOWN:
        return nodes, None
    counts: dict[str, int] = {}
    for n in nodes:
        key = n.get("end") or ("running" if n["exit_code"] is None else f"exit {exit_text(n['exit_code'])}")
        counts[key] = counts.get(key, 0) + 1
    shown = [n for n in nodes if (n.get("end") or "done") != "done" or n["exit_code"] not in (None, 0)
             or n["stop_reason"]][:SHOWN]
    return shown, (f"{len(nodes)} nodes: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) +
                   f"; {len(shown)} shown (the ones that did not end done; every node: status --json)")


def fmt_loss(v: float | None) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) else "-"


def fmt_step(r: dict[str, Any]) -> str:
    """A rank's step, as `step/max_steps` when the trainer told its max."""
    return f"{r['step']}/{r['max_steps']}" if r["max_steps"] else str(r["step"])


def fmt_age(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def status_text(st: dict[str, Any]) -> str:
    lines = [f"job      {st['job']}", f"state    {st['state']}" + (f"  (exit {job_exit_text(st)})"
                                                                     if st["exit_code"] is not None else ""),
             f"backend  {st['backend']}  {st['handle'] or ''}".rstrip(), f"cluster  {st['cluster']}",
             f"restarts {st['restarts']}", f"run dir  {st['run_dir']}"]
    if st.get("scheduler"):
        lines.append(f"sched    {st['scheduler']}")
    if st.get("queue"):
        lines.append(f"queue    {queue_text(st)}")
    if st["root_cause"]:
        lines.append(f"cause    {st['root_cause']}")
    if st.get("diagnosis"):
        d = st["diagnosis"]
        lines.append(f"hang     {d['root_cause'][:600]}")
        lines += [f"stacks   {c.get('count')} rank(s) in {c.get('where')}" for c in d.get("stack_classes", [])[:4]]
    for a in st.get("attempts") or []:
        lines.append(f"attempt  {a['attempt']}: {a['reason'][:300]}")
    if st.get("resumed_from"):
        lines.append(resumed_text(st["resumed_from"]))
    for tracker, rec in (st.get("tracking") or {}).items():
        lines.append(tracking_text(tracker, rec))
    for host, why in (st.get("excluded") or {}).items():
        lines.append(f"excluded {host}: {why}")
    for s in st.get("stragglers") or []:
        what = (f"the others wait for it alone {s.get('median_s', 0) * 100:.1f} % of the time, for the others "
                f"{s.get('others_s', 0) * 100:.1f} %" if s.get("measure") == "wait_share" else
                f"enters the collectives {s.get('median_s', 0) * 1000:.1f} ms after the first rank, the others "
                f"{s.get('others_s', 0) * 1000:.1f} ms" if s.get("evidence") == "arrival" else
                f"{s.get('ratio')}x the others' forward time per step")
        lines.append(f"slow     rank {s.get('rank')} on {s.get('host') or '?'}: {what} (attempt {s.get('attempt')}, "
                     f"step {s.get('step')}, {s.get('action')})")
    if st.get("container"):
        c = st["container"]
        ids = sorted({(h.get("image") or {}).get("digest") or (h.get("image") or {}).get("id") or ""
                      for h in c["hosts"].values()} - {""})
        lines.append(f"image    {c['image']} ({c['runtime']})" + (f"  {', '.join(i[:71] for i in ids)}" if ids else ""))
    lines.append("")
    nodes, node_summary = notable_nodes(st)
    if node_summary:
        lines.append(f"nodes    {node_summary}")
    if nodes:
        lines.append(f"{'NODE':<5} {'HOST':<20} {'RANKS':<9} {'END':<9} {'EXIT':<11} NOTE")
    for n in nodes:
        ranks = f"{n['ranks'][0]}-{n['ranks'][-1]}" if n["ranks"] else "-"
        lines.append(f"{n['node']:<5} {n['host'][:20]:<20} {ranks:<9} {n.get('end') or '-':<9} "
                     f"{exit_text(n['exit_code']):<11} {n.get('note') or ''}".rstrip())
    outs = [n for n in st["nodes"] if n.get("outputs")]
    if outs or st.get("fetched"):
        lines.append("")
        lines += [f"outputs  node {n['node']}: {n['outputs']}" for n in outs]
        if st.get("fetched"):
            lines.append(f"fetched  {st['fetched']}")
    if st["ranks"]:
        lines.append("")
        ranks: list[dict[str, Any]] = st["ranks"]
        if len(ranks) > SHOWN:
            shown, summary = notable_ranks(st)
            keep = {r["rank"] for r in shown}
            ranks = [r for r in ranks if r["rank"] in keep]
            lines.append(f"ranks    {summary}")
        lines.append(f"{'RANK':<5} {'HOST':<20} {'STEP':>10} {'LOSS':>8} {'BEAT':>6} {'FWD/STEP':>9}  LOSS CURVE")
        for r in ranks:
            fwd = "-" if r.get("compute_s") is None else f"{r['compute_s'] * 1000:.1f}ms"
            if r.get("straggler"):
                fwd = "SLOW " + fwd
            lines.append(f"{r['rank']:<5} {r['host'][:20]:<20} {fmt_step(r):>10} {fmt_loss(r['loss']):>8} "
                         f"{fmt_age(r['heartbeat_age_s']):>6} {fwd:>9}  {sparkline(r['losses'])}".rstrip())
    return "\n".join(lines)


def job_exit_text(st: dict[str, Any]) -> str:
    """The job's exit code as `status` shows it: `3`, `137/SIGKILL` for a FAILED job whose cause was a signal (128 +
    N, docs/CONTRACT.md "Exit codes"); a CANCELLED job's 130 is just 130."""
    return exit_text(st["exit_code"]) if st.get("exit_signal") else str(st["exit_code"])


def group_sweeps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`ls` rows (newest first) with each sweep's points together, in point order, at the place of its newest point,
    after a header row {"sweep": id, "header": text}. A point row carries "sweep", "point", "overrides" and "loss"
    (cmd_ls adds them); other rows stay as they are."""
    out: list[dict[str, Any]] = []
    done: set[str] = set()
    for r in rows:
        sweep = r.get("sweep")
        if not sweep:
            out.append(r)
            continue
        if sweep in done:
            continue
        done.add(sweep)
        points = sorted((p for p in rows if p.get("sweep") == sweep), key=lambda p: p.get("point") or 0)
        states: dict[str, int] = {}
        for p in points:
            states[p["state"]] = states.get(p["state"], 0) + 1
        total = r.get("sweep_points") or len(points)
        if total > len(points):
            states["NOT STARTED"] = total - len(points)
        out.append({"sweep": sweep, "header": f"{sweep}  sweep of {total} point(s), at most "
                    f"{r.get('sweep_parallel') or total} at once: " +
                    ", ".join(f"{n} {k}" for k, n in sorted(states.items()))})
        out += points
    return out


def point_note(r: dict[str, Any]) -> str:
    """What an `ls` row of a sweep point says after its columns: its overrides and last loss."""
    loss = r.get("loss")
    return " ".join(r.get("overrides") or []) + (f"  loss {loss:.4f}" if isinstance(loss, (int, float)) else "")


def jobs_text(records: list[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    if not records:
        return "no jobs yet"
    lines = [f"{'JOB':<44} {'STATE':<10} {'BACKEND':<7} {'NODES':>5} {'STEP':>7} {'AGE':>6}"]
    for r in group_sweeps(records):
        if r.get("header"):
            lines.append(r["header"])
            continue
        step = r.get("step")
        name = f"  {r['id']}"[:44] if r.get("sweep") else r["id"][:44]
        lines.append((f"{name:<44} {state_label(r):<10} {r['backend']:<7} {r['nodes']:>5} "
                      f"{('-' if step is None else str(step)):>7} {fmt_age(now - r['created']):>6}"
                      + (f"  {point_note(r)}" if r.get("sweep") else "")).rstrip())
    return "\n".join(lines)


def completed_text(job: str, result: dict[str, Any], run_dir: str | Path | None = None) -> str:
    """The line `submit` prints when a job completed, from the recipe's ORCHESTRATE_RESULT (may be empty). A
    checkpoint that `outputs.fetch` brought back is shown where it is now, on this machine."""
    msg = f"job {job} COMPLETED"
    first, last = result.get("first_loss"), result.get("final_loss")
    if isinstance(first, (int, float)) and isinstance(last, (int, float)):
        msg += f": loss {first:.3f} -> {last:.3f} over {result.get('global_step')} steps"
    ck = result.get("last_checkpoint") or result.get("output_dir")
    if ck and run_dir is not None:
        ck = local_copy(str(ck), Path(run_dir))
    return msg + (f"; checkpoint: {ck}" if ck else "")


def local_copy(path: str, run_dir: Path) -> str:
    """`path` on a host (the job's output dir there, or inside it) as the fetched copy on this machine, when
    `outputs.fetch` brought it back (RUN_DIR/fetched.json, staged.json's output_local); else `path` unchanged."""
    staged, fetched = _read_json(run_dir / "staged.json"), _read_json(run_dir / "fetched.json")
    local, key = staged.get("output_local"), staged.get("output_key")
    if not local or not fetched.get("files"):
        return path
    for marker in filter(None, (f"/{key}" if key else "", "/output")):
        head, sep, rel = (path.rstrip("/") + "/").partition(marker + "/")
        if sep:
            candidate = Path(local, rel.rstrip("/"))
            if candidate.exists():
                return str(candidate)
    return path


def last_step(run_dir: str) -> int | None:
    """The latest step any rank reported (cheap: the last records of each heartbeat file, 512 bytes: `ls` of a
    1,024 x 8-rank job reads 4 MiB, not the whole history)."""
    from orchestrator.node.rundir import RunDir
    return RunDir(run_dir).furthest_step(tail_bytes=512)


def staging_text(files: dict[str, str]) -> str:
    """What a job stages to SSH hosts without a shared filesystem (docs/staging.md), from its stage.json; "" if none."""
    if "stage.json" not in files:
        return ""
    doc = json.loads(files["stage.json"])
    lines = [f"staging  node package {doc['package'][:12]} (orchestrator + recipes) -> WORKDIR/cache/trees/"
             f"{doc['package'][:12]}..., on PYTHONPATH of the agent and ranks"]
    if not doc["stage"]:
        lines.append("         ssh.stage: false - these paths must exist on every host: " + (", ".join(doc["inputs"])
                                                                                           or "(none)"))
    for src in doc["sources"]:
        n = len(src["files"]) if src["files"] else 1
        lines.append(f"         {src['kind']:<6} {src['path']} ({n} file{'s' * (n != 1)}) -> ${{RUN_DIR}}/staged/"
                     f"{src['label']}")
    lines.append(f"         output {doc['output_local']} <- ${{RUN_DIR}}/output on each host (WORKDIR/"
                 f"{doc['output_key']}), fetch: {doc['fetch']}")
    return "\n".join(lines)


def gc_text(report: dict[str, Any], age: str | None) -> str:
    """`orchestrate gc`'s table (orchestrator.gc.Report.to_dict()): one row per thing freed, then the total and the
    jobs left alone."""
    from orchestrator.gc import fmt_bytes
    rows = [("JOB", "WHERE", "WHAT", "SIZE", "PATH")]
    for i in report["items"]:
        what = i["what"] + (f" ({i['detail']})" if i["detail"] else "")
        rows.append((i["job"] or "-", i["where"], what, fmt_bytes(i["bytes"]),
                     i["path"] + (f"  ERROR: {i['error']}" if i["error"] else "")))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}"
             for r in rows] if report["items"] else []
    n = len(report["jobs"])
    verb = "would free" if report["dry_run"] else "freed"
    lines.append(f"{verb} {fmt_bytes(report['bytes'])} of {n} finished job(s)" + (f" older than {age}" if age else "") +
                 (" (dry run: nothing removed)" if report["dry_run"] else ""))
    if report["newer"]:
        lines.append(f"left alone: {report['newer']} finished job(s) newer than {age}")
    for job, why in sorted(report["kept"].items()):
        lines.append(f"left alone: {job}: {why}")
    return "\n".join(lines)


def job_progress(run_dir: str, tail: int = 4096) -> dict[str, Any]:
    """Rank 0's latest {"step", "max_steps", "loss" (its last finite one), "tokens_per_s"} from the end of its heartbeat
    file (a row of a jobs list: one small read per job, whatever its size)."""
    from orchestrator.cli.plot import series
    from orchestrator.node.heartbeat import read_tail
    from orchestrator.node.rundir import RunDir
    out: dict[str, Any] = {"step": None, "max_steps": None, "loss": None, "tokens_per_s": None}
    try:
        recs = read_tail(RunDir(run_dir).path(RunDir.heartbeat_rel(0)), tail)
    except OSError:
        return out
    for rec in recs:
        if isinstance(rec.get("step"), int) and rec.get("event") not in ("boot", "dist"):
            out["step"], out["max_steps"] = rec["step"], rec.get("max_steps") or out["max_steps"]
        if isinstance(rec.get("loss"), (int, float)) and rec["loss"] == rec["loss"]:
            out["loss"] = float(rec["loss"])
    speed = series(recs)[1].get(0)
    out["tokens_per_s"] = round(speed[-1][1], 1) if speed else None
    return out


def job_times(record: dict[str, Any], events: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """{"queue_wait_s": from submit to its first RUNNING (so far, while it has not run), "run_s": from its first RUNNING
    to its end (so far, while it runs)} from the store's events of the job."""
    now = time.time() if now is None else now
    started = next((e["t"] for e in events if e["state"] == "RUNNING"), None)
    ended = next((e["t"] for e in reversed(events) if is_terminal(e["state"])), None) \
        if is_terminal(record["state"]) else None
    end = ended if ended is not None else (record["updated"] if is_terminal(record["state"]) else now)
    return {"queue_wait_s": round((started if started is not None else end) - record["created"], 1),
            "run_s": round(end - started, 1) if started is not None else None}
