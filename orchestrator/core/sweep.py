"""Sweeps, the pure part: `--sweep KEY=V1,V2,...` options expanded into a grid of points before anything is planned.

A point is a list of dotlist overrides (`trainer.learning_rate=1e-05`), applied after the job's own overrides; every
point becomes one ordinary job (its own id `<sweep id>-p<i>`, run dir, store record and output dir
`<output dir>/<sweep id>-p<i>`, so no two points share checkpoints or tracker runs). Values are split on commas
outside brackets and quotes (`--sweep trainer.lr_scheduler_kwargs={a: 1, b: 2},{a: 3}` keeps each mapping whole);
a key given twice is an error, as is an empty value list. The grid is the product of the options in the order given
(the last option varies fastest). No I/O here: orchestrator/sweep.py validates every point and runs them.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import ConfigError, Problem

KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_0-9][A-Za-z0-9_-]*)*$")
MAX_POINTS = 1000  # a grid larger than this is almost certainly a typo (say so before planning 10k jobs)


@dataclass(frozen=True)
class Point:
    index: int
    overrides: tuple[str, ...]  # the point's own KEY=VALUE overrides, in option order

    def label(self) -> str:
        return " ".join(self.overrides)


def split_values(text: str) -> list[str]:
    """`1e-5,3e-5` -> ['1e-5', '3e-5']; commas inside [], {}, () or quotes do not split."""
    out, cur, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


def parse(options: list[str]) -> list[tuple[str, list[str]]]:
    """The --sweep options as (key, values); every problem named (ConfigError, exit 2)."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    axes: list[tuple[str, list[str]]] = []
    for i, opt in enumerate(options):
        key, sep, rest = opt.partition("=")
        key = key.strip()
        where = f"--sweep {opt}"
        if not sep or not KEY.match(key):
            problems.append(Problem(where, "must be KEY=V1,V2,... (a dotted key, then the values)"))
            continue
        values = split_values(rest)
        if any(v == "" for v in values):
            problems.append(Problem(where, "an empty value (two commas in a row, or one at an end)"))
            continue
        if key in seen:
            problems.append(Problem(where, f"{key} is swept twice (also option {seen[key] + 1})"))
            continue
        if len(set(values)) != len(values):
            problems.append(Problem(where, "a value is listed twice"))
            continue
        seen[key] = i
        axes.append((key, values))
    if problems:
        raise ConfigError(problems, source="--sweep")
    return axes


def expand(options: list[str]) -> list[Point]:
    """The grid of the --sweep options (the last option varies fastest)."""
    axes = parse(options)
    size = 1
    for _, values in axes:
        size *= len(values)
    if size > MAX_POINTS:
        raise ConfigError(Problem("--sweep", f"{size} points: more than {MAX_POINTS}; sweep fewer values"),
                          source="--sweep")
    grid = itertools.product(*[[f"{k}={v}" for v in values] for k, values in axes])
    return [Point(i, tuple(p)) for i, p in enumerate(grid)]


def point_job_id(sweep_id: str, point: Point) -> str:
    return f"{sweep_id}-p{point.index}"


def check_parallel(max_parallel: int | None, points: int) -> int:
    """--max-parallel: at least 1 (default: every point at once)."""
    if max_parallel is None:
        return points
    if max_parallel < 1:
        raise ConfigError(Problem("--max-parallel", f"must be an integer >= 1, got {max_parallel}"),
                          source="--max-parallel")
    return min(max_parallel, points)


def block_options(grid: Mapping[str, Any]) -> list[str]:
    """A job file's `sweep.grid` as --sweep options; each value written as JSON, which the dotlist reads back as the
    same value (a string stays a string: `"cosine"`; a list or mapping stays whole)."""
    return [f"{key}=" + ",".join(json.dumps(v) for v in (values if isinstance(values, list) else [values]))
            for key, values in grid.items()]


def merge_options(block: list[str], given: list[str]) -> list[str]:
    """The job file's sweep options and the command line's: a key on both takes the command line's values (in the
    file's place); the command line's other keys come after."""
    def key(opt: str) -> str:
        return opt.partition("=")[0].strip()
    cli = {key(o): o for o in given}
    out = [cli.pop(key(o), o) for o in block]
    return out + [o for o in given if key(o) in cli]
