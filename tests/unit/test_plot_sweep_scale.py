"""`orchestrate plot JOB` and `orchestrate sweep SWEEP_ID` on big runs (issue #29): they open only the heartbeat files
they draw or summarise (rank 0's, or the ranks asked), read a bounded number of bytes of a long one, and give the same
answer as reading everything. Every `open` in the process is counted (path and bytes read) while they run.
"""

from __future__ import annotations

import builtins
import io
import json
import math
from pathlib import Path

import pytest

from orchestrator.cli.plot import plot_job, series
from orchestrator.node.heartbeat import HeartbeatTail, read_sampled

WORLD = 512


class Reads:
    """Every heartbeat file opened while installed, with the bytes read from each."""

    def __init__(self, monkeypatch):
        self.bytes: dict[str, int] = {}
        real = builtins.open
        reads = self

        class Counted:
            def __init__(self, f, name):
                self._f, self._name = f, name

            def read(self, *a):
                data = self._f.read(*a)
                reads.bytes[self._name] = reads.bytes.get(self._name, 0) + len(data)
                return data

            def __getattr__(self, k):
                return getattr(self._f, k)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        def counted_open(file, *a, **kw):
            f = real(file, *a, **kw)
            if not (isinstance(file, (str, Path)) and "/heartbeats/" in str(file)):
                return f
            self.bytes.setdefault(str(file), 0)
            return Counted(f, str(file))

        monkeypatch.setattr(builtins, "open", counted_open)
        monkeypatch.setattr(io, "open", counted_open)

    def heartbeat_files(self) -> set[str]:
        return {Path(p).name for p in self.bytes}

    def total(self, name: str) -> int:
        return sum(n for p, n in self.bytes.items() if Path(p).name == name)


def _beats(rank: int, steps: range, loss0: float = 6.0) -> str:
    return "".join(json.dumps({"t": 1000.0 + s, "rank": rank, "host": "h", "step": s, "max_steps": 10 ** 6,
                               "loss": loss0 / (1 + s / 1000) + (0.3 if s % 7 == 0 else 0.0), "tokens": s * 512,
                               "event": "step", "compute_s": 0.02}) + "\n" for s in steps)


def _run_dir(root: Path, long_steps: int, loss0: float = 6.0) -> Path:
    """A run of WORLD ranks: rank 0's file `long_steps` steps long, every other rank's a few steps (there, but never
    to be read)."""
    hb = root / "heartbeats"
    hb.mkdir(parents=True)
    (root / "plan.json").write_text(json.dumps({"world_size": WORLD, "procs_per_node": 8, "node_plans": []}))
    (hb / "rank0.jsonl").write_text(_beats(0, range(1, long_steps + 1), loss0))
    for g in range(1, WORLD):
        (hb / f"rank{g}.jsonl").write_text(_beats(g, range(1, 4)))
    return root


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    return _run_dir(tmp_path_factory.mktemp("long_run"), 40_000)  # rank 0: ~7 MB, beyond read_sampled's budget


def test_plot_of_a_big_job_opens_only_the_ranks_it_draws_and_bounds_the_bytes(long_run, tmp_path, monkeypatch):
    size = (long_run / "heartbeats" / "rank0.jsonl").stat().st_size
    assert size > 1.5 * (4 << 20)
    reads = Reads(monkeypatch)
    png, drew = plot_job(str(long_run), str(tmp_path / "p.png"), "big")
    assert reads.heartbeat_files() == {"rank0.jsonl"}  # was every one of the 512 (read_all)
    assert reads.total("rank0.jsonl") <= 4 << 20  # was the whole file
    assert drew == (f"rank(s) 0 of {WORLD} (--rank R to draw others); rank(s) 0 downsampled (evenly spaced slices "
                    "of a long heartbeat file)")
    assert png.read_bytes()[:4] == b"\x89PNG"
    reads.bytes.clear()
    _, drew = plot_job(str(long_run), str(tmp_path / "p.png"), "big", ranks=[3, 1, 2, 9])
    assert reads.heartbeat_files() == {"rank1.jsonl", "rank2.jsonl", "rank3.jsonl", "rank9.jsonl"}
    assert drew == f"rank(s) 1-3,9 of {WORLD} (--rank R to draw others)"


def test_a_downsampled_curve_is_the_full_curve_at_fewer_steps(long_run, monkeypatch):
    path = long_run / "heartbeats" / "rank0.jsonl"
    full = series(HeartbeatTail(path.parent, {0}).read())
    recs, down = read_sampled(path)
    part = series(recs)
    assert down and 1000 < len(part[0][0]) < len(full[0][0])
    assert set(part[0][0]) <= set(full[0][0])  # the same (step, loss) points, fewer of them
    steps = [s for s, _ in part[0][0]]
    assert steps == sorted(steps) and steps[-1] == 40_000 and steps[0] < 200  # from the start to the very end
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert max(gaps) < 3 * 40_000 / 256  # evenly spread
    small = long_run / "heartbeats" / "rank5.jsonl"  # a file under the budget: exactly what reading it all gives
    assert read_sampled(small) == (HeartbeatTail(small.parent, {5}).read(), False)


def _old_losses(run_dir: Path) -> tuple[float | None, float | None, int | None]:
    """What `sweep` printed before: rank 0's whole file, parsed line by line."""
    final = best = step = None
    for line in (run_dir / "heartbeats" / "rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") in ("step", "save_start", "end"):
            step = max(step or 0, rec["step"])
        if isinstance(rec.get("loss"), float) and math.isfinite(rec["loss"]):
            final = float(rec["loss"])
            best = final if best is None else min(best, final)
    return final, best, step


def test_sweep_reads_rank0_once_then_only_what_was_appended(tmp_path, monkeypatch):
    from orchestrator import sweeps
    from orchestrator.store import JobStore
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    sid = "sweep-20261128-120000-abcd"
    points, dirs = [], []
    for i in range(3):
        jid = f"{sid}-p{i}"
        dirs.append(_run_dir(tmp_path / jid, 20_000 + 5_000 * i, loss0=5.0 + i))
        JobStore().create(job_id=jid, recipe="r.yaml", recipe_digest="d", cluster="local", backend="local", nodes=64,
                          world_size=WORLD, run_dir=str(dirs[-1]), state="COMPLETED" if i else "RUNNING")
        points.append({"index": i, "job_id": jid, "overrides": [f"trainer.learning_rate={i}e-4"]})
    doc = {"id": sid, "points": points, "max_parallel": 3, "backend": "local"}
    want = {f"p{i}": _old_losses(d) for i, d in enumerate(dirs)}

    def table():
        return {r["point"]: (r["final_loss"], r["best_loss"], r["step"]) for r in sweeps.table_rows(doc)}

    reads = Reads(monkeypatch)
    assert table() == want
    assert reads.heartbeat_files() == {"rank0.jsonl"}  # rank 0 of each point, no other rank's file
    first = reads.total("rank0.jsonl")
    assert first == sum((d / "heartbeats" / "rank0.jsonl").stat().st_size for d in dirs)
    # again, the running point p0 three steps further (and a step half written): only those bytes are read
    with open(dirs[0] / "heartbeats" / "rank0.jsonl", "a") as f:
        f.write(_beats(0, range(20_001, 20_004), loss0=0.5) + '{"t": 1.0, "rank": 0, "st')
    reads.bytes.clear()
    last = 0.5 / (1 + 20_003 / 1000)
    assert table() == {**want, "p0": (last, last, 20_003)}
    assert 0 < reads.total("rank0.jsonl") < 1000  # was the three points' whole files again (~11 MB)
    with open(dirs[0] / "heartbeats" / "rank0.jsonl", "a") as f:  # the half-written step, finished
        f.write('ep": 20004, "loss": 0.01, "event": "step"}\n')
    assert table()["p0"] == (0.01, 0.01, 20_004)


def test_the_last_loss_of_a_point_reads_only_the_files_tail(tmp_path, monkeypatch):
    """`ls`'s loss column for a sweep point (sweep._last_loss): rank 0's latest finite loss, from the end of its file
    through heartbeat.read_tail (the reader `status` uses): a line cut at the start of the tail and an unfinished last
    line are left out, a NaN is passed over, and only the tail's bytes are read."""
    from orchestrator.node.heartbeat import read_tail
    from orchestrator.sweeps import _last_loss
    hb = tmp_path / "heartbeats"
    hb.mkdir()
    recs = [{"event": "step", "step": s, "loss": 10.0 - s / 1000} for s in range(5000)]
    recs += [{"event": "step", "step": 5000, "loss": float("nan")}, {"event": "save", "step": 5000}]
    (hb / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"event": "step", "loss": 0.')
    tail = read_tail(hb / "rank0.jsonl", 300)
    assert tail and tail[-1] == {"event": "save", "step": 5000} and all(isinstance(r, dict) for r in tail)
    assert tail[0]["step"] > 4990  # the partial first line left out, not half-parsed
    reads = Reads(monkeypatch)
    assert _last_loss(str(tmp_path)) == pytest.approx(10.0 - 4999 / 1000)
    assert sum(reads.bytes.values()) <= 4096
    assert _last_loss(str(tmp_path / "none")) is None
