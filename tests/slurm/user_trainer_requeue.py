"""A user's own Hugging Face Trainer script, as a user would write it: it knows nothing of orchestrate (no
orchestrator / recipes import, no checkpoint or signal handling of its own, `save_strategy="no"`). Causal-LM
fine-tuning of a local model on chat `messages` JSONL, on CPU. Used by tests/slurm/test_own_code_slurm.py (a
`scontrol requeue` mid-run).

usage: user_trainer_requeue.py MODEL_DIR DATA_JSONL OUTPUT_DIR MAX_STEPS [STEP_SLEEP_S]

Each rank prints (one write per line, so two ranks' lines cannot interleave):
- `USER_ENV {...}` at start: its rank, SLURM's job id and restart count, and the W&B variables it sees
  (WANDB_RUN_ID / WANDB_RESUME / WANDB_RUN_GROUP / WANDB_NAME; a tracker would read exactly these);
- `USER_BEGIN {...}` at train begin: the Trainer's global step then (> 0 when it resumed from a checkpoint);
- `USER_FIRST_STEP {...}` after the first optimizer step this process ran;
- `USER_DONE {...}` when train() returned: the final global step.
STEP_SLEEP_S (default 0) paces each step, so that a test can act while it trains.
"""

import json
import os
import sys
import time

from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainerCallback, TrainingArguments)

WANDB_KEYS = ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_RUN_GROUP", "WANDB_NAME")


def say(tag: str, **fields) -> None:
    fields = {"rank": int(os.environ.get("RANK", "0")), "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
              **fields}
    sys.stdout.write(f"{tag} {json.dumps(fields, sort_keys=True)}\n")
    sys.stdout.flush()


class Report(TrainerCallback):
    def __init__(self, step_sleep: float):
        self.step_sleep = step_sleep
        self.first = True

    def on_train_begin(self, args, state, control, **kw):
        say("USER_BEGIN", global_step=state.global_step, max_steps=state.max_steps)

    def on_step_end(self, args, state, control, **kw):
        if self.first:
            self.first = False
            say("USER_FIRST_STEP", global_step=state.global_step)
        if self.step_sleep:
            time.sleep(self.step_sleep)


def main() -> None:
    model_dir, data, output_dir, max_steps = sys.argv[1:5]
    step_sleep = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    say("USER_ENV", job=os.environ.get("SLURM_JOB_ID"), world=int(os.environ.get("WORLD_SIZE", "1")),
        **{k: os.environ.get(k) for k in WANDB_KEYS})
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ds = load_dataset("json", data_files=data, split="train")
    ds = ds.map(lambda ex: tok(tok.apply_chat_template(ex["messages"], tokenize=False), truncation=True,
                               max_length=64), remove_columns=ds.column_names)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = TrainingArguments(output_dir=output_dir, max_steps=int(max_steps), per_device_train_batch_size=2,
                             learning_rate=3e-3, logging_steps=1, save_strategy="no", use_cpu=True, report_to="none",
                             disable_tqdm=True, dataloader_num_workers=0, seed=42)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[Report(step_sleep)])
    trainer.train()
    say("USER_DONE", global_step=trainer.state.global_step)


if __name__ == "__main__":
    main()
