"""Trainer callbacks every recipe installs, and the token-counting collator wrapper.

Owns:
- `HeartbeatCallback`: one JSON line per logging step (+ start/save/end events) appended to
  ORCHESTRATE_HEARTBEAT_DIR/rank<G>.jsonl with exactly the contract fields, flushed per write; a no-op
  when the variable is unset. It times itself (`overhead_s`) so the cost is reported, not guessed.
- `PreemptionCallback`: SIGTERM / SIGUSR2 on any rank -> at the next step boundary every rank agrees
  (one tiny all-reduce), saves a checkpoint and stops; the run then exits 128+signal.
- `TokenCounter`: wraps the data collator, counts non-pad tokens per batch (packing efficiency) and
  keeps a FIFO so the cumulative token count matches the steps actually taken.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import signal
import socket
import time

from transformers import TrainerCallback

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


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


class HeartbeatCallback(TrainerCallback):
    """One line per optimizer step (the health monitor's hang clock), with the loss on logging steps;
    "save_start" when a checkpoint save follows the step, "save" when it is done, and a last line "end" or
    "preempted" (stopped after a save-on-signal). Install it AFTER PreemptionCallback so that it sees the
    save that callback asks for."""

    def __init__(self, counter: TokenCounter | None = None, directory: str | None = None, preempt=None):
        self.dir = directory if directory is not None else os.environ.get("ORCHESTRATE_HEARTBEAT_DIR")
        self.counter = counter
        self.preempt = preempt
        self.saving = False
        self.tokens = 0
        self.fh = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.host = socket.gethostname()
        self.overhead_s = 0.0
        self.writes = 0

    def _write(self, state, event: str, loss=None) -> None:
        if not self.dir:
            return
        t0 = time.perf_counter()
        if self.fh is None:
            os.makedirs(self.dir, exist_ok=True)
            self.fh = open(os.path.join(self.dir, f"rank{self.rank}.jsonl"), "a", encoding="utf-8")
        rec = {"t": time.time(), "rank": self.rank, "host": self.host, "step": int(state.global_step),
               "max_steps": int(state.max_steps or 0), "loss": None if loss is None else float(loss),
               "tokens": self.tokens if self.counter is not None else None, "event": event}
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        self.writes += 1
        self.overhead_s += time.perf_counter() - t0

    def on_train_begin(self, args, state, control, **kw):
        self.rank = args.process_index
        self._write(state, "start")

    def on_step_end(self, args, state, control, **kw):
        if self.counter is not None:
            t0 = time.perf_counter()
            self.tokens += self.counter.consume(args.gradient_accumulation_steps)
            self.overhead_s += time.perf_counter() - t0
        self.saving = bool(control.should_save)
        if self.saving:
            self._write(state, "save_start")
        elif not control.should_log:  # a logging step writes its line (with the loss) in on_log
            self._write(state, "step")

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self._write(state, "save_start" if self.saving else "step", logs["loss"])

    def on_save(self, args, state, control, **kw):
        self.saving = False
        self._write(state, "save")

    def on_train_end(self, args, state, control, **kw):
        self._write(state, "preempted" if self.preempt is not None and self.preempt.stopped_by else "end")
        if self.fh is not None:
            self.fh.close()
            self.fh = None


class PreemptionCallback(TrainerCallback):
    """Save-and-stop on SIGTERM/SIGUSR2. Repeats within `DEDUPE_S` of the first are the same request (SLURM,
    torchrun and the node agent each forward one, milliseconds apart) and are ignored; a signal after that
    exits at once (128+signal)."""

    DEDUPE_S = 10.0

    def __init__(self):
        self.received: int | None = None  # signal seen by this process
        self.received_at = 0.0
        self.stopped_by: int | None = None  # signal every rank agreed on (max over ranks)
        self._previous = {}

    def install(self) -> "PreemptionCallback":
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def _handler(self, signum, frame):
        now = time.monotonic()
        if self.received is not None:
            if now - self.received_at < self.DEDUPE_S:
                return
            os._exit(128 + signum)
        self.received, self.received_at = signum, now

    def on_step_end(self, args, state, control, **kw):
        flag = self.received or 0
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            t = torch.tensor([flag], dtype=torch.int64)
            if dist.get_backend() == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        if flag:
            self.stopped_by = flag
            control.should_save = True
            control.should_training_stop = True
        return control
