"""`ls` and `status` on a terminal: rich tables built from the views' data (fixed width, colours checked), when
rich is used at all (`--color`, FORCE_COLOR), and that pipes and `--json` get exactly what they got before."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.cli import tty
from orchestrator.store import JobStore
from orchestrator.cli.views import job_status, jobs_text, rank_rows, status_text
from view_helpers import JOB_ROWS, status_fixture

REPO = Path(__file__).resolve().parents[2]
CAUSE = ("node 3 (gpu07) failed: exit 1: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
         "79.1 GiB total)\nTraceback (most recent call last):")
ROWS = JOB_ROWS + [{"id": "dpo-20261121-2200-ef56", "state": "FAILED", "backend": "ssh", "nodes": 8, "step": 311,
                    "created": 1000.0 - 7200, "root_cause": CAUSE}]


def render(renderable, width: int = 120) -> tuple[str, list]:
    """(plain text, [(text, style)] segments) of a renderable on a colour terminal `width` columns wide."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system="truecolor",
                      highlight=False, record=True)
    segments = [(s.text, s.style) for s in console.render(renderable) if s.text.strip()]
    console.print(renderable)
    return console.export_text(), segments


def style_of(segments, text: str):
    found = [style for t, style in segments if t.strip() == text]
    assert found, f"no cell {text!r} in {[t for t, _ in segments]}"
    return found[0]


def row(text: str, value: str, column: int = 0) -> list[str]:
    """The cells of the one line whose `column`-th cell is `value`."""
    lines = [ln.split() for ln in text.splitlines() if ln.split()[column:column + 1] == [value]]
    assert len(lines) == 1, (value, text)
    return lines[0]


def test_ls_table_columns_states_and_cause():
    text, segments = render(tty.jobs_table(ROWS, now=1090.0), width=140)
    lines = text.splitlines()
    assert lines[0].split() == ["JOB", "STATE", "BACKEND", "NODES", "STEP", "AGE", "CAUSE"]
    assert set(lines[1].strip()) == {"─"}  # a rule under the header, no box around it
    assert row(text, "sft_tiny-20261122-0400-ab12") == ["sft_tiny-20261122-0400-ab12", "RUNNING", "local", "2", "12",
                                                        "90s"]
    assert row(text, "dpo-20261122-0300-cd34") == ["dpo-20261122-0300-cd34", "COMPLETED", "slurm", "4", "-", "18m"]
    failed = row(text, "dpo-20261121-2200-ef56")
    assert failed[:6] == ["dpo-20261121-2200-ef56", "FAILED", "ssh", "8", "311", "2h"]
    cause = " ".join(failed[6:])
    assert cause.startswith("node 3 (gpu07) failed: exit 1: RuntimeError") and cause.endswith("…")
    assert len(cause) == tty.CAUSE_WIDTH and "Traceback" not in text  # first line only, shortened
    assert style_of(segments, "FAILED").color.name == "red" and style_of(segments, "FAILED").bold
    assert style_of(segments, "COMPLETED").color.name == "green"
    assert style_of(segments, "RUNNING").color.name == "yellow"


def test_ls_table_narrow_terminal_cuts_the_cause_not_the_job_ids():
    text, _ = render(tty.jobs_table(ROWS, now=1090.0), width=80)
    assert max(len(ln) for ln in text.splitlines()) <= 80
    for r in ROWS:
        assert r["id"] in text and r["state"] in text
    assert row(text, "dpo-20261121-2200-ef56")[-1].endswith("…")


def test_ls_table_empty():
    assert render(tty.jobs_table([]))[0].strip() == "no jobs yet"


@pytest.mark.health
def test_status_header_and_rank_table(tmp_path):
    st = job_status(status_fixture(tmp_path), now=1010.0)
    text, segments = render(tty.status_view(st), width=120)
    head, table = text.split("\n\n", 1)
    header = {ln[:12].strip(): ln[12:].strip() for ln in head.splitlines()}
    assert header == {"job": "sft-1", "state": "FAILED  (exit 1)", "backend": "ssh  ssh://sft-1", "cluster": "lab",
                      "run dir": f"{tmp_path}/run", "restarts": "1",
                      "root cause": "node 1 (gpu02) failed: signal SIGKILL",
                      "loss": "█▆▅▃▁  5.5000 -> 3.5000  (rank 0)"}
    lines = table.splitlines()
    assert lines[0].split() == ["NODE", "HOST", "RANK", "STATE", "STEP", "LOSS", "HEARTBEAT", "EXIT"]
    assert row(table, "0") == ["0", "gpu01", "0", "stopped", "5/10", "3.5000", "5s", "-"]
    assert row(table, "1") == ["1", "gpu02", "1", "stopped", "3/10", "4.4000", "7s", "137/SIGKILL"]
    assert style_of(segments, "FAILED  (exit 1)").color.name == "red"
    assert style_of(segments, "node 1 (gpu02) failed: signal SIGKILL").color.name == "red"
    assert style_of(segments, "stopped").color.name == "magenta"


def _running(tmp_path: Path, exit_json: dict | None) -> dict:
    """The fixture as a RUNNING job of 2 nodes x 2 ranks: rank 1 never beat; node 1 exited as `exit_json` says."""
    rec = dict(status_fixture(tmp_path), state="RUNNING", exit_code=None, root_cause=None)
    run = Path(rec["run_dir"])
    plan = json.loads((run / "plan.json").read_text())
    plan.update(world_size=4, procs_per_node=2, node_plans=[{"node_rank": 0, "host": "gpu01", "ranks": [0, 1]},
                                                            {"node_rank": 1, "host": "gpu02", "ranks": [2, 3]}])
    (run / "plan.json").write_text(json.dumps(plan))
    beats = [dict(json.loads(ln), rank=2) for ln in (run / "heartbeats" / "rank1.jsonl").read_text().splitlines()]
    (run / "heartbeats" / "rank1.jsonl").unlink()
    (run / "heartbeats" / "rank2.jsonl").write_text("".join(json.dumps(b) + "\n" for b in beats))
    (run / "heartbeats" / "rank3.jsonl").write_text(json.dumps(
        {"t": 1004.0, "rank": 3, "host": "gpu02", "step": 4, "max_steps": 10, "event": "end"}) + "\n")
    exit_path = run / "nodes" / "1" / "exit.json"
    exit_path.unlink()
    if exit_json is not None:
        exit_path.write_text(json.dumps(exit_json))
    return rec


@pytest.mark.health
@pytest.mark.parametrize("exit_json,node1", [
    (None, ["training", "done"]),
    ({"returncode": 0, "stop_reason": ""}, ["done", "done"]),
    ({"returncode": 1, "stop_reason": ""}, ["failed", "failed"]),
    ({"returncode": 143, "stop_reason": "signal SIGTERM"}, ["stopped", "stopped"]),
])
def test_rank_rows_state_per_rank(tmp_path, exit_json, node1):
    st = job_status(_running(tmp_path, exit_json), now=1010.0)
    rows = rank_rows(st)
    assert [(r["node"], r["rank"], r["host"]) for r in rows] == [(0, 0, "gpu01"), (0, 1, "gpu01"), (1, 2, "gpu02"),
                                                                 (1, 3, "gpu02")]
    assert [r["state"] for r in rows] == ["training", "waiting", *node1]
    assert rows[1]["step"] is None and rows[3]["step"] == 4
    text, _ = render(tty.ranks_table(st))
    assert row(text, "0", column=2)[3:] == ["training", "5/10", "3.5000", "5s", "-"]
    # a rank that has not beaten yet still has a row
    assert row(text, "1", column=2)[3:] == ["waiting", "-", "-", "-", "-"]
    assert [ln.strip() == "" for ln in text.splitlines()] == [False] * 4 + [True, False, False]  # nodes apart


def test_rank_rows_of_an_ended_job_without_exit_records(tmp_path):
    st = job_status(dict(status_fixture(tmp_path), state="CANCELLED"), now=1010.0)
    st["nodes"][1]["exit_code"] = None  # e.g. a host that went away before its agent wrote exit.json
    assert [r["state"] for r in rank_rows(st)] == ["stopped", "stopped"]


def test_use_rich(monkeypatch):
    pipe, term = io.StringIO(), io.StringIO()
    term.isatty = lambda: True
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    assert [tty.use_rich(m, pipe) for m in tty.COLOR_MODES] == [False, True, False]
    assert [tty.use_rich(m, term) for m in tty.COLOR_MODES] == [True, True, False]
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert [tty.use_rich(m, pipe) for m in tty.COLOR_MODES] == [True, True, False]


# -- through the command line -----------------------------------------------------------------------------------

def _cli(home: Path, *args: str, check_rc: bool = True, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "COLUMNS")}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**base, "ORCHESTRATE_HOME": str(home), **env}, timeout=120, check=check_rc)


@pytest.fixture
def home(tmp_path) -> Path:
    rec = status_fixture(tmp_path)
    store = JobStore(tmp_path / "jobs.db")
    store.create(job_id=rec["id"], recipe="r.yaml", recipe_digest="d", cluster="lab", backend="ssh", nodes=2,
                 world_size=2, run_dir=rec["run_dir"])
    store.update(rec["id"], "FAILED", handle="ssh://sft-1", exit_code=1, root_cause=rec["root_cause"], restarts=1)
    with sqlite3.connect(tmp_path / "jobs.db") as c:  # ages in hours: the same text a few seconds later
        c.execute("UPDATE jobs SET created=900.0, updated=1010.0")
    return tmp_path


@pytest.mark.health
def test_cli_piped_is_the_plain_text_and_json_is_unchanged(home):
    rec = JobStore(home / "jobs.db").get("sft-1")
    rows = [dict(rec.to_dict(), step=5)]
    assert _cli(home, "ls").stdout == jobs_text(rows) + "\n"
    assert _cli(home, "ls", "--color", "never").stdout == jobs_text(rows) + "\n"
    assert json.loads(_cli(home, "ls", "--json", "--color", "always").stdout) == rows
    status = _cli(home, "status", "sft-1").stdout
    assert status == status_text(job_status(rec.to_dict())) + "\n" and "\x1b[" not in status
    st = json.loads(_cli(home, "status", "sft-1", "--json", "--color", "always").stdout)
    assert set(st) == {"job", "state", "backend", "handle", "cluster", "nodes", "ranks", "restarts", "exit_code",
                       "exit_signal", "root_cause", "run_dir", "created", "updated", "fetched", "container", "excluded",
                       "stragglers", "attempts", "resumed_from", "queue", "tracking", "diagnosis"}
    assert set(st["nodes"][0]) == {"node", "host", "ranks", "end", "exit_code", "signal", "note", "stop_reason",
                                   "outputs"}
    assert set(st["ranks"][0]) == {"rank", "host", "step", "max_steps", "loss", "tokens", "event", "heartbeat_age_s",
                                   "losses", "compute_s", "straggler"}


@pytest.mark.health
@pytest.mark.parametrize("how", [("--color", "always"), ("FORCE_COLOR", "1")])
def test_cli_tables_when_forced(home, how):
    flag, env = (list(how), {}) if how[0] == "--color" else ([], dict([how]))
    ls = _cli(home, "ls", *flag, COLUMNS="100", **env).stdout
    assert "\x1b[1;31mFAILED\x1b[0m" in ls and "CAUSE" in ls and "─" in ls
    status = _cli(home, "status", "sft-1", *flag, COLUMNS="100", **env).stdout
    plain = status.replace("\x1b[0m", "")
    for needle in ("HEARTBEAT", "gpu02", "137", "root cause", "█▆▅▃▁"):
        assert needle in plain, needle
    assert max(len(ln) for ln in plain.splitlines() if "\x1b" not in ln) <= 100
    no_color = _cli(home, "ls", *flag, NO_COLOR="1", **env).stdout
    assert "CAUSE" in no_color and "FAILED" in no_color and "\x1b[1;31m" not in no_color  # tables, no colours


def test_help_documents_color():
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "ls", "--help"], cwd=REPO, capture_output=True,
                         text=True).stdout
    assert "--color {auto,always,never}" in out and "FORCE_COLOR" in out


@pytest.mark.health
def test_attach_progress_follows_color(home):
    """attach to the (ended) fixture job: plain `progress:` lines into a pipe, a rich bar with --color always."""
    plain = _cli(home, "attach", "sft-1", "--quiet", check_rc=False).stdout
    assert "progress: step 5/10 (50%) | loss 3.5000" in plain and "\x1b[" not in plain
    bar = _cli(home, "attach", "sft-1", "--quiet", "--color", "always", check_rc=False).stdout
    assert "progress:" not in bar and "train" in bar and "step 5/10 (50%)" in bar and "━" in bar
    assert "job sft-1 FAILED: node 1 (gpu02) failed" in bar


def test_submit_and_attach_help_document_color():
    for cmd in ("submit", "attach"):
        out = subprocess.run([sys.executable, "-m", "orchestrator.cli", cmd, "--help"], cwd=REPO, capture_output=True,
                             text=True).stdout
        assert "--color {auto,always,never}" in out and "progress" in out, cmd
