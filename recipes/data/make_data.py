"""Deterministic generator of the shipped demo data (`sft_tiny.jsonl`, `dpo_tiny.jsonl`).

Small synthetic tasks (add numbers, reverse a word, uppercase, count letters, ...) in chat form.
SFT rows: {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}.
DPO rows (conversational): {"prompt": [user msg], "chosen": [assistant msg], "rejected": [assistant msg]}.
Run `python recipes/data/make_data.py` to regenerate; output is byte-identical for a given seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 0
WORDS = ["apple", "river", "stone", "cloud", "tiger", "orange", "planet", "garden", "silver", "window",
         "number", "letter", "forest", "candle", "rocket", "pepper", "mirror", "bridge", "yellow", "winter"]


def task(rng: random.Random) -> tuple[str, str, str]:
    """One (question, right answer, plausible wrong answer)."""
    kind = rng.randrange(6)
    w = rng.choice(WORDS)
    if kind == 0:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", f"{a} + {b} = {a + b + rng.randint(1, 9)}."
    if kind == 1:
        return f"Reverse the word '{w}'.", f"The reverse of '{w}' is '{w[::-1]}'.", f"The reverse of '{w}' is '{w}'."
    if kind == 2:
        return f"Write '{w}' in uppercase.", f"In uppercase: {w.upper()}.", f"In uppercase: {w}."
    if kind == 3:
        return (f"How many letters are in '{w}'?", f"'{w}' has {len(w)} letters.",
                f"'{w}' has {len(w) + rng.randint(1, 3)} letters.")
    if kind == 4:
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", f"{a} times {b} is {a + b}."
    c = rng.choice(w)
    return (f"How many times does '{c}' appear in '{w}'?", f"'{c}' appears {w.count(c)} times in '{w}'.",
            f"'{c}' appears {w.count(c) + 1} times in '{w}'.")


def make(n_sft: int = 400, n_dpo: int = 300, seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    sft, dpo = [], []
    for _ in range(n_sft):
        q, good, _bad = task(rng)
        sft.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": good}]})
    for _ in range(n_dpo):
        q, good, bad = task(rng)
        dpo.append({"prompt": [{"role": "user", "content": q}],
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}]})
    return sft, dpo


def write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sft, dpo = make()
    write_jsonl(sft, here / "sft_tiny.jsonl")
    write_jsonl(dpo, here / "dpo_tiny.jsonl")
    print(f"wrote {len(sft)} sft rows, {len(dpo)} dpo rows to {here}")
