"""Your own training script, as you would write it without orchestrate (it imports nothing of orchestrate):
causal-LM fine-tuning with the Hugging Face Trainer on chat `messages` JSONL.

Run alone:           accelerate launch examples/own_code/train.py --model_name_or_path DIR --data FILE ...
Run by orchestrate:  orchestrate submit examples/own_code/my_job.yaml --nodes 2
Every option is a field of `ScriptArgs` below or of transformers' TrainingArguments (HfArgumentParser), so
orchestrate checks the TrainingArguments values and prints the effective batch before anything starts.
"""

import json
import os
from dataclasses import dataclass

from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, HfArgumentParser,
                          Trainer, TrainingArguments)


@dataclass
class ScriptArgs:
    model_name_or_path: str
    data: str  # a JSONL file of {"messages": [...]} rows
    max_length: int = 256


def main() -> None:
    script, args = HfArgumentParser((ScriptArgs, TrainingArguments)).parse_args_into_dataclasses()
    tok = AutoTokenizer.from_pretrained(script.model_name_or_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ds = load_dataset("json", data_files=script.data, split="train")

    def tokenize(example):
        text = tok.apply_chat_template(example["messages"], tokenize=False)
        return tok(text, truncation=True, max_length=script.max_length)

    ds = ds.map(tokenize, remove_columns=ds.column_names)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    out = trainer.train()
    trainer.save_model()
    if int(os.environ.get("RANK", "0")) == 0:
        print("TRAIN_RESULT " + json.dumps({"global_step": trainer.state.global_step,
                                            "training_loss": out.training_loss, "output_dir": args.output_dir}),
              flush=True)


if __name__ == "__main__":
    main()
