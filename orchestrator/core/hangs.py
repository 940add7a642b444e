"""THE hang analysis: from every rank's evidence, the root cause of a hang in one line, and the body of diagnosis.json.

Pure (no I/O): `diagnose(evidence, world_size)` over one `RankEvidence` per rank (what orchestrator.node.hangevidence
collected on the nodes: the rank's flight-recorder entries, the Python stacks of its threads, whether it answered,
was found stopped or never answered). One pass over the entries; the verdict stays short at any scale (counts and the
first few ranks; every rank is in the json body).

The verdict, in order of evidence:
1. The collective where the job stopped: per process group, the highest collective sequence number any rank entered;
   the group where some member ranks are behind it (else where some rank's last entry is not completed) is where the
   job stopped. Its op is the op most ranks entered at that number.
2. The ranks that never entered it (their last entry in that group is an earlier number): THE culprits.
3. A desync: ranks inside a different op at that same number (both ops named).
4. Ranks found stopped (process state T) or that did not answer: named as such (their entries are unknown).
5. The stacks of the main threads, grouped into classes (same frames); with no recorder verdict, a minority class
   (fewer ranks than the largest) is the suspect.

Example: `hang at all_reduce #57 (group 0): rank 2 never entered it; rank 2 is in train.py:41 in load_batch
(time.sleep(600)); 3 ranks wait in all_reduce #57 (train.py:30 in main)`.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

ANSWERED, STOPPED, NO_ANSWER = "answered", "stopped", "no_answer"
LISTED = 8  # a verdict names at most this many ranks of each kind (the rest: a count; all of them in the json)
LAST_ENTRIES = 4  # each rank's last collectives kept in the json body
_LIB_MARKS = ("site-packages", "dist-packages", "/lib/python", "orchestrate_hooks", "orchestrate_hangs",
              "<frozen ", "threading.py")


@dataclass(frozen=True)
class Entry:
    """One collective as a rank's flight recorder holds it."""

    seq: int  # collective_seq_id within its group
    op: str  # all_reduce, broadcast, ... (the backend prefix "gloo:" / "nccl:" dropped)
    group: str  # the process group's name ("0": the default group)
    state: str = ""  # scheduled | started | completed
    sizes: tuple = ()
    t: float = 0.0  # when the rank entered it (seconds, the rank's wall clock)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "group": self.group, "state": self.state,
                "sizes": [list(s) if isinstance(s, (list, tuple)) else s for s in self.sizes], "t": self.t}


Frame = tuple[str, int, str, str]  # (file, line, function, source text or "")


@dataclass(frozen=True)
class RankEvidence:
    rank: int
    host: str = ""
    status: str = ANSWERED  # answered | stopped | no_answer
    entries: tuple[Entry, ...] = ()
    main_stack: tuple[Frame, ...] = ()  # the main thread's frames, outermost first
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # group -> its ranks, where the rank knows
    source: str = ""  # where the evidence came from: responder, py-spy, nccl dump
    pid: int = 0


def entries_from_fr(raw: Iterable[dict]) -> tuple[Entry, ...]:
    """Entries of a torch flight-recorder dump (`_dump_fr_trace` / an NCCL trace file), collectives only."""
    out = []
    for e in raw:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        seq = e.get("collective_seq_id")
        if not isinstance(seq, int) or seq <= 0:
            continue
        op = str(e.get("profiling_name") or "?")
        op = op.split(":", 1)[1] if ":" in op else op
        pg = e.get("process_group")
        group = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", "0"))
        t = e.get("time_created_ns")
        out.append(Entry(seq, op, group, str(e.get("state") or ""), tuple(tuple(s) if isinstance(s, list) else s
                                                                      for s in e.get("input_sizes") or ()),
                         t / 1e9 if isinstance(t, (int, float)) else 0.0))
    return tuple(out)


def groups_from_fr(pg_config: Any) -> dict[str, tuple[int, ...]]:
    """{group: ranks} from a dump's "pg_config" ({name: {"ranks": "[0, 1]" or a list, ...}})."""
    out: dict[str, tuple[int, ...]] = {}
    if not isinstance(pg_config, dict):
        return out
    for name, cfg in pg_config.items():
        ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
        if isinstance(ranks, str):
            ranks = [x for x in ranks.strip("[] ").replace(" ", "").split(",") if x.strip().lstrip("-").isdigit()]
        if isinstance(ranks, (list, tuple)):
            try:
                out[str(name)] = tuple(int(r) for r in ranks)
            except (TypeError, ValueError):
                continue
    return out


def parse_pyspy(text: str) -> tuple[Frame, ...]:
    """The main thread's frames (outermost first) from `py-spy dump` text: its `Thread ... "MainThread"` block (else
    the first thread), lines `    function (file:line)`."""
    blocks: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        if line.startswith("Thread "):
            blocks.append((line, []))
        elif blocks and line.startswith("    ") and line.rstrip().endswith(")") and " (" in line:
            func, _, loc = line.strip().rpartition(" (")
            file, _, num = loc[:-1].rpartition(":")
            try:
                blocks[-1][1].append((file, int(num), func, ""))
            except ValueError:
                continue
    if not blocks:
        return ()
    main = next((b for b in blocks if '"MainThread"' in b[0]), blocks[0])
    return tuple(reversed(main[1]))  # py-spy prints the innermost frame first


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _user_frame(stack: tuple[Frame, ...]) -> Frame | None:
    for f in reversed(stack):
        if not any(m in f[0] for m in _LIB_MARKS):
            return f
    return None


def where(stack: tuple[Frame, ...]) -> str:
    """`train.py:41 in load_batch (time.sleep(600))`: the innermost frame of the user's own code, with its source
    line when known, else what it called; `all_reduce` and the like when the innermost frame is a library's."""
    if not stack:
        return "no stack"
    user = _user_frame(stack)
    inner = stack[-1]
    if user is None:
        return f"{_base(inner[0])}:{inner[1]} in {inner[2]}"
    text = f"{_base(user[0])}:{user[1]} in {user[2]}"
    code = user[3].split("  #", 1)[0].strip()  # (the source line, its trailing comment dropped)
    if code:
        text += f" ({code[:80]})"
    elif inner is not user:
        text += f" > {inner[2]}"
    return text


def _class_key(stack: tuple[Frame, ...]) -> tuple:
    return tuple((_base(f[0]), f[1], f[2]) for f in stack)


@dataclass(frozen=True)
class StackClass:
    where: str
    ranks: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"where": self.where, "count": len(self.ranks), "ranks": list(self.ranks)}


@dataclass(frozen=True)
class Diagnosis:
    """The verdict: `line` (the root cause), `culprits` (most likely first), and the json body (`to_dict`)."""

    line: str
    culprits: tuple[int, ...]
    collective: dict[str, Any] | None  # {"op", "seq", "group"} where the job stopped, or None
    missing: tuple[int, ...] = ()
    desync: dict[str, Any] | None = None  # {"op": the other op, "ranks": [...]}
    stopped: tuple[int, ...] = ()
    no_answer: tuple[int, ...] = ()
    classes: tuple[StackClass, ...] = ()
    last: dict[int, list[dict]] = field(default_factory=dict)  # rank -> its last entries (json body)
    world_size: int = 0

    def root_cause(self, host: str = "") -> str:
        """The job's root cause: the verdict, where its first culprit runs (`host`, read back by `culprit_host`), and
        where the whole record is kept."""
        where = f"; rank {self.culprits[0]} runs on {host}" if host and self.culprits else ""
        return f"{self.line}{where}; RUN_DIR/diagnosis.json"

    def to_dict(self) -> dict[str, Any]:
        return {"root_cause": self.line, "culprits": list(self.culprits), "collective": self.collective,
                "never_entered": list(self.missing), "desync": self.desync, "stopped": list(self.stopped),
                "no_answer": list(self.no_answer), "stack_classes": [c.to_dict() for c in self.classes],
                "last_collectives": {str(r): v for r, v in sorted(self.last.items())}, "world_size": self.world_size}


_RUNS_ON = re.compile(r"; rank \d+ runs on ([^;\s]+)")


def culprit_host(root_cause: str) -> str:
    """The host a `Diagnosis.root_cause` names for its first culprit ("" where it names none): a SLURM node agent's
    verdict reaches the supervisor as this text only (its exit record)."""
    m = _RUNS_ON.search(root_cause)
    return m.group(1) if m else ""


def ranks_text(ranks: Iterable[int], limit: int = LISTED) -> str:
    """`rank 2`, `ranks 1, 5`, `12 ranks (0, 1, 2, ... and 4 more)`."""
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if len(rs) <= limit:
        return "ranks " + ", ".join(map(str, rs))
    return f"{len(rs):,} ranks ({', '.join(map(str, rs[:limit]))} and {len(rs) - limit:,} more)"


def _verb(ranks: Iterable[int], one: str, many: str) -> str:
    return one if len(list(ranks)) == 1 else many


def diagnose(evidence: Iterable[RankEvidence], world_size: int) -> Diagnosis:
    """The hang's root cause from every rank's evidence (a rank with none counts as not answering)."""
    ev: dict[int, RankEvidence] = {}
    for e in evidence:
        ev[e.rank] = e
    for r in range(world_size):
        ev.setdefault(r, RankEvidence(r, status=NO_ANSWER))
    stopped = tuple(sorted(r for r, e in ev.items() if e.status == STOPPED))
    no_answer = tuple(sorted(r for r, e in ev.items() if e.status == NO_ANSWER))

    # one pass: each rank's last entry per group, group membership, each group's top number
    last: dict[str, dict[int, Entry]] = defaultdict(dict)
    members: dict[str, set[int]] = defaultdict(set)
    tails: dict[int, list[dict]] = {}
    for r, e in ev.items():
        for g, rs in e.groups.items():
            members[g].update(rs)
        for en in e.entries:
            cur = last[en.group].get(r)
            if cur is None or en.seq > cur.seq:
                last[en.group][r] = en
            members[en.group].add(r)
        if e.entries:
            tails[r] = [x.to_dict() for x in sorted(e.entries, key=lambda x: x.t)[-LAST_ENTRIES:]]
    known = {r for r, e in ev.items() if e.entries}  # ranks whose recorder we read

    best: tuple | None = None
    for g, by_rank in last.items():
        top = max(x.seq for x in by_rank.values())
        at_top = {r: x for r, x in by_rank.items() if x.seq == top}
        behind = sorted(r for r in members[g] if r in known and (r not in by_rank or by_rank[r].seq < top))
        open_ = any(x.state != "completed" for x in at_top.values())
        if not behind and not open_:
            continue
        score = (bool(behind), len(at_top), g == "0")
        if best is None or score > best[0]:
            best = (score, g, top, at_top, behind)
    collective = None
    missing: tuple[int, ...] = ()
    desync = None
    waiting: list[int] = []
    if best is not None:
        _, g, top, at_top, behind = best
        ops = Counter(x.op for x in at_top.values())
        op = ops.most_common(1)[0][0]
        collective = {"op": op, "seq": top, "group": g}
        missing = tuple(behind)
        other = sorted(r for r, x in at_top.items() if x.op != op)
        if other:
            other_op = Counter(at_top[r].op for r in other).most_common(1)[0][0]
            desync = {"op": other_op, "ranks": other}
        waiting = sorted(r for r, x in at_top.items() if x.op == op)

    # stacks: classes of the main threads' frames
    by_key: dict[tuple, list[int]] = defaultdict(list)
    sample: dict[tuple, tuple[Frame, ...]] = {}
    for r in sorted(ev):
        st = ev[r].main_stack
        if st:
            k = _class_key(st)
            by_key[k].append(r)
            sample.setdefault(k, st)
    classes = tuple(sorted((StackClass(where(sample[k]), tuple(rs)) for k, rs in by_key.items()),
                           key=lambda c: (-len(c.ranks), c.ranks[0])))
    class_of = {r: c for c in classes for r in c.ranks}
    minority: list[int] = []
    if len(classes) > 1 and len(classes[-1].ranks) < len(classes[0].ranks):
        minority = sorted(r for c in classes[1:] if len(c.ranks) < len(classes[0].ranks) for r in c.ranks)

    # culprits, most likely first
    order: list[int] = []
    for group in (missing, stopped, desync["ranks"] if desync else (), () if (missing or desync) else minority,
                  no_answer if not (missing or stopped or desync or minority) else ()):
        order += [r for r in group if r not in order]
    if not order and minority:
        order = list(minority)

    parts = []
    if collective is not None:
        parts.append(f"hang at {collective['op']} #{collective['seq']} (group {collective['group']})")
    else:
        parts.append("hang")
    if missing:
        parts.append(f"{ranks_text(missing)} never entered it")
    if desync:
        parts.append(f"desync: {ranks_text(desync['ranks'])} {_verb(desync['ranks'], 'is', 'are')} in "
                     f"{desync['op']} #{collective['seq'] if collective else '?'} while the others are in "
                     f"{collective['op'] if collective else '?'}")
    if len(stopped) == 1:
        pid = ev[stopped[0]].pid
        parts.append(f"rank {stopped[0]} ({f'process {pid}' if pid else 'its process'} is stopped)")
    elif stopped:
        parts.append(f"{ranks_text(stopped)}: processes stopped (state T)")
    shown: set[tuple] = set()
    for r in [r for r in order if r in class_of][:LISTED]:  # where the culprits are (their classes, up to 3)
        c = class_of[r]
        if c.ranks in shown or len(shown) >= 3 or (c is classes[0] and len(classes) > 1):
            continue  # (a culprit in the largest class: its place says nothing the waiters' does not)
        shown.add(c.ranks)
        inside = [x for x in c.ranks if x in order]
        parts.append(f"{ranks_text(inside)} {_verb(inside, 'is', 'are')} in {c.where}")
    if not order and classes:
        parts.append(f"no rank stands out: {len(classes)} stack class{'es' if len(classes) > 1 else ''}, "
                     f"largest {len(classes[0].ranks)} ranks in {classes[0].where}")
    if waiting and collective is not None:
        wc = class_of.get(waiting[0])
        parts.append(f"{len(waiting):,} {_verb(waiting, 'rank waits', 'ranks wait')} in {collective['op']} "
                     f"#{collective['seq']}" + (f" ({wc.where})" if wc is not None and len(wc.ranks) > 1 else ""))
    if no_answer:
        parts.append(f"{ranks_text(no_answer)} did not answer")
    line = parts[0] + (": " + "; ".join(parts[1:]) if len(parts) > 1 else "")
    return Diagnosis(line, tuple(order), collective, missing, desync, stopped, no_answer, classes,
                     tails, world_size)
