"""A user's own Hugging Face Trainer script (never imports orchestrator): causal-LM fine-tuning of a local model on
chat `messages` JSONL, on CPU. Every rank prints `USER_PARAMS {"rank", "sha", "world"}` when training returns (its
parameters' hash: equal on every rank iff gradients were synced).

usage: user_train.py MODEL_DIR DATA_JSONL OUTPUT_DIR MAX_STEPS [RAISE_ON_RANK1_AT_STEP | hang:N]

With the fifth argument, rank 1 raises `RuntimeError: loss is nan at step N` from a callback at that step, as a
user's own check would; `hang:N`: rank 1's data collator never returns from its N-th batch (a data loader stuck).
"""

import hashlib
import json
import os
import sys
import time

from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainerCallback, TrainingArguments)


class NanCheck(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at and os.environ.get("RANK") == "1":
            raise RuntimeError(f"loss is nan at step {state.global_step}")


class StuckCollator:
    """The data collator, except that on rank 1 its `at`-th batch never comes (a data loader stuck on a read)."""

    def __init__(self, collate, at: int) -> None:
        self.collate, self.at, self.calls = collate, at, 0

    def __call__(self, features):
        self.calls += 1
        if self.calls == self.at and os.environ.get("RANK") == "1":
            sys.stdout.write(f"USER_STUCK rank 1 in its data loader at batch {self.calls}\n")
            sys.stdout.flush()
            time.sleep(3600)
        return self.collate(features)


def main() -> None:
    model_dir, data, output_dir, max_steps = sys.argv[1:5]
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ds = load_dataset("json", data_files=data, split="train")
    ds = ds.map(lambda ex: tok(tok.apply_chat_template(ex["messages"], tokenize=False), truncation=True,
                               max_length=128), remove_columns=ds.column_names)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = TrainingArguments(output_dir=output_dir, max_steps=int(max_steps), per_device_train_batch_size=4,
                             learning_rate=3e-3, logging_steps=1, save_strategy="no", use_cpu=True, report_to="none",
                             disable_tqdm=True, dataloader_num_workers=0, seed=42)
    fault = sys.argv[5] if len(sys.argv) > 5 else ""
    collate = DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=StuckCollator(collate, int(fault[5:])) if fault.startswith("hang:") else collate,
                      callbacks=[NanCheck(int(fault))] if fault.isdigit() else None)
    trainer.train()
    sha = hashlib.sha256()
    for p in model.parameters():
        sha.update(p.detach().cpu().numpy().tobytes())
    # one write per line, so two ranks' lines (unbuffered, one shared stdout) cannot interleave
    sys.stdout.write("USER_PARAMS " + json.dumps({"rank": int(os.environ.get("RANK", "0")), "sha": sha.hexdigest()[:16],
                                                  "world": int(os.environ.get("WORLD_SIZE", "1"))}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
