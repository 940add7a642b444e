"""Helpers the sft / dpo / cp recipes share: runtime detection, process-group setup, data, model and
TRL-config building.

Owns:
- `Runtime` / `setup_runtime`: which accelerator (ORCHESTRATE_ACCELERATOR, else CUDA availability), which
  distributed engine accelerate launched us with (DDP, DeepSpeed, FSDP), and the process group with an
  explicit timeout on CPU (transformers ignores `ddp_timeout` when `use_cpu=True`).
- `load_split`: local JSONL/JSON/parquet files or a hub dataset name.
- `build_config`: the `trainer:` block -> SFTConfig/DPOConfig, plus the few defaults the recipes add
  (CPU switches, tiny-model switches) only where the user said nothing.
- `resolve_resume`: checkpoint.resume -> a path or None.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from recipes.tiny import BUILTIN_MODELS, resolve_model_path

DEFAULT_CPU_PG_TIMEOUT_S = 300


class RecipeError(RuntimeError):
    """A recipe cannot run as configured; the message says why and what to change."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Runtime:
    accelerator: str  # cpu | gpu
    engine: str  # ddp | deepspeed | fsdp | none
    world_size: int
    rank: int
    pg_timeout_s: int

    @property
    def cpu(self) -> bool:
        return self.accelerator == "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect_runtime(trainer_cfg: dict | None = None) -> Runtime:
    trainer_cfg = trainer_cfg or {}
    acc = os.environ.get("ORCHESTRATE_ACCELERATOR", "").strip().lower()
    if acc not in ("cpu", "gpu"):
        import torch

        acc = "gpu" if torch.cuda.is_available() else "cpu"
    if _flag("ACCELERATE_USE_DEEPSPEED") or trainer_cfg.get("deepspeed"):
        engine = "deepspeed"
    elif _flag("ACCELERATE_USE_FSDP") or trainer_cfg.get("fsdp"):
        engine = "fsdp"
    else:
        engine = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "none"
    timeout = int(trainer_cfg.get("ddp_timeout") or os.environ.get("ORCHESTRATE_PG_TIMEOUT")
                  or DEFAULT_CPU_PG_TIMEOUT_S)
    return Runtime(acc, engine, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")), timeout)


def setup_runtime(trainer_cfg: dict | None = None) -> Runtime:
    """Detect the runtime and, on CPU, create the gloo process group ourselves (explicit timeout).

    accelerate/transformers later find the group already initialised and reuse it.
    """
    rt = detect_runtime(trainer_cfg)
    if rt.cpu and rt.engine == "fsdp":
        if os.environ.get("FSDP_VERSION", "1") != "2":
            raise RecipeError(
                "FSDP1 was requested (profile fsdp1) on CPU. accelerate 1.15 silently drops the FSDP plugin on "
                "CPU-only runs and would train plain DDP without sharding anything; this recipe refuses instead of "
                "pretending. On CPU use profile fsdp2 (really sharded, see recipes.fsdp_cpu), zero2/zero3, or "
                "multi_gpu; FSDP1 needs GPUs.")
        from recipes import fsdp_cpu

        fsdp_cpu.enable()
    if rt.cpu:
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    if rt.world_size > 1 and rt.cpu:
        import torch.distributed as dist

        if rt.engine == "deepspeed":
            import deepspeed

            # DeepSpeed's comm layer must be up (on gloo) before any model or ref model is built under ZeRO-3.
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                                       timeout=timedelta(seconds=rt.pg_timeout_s), verbose=False)
        elif not dist.is_initialized():
            dist.init_process_group(backend="gloo", timeout=timedelta(seconds=rt.pg_timeout_s))
    from recipes import phases

    phases.mark("dist")
    return rt


# ---------------------------------------------------------------------------------------------- data

_LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_split(data_cfg: dict, split: str):
    """One split of `data.path` (local files or a hub dataset name), cut to `data.max_samples`."""
    from datasets import load_dataset

    paths = data_cfg["path"]
    paths = [paths] if isinstance(paths, str) else list(paths)
    local = [Path(p) for p in paths]
    if all(p.exists() for p in local):
        files = []
        for p in local:
            files += sorted(str(f) for f in p.rglob("*") if f.suffix in _LOCAL_BUILDERS) if p.is_dir() else [str(p)]
        kinds = {_LOCAL_BUILDERS.get(Path(f).suffix) for f in files}
        if len(kinds) != 1 or None in kinds:
            raise RecipeError(f"data.path: cannot tell the format of {files} (use one of {sorted(_LOCAL_BUILDERS)})")
        ds = load_dataset(kinds.pop(), data_files=files, split=split)
    elif len(paths) == 1:
        ds = load_dataset(paths[0], data_cfg.get("config"), split=split)
    else:
        missing = [str(p) for p in local if not p.exists()]
        raise RecipeError(f"data.path: local files not found: {missing}")
    n = data_cfg.get("max_samples")
    if n is not None and int(n) < len(ds):
        ds = ds.select(range(int(n)))
    return ds


def load_datasets(data_cfg: dict):
    train = load_split(data_cfg, data_cfg.get("split") or "train")
    ev = data_cfg.get("eval_split")
    return train, (load_split(data_cfg, ev) if ev else None)


# --------------------------------------------------------------------------------------- model / config

def model_path(cfg: dict) -> str:
    return resolve_model_path(str(cfg["model"]["name_or_path"]))


def model_init_kwargs(model_cfg: dict) -> dict[str, Any]:
    kw: dict[str, Any] = {"dtype": model_cfg.get("dtype") or "auto",
                          "trust_remote_code": bool(model_cfg.get("trust_remote_code", False))}
    if model_cfg.get("attn_implementation"):
        kw["attn_implementation"] = model_cfg["attn_implementation"]
    return kw


def load_tokenizer(cfg: dict):
    from transformers import AutoTokenizer

    src = cfg.get("tokenizer") or cfg["model"]["name_or_path"]
    tok = AutoTokenizer.from_pretrained(resolve_model_path(str(src)),
                                        trust_remote_code=bool(cfg["model"].get("trust_remote_code", False)))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def check_liger(trainer_cfg: dict) -> None:
    if trainer_cfg.get("use_liger_kernel") and importlib.util.find_spec("liger_kernel") is None:
        raise RecipeError("trainer.use_liger_kernel is true but the `liger-kernel` package is not installed on this "
                          "node (pip install liger-kernel; it needs a GPU with Triton). "
                          "Set it to false to run without.")


def default_report_to() -> str:
    """The recipes' trackers where `trainer.report_to` is not given: MLflow where the ranks have a tracking store
    (MLFLOW_TRACKING_URI set, the mlflow package installed; one run per job, docs/tracking.md), else none."""
    if os.environ.get("MLFLOW_TRACKING_URI") and importlib.util.find_spec("mlflow") is not None:
        return "mlflow"
    return "none"


def build_config(config_cls, cfg: dict, rt: Runtime, extra_defaults: dict | None = None):
    """`trainer:` -> a TRL config. User keys pass through unchanged; defaults only fill silence."""
    t = dict(cfg.get("trainer") or {})
    check_liger(t)
    t.setdefault("output_dir", os.path.abspath(os.path.join("outputs", str(cfg.get("recipe", "run")))))
    t["output_dir"] = os.path.abspath(t["output_dir"])
    tiny = str(cfg["model"]["name_or_path"]) in BUILTIN_MODELS
    defaults: dict[str, Any] = dict(extra_defaults or {})
    defaults.setdefault("report_to", default_report_to())
    fsdp_checkpoints = os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "").lower() == "true"  # set by accelerate
    if (tiny or fsdp_checkpoints) and "gradient_checkpointing" not in t:
        # TRL defaults it on: pointless for tiny models, and under an FSDP profile that checkpoints activations
        # itself transformers refuses both at once (a value the user gives is checked at plan time instead)
        defaults.setdefault("activation_checkpointing", False)
    if not sys.stderr.isatty():
        defaults.setdefault("disable_tqdm", True)  # progress bars garble node logs; the loss lines stay
    if rt.cpu:
        if "fp16" not in t:
            defaults.setdefault("bf16", False)  # TRL defaults bf16 on; on CPU that is slow autocast
        defaults.setdefault("dataloader_pin_memory", False)
        if rt.engine != "deepspeed":
            t["use_cpu"] = True
        elif rt.world_size > 1:
            # accelerate drops DeepSpeed when cpu=True, so DeepSpeed on CPU keeps use_cpu off (the device is the CPU
            # anyway) and names gloo: without a backend accelerate counts one process and DeepSpeed's batch check fails.
            t.setdefault("ddp_backend", "gloo")
    for k, v in defaults.items():
        t.setdefault(k, v)
    if "model_init_kwargs" not in t:
        t["model_init_kwargs"] = model_init_kwargs(cfg["model"])
    return config_cls(**as_parsed(config_cls, older_names(config_cls, t)))


def as_parsed(config_cls, t: dict) -> dict:
    """An integer given for a float field becomes a float, as HfArgumentParser reads it from a command line: a YAML
    `adam_beta1: 0` would reach torch's Adam as an int, which it refuses ("betas must be either both floats or both
    Tensors") although the plan took the value (orchestrator.core.trainerranges)."""
    import dataclasses

    from orchestrator.trlfields import field_kinds

    kinds = field_kinds(config_cls) if dataclasses.is_dataclass(config_cls) else {}
    return {k: float(v) if type(v) is int and kinds.get(k) in ("float", "opt_float") else v for k, v in t.items()}


def older_names(config_cls, t: dict) -> dict:
    """Keys the installed transformers does not have yet, under the older field that means the same
    (orchestrator.core.spec.TRAINER_ALIASES: `activation_checkpointing` is `gradient_checkpointing` before 5.2x)."""
    import dataclasses

    from orchestrator.core.spec import TRAINER_ALIASES

    fields = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else None
    if fields is None:
        return t
    out = dict(t)
    for new, old in TRAINER_ALIASES.items():
        if new in out and new not in fields and old in fields:
            out.setdefault(old, out.pop(new))
    return out


def resolve_resume(cfg: dict, output_dir: str) -> str | None:
    """checkpoint.resume -> the checkpoint to resume from (orchestrate_checkpoint.resume_from: the zero-code hooks'
    rule too; a restart of a job begun from a path goes on from the job's own latest checkpoint)."""
    from orchestrator.node.hooks.orchestrate_checkpoint import resume_from, whose

    job = os.environ.get("ORCHESTRATE_JOB_ID", "").strip()
    try:
        path = resume_from((cfg.get("checkpoint") or {}).get("resume", "auto"), output_dir, job)
    except FileNotFoundError as e:
        raise RecipeError(str(e)) from None
    if path and int(os.environ.get("RANK", "0") or 0) == 0:
        print(f"orchestrate recipe: resuming from {path}{whose(path, job)}", file=sys.stderr, flush=True)
    return path
