"""Per-rank output lines (orchestrator.node.ranklines): the tag, its parsing and display, the relay's line splitting,
and a real process under the ranks' start-up hook writing through the relay: every line it writes (stdout, stderr,
C-level, a child process's, a traceback) arrives tagged with its rank, in order; a subprocess whose output the rank
captures keeps it; without a relay, or with the hooks off, nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

from orchestrator.node.hooks import HOOKS_DIR
from orchestrator.node.ranklines import RankRelay, prefix, show, split_chunk, split_rank, tag
from orchestrator.node.rundir import RunDir
from orchestrator.supervise import last_exception


def test_tag_parse_and_show():
    assert tag(3, "loss 1.0") == "[rank3]: loss 1.0"
    assert tag(3, "[rank3]: Traceback") == "[rank3]: Traceback"  # torch's own prefix is not doubled
    assert tag(3, "[rank5]: x") == "[rank3]: [rank5]: x"
    assert split_rank("[rank12]: step 4") == (12, "step 4")
    assert split_rank("[rank12]:   File \"x.py\"") == (12, "  File \"x.py\"")  # indentation kept
    assert split_rank("[rank1] no colon") == (None, "[rank1] no colon")
    assert split_rank("W1128 torchrun warning") == (None, "W1128 torchrun warning")
    assert prefix("gpu02", 1, 3) == "[gpu02 node1 rank3]" and prefix("gpu02", 1, None) == "[gpu02 node1]"
    assert show("gpu02", 1, "[rank3]: hello from rank 3") == "[gpu02 node1 rank3] hello from rank 3"
    assert show("gpu02", 1, "accelerate warning") == "[gpu02 node1] accelerate warning"
    # the supervisor's root cause reads the tag as it read torch's
    assert last_exception("[rank3]: Traceback (most recent call last):\n[rank3]: ValueError: bad\n") == \
        (3, "ValueError: bad")


def test_split_chunk_tags_whole_lines_and_keeps_the_rest():
    out, rest = split_chunk(2, b"a\nb\r\n\nc\r 50%|#\r[rank2]: Traceback\npar")
    assert out == b"[rank2]: a\n[rank2]: b\n[rank2]: c\n[rank2]:  50%|#\n[rank2]: Traceback\n" and rest == b"par"
    assert split_chunk(2, b"par", final=True) == (b"[rank2]: par\n", b"")
    out, rest = split_chunk(0, b"x" * (1 << 17))  # a runaway unterminated line is not held forever
    assert out.startswith(b"[rank0]: xxx") and rest == b""


RANK_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys
    print("hello from rank", os.environ["RANK"])
    print("to stderr", file=sys.stderr)
    print("to stdout again")
    os.write(1, b"fd-level write\\n")
    os.write(2, b"no newline yet...")
    os.write(2, b" done\\n")
    subprocess.run([sys.executable, "-c", "print('child inherits the pipe')"], check=True)
    got = subprocess.run([sys.executable, "-c", "print('captured by the rank')"], capture_output=True, text=True)
    print("captured:", got.stdout.strip())
    def inner():
        raise RuntimeError("loss is nan at step 3")
    inner()
""")


def _env(run_dir, node, rank, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATE_", "RANK", "LOCAL_RANK"))}
    env.update(PYTHONPATH=HOOKS_DIR, ORCHESTRATE_RUN_DIR=str(run_dir), ORCHESTRATE_NODE_RANK=str(node), RANK=str(rank),
               LOCAL_RANK="1", ORCHESTRATE_HEARTBEAT_DIR=str(run_dir / "heartbeats"), PYTHONUNBUFFERED="1", **extra)
    return env


def _collect(fd: int, into: list) -> threading.Thread:
    def run():
        while chunk := os.read(fd, 65536):
            into.append(chunk)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_rank_under_the_hook_writes_through_the_relay_tagged_and_in_order(tmp_path):
    rd = RunDir(tmp_path)
    r, w = os.pipe()
    relay = RankRelay(rd.rank_pipes(1), [2, 3], out_fd=w)
    assert relay.open() is None
    relay.start()
    got: list[bytes] = []
    reader = _collect(r, got)
    p = subprocess.run([sys.executable, "-c", RANK_SCRIPT], env=_env(tmp_path, 1, 3), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=60)
    relay.close()
    os.close(w)
    reader.join(10)
    assert p.returncode == 1 and p.stdout == b"", p.stdout  # nothing left on the launcher's stream
    lines = b"".join(got).decode().splitlines()
    assert all(ln.startswith("[rank3]: ") for ln in lines), lines
    text = [split_rank(ln)[1] for ln in lines]
    assert text[:8] == ["hello from rank 3", "to stderr", "to stdout again", "fd-level write",
                        "no newline yet... done", "child inherits the pipe", "captured: captured by the rank",
                        "Traceback (most recent call last):"]
    assert text[-1] == "RuntimeError: loss is nan at step 3"
    assert last_exception("\n".join(lines)) == (3, "RuntimeError: loss is nan at step 3")
    assert not rd.rank_pipes(1).exists()  # the pipes go with the launch


def test_the_last_unfinished_line_of_a_rank_is_not_lost(tmp_path):
    rd = RunDir(tmp_path)
    r, w = os.pipe()
    relay = RankRelay(rd.rank_pipes(0), [0], out_fd=w)
    assert relay.open() is None
    relay.start()
    got: list[bytes] = []
    reader = _collect(r, got)
    subprocess.run([sys.executable, "-c", "import os; os.write(1, b'line\\nkilled mid-li'); os._exit(9)"],
                   env=_env(tmp_path, 0, 0), timeout=60)
    relay.close()
    os.close(w)
    reader.join(10)
    assert b"".join(got) == b"[rank0]: line\n[rank0]: killed mid-li\n"


def test_without_a_relay_or_with_the_hooks_off_output_is_untouched(tmp_path):
    script = "import sys; print('plain'); print('err', file=sys.stderr)"
    p = subprocess.run([sys.executable, "-c", script], env=_env(tmp_path, 0, 0), capture_output=True, text=True,
                       timeout=60)
    assert (p.stdout, p.stderr) == ("plain\n", "err\n")  # no pipe made by an agent: where it was
    relay = RankRelay(RunDir(tmp_path).rank_pipes(0), [0], out_fd=os.open(os.devnull, os.O_WRONLY))
    assert relay.open() is None
    relay.start()
    try:
        p = subprocess.run([sys.executable, "-c", script], env=_env(tmp_path, 0, 0, ORCHESTRATE_HOOKS="0"),
                           capture_output=True, text=True, timeout=60)
        assert (p.stdout, p.stderr) == ("plain\n", "err\n")
    finally:
        relay.close()
        os.close(relay.out_fd)


def test_relay_keeps_reading_when_its_output_is_gone(tmp_path):
    """A rank must never block on a full pipe because the agent's stdout went away: its lines are dropped."""
    r, w = os.pipe()
    relay = RankRelay(RunDir(tmp_path).rank_pipes(0), [0], out_fd=w)
    assert relay.open() is None
    relay.start()
    os.close(r)
    p = subprocess.run([sys.executable, "-c", "print('x' * 100, flush=True)\nfor _ in range(20000): print('y' * 99)"],
                       env=_env(tmp_path, 0, 0), timeout=60)
    relay.close()
    os.close(w)
    assert p.returncode == 0 and relay.broken
