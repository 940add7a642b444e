"""Training progress for `submit`: fed heartbeat records (from the `ORCHESTRATE_HB` lines node agents
forward), it reports step / max_steps, loss, tokens/s and ETA of rank 0, as a rich progress bar on a
terminal or as plain `progress:` lines otherwise (logs, CI)."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    def __init__(self, rich: bool | None = None, stream=None):
        self.stream = stream or sys.stdout
        self.rich = self.stream.isatty() if rich is None else rich
        self.first: tuple[float, int, int] | None = None  # (t, step, tokens)
        self.last_line = ""
        self._bar = None
        self._task = None

    def line(self, rec: dict[str, Any]) -> str | None:
        """The progress text for one heartbeat of rank 0 (None for other ranks / non-step events)."""
        if rec.get("rank") != 0 or rec.get("event") not in ("step", "end"):
            return None
        step, t, tokens = rec.get("step") or 0, float(rec.get("t") or 0), rec.get("tokens")
        max_steps = rec.get("max_steps")
        if self.first is None:
            self.first = (t, step, tokens or 0)
        t0, s0, k0 = self.first
        parts = [f"step {step}/{max_steps}" if max_steps else f"step {step}"]
        if max_steps:
            parts[0] += f" ({100 * step // max(1, max_steps)}%)"
        if isinstance(rec.get("loss"), (int, float)):
            parts.append(f"loss {rec['loss']:.4f}")
        if isinstance(tokens, int) and t > t0:
            parts.append(f"{(tokens - k0) / (t - t0):,.0f} tok/s")
        if max_steps and step > s0 and t > t0:
            eta = (max_steps - step) * (t - t0) / (step - s0)
            parts.append(f"ETA {eta:.0f}s")
        return " | ".join(parts)

    def feed(self, rec: dict[str, Any]) -> None:
        text = self.line(rec)
        if text is None or text == self.last_line:
            return
        self.last_line = text
        if not self.rich:
            print(f"progress: {text}", file=self.stream, flush=True)
            return
        from rich.progress import BarColumn, Progress as Bar, TextColumn
        if self._bar is None:
            self._bar = Bar(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.description}"), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(text, total=rec.get("max_steps") or None)
        self._bar.update(self._task, completed=rec.get("step") or 0, description=text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
