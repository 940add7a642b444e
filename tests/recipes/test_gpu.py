"""Context parallelism (ring attention on FSDP2) and ALST/Ulysses (DeepSpeed) need >= 2 CUDA GPUs:
these tests skip elsewhere. On CPU the cp recipe's clear refusal is tested in test_single_process."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable torch/CUDA means no GPUs here
        return 0


@pytest.mark.skipif(_gpus() < 2, reason="needs >= 2 CUDA GPUs")
@pytest.mark.parametrize("profile,par", [("context_parallel", {"cp": 2}), ("alst_ulysses", {"sp": 2})])
def test_cp_recipe_trains_on_two_gpus(profile, par, recipe_cfg, launch):
    cfg = recipe_cfg("sft_tiny", max_steps=10, bf16=True, max_length=512)
    cfg["recipe"] = "cp"
    cfg["model"]["dtype"] = "bfloat16"
    cfg["launch"]["profile"] = profile
    cfg["launch"]["parallelism"].update(par)
    rc, res, out = launch(cfg, profile, nprocs=2, env={"ORCHESTRATE_ACCELERATOR": "gpu"}, timeout=600)
    assert rc == 0 and res is not None, out[-4000:]
    assert res["global_step"] == 10 and res["final_loss"] < res["first_loss"]
    assert res["runtime"]["accelerator"] == "gpu"
