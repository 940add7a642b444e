"""A hang's evidence on the nodes: asked of every rank before the teardown, read back for the one analysis.

`collect(rd, pids, stopped)` runs on the node that holds the ranks (the local backend, the agent's `--diagnose` over
SSH, the agent's monitor inside a SLURM allocation): each rank found stopped (state T) is named so; every other rank's
responder (hooks/orchestrate_hangs.py, its FIFO RUN_DIR/hangs/ask_rank<G>) is asked at once, in parallel, and waited
for at most ANSWER_S: a rank that wrote nothing by then "did not answer". Each rank's status is kept in
RUN_DIR/hangs/rank<G>.status.json (this module, the one writer), its evidence in RUN_DIR/hangs/rank<G>.json (the
rank). NCCL's RAS summary, where the NCCL in use has the `ncclras` client, goes to RUN_DIR/hangs/ras_<host>.txt.

`load(rd, world_size)` turns what a run dir holds into core.hangs.RankEvidence (the responder's recorder entries and
main-thread stack; else the py-spy stacks in RUN_DIR/stacks/rank<G>.txt and the NCCL recorder's own dump,
RUN_DIR/stacks/nccl_trace_rank_<G>); `diagnose_run` judges them (core.hangs.diagnose) and keeps diagnosis.json.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

from orchestrator.core.hangs import (ANSWERED, NO_ANSWER, STOPPED, Diagnosis, RankEvidence, diagnose, entries_from_fr,
                                     groups_from_fr, parse_pyspy)
from orchestrator.node.proctools import state
from orchestrator.node.rundir import RunDir

ANSWER_S = 2.0  # how long the ranks' responders are waited for, all together
RAS_S = 3.0


def poke(fifo: Path) -> bool:
    """One byte to a FIFO whose reader waits for it (a rank's responder; torch's NCCL debug pipe), never blocking:
    False where there is no FIFO or nobody reads it."""
    try:
        if not stat.S_ISFIFO(os.stat(fifo).st_mode):
            return False
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no FIFO (no responder in this rank) or nobody reading it
        return False
    try:
        os.write(fd, b"1")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _answered_at(path: Path) -> float:
    try:
        return float(json.loads(path.read_text()).get("t") or 0.0)
    except (OSError, ValueError, AttributeError):
        return 0.0


def collect(rd: RunDir, pids: dict[int, int], stopped: set[int] | None = None, wait_s: float = ANSWER_S
            ) -> dict[int, str]:
    """Ask this node's ranks (global rank -> pid) for their evidence; -> rank -> answered | stopped | no_answer."""
    rd.mkdir(RunDir.HANGS)
    stopped = {g for g in pids if state(pids[g]) == "T"} | set(stopped or ())
    asked_at = time.time()
    status = {g: STOPPED for g in pids if g in stopped}
    waiting = {g for g in pids if g not in stopped and poke(rd.path(RunDir.hang_ask_rel(g)))}
    status.update({g: NO_ANSWER for g in pids if g not in stopped and g not in waiting})
    deadline = time.monotonic() + wait_s
    while waiting:
        for g in list(waiting):
            if _answered_at(rd.path(RunDir.hang_evidence_rel(g))) >= asked_at - 0.5:
                status[g] = ANSWERED
                waiting.discard(g)
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    status.update({g: NO_ANSWER for g in waiting})
    took = time.time() - asked_at
    for g, st in status.items():
        try:
            rd.write_json(RunDir.hang_status_rel(g), {"rank": g, "pid": pids[g], "status": st, "asked": asked_at,
                                                      "took_s": round(took, 3)})
        except OSError:
            pass
    ras(rd)
    return status


def ras(rd: RunDir) -> str:
    """NCCL's RAS summary of the job (`ncclras`, NCCL >= 2.24), kept in RUN_DIR/hangs/ras_<host>.txt; "" without."""
    exe = shutil.which("ncclras")
    if not exe:
        return ""
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=RAS_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    try:
        rd.write_text(f"{RunDir.HANGS}/ras_{os.uname().nodename}.txt", out)
    except OSError:
        pass
    return out


class _OnlyData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # an NCCL trace holds plain data only
        raise pickle.UnpicklingError(f"{module}.{name} refused")


def _nccl_dump(rd: RunDir, rank: int) -> dict:
    path = rd.stacks / f"nccl_trace_rank_{rank}"
    try:
        with open(path, "rb") as fh:
            data = _OnlyData(fh).load()
        return data if isinstance(data, dict) else {}
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
        return {}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _with_source(frames: tuple) -> tuple:
    import linecache
    return tuple((f, n, fn, code or linecache.getline(f, n).strip()[:200]) for f, n, fn, code in frames)


def rank_evidence(rd: RunDir, rank: int, since: float = 0.0) -> RankEvidence | None:
    """One rank's evidence as kept in the run dir (None: nothing at all); a status asked before `since` (an earlier
    attempt's) does not count."""
    st = _read_json(rd.path(RunDir.hang_status_rel(rank)))
    if float(st.get("asked") or 0.0) < since:
        st = {}
    ev = _read_json(rd.path(RunDir.hang_evidence_rel(rank)))
    status = str(st.get("status") or "")
    if status == ANSWERED and ev:
        fr = ev.get("fr") or {}
        main = next((s for s in ev.get("stacks") or () if s.get("main")), None)
        frames = tuple((str(f[0]), int(f[1]), str(f[2]), str(f[3]) if len(f) > 3 else "")
                       for f in (main or {}).get("frames") or () if isinstance(f, list) and len(f) >= 3)
        entries, groups, source = entries_from_fr(fr.get("entries") or ()), groups_from_fr(fr.get("pg_config")), \
            "responder"
    else:
        entries, groups, frames, source = (), {}, (), ""
    if not entries:  # NCCL's own dump (a GPU plan: TORCH_NCCL_DEBUG_INFO_TEMP_FILE), where there is one
        dump = _nccl_dump(rd, rank)
        if dump.get("entries"):
            entries, groups, source = entries_from_fr(dump["entries"]), groups_from_fr(dump.get("pg_config")), \
                (source + "+nccl dump").lstrip("+")
    if not frames:
        try:
            text = (rd.stacks / f"rank{rank}.txt").read_text(errors="replace")
        except OSError:
            text = ""
        frames = _with_source(parse_pyspy(text))
        source = (source + "+py-spy").lstrip("+") if frames else source
    if not status and not entries and not frames:
        return None
    return RankEvidence(rank, str(ev.get("host") or ""), status if status in (ANSWERED, STOPPED) else NO_ANSWER,
                        entries, frames, groups, source, int(st.get("pid") or 0))


CARRIED = (RunDir.hang_status_rel, RunDir.hang_evidence_rel, lambda g: f"{RunDir.STACKS}/rank{g}.txt")
CARRIED_BYTES = 256 * 1024  # per file: what a node's `--diagnose` answer carries back (hosts without a shared fs)


def export(rd: RunDir, ranks) -> dict[str, str]:
    """This node's ranks' evidence files (rel path -> text), for `--diagnose`'s answer over SSH (`absorb` keeps
    them in the submitter's run dir where the hosts share no filesystem)."""
    out = {}
    for g in ranks:
        for rel_of in CARRIED:
            rel = rel_of(g)
            try:
                out[rel] = rd.path(rel).read_text(errors="replace")[:CARRIED_BYTES]
            except OSError:
                continue
    return out


def absorb(rd: RunDir, files: dict) -> None:
    """Keep the evidence files a node's `--diagnose` answer carried (`export`), under the same paths."""
    for rel, text in files.items():
        parts = str(rel).split("/")
        if len(parts) != 2 or parts[0] not in (RunDir.HANGS, RunDir.STACKS) or not parts[1].startswith("rank") \
                or ".." in rel or not isinstance(text, str):
            continue
        try:
            rd.mkdir(parts[0])
            rd.write_text(rel, text)
        except OSError:
            pass


def load(rd: RunDir, world_size: int, since: float = 0.0) -> list[RankEvidence]:
    return [e for e in (rank_evidence(rd, g, since) for g in range(world_size)) if e is not None]


def diagnose_run(rd: RunDir, world_size: int, wait_s: float = 0.0, since: float = 0.0) -> Diagnosis | None:
    """The analysis over the run dir's evidence (None: no rank left any), kept in RUN_DIR/diagnosis.json. `wait_s`:
    how long to wait for every rank's status (other nodes still collecting: inside a SLURM allocation)."""
    deadline = time.monotonic() + wait_s
    while wait_s and time.monotonic() < deadline and \
            not all(rd.path(RunDir.hang_status_rel(g)).exists() for g in range(world_size)):
        time.sleep(0.2)
    evidence = load(rd, world_size, since)
    if not evidence:
        return None
    t0 = time.perf_counter()
    d = diagnose(evidence, world_size)
    body = dict(d.to_dict(), analysis_s=round(time.perf_counter() - t0, 4), t=time.time(),
                sources={str(e.rank): e.source for e in evidence if e.source})
    ras_files = sorted(rd.path(RunDir.HANGS).glob("ras_*.txt"))
    if ras_files:
        body["nccl_ras"] = {p.name[4:-4]: p.read_text(errors="replace")[-4000:] for p in ras_files}
    try:
        rd.write_json(RunDir.DIAGNOSIS, body)
    except OSError:
        pass
    return d
