"""Pure expansion of SLURM-style host expressions: `gpu[01-04,07]`, `node[1-2],login`, `a[1-2]-b[3-4]`.

Used for SLURM_JOB_NODELIST on the node (main host = first host) and for `ssh.hosts` expressions.
No subprocess (`scontrol show hostnames` is not needed).
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class HostlistError(ValueError):
    pass


def _split_top(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in {expr!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in {expr!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise HostlistError(f"bad range {item!r} in {expr!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise HostlistError(f"descending range {item!r} in {expr!r}")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_one(term: str, expr: str) -> list[str]:
    i = term.find("[")
    if i < 0:
        if "]" in term:
            raise HostlistError(f"unbalanced ']' in {expr!r}")
        return [term]
    j = term.find("]", i)
    if j < 0:
        raise HostlistError(f"unbalanced '[' in {expr!r}")
    prefix, body, rest = term[:i], term[i + 1:j], term[j + 1:]
    tails = _expand_one(rest, expr) if rest else [""]
    return [prefix + mid + tail for mid in _expand_ranges(body, expr) for tail in tails]


def expand(expr: str) -> list[str]:
    """`gpu[01-03,07]` -> ['gpu01', 'gpu02', 'gpu03', 'gpu07']; order kept, no dedup."""
    if not isinstance(expr, str) or not expr.strip():
        raise HostlistError("empty host expression")
    hosts: list[str] = []
    for term in _split_top(expr.strip()):
        hosts.extend(_expand_one(term, expr))
    return hosts


def first_host(expr: str) -> str:
    return expand(expr)[0]
