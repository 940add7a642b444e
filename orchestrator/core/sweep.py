"""Sweeps, the pure part: `--sweep KEY=V1,V2,...` options expanded into a grid of points before anything is planned.

The values of one `--sweep KEY=VALUES` option (GRAMMAR; docs/sweeps.md):

| VALUES            | points                                              |
|-------------------|-----------------------------------------------------|
| `a,b,c`           | a, b, c                                             |
| `[a,b,c]`         | a, b, c (a list, as people type it)                 |
| `1..4`, `0..8:2`  | 1, 2, 3, 4 and 0, 2, 4, 6, 8 (integers, ends kept)  |
| `log:1e-5:1e-3:3` | 1e-05, 0.0001, 0.001 (N values, evenly in log)      |
| `lin:0:1:5`       | 0, 0.25, 0.5, 0.75, 1 (N values, evenly)            |

To sweep a list-valued key give each list whole: `KEY=[1,2],[3,4]`, or `KEY=[[1,2]]` for one point.
A point is a list of dotlist overrides (`trainer.learning_rate=1e-05`), applied after the job's own overrides; every
point becomes one ordinary job (its own id `<sweep id>-p<i>`, run dir, store record and output dir
`<output dir>/<sweep id>-p<i>`, so no two points share checkpoints or tracker runs). Values are split on commas
outside brackets and quotes (`--sweep trainer.lr_scheduler_kwargs={a: 1, b: 2},{a: 3}` keeps each mapping whole);
a key given twice is an error, as is an empty value list. The grid is the product of the options in the order given
(the last option varies fastest). No I/O here: orchestrator/sweeps.py validates every point and runs them.
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
GRAMMAR = "KEY=a,b,c | KEY=[a,b,c] | KEY=1..4[:STEP] | KEY=log:LO:HI:N | KEY=lin:LO:HI:N"
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?::(\d+))?$")
_SPACED = re.compile(r"^(log|lin):([^:]+):([^:]+):([^:]+)$")
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


def _number(text: str) -> float:
    v = float(text)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(text)
    return v


def values_of(text: str) -> list[str]:
    """One option's VALUES (after `KEY=`) as the point values; ValueError(why) for a bad range or spacing."""
    text = text.strip()
    m = _RANGE.match(text)
    if m:
        lo, hi, step = int(m[1]), int(m[2]), int(m[3] or 1)
        if step < 1 or hi < lo:
            raise ValueError(f"{text}: a range A..B[:STEP] needs A <= B and STEP >= 1")
        return [str(v) for v in range(lo, hi + 1, step)]
    m = _SPACED.match(text)
    if m:
        kind, lo_s, hi_s, n_s = m.groups()
        try:
            a, b, n = _number(lo_s), _number(hi_s), int(n_s)
        except ValueError:
            raise ValueError(f"{text}: {kind}:LO:HI:N needs two numbers and a whole N") from None
        if n < 2 or (kind == "log" and (a <= 0 or b <= 0)):
            raise ValueError(f"{text}: {kind}:LO:HI:N needs N >= 2" + (" and LO, HI > 0" if kind == "log" else ""))
        if kind == "log":
            vals = [a * (b / a) ** (i / (n - 1)) for i in range(n)]
        else:
            vals = [a + (b - a) * i / (n - 1) for i in range(n)]
        return [f"{v:.6g}" for v in vals]
    if re.match(r"^(log|lin):", text) or re.match(r"^-?\d+\.\.", text):
        raise ValueError(f"{text}: not a range or a spacing")
    values = split_values(text)
    if len(values) == 1 and values[0].startswith("[") and values[0].endswith("]"):
        values = split_values(values[0][1:-1])  # [a,b,c]: the list's items are the values
    return values


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
            problems.append(Problem(where, f"must be one of {GRAMMAR} (KEY a dotted key)"))
            continue
        try:
            values = values_of(rest)
        except ValueError as e:
            problems.append(Problem(where, f"{e}; the grammar: {GRAMMAR}"))
            continue
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
    def option(key: str, values: Any) -> str:
        if isinstance(values, str) and (_RANGE.match(values.strip()) or _SPACED.match(values.strip())):
            return f"{key}={values.strip()}"  # `lr: "log:1e-5:1e-3:4"` in the file: the same grammar
        vals = values if isinstance(values, list) else [values]
        text = ",".join(json.dumps(v) for v in vals)
        return f"{key}=[{text}]" if len(vals) == 1 and isinstance(vals[0], list) else f"{key}={text}"
    return [option(key, values) for key, values in grid.items()]


def merge_options(block: list[str], given: list[str]) -> list[str]:
    """The job file's sweep options and the command line's: a key on both takes the command line's values (in the
    file's place); the command line's other keys come after."""
    def key(opt: str) -> str:
        return opt.partition("=")[0].strip()
    cli = {key(o): o for o in given}
    out = [cli.pop(key(o), o) for o in block]
    return out + [o for o in given if key(o) in cli]
