"""`orchestrate plot JOB`: a PNG of loss and tokens/s per rank over steps, from the heartbeats (matplotlib,
imported only here, with the non-interactive Agg backend)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from orchestrator.errors import ConfigError
from orchestrator.node.heartbeat import read_all


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


def plot_job(run_dir: str, out: str, title: str) -> Path:
    loss, speed = series(read_all(Path(run_dir) / "heartbeats"))
    if not loss and not speed:
        raise ConfigError(f"{title}: no heartbeats with a loss yet in {run_dir}/heartbeats")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
