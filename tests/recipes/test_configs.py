"""Every shipped recipe YAML follows the contract's schema and its `trainer:` block is accepted by TRL."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "recipes" / "configs").glob("*.yaml"))
TOP = {"recipe", "model", "tokenizer", "data", "trainer", "checkpoint", "launch"}
SUB = {
    "model": {"name_or_path", "dtype", "attn_implementation", "trust_remote_code"},
    "data": {"path", "config", "split", "eval_split", "max_samples"},
    "checkpoint": {"resume", "save_on_signal"},
    "launch": {"profile", "nodes", "procs_per_node", "mixed_precision", "parallelism", "env", "secret_env", "port"},
}
PROFILES = {"multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2", "context_parallel", "alst_ulysses"}


def test_there_are_configs():
    names = {p.stem for p in CONFIGS}
    assert {"sft_tiny", "dpo_tiny", "sft_tiny_packing", "sft_tiny_zero2", "sft_tiny_zero3",
            "sft_tiny_fsdp2"} <= names
    assert any(n.startswith("cp_") for n in names)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_schema_and_trl_accepts_trainer_block(path, tmp_path, monkeypatch):
    from trl import DPOConfig, SFTConfig

    cfg = yaml.safe_load(path.read_text())
    assert set(cfg) == TOP
    for key, fields in SUB.items():
        assert set(cfg[key]) <= fields, (key, set(cfg[key]) - fields)
    assert set(cfg["launch"]["parallelism"]) <= {"dp_replicate", "dp_shard", "tp", "cp", "sp"}
    assert cfg["recipe"] in ("sft", "dpo", "cp") and cfg["launch"]["profile"] in PROFILES
    assert cfg["model"]["dtype"] in ("auto", "float32", "bfloat16", "float16")
    if cfg["recipe"] == "cp":
        par = cfg["launch"]["parallelism"]
        assert (par.get("cp") or 1) > 1 or (par.get("sp") or 1) > 1
        assert cfg["launch"]["profile"] in ("context_parallel", "alst_ulysses")
    # TRL validates the trainer block (on CPU here, so GPU-only precision flags are switched off)
    t = {**cfg["trainer"], "output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "fp16": False}
    (DPOConfig if cfg["recipe"] == "dpo" else SFTConfig)(**t)
