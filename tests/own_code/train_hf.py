"""A user's own Hugging Face Trainer script, as a user would write it: it knows nothing of orchestrate (no
orchestrator / recipes import). Causal-LM fine-tuning of a local model on chat `messages` JSONL, on CPU.

usage: train_hf.py MODEL_DIR DATA_JSONL OUTPUT_DIR MAX_STEPS [SAVE_STEPS]
REPORT_TO (environment, default none): the Trainer's report_to, e.g. tensorboard or tensorboard,mlflow.
Prints `USER_RESULT {json}` from rank 0 when training returns.
"""

import json
import os
import sys

from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)


def main() -> None:
    model_dir, data, output_dir, max_steps = sys.argv[1:5]
    save_steps = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ds = load_dataset("json", data_files=data, split="train")

    def tokenize(example):
        text = tok.apply_chat_template(example["messages"], tokenize=False)
        return tok(text, truncation=True, max_length=128)

    ds = ds.map(tokenize, remove_columns=ds.column_names)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = TrainingArguments(
        output_dir=output_dir, max_steps=int(max_steps), per_device_train_batch_size=4, learning_rate=3e-3,
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=True, report_to=os.environ.get("REPORT_TO", "none").split(","), disable_tqdm=True,
        dataloader_num_workers=0, seed=42, include_num_input_tokens_seen="non_padding")
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    out = trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        print("USER_RESULT " + json.dumps({"global_step": trainer.state.global_step,
                                           "training_loss": out.training_loss}), flush=True)


if __name__ == "__main__":
    main()
