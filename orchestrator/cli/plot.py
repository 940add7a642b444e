"""`orchestrate plot JOB`: a PNG of loss and tokens/s per rank over steps, from the heartbeats; `plot SWEEP_ID`: the
sweep's points' loss curves (rank 0 of each) overlaid, labelled by their overrides (matplotlib, imported only here,
with the non-interactive Agg backend).

The cost is bounded by what is drawn, not by the job's size or length: only the drawn ranks' files are opened (every
rank of a job of at most DEFAULT_RANKS ranks, else rank 0, or the ranks asked with --rank), and each of them through
heartbeat.read_sampled (a file bigger than its budget is read as evenly spaced slices: the curve is downsampled, and
the command says so)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.node.heartbeat import read_sampled
from orchestrator.node.rundir import RunDir

DEFAULT_RANKS = 8  # a job of at most this many ranks draws them all; a bigger one rank 0 unless --rank says


def series(heartbeats: list[dict]) -> tuple[dict[int, list[tuple[int, float]]], dict[int, list[tuple[int, float]]]]:
    """Per rank: (step, loss) points and (step, tokens/s) points between consecutive heartbeats."""
    loss: dict[int, list[tuple[int, float]]] = defaultdict(list)
    speed: dict[int, list[tuple[int, float]]] = defaultdict(list)
    last: dict[int, tuple[float, int]] = {}
    for rec in sorted(heartbeats, key=lambda r: (r.get("rank", 0), r.get("t", 0))):
        rank, step, t = rec.get("rank"), rec.get("step"), rec.get("t")
        if not isinstance(rank, int) or not isinstance(step, int):
            continue
        if isinstance(rec.get("loss"), (int, float)):
            loss[rank].append((step, float(rec["loss"])))
        tokens = rec.get("tokens")
        if isinstance(tokens, int) and isinstance(t, (int, float)):
            if rank in last and t > last[rank][0] and tokens >= last[rank][1]:
                speed[rank].append((step, (tokens - last[rank][1]) / (t - last[rank][0])))
            last[rank] = (t, tokens)
    return dict(loss), dict(speed)


def _pyplot():
    try:
        import matplotlib
    except ImportError:  # a dependency of orchestrate; gone all the same (e.g. installed with --no-deps)
        raise OrchestratorError("orchestrate plot needs matplotlib, which is not installed here: "
                                "pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, plt, out: str) -> Path:
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_curves(points: list[tuple[str, str]]) -> tuple[list[tuple[str, list[tuple[int, float]]]], list[str]]:
    """(label, rank 0's (step, loss) points) of each (label, run dir), and the labels' first words (`p3`) of those
    whose heartbeat file was downsampled: what `plot SWEEP_ID` draws and the dashboard's sweep page shows."""
    curves, sampled = [], []
    for label, run_dir in points:
        recs, down = read_sampled(RunDir(run_dir).heartbeats / "rank0.jsonl")
        curves.append((label, series(recs)[0].get(0) or []))
        sampled += [label.split()[0]] * down
    return curves, sampled


def plot_sweep(points: list[tuple[str, str]], out: str, title: str) -> tuple[Path, str]:
    """`points`: (label, run dir) of each point that has one; rank 0's loss over steps of each, on one axis. Returns
    the PNG and a note naming the points whose curves were downsampled ("" when none was)."""
    curves, sampled = sweep_curves(points)
    if not any(pts for _, pts in curves):
        raise ConfigError(f"{title}: no point has a heartbeat with a loss yet")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in curves:
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=label, marker=".")
    ax.set_ylabel("loss (rank 0)")
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small")
    return _save(fig, plt, out), (f"{', '.join(sampled)} downsampled (evenly spaced slices of a long heartbeat file)"
                                  if sampled else "")


def _world(run: RunDir) -> int | None:
    plan = run.read_json(run.PLAN)
    world = plan.get("world_size") if isinstance(plan, dict) else None
    return world if isinstance(world, int) and world > 0 else None


def drawn_ranks(run: RunDir, world: int | None) -> list[int]:
    """The ranks drawn when none are asked: every rank of a job of at most DEFAULT_RANKS, else rank 0."""
    have = list(range(world)) if world is not None else \
        sorted(int(p.stem[4:]) for p in run.heartbeats.glob("rank*.jsonl") if p.stem[4:].isdigit())  # (no plan:
    return have if len(have) <= DEFAULT_RANKS else [0]  # the files there are; a listing, none opened)


def job_curves(run_dir: str, ranks: list[int] | None = None
               ) -> tuple[dict[int, list[tuple[int, float]]], dict[int, list[tuple[int, float]]], str]:
    """(loss, tokens/s) points per drawn rank and what was drawn (which ranks of how many; which were downsampled):
    what `plot JOB` draws and the dashboard's job page shows. `ranks`: those asked (--rank), else `drawn_ranks`."""
    run = RunDir(run_dir)
    world = _world(run)
    ranks = drawn_ranks(run, world) if ranks is None else ranks
    records: list[dict] = []
    sampled = []
    for rank in sorted(set(ranks)):
        recs, down = read_sampled(run.heartbeats / f"rank{rank}.jsonl")
        records += recs
        sampled += [rank] * down
    loss, speed = series(records)
    drew = f"rank(s) {_spans(sorted(set(ranks)))}" + (f" of {world}" if world else "")
    if world is not None and world > DEFAULT_RANKS and len(set(ranks)) < world:
        drew += " (--rank R to draw others)"
    if sampled:
        drew += f"; rank(s) {_spans(sampled)} downsampled (evenly spaced slices of a long heartbeat file)"
    return loss, speed, drew


def plot_job(run_dir: str, out: str, title: str, ranks: list[int] | None = None) -> tuple[Path, str]:
    """The PNG and what it drew (which ranks of how many; which were downsampled). `ranks`: those asked (--rank)."""
    loss, speed, drew = job_curves(run_dir, ranks)
    if not loss and not speed:
        raise ConfigError(f"{title}: no heartbeats with a loss yet in {run_dir}/heartbeats")
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for rank, pts in sorted(loss.items()):
        ax1.plot([s for s, _ in pts], [v for _, v in pts], label=f"rank {rank}", marker=".")
    ax1.set_ylabel("loss")
    ax1.set_title(title)
    ax1.legend(loc="upper right", fontsize="small")
    for rank, pts in sorted(speed.items()):
        ax2.plot([s for s, _ in pts], [v for _, v in pts], label=f"rank {rank}")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    return _save(fig, plt, out), drew


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
