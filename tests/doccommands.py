"""The `orchestrate` commands of the docs (README.md, docs/*.md, the comments of cluster_configs/*.yaml), for the
tests that run them (tests/unit/test_docs_commands.py, tests/local_backend/test_docs_commands_run.py,
tests/slurm/test_docs_commands_slurm.py).

Two kinds:

- SHOWN: a line of a fenced code block whose first word is `orchestrate`, and a cluster file's comment line whose text
  starts with `orchestrate`. It runs VERBATIM: `bash -e -o pipefail -c LINE` from the repo root, with the venv's bin
  first on PATH (and the repo on PYTHONPATH, so a worktree runs its own code), the offline Hugging Face variables and
  a temporary ORCHESTRATE_HOME. The docs' placeholders are shell variables the test sets, as a reader would:
  `$JOB` the job id that the latest `orchestrate submit` shown before it printed, `$SWEEP_ID` the latest sweep's id,
  `$DIR` a new directory path. It must exit 0, unless an annotation says otherwise.
- MENTION: `orchestrate ...` anywhere else (a code span in a sentence, a comment after other text): the subcommand must
  exist and its flags parse (`orchestrate X --help` runs); placeholders (JOB, DIR, `...`) are filled from a table.

Annotations, visible in the doc source (keep them few: each says why):

    <!-- doc-test: skip "TEXT": REASON -->      before a fenced block: its shown commands containing TEXT (all of
    <!-- doc-test: exit 2 "TEXT": REASON -->    them without "TEXT") are not run here / must exit 2 /
    <!-- doc-test: slurm "TEXT": REASON -->     run on the SLURM testbed (tests/slurm) instead
    # doc-test: skip: REASON                    in a cluster file: the same, for the next command comment line
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ("submit", "render", "ls", "status", "attach", "logs", "plot", "cancel", "gc", "sweep", "dashboard")
VARIABLES = ("JOB", "SWEEP_ID", "DIR")
ANNOTATION = re.compile(r'doc-test:\s*(skip|exit \d+|slurm)\s*(?:"([^"]+)")?\s*:\s*(.*?)\s*(?:-->)?\s*$')


@dataclass(frozen=True)
class Shown:
    where: str                # file:line
    text: str                 # the line as the doc shows it (what bash runs)
    action: str = "run"       # run | skip | exit N | slurm
    reason: str = ""

    @property
    def exit_code(self) -> int:
        return int(self.action.split()[1]) if self.action.startswith("exit ") else 0


@dataclass(frozen=True)
class Annotation:
    where: str
    action: str
    match: str | None
    reason: str


def sources() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "cluster_configs").glob("*.yaml"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _parse_annotation(text: str, where: str) -> Annotation | None:
    if "doc-test:" not in text:
        return None
    m = ANNOTATION.search(text)
    if not m or not m.group(3):
        raise ValueError(f"{where}: a doc-test annotation must read `doc-test: skip|exit N|slurm [\"TEXT\"]: REASON`: "
                         f"{text.strip()}")
    return Annotation(where, m.group(1), m.group(2), m.group(3))


def _apply(where: str, line: str, pending: list[Annotation], used: set[Annotation]) -> Shown:
    for a in pending:
        if a.match is None or a.match in line:
            used.add(a)
            return Shown(where, line, a.action, a.reason)
    return Shown(where, line)


def scan(path: Path) -> tuple[list[Shown], list[tuple[str, str]], list[Annotation], set[Annotation]]:
    """(shown commands, mentions as (where, text of the code it sits in), annotations, the annotations used)."""
    shown: list[Shown] = []
    mentions: list[tuple[str, str]] = []
    annotations: list[Annotation] = []
    used: set[Annotation] = set()
    lines = path.read_text().splitlines()
    if path.suffix == ".yaml":
        pending: list[Annotation] = []
        for n, line in enumerate(lines, 1):
            if "#" not in line:
                continue
            where = f"{_rel(path)}:{n}"
            comment = line.split("#", 1)[1]
            a = _parse_annotation(comment, where)
            if a:
                annotations.append(a)
                pending = [a]
            elif comment.strip().startswith("orchestrate "):
                shown.append(_apply(where, comment.strip(), pending, used))
                pending = []
            elif "orchestrate" in comment:
                mentions.append((where, comment))
        return shown, mentions, annotations, used
    fenced = False
    pending = []
    for n, line in enumerate(lines, 1):
        where = f"{_rel(path)}:{n}"
        a = _parse_annotation(line, where) if line.lstrip().startswith("<!--") else None
        if a:
            annotations.append(a)
            pending.append(a)
            continue
        if line.lstrip().startswith("```"):
            fenced = not fenced
            if not fenced:
                pending = []   # an annotation applies to the one block after it
            continue
        if fenced:
            if line.lstrip().startswith("orchestrate ") or line.strip() == "orchestrate":
                shown.append(_apply(where, line.strip(), pending, used))
            elif "orchestrate" in line:
                mentions.append((where, line))
        else:
            if line.strip() and pending and not line.lstrip().startswith("<!--"):
                raise ValueError(f"{pending[0].where}: a doc-test annotation must come right before a fenced block")
            for span in re.findall(r"`([^`]+)`", line):
                mentions.append((where, span))
    return shown, mentions, annotations, used


def collect() -> tuple[list[Shown], list[tuple[str, str]], list[Annotation], list[Annotation]]:
    """Every shown command and mention of every source, the annotations, and those that matched no command."""
    shown, mentions, annotations, unused = [], [], [], []
    for path in sources():
        s, m, a, used = scan(path)
        shown += s
        mentions += m
        annotations += a
        unused += [x for x in a if x not in used]
    return shown, mentions, annotations, unused


# ------------------------------------------------------------------------------------------- running

JOB_LINE = re.compile(r"^job\s+([\w.-]+)", re.MULTILINE)
SWEEP_LINE = re.compile(r"^sweep\s+(sweep-[\w.-]+):", re.MULTILINE)


def doc_env(home: Path) -> dict[str, str]:
    """The only adaptations: the venv's `orchestrate` first on PATH (this checkout's code on PYTHONPATH), the
    offline Hugging Face variables and a temporary ORCHESTRATE_HOME."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT), "ORCHESTRATE_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1", "COLUMNS": "120"}
    env.pop("FORCE_COLOR", None)
    return env


def run_shown(shown: list[Shown], env: dict[str, str], tmp: Path, timeout: float = 420) -> dict:
    """Runs each command (`bash -e -o pipefail -c LINE` from the repo root) in order; {Shown: (rc, output, vars)}.
    $JOB is the id the latest real `orchestrate submit` before it printed, $SWEEP_ID the latest sweep's, $DIR a new
    path for each command."""
    variables: dict[str, str] = {}
    out = {}
    for i, s in enumerate(shown):
        variables["DIR"] = str(tmp / f"dir{i}")
        t0 = time.monotonic()
        try:
            p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", s.text], cwd=ROOT, env={**env, **variables},
                               capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = 124, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
        out[s] = (rc, text, dict(variables), time.monotonic() - t0)
        if rc == 0 and " submit " in f" {s.text} " and "--dry-run" not in s.text:
            sweep = SWEEP_LINE.search(text)
            job = JOB_LINE.search(text)
            if sweep:
                variables["SWEEP_ID"] = sweep.group(1)
            elif job:
                variables["JOB"] = job.group(1)
    return out


# ------------------------------------------------------------------------------------------- mentions

MENTION_RECIPE = "recipes/configs/sft_tiny.yaml"
SUBSTITUTE = {"recipe.yaml": MENTION_RECIPE, "JOB": "sft_tiny-20260101-000000-abcd", "N": "0", "R": "0", "RE": "loss",
              "SWEEP_ID": "sweep-20260101-000000-abcd"}
ELLIPSIS_AFTER = {"--cluster": "cluster_configs/ssh_example.yaml", "-c": "cluster_configs/ssh_example.yaml",
                  "submit": MENTION_RECIPE, "render": MENTION_RECIPE}
NOT_COMMANDS = {"recipe", "node"}   # "orchestrate recipe error: ...", "orchestrate node agent: rank 1 ..."


def commands_in(code: str) -> list[str]:
    """Commands starting at each `orchestrate` word of one line of code: `# comment`, `(...)` asides and shell
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


def _expand_optional(text: str) -> str:
    """`[--node N]` -> `--node N`; `[--rank R|--node N]` -> `--rank R` (the first alternative)."""
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split("|")[0], text)


def mention_argv(where: str, text: str, out_dir: str) -> list[str] | None:
    """argv after `orchestrate` to parse for one mentioned command (placeholders filled); None for a quoted message."""
    words = shlex.split(_expand_optional(text).replace("$", ""))[1:]
    if words and words[0] in NOT_COMMANDS:
        return None
    argv: list[str] = []
    for w in words:
        if w == "...":
            prev = argv[-1] if argv else None
            assert prev in ELLIPSIS_AFTER, f"{where}: no substitution for `...` after {prev!r}: {text}"
            argv.append(ELLIPSIS_AFTER[prev])
        elif w == "DIR":
            argv.append(out_dir)
        else:
            argv.append(SUBSTITUTE.get(w, w))
    if argv and not argv[0].startswith("-"):
        assert argv[0] in SUBCOMMANDS, f"{where}: `orchestrate {argv[0]}` is not a command: {text}"
    return argv
