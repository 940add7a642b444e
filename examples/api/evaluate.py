"""Evaluate a trained causal LM on a chat JSONL file: the mean next-token loss over the first --samples conversations.

A plain script that knows nothing of orchestrate (docs/api.md runs it as the "evaluate" step after a training job):

    python examples/api/evaluate.py --model outputs/api_train/checkpoint-4 --data recipes/data/sft_tiny.jsonl

Prints one line `EVAL {"loss": ..., "samples": N, "model": ...}` (rank 0).
"""

import argparse
import itertools
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--samples", type=int, default=16)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    with open(args.data) as f:
        rows = [json.loads(line) for line in itertools.islice(f, args.samples)]
    losses = []
    with torch.no_grad():
        for row in rows:
            text = tok.apply_chat_template(row["messages"], tokenize=False)
            ids = tok(text, return_tensors="pt").input_ids
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    if os.environ.get("RANK", "0") == "0":
        print("EVAL " + json.dumps({"loss": sum(losses) / len(losses), "samples": len(losses), "model": args.model}),
              flush=True)


if __name__ == "__main__":
    main()
