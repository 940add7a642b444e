"""Terminal output of `orchestrate ls` and `orchestrate status`: rich tables built from the dicts of `views`.

Owns when rich is used (`--color auto|always|never`; auto: stdout is a TTY or FORCE_COLOR is set, as rich
itself reads it) and how the ls rows and a `job_status` dict become rich tables with coloured states.
Anything else (a pipe, a script, `--color never`) gets `views`' plain text, byte for byte. The CLI imports
this module only in the commands that print a view, and rich is imported inside the functions.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from orchestrator.cli.views import (fmt_age, fmt_loss, fmt_step, group_sweeps, job_exit_text, jobs_text, notable_ranks,
                                    point_note, queue_text, resumed_text, sparkline, state_label, status_text)
from orchestrator.types import exit_text

COLOR_MODES = ("auto", "always", "never")

STATE_STYLE = {"COMPLETED": "green", "RUNNING": "yellow", "RESTARTING": "yellow", "PENDING": "cyan", "QUEUED": "cyan",
               "FAILED": "bold red", "CANCELLED": "magenta", "TIMEOUT": "red", "NODE_FAIL": "red",
               "OUT_OF_MEMORY": "red", "PREEMPTED": "yellow",
               # a rank's state (views.rank_rows)
               "training": "yellow", "starting": "cyan", "saving": "cyan", "waiting": "dim", "done": "green",
               "preempted": "yellow", "stopped": "magenta", "failed": "bold red", "hung": "bold red", "lost": "red"}

CAUSE_WIDTH = 60


def use_rich(mode: str = "auto", stream=None) -> bool:
    if mode != "auto":
        return mode == "always"
    return (stream or sys.stdout).isatty() or bool(os.environ.get("FORCE_COLOR"))


def console(**kw):
    """A console that renders tables and colours even into a pipe (the caller decided); NO_COLOR still applies."""
    from rich.console import Console
    return Console(**{"highlight": False, "force_terminal": True, **kw})


def state_text(state: str):
    from rich.text import Text
    return Text(state, style=STATE_STYLE.get(state, ""))


def short(text: str | None, width: int = CAUSE_WIDTH) -> str:
    """The first line of `text`, cut to `width` characters with an ellipsis."""
    line = (text or "").strip().split("\n", 1)[0]
    return line if len(line) <= width else line[:width - 1] + "…"


def jobs_table(rows: list[dict[str, Any]], now: float | None = None):
    """The `ls` table: job, state, backend, nodes, step, age, root cause (shortened)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text
    if not rows:
        return Text("no jobs yet")
    now = time.time() if now is None else now
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("JOB", no_wrap=True)
    table.add_column("STATE", no_wrap=True)
    table.add_column("BACKEND")
    for name in ("NODES", "STEP", "AGE"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("CAUSE")  # the one column that gives way when the terminal is narrow
    for r in group_sweeps(rows):
        if r.get("header"):
            table.add_row(Text(r["header"], style="bold"), end_section=False)
            continue
        step = r.get("step")
        state = state_text(r["state"])
        if state_label(r) != r["state"]:
            state.append(state_label(r)[len(r["state"]):])
        note = Text(point_note(r), no_wrap=True, overflow="ellipsis") if r.get("sweep") else \
            Text(short(r.get("root_cause")), style="red", no_wrap=True, overflow="ellipsis")
        table.add_row(("  " if r.get("sweep") else "") + r["id"], state, r["backend"], str(r["nodes"]),
                      "-" if step is None else str(step), fmt_age(now - r["created"]), note)
    return table


def _loss_line(st: dict[str, Any]) -> str | None:
    """Sparkline of the lowest rank that reported losses, with its first and last loss."""
    ranked = [r for r in st["ranks"] if r["losses"]]
    if not ranked:
        return None
    r = ranked[0]
    return f"{sparkline(r['losses'])}  {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}  (rank {r['rank']})"


def status_header(st: dict[str, Any]):
    """Key/value grid: job, state, backend handle, cluster, run dir, restarts, scheduler, root cause, loss."""
    from rich.table import Table
    from rich.text import Text
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    state = state_text(st["state"])
    if st["exit_code"] is not None:
        state.append(f"  (exit {job_exit_text(st)})")
    rows = [("job", st["job"]), ("state", state), ("backend", f"{st['backend']}  {st['handle'] or ''}".rstrip()),
            ("cluster", st["cluster"]), ("run dir", st["run_dir"]), ("restarts", str(st["restarts"])),
            ("scheduler", st.get("scheduler")), ("queue", queue_text(st)),
            ("root cause", st["root_cause"] and Text(st["root_cause"], style="red")), ("loss", _loss_line(st)),
            ("resumed", st.get("resumed_from") and resumed_text(st["resumed_from"], verb=""))]
    for key, value in rows:
        if value:
            grid.add_row(key, value)
    return grid


def ranks_table(st: dict[str, Any]):
    """One row per rank: node, host, rank, state, step, loss, last heartbeat age, the node's exit code."""
    from rich import box
    from rich.table import Table
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for name in ("NODE", "HOST", "RANK", "STATE", "STEP", "LOSS", "HEARTBEAT", "EXIT"):
        table.add_column(name, justify="left" if name in ("HOST", "STATE") else "right", no_wrap=name != "HOST")
    rows, summary = notable_ranks(st)
    if summary:
        table.caption, table.caption_justify = summary, "left"
    grouped = len({r["node"] for r in rows}) < len(rows)  # a rule between nodes when nodes have several ranks
    for i, r in enumerate(rows):
        last_of_node = grouped and (i + 1 == len(rows) or rows[i + 1]["node"] != r["node"])
        table.add_row("-" if r["node"] is None else str(r["node"]), r["host"], str(r["rank"]), state_text(r["state"]),
                      "-" if r["step"] is None else fmt_step(r), fmt_loss(r["loss"]), fmt_age(r["heartbeat_age_s"]),
                      exit_text(r["exit_code"]), end_section=last_of_node)
    return table


def status_view(st: dict[str, Any]):
    from rich.console import Group
    outs = [f"outputs  node {n['node']}: {n['outputs']}" for n in st["nodes"] if n.get("outputs")]
    outs += [f"fetched  {st['fetched']}"] if st.get("fetched") else []
    return Group(status_header(st), *(["", "\n".join(outs)] if outs else []), "", ranks_table(st))


def show_jobs(rows: list[dict[str, Any]], mode: str = "auto") -> None:
    if use_rich(mode):
        console().print(jobs_table(rows))
    else:
        print(jobs_text(rows))


def show_status(st: dict[str, Any], mode: str = "auto") -> None:
    if use_rich(mode):
        console().print(status_view(st))
    else:
        print(status_text(st))
