"""Per-rank output lines: every line a rank writes is attributed to its global rank, with no change to user code.

How (docs/CONTRACT.md, "Output"): before the launch the node agent makes one named pipe per rank of its node
(`RunDir.rank_pipe`: RUN_DIR/nodes/<R>/output/rank<G>) and reads them all in one thread (`RankRelay`). In each rank the
start-up hook (hooks/sitecustomize.py) points fd 1 and 2 at its pipe before the user's code runs, so Python's prints,
tracebacks, logging and C-level writes (NCCL, glog) of that process and of its children (DataLoader workers) all go
there, stdout and stderr in the order they were written. The relay writes each complete line to the agent's stdout
as `[rankG]: text`: the format torch itself gives a rank's tracebacks once its process group is up, which is left as
it is, not doubled. Lines of no rank (the launcher, accelerate's warnings, the agent) have no tag.

Everything downstream reads the tag with `split_rank` and shows `[host nodeR rankG] text` (`show`), or
`[host nodeR] text` for a line of no rank. A rank whose hook is off (ORCHESTRATE_HOOKS=0) or that could not open its
pipe writes untagged, as before. Standard library only: it runs on every node.
"""

from __future__ import annotations

import os
import re
import selectors
import stat
import threading
from pathlib import Path

_TAG = re.compile(r"^\[rank(\d+)\]:[ ]?")
MAX_LINE = 1 << 16  # an unterminated line this long is passed on as it is (a runaway progress bar)


def tag(rank: int, text: str) -> str:
    """`[rankG]: text`; a line that already carries rank G's tag (torch's own) is left as it is."""
    return text if text.startswith(f"[rank{rank}]:") else f"[rank{rank}]: {text}"


def split_rank(line: str) -> tuple[int | None, str]:
    """(global rank, text) of a node's output line; (None, line) for a line of no rank."""
    m = _TAG.match(line)
    if m is None:
        return None, line
    return int(m.group(1)), line[m.end():]


def prefix(host: str, node: int, rank: int | None) -> str:
    """`[host nodeR rankG]`, or `[host nodeR]` for a line of no rank."""
    return f"[{host} node{node}]" if rank is None else f"[{host} node{node} rank{rank}]"


def show(host: str, node: int, line: str) -> str:
    """A node's output line as live output and `orchestrate logs` print it."""
    rank, text = split_rank(line)
    return f"{prefix(host, node, rank)} {text}"


def split_chunk(rank: int, buf: bytes, final: bool = False) -> tuple[bytes, bytes]:
    """(tagged complete lines, unfinished rest) of a rank's raw output. A line ends at \\n or \\r (a progress bar's
    updates are lines, as the backends read them); blank lines are dropped; `final` or an unfinished rest longer than
    MAX_LINE passes the rest on as a line too."""
    parts = re.split(rb"[\r\n]", buf)
    rest = parts.pop()
    if final or len(rest) > MAX_LINE:
        parts.append(rest)
        rest = b""
    own = b"[rank%d]:" % rank
    out = [(p if p.startswith(own) else own + b" " + p) + b"\n" for p in parts if p.strip()]
    return b"".join(out), rest


def is_pipe(path: str | os.PathLike) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


class RankRelay:
    """The node agent's side: one named pipe per rank of the node, read by one thread that writes each rank's complete
    lines, tagged, to `out_fd` as they arrive (nothing is held but an unfinished line, as every backend does). Each
    pipe keeps a writer of the relay's own, so a rank that exits (or a restarted one that opens it again) never ends
    the stream. A rank's lines keep their order; lines of different ranks never interleave mid-line."""

    def __init__(self, directory: Path, ranks: list[int], out_fd: int = 1):
        self.dir, self.ranks, self.out_fd = Path(directory), list(ranks), out_fd
        self.fds: dict[int, tuple[int, int]] = {}  # rank -> (read end, the relay's own write end)
        self.pending: dict[int, bytes] = {}
        self.broken = False  # out_fd is gone: keep reading (a rank must never block on a full pipe), drop the lines
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None

    def path(self, rank: int) -> Path:
        return self.dir / f"rank{rank}"

    def open(self) -> str | None:
        """Make and open the pipes (an earlier attempt's are replaced). Returns why it could not (the ranks then write
        untagged), or None."""
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            for g in self.ranks:
                p = self.path(g)
                p.unlink(missing_ok=True)
                os.mkfifo(p, 0o600)
                r = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    w = os.open(p, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError:
                    os.close(r)
                    raise
                self.fds[g] = (r, w)
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
        except OSError as e:
            self.close()
            return f"per-rank output pipes in {self.dir}: {e.strerror or e}"
        return None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="rank-output")
        self._thread.start()

    def _emit(self, data: bytes) -> None:
        while data and not self.broken:
            try:
                n = os.write(self.out_fd, data)
            except InterruptedError:
                continue
            except OSError:
                self.broken = True
                return
            data = data[n:]

    def _read(self, rank: int, final: bool = False) -> None:
        fd = self.fds[rank][0]
        buf = self.pending.get(rank, b"")
        for _ in range(1 << 20 if final else 16):  # (a busy rank cannot starve the others between selects)
            try:
                chunk = os.read(fd, 1 << 16)
            except InterruptedError:
                continue
            except OSError:  # BlockingIOError: nothing more now
                break
            if not chunk:
                break
            buf += chunk
        out, self.pending[rank] = split_chunk(rank, buf, final)
        self._emit(out)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for g, (r, _w) in self.fds.items():
            sel.register(r, selectors.EVENT_READ, g)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                for key, _ev in sel.select():
                    if key.data is not None:
                        self._read(key.data)
            for g in self.fds:  # what the ranks wrote last, unfinished lines included
                self._read(g, final=True)
        finally:
            sel.close()

    def close(self, timeout: float = 5.0) -> None:
        """Pass on what is left (the launch is over), stop the thread, close and remove the pipes."""
        self._stop.set()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)
        for g, (r, w) in self.fds.items():
            for fd in (r, w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                self.path(g).unlink(missing_ok=True)
            except OSError:
                pass
        self.fds = {}
        try:
            self.dir.rmdir()  # (only when empty)
        except OSError:
            pass
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
