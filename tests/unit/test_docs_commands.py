"""Docs that run, the fast half (tests/doccommands.py says what is extracted and how): every command the docs show
parses with the CLI's own parser, every mention of `orchestrate X` names a command whose flags exist, and every
annotation matches a command. The shown commands themselves run verbatim in
tests/local_backend/test_docs_commands_run.py (real jobs: slow) and, for the SLURM testbed, tests/slurm.
A command that does not parse is a docs bug: fix the doc."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
from doccommands import ROOT, SUBCOMMANDS, Shown, collect, commands_in, mention_argv, scan

SHOWN, MENTIONS, ANNOTATIONS, UNUSED = collect()
MENTIONED = [(where, c) for where, code in MENTIONS for c in commands_in(code)]


def _parse_like_main(argv: list[str]) -> str | None:
    """The CLI's own parser on argv (no command runs): None when it parses, else argparse's message."""
    from orchestrator.cli.main import build_parser
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, extra = build_parser().parse_known_args(argv)
    except SystemExit as e:
        return f"exit {e.code}: {err.getvalue().strip()}"
    if extra and (getattr(args, "overrides", None) is None or any(x.startswith("-") for x in extra)):
        return f"unrecognized arguments: {' '.join(extra)}"
    return None


@pytest.mark.parametrize("shown", SHOWN, ids=[f"{s.where} {s.text}"[:90] for s in SHOWN])
def test_shown_command_parses(shown: Shown, tmp_path):
    """Each command of the line (`a ; b`) parses with the placeholders' values set (the run test runs it)."""
    for cmd in commands_in(shown.text):
        argv = mention_argv(shown.where, cmd, str(tmp_path / "out"))
        assert argv is not None, f"{shown.where}: not a command: {cmd}"
        problem = _parse_like_main(argv) if argv and argv != ["--help"] else None
        assert problem is None, f"{shown.where}: `{cmd}` does not parse ({problem}): fix the doc"


@pytest.mark.parametrize("mention", MENTIONED, ids=[f"{w} {c}"[:90] for w, c in MENTIONED])
def test_mentioned_command_exists(mention, tmp_path):
    where, cmd = mention
    argv = mention_argv(where, cmd, str(tmp_path / "out"))
    if argv is None:
        return  # a message the tool prints, quoted
    if len(argv) <= 1:
        return  # `orchestrate` or `orchestrate render` in a sentence: each subcommand's --help runs below
    problem = _parse_like_main(argv)
    assert problem is None, f"{where}: `{cmd}` does not parse ({problem}): fix the doc"


def test_every_subcommand_help_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    for sub in ("--help", *SUBCOMMANDS):
        argv = [sub] if sub == "--help" else [sub, "--help"]
        p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, f"orchestrate {' '.join(argv)}: exit {p.returncode}\n{p.stdout}{p.stderr}"


def test_annotations_are_used_and_few():
    assert not UNUSED, "doc-test annotations that match no command (stale?): " + "; ".join(
        f"{a.where} {a.action} {a.match!r}" for a in UNUSED)
    skipped = [s for s in SHOWN if s.action in ("skip", "slurm")]
    assert all(s.reason for s in skipped)
    assert len([s for s in SHOWN if s.action == "skip"]) <= 8, "too many doc commands skipped: " + "; ".join(
        f"{s.where} {s.text}" for s in skipped)


def test_every_source_and_command_is_covered():
    """The extractor sees the commands it must see (a broken extractor would pass every doc)."""
    wheres = {s.where.split(":")[0] for s in SHOWN}
    assert {"README.md", "docs/recipes.md", "docs/gpus.md", "docs/containers.md", "cluster_configs/slurm_example.yaml",
            "cluster_configs/ssh_example.yaml", "cluster_configs/slurm_local.yaml"} <= wheres, wheres
    subs = {c.split()[1] for s in SHOWN for c in commands_in(s.text) if len(c.split()) > 1}
    subs |= {c.split()[1] for _, c in MENTIONED if len(c.split()) > 1}
    assert set(SUBCOMMANDS) <= subs, f"no doc shows {set(SUBCOMMANDS) - subs}"
    assert sum(1 for s in SHOWN if s.where.startswith("README.md") and s.action == "run") >= 6  # the quick start
    assert {"docs/operations.md", "docs/sweeps.md", "docs/own-code.md"} <= wheres, wheres  # (moved from the README)
    assert sum(1 for s in SHOWN if s.action == "run") >= 25, len(SHOWN)
    assert any(s.action == "slurm" for s in SHOWN)


def test_extractor_cases(tmp_path):
    assert commands_in("orchestrate ls | status JOB | logs JOB [--node N] | cancel JOB") == [
        "orchestrate ls", "orchestrate status JOB", "orchestrate logs JOB [--node N]", "orchestrate cancel JOB"]
    assert commands_in("orchestrate status JOB --color always | less -R     # into a pipe") == [
        "orchestrate status JOB --color always"]
    assert commands_in("orchestrate ls ; orchestrate status $JOB   # later") == [
        "orchestrate ls", "orchestrate status $JOB"]
    assert commands_in("  (add --detach, then: orchestrate attach JOB)") == ["orchestrate attach JOB"]
    assert commands_in("a ~/orchestrate dir, .venv/bin/orchestrate-x") == []
    assert mention_argv("x", "orchestrate render ... --cluster ... --out DIR", "/o") == [
        "render", "recipes/configs/sft_tiny.yaml", "--cluster", "cluster_configs/ssh_example.yaml", "--out", "/o"]
    assert mention_argv("x", "orchestrate logs $JOB [--rank R|--node N] -f", "/o") == [
        "logs", "sft_tiny-20260101-000000-abcd", "--rank", "0", "-f"]
    assert mention_argv("x", "orchestrate recipe error: ...", "/o") is None
    assert _parse_like_main(["logs", "J", "--follow"]) is None
    assert "unrecognized" in (_parse_like_main(["logs", "J", "--no-such-flag"]) or "")
    doc = tmp_path / "d.md"
    doc.write_text('x `orchestrate status JOB` y\n\n<!-- doc-test: exit 2 "bad": shown failing -->\n```\n'
                   "orchestrate ls          # fine\norchestrate submit bad.yaml\n   more: orchestrate gc\n```\n"
                   "```\norchestrate submit bad.yaml\n```\n")
    shown, mentions, annotations, used = scan(doc)
    assert [(s.text, s.action) for s in shown] == [("orchestrate ls          # fine", "run"),
                                                   ("orchestrate submit bad.yaml", "exit 2"),
                                                   ("orchestrate submit bad.yaml", "run")]
    assert shown[1].exit_code == 2 and used == set(annotations)
    assert [m[1] for m in mentions] == ["orchestrate status JOB", "   more: orchestrate gc"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# doc-test: skip: the site's hosts\n#   orchestrate submit r.yaml --cluster c.yaml\n"
                   "#   orchestrate render r.yaml --out $DIR\nkind: ssh   # see orchestrate --help\n")
    shown, mentions, _, _ = scan(cfg)
    assert [(s.text, s.action, s.reason) for s in shown] == [
        ("orchestrate submit r.yaml --cluster c.yaml", "skip", "the site's hosts"),
        ("orchestrate render r.yaml --out $DIR", "run", "")]
