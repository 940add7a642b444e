"""Long-context SFT with context / sequence parallelism: `main(cfg) -> dict`.

Two launch profiles, both configured through accelerate's ParallelismConfig (the profile's accelerate
YAML sets PARALLELISM_CONFIG_* for every rank; `launch.parallelism` in the recipe is the fallback):
- `context_parallel`: ring attention on FSDP2 (`cp_size` > 1, `cp_backend: torch`), SDPA attention,
  no packing (it needs a block-diagonal mask that CP drops), sequences padded to a multiple of 2*cp.
- `alst_ulysses`: DeepSpeed ALST/Ulysses sequence parallelism (`sp_size` > 1, `sp_backend: deepspeed`),
  SDPA or flash attention, heads divisible by sp, sequences padded to a multiple of sp.
Neither runs on CPU (PyTorch has no CPU sharding rule for SDPA's flash kernel, and accelerate refuses
ParallelismConfig without FSDP2 on GPUs): on CPU this recipe stops with a clear error before loading
anything. Everything else (data, callbacks, resume, result) is the SFT recipe's.
"""

from __future__ import annotations

import os
from typing import Any

from recipes.common import RecipeError, detect_runtime, model_path
from recipes.tiny import BUILTIN_MODELS


def parallel_sizes(cfg: dict) -> tuple[int, int]:
    """(cp, sp) from the launcher's env, else from `launch.parallelism`."""
    par = ((cfg.get("launch") or {}).get("parallelism") or {})

    def size(env: str, key: str) -> int:
        v = os.environ.get(env)
        return int(v) if v not in (None, "", "None") else int(par.get(key) or 1)

    return size("PARALLELISM_CONFIG_CP_SIZE", "cp"), size("PARALLELISM_CONFIG_SP_SIZE", "sp")


def _num_heads(cfg: dict) -> int | None:
    name = str(cfg["model"]["name_or_path"])
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]["num_attention_heads"]
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path(cfg), trust_remote_code=bool(cfg["model"].get("trust_remote_code")))
    return getattr(c.get_text_config(), "num_attention_heads", None)


def plan(cfg: dict, rt) -> dict[str, Any]:
    """Validate the cp/sp setup and return the SFT defaults it needs. Raises RecipeError, loads no weights."""
    cp, sp = parallel_sizes(cfg)
    t = cfg.get("trainer") or {}
    attn = (cfg.get("model") or {}).get("attn_implementation")
    if cp <= 1 and sp <= 1:
        raise RecipeError("recipe cp needs context or sequence parallelism: use launch.profile context_parallel "
                          "(parallelism.cp > 1) or alst_ulysses (parallelism.sp > 1); for plain SFT use recipe sft")
    if cp > 1 and sp > 1:
        raise RecipeError(f"recipe cp: choose context parallelism (cp={cp}) or Ulysses (sp={sp}), not both")
    if rt.cpu:
        what = f"context parallelism (cp={cp}, ring attention on FSDP2)" if cp > 1 else \
            f"ALST/Ulysses sequence parallelism (sp={sp}, DeepSpeed)"
        raise RecipeError(f"{what} needs CUDA GPUs and cannot run on CPU: accelerate only accepts ParallelismConfig "
                          "with FSDP2/DeepSpeed on GPUs and PyTorch has no CPU sharding rule for SDPA. Run it on a "
                          "GPU cluster, or use recipe sft for CPU runs.")
    if t.get("packing") or t.get("padding_free"):
        raise RecipeError("recipe cp: packing / padding_free cannot be combined with context or sequence "
                          "parallelism (the block-diagonal mask is dropped); set trainer.packing: false")
    if rt.world_size % (cp * sp) != 0:
        raise RecipeError(f"recipe cp: world size {rt.world_size} is not a multiple of cp*sp = {cp * sp}")
    if cp > 1:
        if rt.engine != "fsdp" or os.environ.get("FSDP_VERSION", "2") != "2":
            raise RecipeError("context parallelism runs on FSDP2 only: use launch.profile context_parallel")
        if attn not in (None, "sdpa"):
            raise RecipeError(f"context parallelism needs model.attn_implementation: sdpa (got {attn!r})")
        return {"pad_to_multiple_of": 2 * cp, "model_init_kwargs_attn": "sdpa"}
    if rt.engine != "deepspeed":
        raise RecipeError("ALST/Ulysses sequence parallelism runs on DeepSpeed only: use launch.profile alst_ulysses")
    if attn in ("eager", "flex_attention"):
        raise RecipeError(f"ALST/Ulysses needs sdpa or flash attention, not {attn!r}")
    heads = _num_heads(cfg)
    if heads is not None and heads % sp:
        raise RecipeError(f"ALST/Ulysses: num_attention_heads {heads} is not divisible by sp={sp}")
    return {"pad_to_multiple_of": sp, "model_init_kwargs_attn": attn or "sdpa"}


def main(cfg: dict) -> dict[str, Any]:
    rt = detect_runtime(cfg.get("trainer"))
    needs = plan(cfg, rt)
    cfg = dict(cfg, model=dict(cfg["model"], attn_implementation=needs.pop("model_init_kwargs_attn")))
    from recipes import sft
    from recipes.common import setup_runtime
    from recipes.runner import train_and_report, wrap_collator

    rt = setup_runtime(cfg.get("trainer"))
    trainer, tokenizer, rt = sft.build_trainer(cfg, rt, extra_defaults={**needs, "per_device_train_batch_size": 1})
    counter = wrap_collator(trainer, tokenizer.pad_token_id)
    return train_and_report(trainer, cfg, counter, rt)
