"""Zero-code hooks into a user's ranks (issue #12, "Bring your own training code").

This directory is put FIRST on the ranks' PYTHONPATH by the node agent (`HOOKS_DIR`); its files are then
top-level modules in every rank, and none of them imports anything but the standard library at start-up:

- `sitecustomize.py`: runs in every Python process started with that PYTHONPATH. Active only in a rank of an
  orchestrate launch (ORCHESTRATE_HEARTBEAT_DIR set and RANK or LOCAL_RANK present; the torchrun / accelerate
  parent has neither), it installs `orchestrate_hooks` and then chains to the user's own sitecustomize.py,
  if one is further on sys.path.
- `orchestrate_hooks.py`: a meta-path finder that acts when the user's code imports `torch.optim.optimizer`
  (one "step" record per optimizer step) or `transformers.trainer` (heartbeat + save-on-signal callbacks on every
  Trainer, automatic resume) or `mlflow`; the "boot" mark.
- `orchestrate_tracking.py`: one tracker run per job across its attempts (W&B run id from the job id, TensorBoard
  log dir, the MLflow run found by its `orchestrate.job_id` tag).
- `orchestrate_trainer.py`: the Trainer callbacks (shared with the built-in recipes).
- `orchestrate_heartbeat.py`: the one writer of heartbeat records, and `beat(step, loss=...)` for loops that
  step no torch optimizer.
- `orchestrate_world.py`: a rank never trains alone: accelerate told about a CPU cluster at start-up, and a rank whose
  distributed state is not the launch's world stopped at its first optimizer step (`TrainsAlone`).
- `orchestrate_checkpoint.py`: each checkpoint's record of the job that wrote it, and which checkpoint a rank
  resumes from (shared with the built-in recipes and read by the submitter).

Environment (set by the node agent for the ranks):
  ORCHESTRATE_HEARTBEAT_DIR   RUN_DIR/heartbeats; unset = every hook is off
  ORCHESTRATE_RESUME          "auto" / "latest": a Trainer.train() called without resume_from_checkpoint resumes
                              from the latest checkpoint-* in args.output_dir (if any); a path: from that checkpoint
                              (a restart: from the job's own latest one); unset / "never": the call is left alone
  ORCHESTRATE_SAVE_ON_SIGNAL  "0" turns the Trainer save-on-signal off (default on)
  ORCHESTRATE_SAVE_ON_EACH_NODE "1" sets TrainingArguments.save_on_each_node (SSH hosts without a shared filesystem)
  ORCHESTRATE_JOB_ID          W&B defaults (WANDB_RUN_ID, WANDB_RESUME=allow, WANDB_RUN_GROUP, WANDB_NAME) where unset,
                              the MLflow run rank 0 resumes (its tag orchestrate.job_id);
                              the job named in each saved checkpoint's orchestrate.json
  ORCHESTRATE_HOOKS           "0" turns all of it off (the chained user sitecustomize still runs)
  ORCHESTRATE_HEARTBEAT_FLUSH_S  buffering of optimizer-hook / beat() step records (default 0.5 s)
"""

from pathlib import Path

HOOKS_DIR = str(Path(__file__).resolve().parent)
