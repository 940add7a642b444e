"""Docs that run: every `orchestrate ...` command shown in README.md, docs/*.md and the comments of
cluster_configs/*.yaml is extracted and run, so a doc cannot show a command or a flag that does not exist.

- `submit` runs with `--dry-run` added (validates the recipe and cluster, prints the plan, starts nothing);
- `render` runs into a temp dir;
- `ls` runs for real against an empty ORCHESTRATE_HOME, and so does `gc` (with `--dry-run` added), unless it names
  a job (then it is parsed, like the operator commands);
- operator commands (status, logs, attach, plot, cancel) are parsed by the real argument parser (so every flag
  shown must exist) and run with `--help`;
- a bare mention of a subcommand (`orchestrate render` in a sentence) runs `orchestrate render --help`.

Placeholders are replaced from the small table below. A command that cannot run is a docs bug: fix the doc.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("submit", "render", "ls", "status", "attach", "logs", "plot", "cancel", "gc", "sweep")
OPERATOR = ("status", "attach", "logs", "plot", "cancel", "sweep")
RECIPE = "recipes/configs/sft_tiny.yaml"

# Placeholders as the docs write them -> what the test runs.
SUBSTITUTE = {
    "recipe.yaml": RECIPE,
    "JOB": "sft_tiny-20260101-000000-abcd",
    "N": "0",
    "R": "0",
    "RE": "loss",
    "SWEEP_ID": "sweep-20260101-000000-abcd",
}
# `...` stands for "the usual arguments": after --cluster a cluster file, after submit/render the recipe.
ELLIPSIS_AFTER = {"--cluster": "cluster_configs/ssh_example.yaml", "-c": "cluster_configs/ssh_example.yaml",
                  "submit": RECIPE, "render": RECIPE}
# `orchestrate WORD` in a code span that is not a command: messages the tool prints, quoted in the docs.
NOT_COMMANDS = {"recipe", "node"}   # "orchestrate recipe error: ...", "orchestrate node agent: rank 1 ..."


@dataclass(frozen=True)
class Shown:
    where: str     # file:line
    text: str      # the command as the doc shows it


def _md_code(text: str):
    """(line number, code) for every line of fenced/indented code blocks and every inline code span."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or (line.startswith("    ") and "`" not in line):
            yield n, line
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield n, span


def _yaml_comments(text: str):
    for n, line in enumerate(text.splitlines(), 1):
        if "#" in line:
            yield n, line.split("#", 1)[1]


def _commands_in(code: str) -> list[str]:
    """Commands starting at each `orchestrate` word of one code line: `# comment`, `(...)` asides and shell
    pipes cut off, `a ; b` split, `orchestrate ls | status JOB | ...` (alternatives) expanded."""
    out = []
    for m in re.finditer(r"(?<![\w./-])orchestrate(?=\s|$)", code):
        rest = code[m.start():]
        rest = re.split(r"\s#|\)|\s;\s|;$", rest)[0].strip()
        parts = [p.strip() for p in re.split(r"\s\|\s", rest)]
        out.append(parts[0])
        for p in parts[1:]:
            word = p.split()[0] if p.split() else ""
            if word not in SUBCOMMANDS:
                break                      # a real shell pipe (`| less -R`): the command ended
            out.append(f"orchestrate {p}")
    return out


def shown_commands() -> list[Shown]:
    found = []
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in sources:
        for n, code in _md_code(path.read_text()):
            found += [Shown(f"{path.relative_to(ROOT)}:{n}", c) for c in _commands_in(code)]
    for path in sorted((ROOT / "cluster_configs").glob("*.yaml")):
        for n, comment in _yaml_comments(path.read_text()):
            found += [Shown(f"{path.relative_to(ROOT)}:{n}", c) for c in _commands_in(comment)]
    return found


def _expand_optional(text: str) -> str:
    """`[--node N]` -> `--node N`; `[--rank R|--node N]` -> `--rank R` (the first alternative)."""
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split("|")[0], text)


def plan(shown: Shown, tmp: Path) -> tuple[str, list[str]] | None:
    """(mode, argv after `orchestrate`) for one shown command; None for a quoted message (NOT_COMMANDS)."""
    words = shlex.split(_expand_optional(shown.text))[1:]
    if words and words[0] in NOT_COMMANDS:
        return None
    argv: list[str] = []
    for w in words:
        if w == "...":
            prev = argv[-1] if argv else None
            assert prev in ELLIPSIS_AFTER, f"{shown.where}: no substitution for `...` after {prev!r}: {shown.text}"
            argv.append(ELLIPSIS_AFTER[prev])
        elif w == "DIR":
            argv.append(str(tmp / "out"))
        else:
            argv.append(SUBSTITUTE.get(w, w))
    if not argv:
        return "run", ["--help"]                             # the program named in a sentence
    if argv[0].startswith("-"):
        return "run", argv                                   # orchestrate --help / --version
    sub = argv[0]
    assert sub in SUBCOMMANDS, f"{shown.where}: `orchestrate {sub}` is not a command: {shown.text}"
    if len(argv) == 1 and sub not in ("ls", "gc"):
        return "run", [sub, "--help"]                        # a mention: `orchestrate render` writes ...
    if sub == "submit":
        return "run", argv + ([] if "--dry-run" in argv else ["--dry-run"])
    if sub == "render":
        return "run", argv + ([] if ("--out" in argv or "-o" in argv) else ["--out", str(tmp / "out")])
    if sub == "ls":
        return "run", argv
    if sub == "gc" and SUBSTITUTE["JOB"] not in argv:
        return "run", argv + ([] if ("--dry-run" in argv or "-n" in argv) else ["--dry-run"])
    return "parse+help", argv


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


SHOWN = shown_commands()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Runs every shown command once (in parallel, a few at a time); {Shown: (argv, rc, output)}."""
    base = tmp_path_factory.mktemp("docs_commands")
    env = {**os.environ, "ORCHESTRATE_HOME": str(base / "home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "120"}
    env.pop("FORCE_COLOR", None)

    def run(argv: list[str]) -> tuple[int, str]:
        p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout + p.stderr

    # the first submit validates trainer keys against TRL's SFTConfig and caches its fields (~3 s); warm it once
    run(["submit", RECIPE, "--dry-run"])
    jobs = {}
    for i, shown in enumerate(SHOWN):
        tmp = Path(tempfile.mkdtemp(prefix=f"cmd{i}-", dir=base))
        jobs[shown] = plan(shown, tmp)

    def one(item):
        shown, planned = item
        if planned is None:
            return shown, (None, 0, "quoted message, not a command")
        mode, argv = planned
        if mode == "parse+help":
            problem = _parse_like_main(argv)
            if problem:
                return shown, (argv, 2, problem)
            argv = [argv[0], "--help"]
        rc, out = run(argv)
        return shown, (argv, rc, out)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(one, jobs.items()))


@pytest.mark.parametrize("shown", SHOWN, ids=[f"{s.where} {s.text}"[:90] for s in SHOWN])
def test_shown_command_runs(shown, results):
    argv, rc, out = results[shown]
    assert rc == 0, (f"{shown.where}: `{shown.text}` does not run (ran: orchestrate {shlex.join(argv or [])}, "
                     f"exit {rc}): fix the doc\n{out[-2000:]}")


def test_every_source_and_command_is_covered():
    """The extractor sees the commands it must see (a broken extractor would pass every doc)."""
    wheres = {s.where.split(":")[0] for s in SHOWN}
    assert {"README.md", "docs/slurm.md", "docs/recipes.md", "cluster_configs/slurm_example.yaml",
            "cluster_configs/ssh_example.yaml", "cluster_configs/slurm_local.yaml"} <= wheres, wheres
    subs = {shlex.split(s.text)[1] for s in SHOWN if len(shlex.split(s.text)) > 1}
    assert set(SUBCOMMANDS) <= subs, f"no doc shows {set(SUBCOMMANDS) - subs}"
    assert sum(1 for s in SHOWN if s.where.startswith("README.md")) >= 15


def test_extractor_cases(tmp_path):
    assert _commands_in("orchestrate ls | status JOB | logs JOB [--node N] | cancel JOB") == [
        "orchestrate ls", "orchestrate status JOB", "orchestrate logs JOB [--node N]", "orchestrate cancel JOB"]
    assert _commands_in("orchestrate status JOB --color always | less -R     # into a pipe") == [
        "orchestrate status JOB --color always"]
    assert _commands_in("orchestrate submit recipe.yaml --detach ; orchestrate attach JOB   # later") == [
        "orchestrate submit recipe.yaml --detach", "orchestrate attach JOB"]
    assert _commands_in("  (add --detach, then: orchestrate attach JOB)") == ["orchestrate attach JOB"]
    assert _commands_in("a ~/orchestrate dir, .venv/bin/orchestrate-x") == []
    assert plan(Shown("x", "orchestrate render ... --cluster ... --out DIR"), tmp_path) == (
        "run", ["render", RECIPE, "--cluster", "cluster_configs/ssh_example.yaml", "--out", str(tmp_path / "out")])
    assert plan(Shown("x", "orchestrate logs JOB [--rank R|--node N] -f"), tmp_path) == (
        "parse+help", ["logs", SUBSTITUTE["JOB"], "--rank", "0", "-f"])
    assert plan(Shown("x", "orchestrate recipe error: ..."), tmp_path) is None
    assert _parse_like_main(["logs", "J", "--follow"]) is None
    assert "unrecognized" in _parse_like_main(["logs", "J", "--no-such-flag"])
