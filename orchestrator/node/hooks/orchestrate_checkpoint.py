"""Checkpoints under orchestrate: which job wrote each one, and which one a rank resumes from.

Standard library only, importable under two names like `orchestrate_heartbeat` (from the hooks directory in a
rank, `orchestrator.node.hooks.orchestrate_checkpoint` from the package: the built-in recipes and the submitter).

- `write_record(checkpoint_dir, job_id, step)`: the record RECORD (`<output_dir>/checkpoint-N/orchestrate.json`,
  {"job_id", "step", "t"}), written once per checkpoint by the process that saved it, after the Trainer saved it
  (`orchestrate_trainer.HeartbeatCallback.on_save`: the built-in recipes and the zero-code hooks alike). Outside
  orchestrate (no ORCHESTRATE_JOB_ID) nothing is written. The submitter reads it (`describe`) so that a NEW job does
  not continue another job's checkpoints by itself (orchestrator.core.resume, docs/CONTRACT.md "Checkpoints").
- `checkpoints(output_dir)` / `latest(output_dir)`: transformers' own rule (`trainer_utils.get_last_checkpoint`):
  directories named checkpoint-<N>, the highest N.
- `complete(checkpoint_dir)`: its save ended: it holds the record or trainer_state.json (the Trainer writes that last,
  after the weights, optimizer and RNG states). A rank killed while saving leaves a checkpoint-N without either;
  resuming from it fails (FileNotFoundError: trainer_state.json) on every restart, so resume skips it.
- `describe(checkpoint_dir)`: {"path", "job", "step"}: the job from the record (None: written outside orchestrate),
  the step from the record, else trainer_state.json's global_step, else N; `whose` says it in a rank's log line.
- `resume_from(mode, output_dir, job_id)`: what a rank resumes from for checkpoint.resume (ORCHESTRATE_RESUME):
  never / off -> None; auto / latest -> the latest complete checkpoint (None: a fresh start; a newer incomplete one
  is skipped and said on stderr); a path -> that checkpoint, unless the output dir holds complete checkpoints this
  very job wrote since (a restart goes on from its own progress).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

RECORD = "orchestrate.json"
NAME = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils._re_checkpoint
OFF = ("", "never", "0", "false", "no", "off")


def checkpoints(output_dir: str) -> list[str]:
    """The checkpoint-<N> directories of `output_dir`, oldest (lowest N) first; [] when there is none."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names
             if (m := NAME.match(n)) is not None and os.path.isdir(os.path.join(output_dir, n))]
    return [os.path.join(output_dir, n) for _, n in sorted(found)]


def latest(output_dir: str) -> str | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def complete(checkpoint_dir: str) -> bool:
    """The checkpoint's save ended (module docstring): its record or trainer_state.json is there."""
    return any(os.path.isfile(os.path.join(checkpoint_dir, name)) for name in (RECORD, "trainer_state.json"))


def latest_complete(output_dir: str, say: bool = True) -> str | None:
    """The newest complete checkpoint of `output_dir` (None: none); each newer incomplete one is said on stderr."""
    for path in reversed(checkpoints(output_dir)):
        if complete(path):
            return path
        if say:
            print(f"orchestrate: {path} is incomplete (its save was cut short: no trainer_state.json): not resumed "
                  f"from", file=sys.stderr, flush=True)
    return None


def read_record(checkpoint_dir: str) -> dict | None:
    try:
        with open(os.path.join(checkpoint_dir, RECORD)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_record(checkpoint_dir: str, job_id: str, step: int) -> bool:
    """Record that job `job_id` wrote `checkpoint_dir` at `step` (atomically); never fails the run (a warning)."""
    if not job_id or not os.path.isdir(checkpoint_dir):
        return False
    path = os.path.join(checkpoint_dir, RECORD)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"job_id": job_id, "step": int(step), "t": round(time.time(), 3)}, f)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"orchestrate: checkpoint record {path} not written: {e}", file=sys.stderr, flush=True)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
    return True


def _trainer_step(checkpoint_dir: str) -> int | None:
    try:
        with open(os.path.join(checkpoint_dir, "trainer_state.json")) as f:
            step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def describe(checkpoint_dir: str) -> dict:
    """{"path", "job", "step"} of a checkpoint directory (job None: no record, written outside orchestrate)."""
    rec = read_record(checkpoint_dir) or {}
    job = rec.get("job_id") if isinstance(rec.get("job_id"), str) and rec.get("job_id") else None
    step = rec.get("step") if isinstance(rec.get("step"), int) else _trainer_step(checkpoint_dir)
    if step is None:
        m = NAME.match(os.path.basename(os.path.normpath(checkpoint_dir)))
        step = int(m.group(1)) if m else None
    return {"path": checkpoint_dir, "job": job, "step": step}


def whose(checkpoint_dir: str, job_id: str = "") -> str:
    """': a checkpoint of job X' when its record names another job than `job_id` (what a rank's log adds), else ''."""
    other = describe(checkpoint_dir)["job"]
    return f": a checkpoint of job {other}" if other and other != job_id else ""


def resume_from(mode, output_dir: str, job_id: str = "") -> str | None:
    """The checkpoint a rank resumes from (module docstring). A path that is no directory: FileNotFoundError."""
    if mode is None or mode is False or str(mode).strip().lower() in OFF:
        return None
    mode = str(mode).strip()
    if mode.lower() in ("auto", "latest"):
        return latest_complete(output_dir) if output_dir else None
    own = [c for c in checkpoints(output_dir) if job_id and (read_record(c) or {}).get("job_id") == job_id] \
        if output_dir else []
    if own:  # a restart of the job that began from `mode`: its own checkpoints are further on
        return own[-1]
    if not os.path.isdir(mode):
        raise FileNotFoundError(f"checkpoint.resume: {mode!r} is not a checkpoint directory")
    return mode
