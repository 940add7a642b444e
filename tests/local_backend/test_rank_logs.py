"""Per-rank log lines with a real `accelerate launch` on the local backend, 2 nodes x 2 processes (CPU, gloo): live
output and `orchestrate logs` prefix each rank's line `[localhost nodeR rankG]` (global rank), a line of no rank
`[localhost nodeR]`; `logs --rank G` gives exactly rank G's lines, while the job runs (`-f`) and after; a traceback
stays with the rank that printed it. The built-in recipe and a user's own script alike, no code changed. Slow."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from helpers import OFFLINE_ENV, PYTHON, cli

pytestmark = pytest.mark.slow

PREFIX = re.compile(r"^\[localhost node(\d+)(?: rank(\d+))?\] (.*)$")


def by_rank(text: str) -> dict[int | None, list[tuple[int, str]]]:
    """rank (None: no rank) -> [(node, text)] of the node lines of an output, in order; every node line parses."""
    out: dict[int | None, list[tuple[int, str]]] = {}
    for line in text.splitlines():
        if not line.startswith("[localhost node"):
            continue
        m = PREFIX.match(line)
        assert m, line
        rank = int(m.group(2)) if m.group(2) is not None else None
        out.setdefault(rank, []).append((int(m.group(1)), m.group(3)))
    return out


def logs(job: str, *args: str) -> str:
    r = cli("logs", job, *args, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_builtin_recipe_lines_carry_their_global_rank(tmp_path, job_guard):
    r = cli("submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--procs-per-node", "2", "trainer.max_steps=4",
            "trainer.logging_steps=1", f"trainer.output_dir={tmp_path / 'out'}", timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    job = re.search(r"^job (\S+) COMPLETED", r.stdout, re.MULTILINE).group(1)
    live = by_rank(r.stdout)
    assert {0, 1, 2, 3} <= set(live), sorted(live, key=str)  # every rank said something, under its own rank
    for rank, lines in live.items():
        if rank is not None:
            assert {node for node, _ in lines} == {rank // 2}, (rank, lines[:3])  # ...on the node that holds it
    # The Trainer prints its loss on each node's local main process: global ranks 0 and 2, never 1 or 3.
    loss_ranks = {rank for rank, lines in live.items() for _, t in lines if t.startswith("{'loss': ")}
    assert loss_ranks == {0, 2}, loss_ranks
    assert any(t.startswith("ORCHESTRATE_RESULT ") for _, t in live[0])
    assert not any(t.startswith("ORCHESTRATE_RESULT ") for rank, lines in live.items() if rank != 0 for _, t in lines)
    # `logs` shows what the live output showed, with the same prefixes; `--rank G` exactly rank G's lines, in order
    assert by_rank(logs(job)) == live
    for rank in range(4):
        assert by_rank(logs(job, "--rank", str(rank))) == {rank: live[rank]}, rank
    node1 = by_rank(logs(job, "--node", "1"))
    assert set(node1) <= {2, 3, None} and node1[2] == live[2] and node1[3] == live[3]


USER_SCRIPT = textwrap.dedent("""
    import os, sys, time, traceback
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    for i in range(3):
        print(f"hello from rank {rank} ({i})")
        print(f"stderr of rank {rank} ({i})", file=sys.stderr)
        time.sleep(0.5)
    dist.init_process_group("gloo")
    dist.barrier()
    if rank == 3:
        try:
            raise ValueError("caught by rank 3")
        except ValueError:
            traceback.print_exc()
        raise RuntimeError("rank 3 fails on purpose")
    time.sleep(120)  # the others wait to be torn down
""")


def test_own_script_lines_rank_filter_and_a_ranks_traceback(tmp_path, job_guard):
    (tmp_path / "hello.py").write_text(USER_SCRIPT)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"run": {"script": "hello.py"},
                                                        "health": {"stall_timeout": 120}}))
    env = {**os.environ, **OFFLINE_ENV}
    sub = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "submit", "job.yaml", "--nodes", "2", "--procs-per-node",
                           "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head = []
    for line in sub.stdout:  # until the run dir exists; then follow rank 2 while the job runs
        head.append(line)
        m = re.match(r"^job (\S+): run dir ", line)
        if m:
            break
    assert m, "".join(head)
    job = m.group(1)
    follow = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "logs", job, "-f", "--rank", "2"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rest, _ = sub.communicate(timeout=600)
    text = "".join(head) + rest
    followed, err = follow.communicate(timeout=120)
    assert sub.returncode == 1, text[-4000:]
    assert follow.returncode == 0, err

    # the root cause names rank 3 and its exception
    assert re.search(r"failed: .* \| rank 3: RuntimeError: rank 3 fails on purpose$", text, re.MULTILINE), text[-3000:]
    live = by_rank(text)
    for rank in range(4):  # each hello under its own rank's prefix, in order, stdout and stderr as written
        said = [t for _, t in live.get(rank, []) if t.startswith(("hello from", "stderr of"))]
        assert said == [f"{w} rank {rank} ({i})" for i in range(3) for w in ("hello from", "stderr of")], (rank, said)
        assert {node for node, _ in live[rank]} == {rank // 2}
    others = [(rank, t) for rank, lines in live.items() if rank not in (3, None) for _, t in lines
              if "rank 3" in t or "Traceback" in t or t.startswith(("ValueError", "RuntimeError"))]
    assert not others, others  # no other rank carries rank 3's lines or a traceback...
    assert not [t for _, t in live.get(None, []) if "by rank 3" in t or "fails on purpose" in t]  # nor a rankless one

    # logs --rank 3: exactly rank 3's lines, both tracebacks whole
    mine = logs(job, "--rank", "3").splitlines()
    assert mine and all(x.startswith("[localhost node1 rank3] ") for x in mine), mine
    texts = [x[len("[localhost node1 rank3] "):] for x in mine]
    assert texts == [t for _, t in live[3]]
    assert texts.count("Traceback (most recent call last):") == 2
    caught = texts.index("ValueError: caught by rank 3")
    assert texts[caught - 1].strip() == 'raise ValueError("caught by rank 3")'
    assert texts[-1] == "RuntimeError: rank 3 fails on purpose"
    assert logs(job, "--rank", "3", "--grep", "^(ValueError|RuntimeError):").splitlines() == [
        "[localhost node1 rank3] ValueError: caught by rank 3",
        "[localhost node1 rank3] RuntimeError: rank 3 fails on purpose"]

    # logs -f --rank 2, started while the job ran: rank 2's lines only, as they came
    got = followed.splitlines()
    assert got and all(x.startswith("[localhost node1 rank2] ") for x in got), got
    assert [x for x in got if "hello from" in x] == [f"[localhost node1 rank2] hello from rank 2 ({i})"
                                                     for i in range(3)]

    node0 = by_rank(logs(job, "--node", "0"))
    assert set(node0) <= {0, 1, None} and node0[0] == live[0] and node0[1] == live[1]
    assert Path(tmp_path / "hello.py").read_text() == USER_SCRIPT  # (the user's code, untouched)
