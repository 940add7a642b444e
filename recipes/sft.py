"""Supervised fine-tuning on TRL's SFTTrainer: `main(cfg) -> dict`.

Owns only the SFT-specific wiring; everything shared (runtime, data, config defaults, callbacks,
resume, result) lives in `recipes.common` / `recipes.runner`. Packing (TRL's BFD, padding-free),
truncation (`max_length`), completion-only / assistant-only loss, `pad_to_multiple_of` and
`use_liger_kernel` are TRL options set in the recipe's `trainer:` block and pass through unchanged.
"""

from __future__ import annotations

from typing import Any

from recipes.common import build_config, load_datasets, load_tokenizer, model_path, setup_runtime
from recipes.runner import train_and_report, wrap_collator


def build_trainer(cfg: dict, rt=None, extra_defaults: dict | None = None):
    """(trainer, tokenizer, runtime) for `cfg`; `extra_defaults` fill `trainer:` keys the user left out (used by cp)."""
    from trl import SFTConfig, SFTTrainer

    rt = rt or setup_runtime(cfg.get("trainer"))
    args = build_config(SFTConfig, cfg, rt, extra_defaults)
    tokenizer = load_tokenizer(cfg)
    train, ev = load_datasets(cfg["data"])
    trainer = SFTTrainer(model=model_path(cfg), args=args, train_dataset=train, eval_dataset=ev,
                         processing_class=tokenizer)
    return trainer, tokenizer, rt


def main(cfg: dict) -> dict[str, Any]:
    trainer, tokenizer, rt = build_trainer(cfg)
    counter = wrap_collator(trainer, tokenizer.pad_token_id)
    return train_and_report(trainer, cfg, counter, rt)
