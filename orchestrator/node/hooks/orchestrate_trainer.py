"""Trainer callbacks shared by the built-in recipes and the zero-code hooks: heartbeats and save-on-signal.

Imported only once transformers is (the hooks load it at the first `Trainer(...)`; `recipes/callbacks.py`
re-exports both classes), so importing it costs nothing extra.

- `HeartbeatCallback`: one record per optimizer step (the health monitor's hang clock), with the loss on
  logging steps; "start", "save_start" (a checkpoint save follows this step), "save" (done), and a last line
  "end" or "preempted" (stopped after a save-on-signal). Records go through `orchestrate_heartbeat.Writer`
  (docs/CONTRACT.md's fields); while it trains it claims the step records, so the optimizer-step hook stays
  silent. Tokens: a `counter` (the recipes' TokenCounter collator wrapper) when given, else the Trainer's own
  `state.num_input_tokens_seen` when the user turned `include_num_input_tokens_seen` on, else null.
  It times itself (`overhead_s`). Install it AFTER PreemptionCallback so that it sees the save that one asks for.
  On each save, the process that saved the checkpoint (`args.should_save`) records which job wrote it:
  `checkpoint-N/orchestrate.json` (orchestrate_checkpoint.write_record; under orchestrate only: ORCHESTRATE_JOB_ID).
- `PreemptionCallback`: SIGTERM / SIGUSR2 on any rank -> every rank agrees to stop at the same step boundary,
  saves a checkpoint and stops; the caller then exits 128+signal. Agreeing takes one tiny all-reduce (and, on GPU,
  a host sync): about 0.3 ms over gloo on loopback, 3 % of a 10 ms step if done every step. So the ranks agree
  every `every` steps, about every `CHECK_S` seconds (ORCHESTRATE_SIGNAL_CHECK_S, default 0.5): each agreement
  also takes the MAX over ranks of the time per step since the last one, and every rank computes the next
  interval from those same numbers, so all of them check at the same steps (and at the last step). A signal is
  acted on within CHECK_S plus one step. Repeats within `DEDUPE_S` of the first are the same request (SLURM,
  torchrun and the node agent each forward one) and are ignored; a signal after that exits at once (128+signal).

Both carry `orchestrate_role` ("heartbeat" / "preempt") so the hooks can tell that a Trainer already has
orchestrate's callbacks (a built-in recipe) and add none of their own.
"""

from __future__ import annotations

import os
import signal
import time

from transformers import TrainerCallback

try:  # from the hooks directory (a user's rank) or from the package (the recipes): one module either way
    import orchestrate_checkpoint as ckpt
    import orchestrate_heartbeat as hb
except ImportError:
    from orchestrator.node.hooks import orchestrate_checkpoint as ckpt
    from orchestrator.node.hooks import orchestrate_heartbeat as hb

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class HeartbeatCallback(TrainerCallback):
    orchestrate_role = "heartbeat"

    def __init__(self, counter=None, directory: str | None = None, preempt=None):
        self.writer = hb.Writer(directory if directory is not None else os.environ.get("ORCHESTRATE_HEARTBEAT_DIR"))
        self.counter = counter
        self.preempt = preempt
        self.saving = False
        self.tokens = 0
        self.overhead_s = 0.0

    @property
    def writes(self) -> int:
        return self.writer.records

    def _tokens(self, args, state):
        if self.counter is not None:
            return self.tokens
        mode = getattr(args, "include_num_input_tokens_seen", "no")
        if mode in (None, False, "no"):
            return None
        return int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def _write(self, args, state, event: str, loss=None) -> None:
        before = self.writer.overhead_s
        self.writer.write(event, state.global_step, state.max_steps or 0, loss, self._tokens(args, state))
        self.overhead_s += self.writer.overhead_s - before

    def on_train_begin(self, args, state, control, **kw):
        if self.writer.fd < 0:
            self.writer.rank = args.process_index
        hb.claim("trainer")
        self._write(args, state, "start")

    def on_step_end(self, args, state, control, **kw):
        if self.counter is not None:
            t0 = time.perf_counter()
            self.tokens += self.counter.consume(args.gradient_accumulation_steps)
            self.overhead_s += time.perf_counter() - t0
        self.saving = bool(control.should_save)
        if self.saving:
            self._write(args, state, "save_start")
        elif not control.should_log:  # a logging step writes its line (with the loss) in on_log
            self._write(args, state, "step")

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self._write(args, state, "save_start" if self.saving else "step", logs["loss"])

    def on_save(self, args, state, control, **kw):
        self.saving = False
        job = os.environ.get("ORCHESTRATE_JOB_ID", "").strip()
        if job and getattr(args, "should_save", False) and getattr(args, "output_dir", None):
            ckpt.write_record(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), job, state.global_step)
        self._write(args, state, "save")

    def on_train_end(self, args, state, control, **kw):
        stopped = self.preempt is not None and self.preempt.stopped_by
        self._write(args, state, "preempted" if stopped else "end")
        hb.release("trainer")
        self.writer.close()


def _check_s() -> float:
    try:
        return max(0.0, float(os.environ.get("ORCHESTRATE_SIGNAL_CHECK_S", "") or 0.5))
    except ValueError:
        return 0.5


class PreemptionCallback(TrainerCallback):
    orchestrate_role = "preempt"
    DEDUPE_S = 10.0
    MAX_EVERY = 10_000  # steps between agreements, at most

    def __init__(self):
        self.received: int | None = None  # signal seen by this process
        self.received_at = 0.0
        self.stopped_by: int | None = None  # signal every rank agreed on (max over ranks)
        self._previous = {}
        self.check_s = _check_s()
        self.every = 1  # steps between agreements: the same on every rank (computed from all-reduced numbers)
        self.next_check = 0  # the global step of the next agreement
        self.checks = 0
        self._last = (0.0, -1)  # (monotonic time, global step) of the last agreement; -1: none since train begin

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

    def on_train_begin(self, args, state, control, **kw):
        self._last = (time.monotonic(), -1)  # the first agreement, at the first step, counts its time as one step
        self.next_check = 0

    def on_step_end(self, args, state, control, **kw):
        step = state.global_step
        if step < self.next_check and not (state.max_steps and step >= state.max_steps):
            return control
        flag = self.received or 0
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            now = time.monotonic()
            t0, s0 = self._last
            t = torch.tensor([float(flag), (now - t0) / (1 if s0 < 0 else max(1, step - s0))], dtype=torch.float64)
            if dist.get_backend() == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag, per_step = (float(x) for x in t.tolist())
            flag = int(flag)
            self.checks += 1
            self._last = (now, step)
            self.every = self.MAX_EVERY if per_step <= 0 else max(1, min(self.MAX_EVERY, int(self.check_s / per_step)))
        self.next_check = step + self.every  # (one process: no peers to agree with, every step costs nothing)
        if flag:
            self.stopped_by = flag
            control.should_save = True
            control.should_training_stop = True
        return control


hb.one_module_per_process(__name__, "orchestrate_trainer")
