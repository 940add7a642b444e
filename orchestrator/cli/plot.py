"""`orchestrate plot JOB`: a PNG of loss and tokens/s per rank over steps, from the heartbeats; `plot SWEEP_ID`: the
sweep's points' loss curves (rank 0 of each) overlaid, labelled by their overrides (matplotlib, imported only here,
with the non-interactive Agg backend)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from orchestrator.errors import ConfigError
from orchestrator.node.heartbeat import HeartbeatTail, read_all


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
    import matplotlib
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


def plot_sweep(points: list[tuple[str, str]], out: str, title: str) -> Path:
    """`points`: (label, run dir) of each point that has one; rank 0's loss over steps of each, on one axis."""
    curves = [(label, series(HeartbeatTail(Path(run_dir) / "heartbeats", ranks={0}).read())[0].get(0) or [])
              for label, run_dir in points]
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
    return _save(fig, plt, out)


def plot_job(run_dir: str, out: str, title: str) -> Path:
    loss, speed = series(read_all(Path(run_dir) / "heartbeats"))
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
    return _save(fig, plt, out)
