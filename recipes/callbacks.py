"""Trainer callbacks every recipe installs, and the token-counting collator wrapper.

- `HeartbeatCallback`, `PreemptionCallback`: defined once in orchestrator/node/hooks/orchestrate_trainer.py and
  shared with the zero-code hooks that give a user's own Trainer script the same records (one writer of the
  heartbeat format: orchestrate_heartbeat.Writer). HeartbeatCallback: one JSON line per optimizer step (+ start/
  save_start/save/end/preempted events) appended to ORCHESTRATE_HEARTBEAT_DIR/rank<G>.jsonl with exactly the
  contract fields, written per event; a no-op when the variable is unset; it times itself (`overhead_s`) so the
  cost is reported, not guessed. PreemptionCallback: SIGTERM / SIGUSR2 on any rank -> at the next agreement (one
  tiny all-reduce about every 0.5 s of training, at the same steps on every rank) every rank stops, saves a
  checkpoint; the run then exits 128+signal.
- `TokenCounter`: wraps the data collator, counts non-pad tokens per batch (packing efficiency) and
  keeps a FIFO so the cumulative token count matches the steps actually taken.
"""

from __future__ import annotations

import collections
import hashlib

from orchestrator.node.hooks.orchestrate_trainer import PREEMPT_SIGNALS, HeartbeatCallback, PreemptionCallback

__all__ = ["PREEMPT_SIGNALS", "HeartbeatCallback", "PreemptionCallback", "TokenCounter"]


class TokenCounter:
    """Collator wrapper: per-batch non-pad / total token counts and the first batch's fingerprint."""

    def __init__(self, collator, pad_token_id: int | None):
        self.collator = collator
        self.pad_token_id = pad_token_id
        self.pending: collections.deque[int] = collections.deque()
        self.nonpad = 0  # over all batches built
        self.total = 0
        self.batches = 0
        self.first_batch_sha: str | None = None

    def __call__(self, examples):
        batch = self.collator(examples)
        ids = batch.get("input_ids")
        if ids is None:
            ids = batch.get("chosen_input_ids")
        mask = batch.get("attention_mask")
        if ids is not None:
            total = int(ids.numel())
            if mask is not None and mask.shape == ids.shape:
                nonpad = int(mask.sum())
            elif self.pad_token_id is not None:
                nonpad = int((ids != self.pad_token_id).sum())
            else:
                nonpad = total
            if self.first_batch_sha is None:
                self.first_batch_sha = hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest()[:16]
            self.nonpad += nonpad
            self.total += total
            self.batches += 1
            self.pending.append(nonpad)
        return batch

    def consume(self, n_batches: int) -> int:
        """Tokens of the next n batches the trainer consumed (the dataloader builds one batch ahead)."""
        return sum(self.pending.popleft() for _ in range(min(n_batches, len(self.pending))))

    @property
    def nonpad_fraction(self) -> float | None:
        return self.nonpad / self.total if self.total else None
