"""The part of a run every recipe shares once its TRL trainer exists: callbacks, resume, train, final
save, and the result dict (`main(cfg)` returns it; `recipes.run` prints it as ORCHESTRATE_RESULT).

Owns the result fields: first_loss, final_loss, losses, global_step, max_steps, output_dir,
last_checkpoint, resumed_from, nonpad_fraction, pack_fill, tokens, train_runtime, heartbeat_overhead_s,
heartbeat_overhead_frac, preempted_signal, world_size, runtime, ranks (per-rank fingerprints, gathered to rank 0:
param hash, local/full parameter and optimizer-state sizes, first batch hash: proof of sync and sharding).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from recipes.callbacks import HeartbeatCallback, PreemptionCallback, TokenCounter
from recipes.common import resolve_resume


def wrap_collator(trainer, pad_token_id) -> TokenCounter:
    counter = TokenCounter(trainer.data_collator, pad_token_id)
    trainer.data_collator = counter
    return counter


def _local_param_stats(model) -> dict[str, Any]:
    h = hashlib.sha256()
    local = full = 0
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3: p.data is empty, the rank's partition is ds_tensor
            t, n_full = p.ds_tensor, int(p.ds_numel)
        elif hasattr(p, "to_local"):  # FSDP2 DTensor
            t, n_full = p.to_local(), int(p.numel())
        else:
            t, n_full = p.data, int(p.numel())
        t = t.detach().float().cpu().contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
        local += int(t.numel())
        full += n_full
    return {"param_sha": h.hexdigest()[:16], "local_param_numel": local, "full_param_numel": full}


def _optimizer_state_numel(optimizer) -> int | None:
    opt = optimizer
    for _ in range(4):  # AcceleratedOptimizer -> DeepSpeedZeroOptimizer -> torch optimizer
        if hasattr(opt, "state") and isinstance(opt.state, dict) and not hasattr(opt, "optimizer"):
            break
        if not hasattr(opt, "optimizer"):
            break
        opt = opt.optimizer
    state = getattr(opt, "state", None)
    if not isinstance(state, dict):
        return None
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 keeps DTensor optimizer states

    return int(sum(local(s["exp_avg"]).numel() for s in state.values() if isinstance(s, dict) and "exp_avg" in s))


def pack_fill(trainer) -> float | None:
    """Mean fill of packed rows (tokens / max_length); what a padded batch of bins would waste."""
    a = trainer.args
    ds = trainer.train_dataset
    if not getattr(a, "packing", False) or not a.max_length or "seq_lengths" not in (ds.column_names or []):
        return None
    sub = ds.select(range(min(len(ds), 2000)))
    return round(sum(sum(x) for x in sub["seq_lengths"]) / (len(sub) * a.max_length), 4)


def _gather(obj) -> list:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def train_and_report(trainer, cfg: dict, counter: TokenCounter | None = None, rt=None) -> dict[str, Any]:
    args = trainer.args
    fill = pack_fill(trainer)
    preempt = None
    if (cfg.get("checkpoint") or {}).get("save_on_signal", True):
        preempt = PreemptionCallback().install()
        trainer.add_callback(preempt)
    heartbeat = HeartbeatCallback(counter, preempt=preempt)  # after preempt: it sees the save preempt asks for
    trainer.add_callback(heartbeat)
    resume = resolve_resume(cfg, args.output_dir)
    t0 = time.perf_counter()
    out = trainer.train(resume_from_checkpoint=resume)
    wall = time.perf_counter() - t0
    stopped_by = preempt.stopped_by if preempt is not None else None
    if preempt is not None and stopped_by is None:
        preempt.uninstall()
    # A preempted run keeps its handler until exit: the launcher's own SIGTERM to the ranks that are already
    # on their way out then ends them with 128+signal too, instead of a bare -15.
    if stopped_by is None and cfg.get("save_final_model", True):
        trainer.save_model(args.output_dir)

    from transformers.trainer_utils import get_last_checkpoint

    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    info = {"rank": args.process_index, "first_batch_sha": counter.first_batch_sha if counter else None,
            "optimizer_state_numel": _optimizer_state_numel(trainer.optimizer) if trainer.optimizer else None,
            "nonpad": counter.nonpad if counter else 0, "total": counter.total if counter else 0,
            "tokens": heartbeat.tokens,
            **_local_param_stats(trainer.model)}
    ranks = _gather(info)
    nonpad, total = sum(r["nonpad"] for r in ranks), sum(r["total"] for r in ranks)
    train_runtime = (out.metrics or {}).get("train_runtime", wall)
    return {
        "recipe": cfg.get("recipe"),
        "first_loss": losses[0][1] if losses else None,
        "final_loss": losses[-1][1] if losses else None,
        "losses": losses,
        "global_step": int(trainer.state.global_step),
        "max_steps": int(trainer.state.max_steps),
        "output_dir": args.output_dir,
        "last_checkpoint": get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None,
        "resumed_from": resume,
        "nonpad_fraction": round(nonpad / total, 4) if total else None,
        "pack_fill": fill,
        "tokens": sum(r["tokens"] for r in ranks),
        "train_runtime": round(float(train_runtime), 3),
        "heartbeat_overhead_s": round(heartbeat.overhead_s, 6),
        "heartbeat_overhead_frac": round(heartbeat.overhead_s / wall, 6) if wall else None,
        "preempted_signal": stopped_by,
        "world_size": len(ranks),
        "runtime": None if rt is None else {"accelerator": rt.accelerator, "engine": rt.engine,
                                            "pg_timeout_s": rt.pg_timeout_s, "use_cpu": bool(args.use_cpu)},
        "ranks": ranks,
    }
