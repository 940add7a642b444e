"""Reading heartbeat records: the per-rank files RUN_DIR/heartbeats/rank<G>.jsonl (incrementally: `HeartbeatTail`,
over `appended`, the one reader of a file's new lines) and the `ORCHESTRATE_HB {json}` lines node agents forward over
their output (`parse_forwarded`). The record format is docs/CONTRACT.md's; the ranks write it (recipes, the zero-code
hooks). Standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

HB_PREFIX = "ORCHESTRATE_HB "


def parse_forwarded(line: str) -> dict[str, Any] | None:
    if not line.startswith(HB_PREFIX):
        return None
    try:
        rec = json.loads(line[len(HB_PREFIX):])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


class HeartbeatTail:
    """Incrementally read complete new lines of every rank<G>.jsonl in a directory."""

    def __init__(self, directory: Path, ranks: set[int] | None = None, from_end: bool = False):
        """`from_end`: skip what the files hold now (an earlier attempt's records); read only what comes next."""
        self.dir = Path(directory)
        self.ranks = ranks
        self.offsets: dict[Path, int] = {}
        self._paths: list[Path] | None = None
        if from_end:
            for path in self.paths():
                try:
                    self.offsets[path] = path.stat().st_size
                except OSError:
                    pass

    def paths(self) -> list[Path]:
        """The files to read: the given ranks' own (a node agent's: never a listing of every rank's file in a shared
        directory, which made each of N agents cost O(N) per read), else every rank<G>.jsonl there is."""
        if self.ranks is not None:
            if self._paths is None:
                self._paths = [self.dir / f"rank{g}.jsonl" for g in sorted(self.ranks)]
            return self._paths
        return sorted(self.dir.glob("rank*.jsonl")) if self.dir.is_dir() else []

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in self.paths():
            try:
                for end, rec in appended(path, self.offsets.get(path, 0)):
                    self.offsets[path] = end
                    if rec is not None:
                        out.append(rec)
            except OSError:  # (not there yet)
                continue
        return out


def appended(path: Path, offset: int, chunk: int = 1 << 20) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """Each complete line of a heartbeat file after byte `offset`: (the offset just past it, where a next read
    starts; its record, None when it is not a JSON object), read a chunk at a time (an unfinished last line waits
    for the next read, whole). OSError when the file cannot be read."""
    with open(path, "rb") as f:
        f.seek(offset)
        rest = b""
        while data := f.read(chunk):
            data = rest + data
            cut = data.rfind(b"\n") + 1
            for line in data[:cut].split(b"\n")[:-1]:
                offset += len(line) + 1
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                yield offset, rec if isinstance(rec, dict) else None
            rest = data[cut:]


def read_all(directory: Path) -> list[dict[str, Any]]:
    return HeartbeatTail(directory).read()


def _rank_of(path: Path) -> int:
    try:
        return int(path.stem[4:])
    except ValueError:
        return -1


def read_tails(directory: Path, budget: int = 4 << 20, least: int = 512, most: int = 256 << 10
               ) -> list[dict[str, Any]]:
    """The LAST records of every rank<G>.jsonl, each rank's in order: at most `budget` bytes in all, shared by the
    ranks (each reads between `least` and `most` bytes from its file's end). What `status` needs of a running or
    ended job (each rank's latest state, its recent forward times and losses) at a cost bounded by the job's size,
    not by how long it ran: 8,192 ranks read 512 bytes each (their last ~2 records), a 16-rank job up to 256 KiB each
    (its whole history for most runs)."""
    if not directory.is_dir():
        return []
    paths = sorted(directory.glob("rank*.jsonl"), key=_rank_of)
    each = max(least, min(most, budget // max(1, len(paths))))
    out: list[dict[str, Any]] = []
    for path in paths:
        try:
            out += read_tail(path, each)
        except OSError:
            continue
    return out


def read_tail(path: Path, nbytes: int) -> list[dict[str, Any]]:
    """The records of the last `nbytes` of one heartbeat file, in order: a partial first line (mid-file) and an
    unfinished last one left out. OSError when the file cannot be read."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - nbytes))
        data = f.read(nbytes)
    return _records(data, mid_file=size > nbytes)


def read_since(path: Path, offset: int, overlap: int = 2048, most: int = 4 << 20) -> tuple[list[dict[str, Any]], int]:
    """The records after byte `offset` of one heartbeat file, with those of the `overlap` bytes before it (a rate
    between consecutive records needs the one before), at most `most` bytes; and where the complete lines read end
    (the next call's `offset`); nothing when no complete line came since. What a live view reads each time it looks
    again. OSError when it cannot be read."""
    start = max(0, offset - overlap)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(offset - start + most)
    cut = data.rfind(b"\n") + 1
    if start + cut <= offset:  # nothing complete came since
        return [], offset
    return _records(data[:cut], mid_file=start > 0), start + cut


def _records(data: bytes, mid_file: bool) -> list[dict[str, Any]]:
    """The records of a slice of a heartbeat file: its unfinished last line left out, and its first too when the slice
    starts mid-file (a partial line). One parse for the lot, line by line only if one is bad."""
    lines = data.split(b"\n")[:-1]
    lines = [ln for ln in (lines[1:] if mid_file else lines) if ln.strip()]
    try:
        recs = json.loads(b"[" + b",".join(lines) + b"]")
    except ValueError:
        recs = [r for r in map(_loads, lines) if r is not None]
    return [r for r in recs if isinstance(r, dict)]


def read_sampled(path: Path, budget: int = 4 << 20, windows: int = 256) -> tuple[list[dict[str, Any]], bool]:
    """One rank<G>.jsonl's records in file order at a cost bounded by `budget` bytes, not by how long the job ran:
    the whole file when it is no bigger, else `windows` evenly spaced slices of budget/windows bytes each, the last
    one ending at the file's end (complete lines only). Returns (records, downsampled). What `plot` draws."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size <= budget:
                f.seek(0)
                chunks = [(0, f.read())]
            else:
                each = budget // windows
                chunks = []
                for i in range(windows):
                    start = i * (size - each) // (windows - 1)
                    f.seek(start)
                    chunks.append((start, f.read(each)))
    except OSError:
        return [], False
    out: list[dict[str, Any]] = []
    for start, data in chunks:
        out += _records(data, mid_file=start > 0)
    return out, size > budget


def _loads(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None
