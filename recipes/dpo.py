"""Direct preference optimisation on TRL's DPOTrainer: `main(cfg) -> dict`.

TRL 1.16's DPOConfig has `max_length` (and `truncation_mode`) but no max_prompt_length /
max_completion_length any more; set them in `trainer:` only if your TRL has them (TRL validates).
Reference model: TRL builds it from the policy's path; under DeepSpeed ZeRO-3 it is sharded like the
policy. On CPU the DeepSpeed comm layer is initialised on gloo before any model is built
(`recipes.common.setup_runtime`), which is what ZeRO-3 + a TRL-built reference model needs.
"""

from __future__ import annotations

from typing import Any

from recipes.common import build_config, load_datasets, load_tokenizer, model_path, setup_runtime
from recipes.runner import train_and_report, wrap_collator


def main(cfg: dict) -> dict[str, Any]:
    from trl import DPOConfig, DPOTrainer

    rt = setup_runtime(cfg.get("trainer"))
    args = build_config(DPOConfig, cfg, rt)
    tokenizer = load_tokenizer(cfg)
    train, ev = load_datasets(cfg["data"])
    trainer = DPOTrainer(model=model_path(cfg), args=args, train_dataset=train, eval_dataset=ev,
                         processing_class=tokenizer)
    counter = wrap_collator(trainer, tokenizer.pad_token_id)
    return train_and_report(trainer, cfg, counter, rt)
