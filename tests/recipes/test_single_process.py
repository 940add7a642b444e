"""Single-process recipes, in-process `main(cfg)`: SFT and DPO train, heartbeats, packing, resume with
optimizer state, clear errors (cp on CPU, Liger missing)."""

from __future__ import annotations

import importlib.util
import json

import pytest

CONTRACT_FIELDS = {"t", "rank", "host", "step", "max_steps", "loss", "tokens", "event"}


def test_sft_trains_and_writes_heartbeats(recipe_cfg, tmp_path, monkeypatch):
    from recipes import sft

    hb = tmp_path / "hb"
    monkeypatch.setenv("ORCHESTRATE_HEARTBEAT_DIR", str(hb))
    monkeypatch.setenv("ORCHESTRATE_ACCELERATOR", "cpu")
    res = sft.main(recipe_cfg("sft_tiny", logging_steps=1))
    assert res["global_step"] == 30 and res["world_size"] == 1
    assert res["final_loss"] < res["first_loss"] - 2.0, res["losses"]
    assert res["runtime"]["use_cpu"] is True
    lines = [json.loads(x) for x in (hb / "rank0.jsonl").read_text().splitlines()]
    assert all(set(r) - {"compute_s"} == CONTRACT_FIELDS for r in lines)
    events = [r["event"] for r in lines]
    assert events[0] == "dist" and lines[0]["step"] == 0  # start-up phase mark (in-process: no "boot")
    assert events[1] == "start" and events[-1] == "end" and events.count("step") == 30
    steps = [r for r in lines if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 31)) and all(r["max_steps"] == 30 for r in steps)
    assert steps[-1]["tokens"] == res["tokens"] > 0 and isinstance(steps[0]["loss"], float)
    # heartbeat cost, self-measured by the callback: well under 1% of the training time
    assert res["heartbeat_overhead_frac"] < 0.01, res["heartbeat_overhead_frac"]
    print("heartbeat overhead", res["heartbeat_overhead_s"], "s =", res["heartbeat_overhead_frac"])


def test_dpo_trains(recipe_cfg, monkeypatch):
    from recipes import dpo

    monkeypatch.setenv("ORCHESTRATE_ACCELERATOR", "cpu")
    res = dpo.main(recipe_cfg("dpo_tiny"))
    assert res["global_step"] == 20
    assert abs(res["first_loss"] - 0.693) < 0.02
    assert res["final_loss"] < res["first_loss"] - 0.05, res["losses"]


def test_packing_nonpad_fraction(recipe_cfg, monkeypatch):
    from recipes import sft

    monkeypatch.setenv("ORCHESTRATE_ACCELERATOR", "cpu")
    res = sft.main(recipe_cfg("sft_tiny_packing", max_steps=8))
    print("nonpad_fraction", res["nonpad_fraction"], "pack_fill", res["pack_fill"])
    assert res["nonpad_fraction"] >= 0.95
    assert res["pack_fill"] >= 0.9
    assert res["final_loss"] < res["first_loss"]


def test_resume_restores_step_and_optimizer(recipe_cfg, tmp_path, monkeypatch):
    import torch
    from transformers import TrainerCallback

    from recipes import sft
    from recipes.runner import train_and_report, wrap_collator

    monkeypatch.setenv("ORCHESTRATE_ACCELERATOR", "cpu")
    first = sft.main(recipe_cfg("sft_tiny", max_steps=6, save_strategy="steps", save_steps=3))
    ckpt = tmp_path / "out" / "checkpoint-6"
    assert first["last_checkpoint"] == str(ckpt)
    saved = torch.load(ckpt / "optimizer.pt", weights_only=False)["state"]

    seen = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kw):
            seen["step"] = state.global_step
            seen["state"] = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                             for i, s in enumerate(optimizer.state.values())}

    cfg = recipe_cfg("sft_tiny", max_steps=9, save_strategy="steps", save_steps=3)
    trainer, tok, rt = sft.build_trainer(cfg)
    trainer.add_callback(Probe())
    res = train_and_report(trainer, cfg, wrap_collator(trainer, tok.pad_token_id), rt)
    assert res["resumed_from"] == str(ckpt)
    assert seen["step"] == 6 and res["global_step"] == 9
    assert len(seen["state"]) == len(saved) > 0
    for i, s in saved.items():
        assert torch.equal(seen["state"][i]["exp_avg"], s["exp_avg"])
        assert torch.equal(seen["state"][i]["exp_avg_sq"], s["exp_avg_sq"])
    assert float(seen["state"][0]["exp_avg"].abs().sum()) > 0
    # the log history continues from the checkpoint's (logging_steps 2 in the shipped config)
    assert [s for s, _ in res["losses"]] == [2, 4, 6, 8]


def test_resume_never_and_explicit(recipe_cfg, tmp_path, monkeypatch):
    from recipes.common import RecipeError, resolve_resume

    out = tmp_path / "o"
    for n in (4, 12):
        (out / f"checkpoint-{n}").mkdir(parents=True)
        (out / f"checkpoint-{n}" / "trainer_state.json").write_text(f'{{"global_step": {n}}}')
    (out / "checkpoint-16").mkdir()  # a save cut short (no trainer_state.json): never resumed from
    assert resolve_resume({"checkpoint": {"resume": "auto"}}, str(out)).endswith("checkpoint-12")
    assert resolve_resume({"checkpoint": {"resume": "never"}}, str(out)) is None
    assert resolve_resume({"checkpoint": {"resume": str(out / "checkpoint-4")}}, str(out)).endswith("checkpoint-4")
    with pytest.raises(RecipeError):
        resolve_resume({"checkpoint": {"resume": str(out / "nope")}}, str(out))


def test_cp_on_cpu_fails_clearly(recipe_cfg, monkeypatch):
    from recipes import cp
    from recipes.common import RecipeError

    monkeypatch.setenv("ORCHESTRATE_ACCELERATOR", "cpu")
    cfg = recipe_cfg("sft_tiny")
    cfg["recipe"] = "cp"
    cfg["launch"]["parallelism"]["cp"] = 2
    with pytest.raises(RecipeError, match="cannot run on CPU"):
        cp.main(cfg)
    cfg["launch"]["parallelism"]["cp"] = None
    with pytest.raises(RecipeError, match="needs context or sequence parallelism"):
        cp.main(cfg)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger installed")
def test_liger_missing_is_a_clear_error(recipe_cfg, monkeypatch):
    from recipes import sft
    from recipes.common import RecipeError

    monkeypatch.setenv("ORCHESTRATE_ACCELERATOR", "cpu")
    with pytest.raises(RecipeError, match="liger-kernel"):
        sft.main(recipe_cfg("sft_tiny", use_liger_kernel=True))


def test_fsdp1_on_cpu_is_refused(monkeypatch):
    from recipes.common import RecipeError, setup_runtime

    monkeypatch.setenv("ORCHESTRATE_ACCELERATOR", "cpu")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(RecipeError, match="silently drops the FSDP plugin"):
        setup_runtime({})


def test_assistant_only_loss_and_pad_multiple(recipe_cfg, monkeypatch):
    """The tiny tokenizer's ChatML template has {% generation %} markers: assistant-only loss works."""
    from recipes import sft

    monkeypatch.setenv("ORCHESTRATE_ACCELERATOR", "cpu")
    trainer, tok, rt = sft.build_trainer(recipe_cfg("sft_tiny", max_steps=2, assistant_only_loss=True,
                                                    pad_to_multiple_of=16))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape[1] % 16 == 0
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    trained = tok.decode(ids[labels != -100])
    assert "<|im_start|>user" not in trained and trained.endswith("<|im_end|>")
    assert 0 < int((labels != -100).sum()) < int(batch["attention_mask"][0].sum())
