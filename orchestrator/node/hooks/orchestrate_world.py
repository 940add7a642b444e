"""A rank never trains alone: its distributed state must be the world torchrun started (WORLD_SIZE ranks).

On a CPU cluster the plan uses accelerate's torchrun path (MULTI_GPU, use_cpu false; orchestrator.core.plan), and
`accelerate launch` then tells the ranks ACCELERATE_USE_CPU=False. accelerate decides its state from the device: with
no GPU and no `cpu=True` a rank's `Accelerator()` / `PartialState()` is DistributedType.NO with 1 process, while
torch.distributed (which it initialized all the same) has the whole world: every rank trains alone, in silence. So:

- `on_cpu_cluster()` (at start-up, before the user's code): on a CPU cluster outside DeepSpeed, ACCELERATE_USE_CPU=true,
  what accelerate's `Accelerator()` (AcceleratorState), transformers' TrainingArguments and accelerate's own test
  scripts read: their state becomes MULTI_CPU over gloo with torchrun's ranks. Under DeepSpeed it is left alone
  (with it accelerate would drop DeepSpeed; the built-in recipes pass backend gloo there instead).
- `trains_alone()` (orchestrate_hooks asks it at the rank's first optimizer step): what is still not distributed -
  a `PartialState()` not told `cpu=True` (it reads no environment), accelerate under DeepSpeed on CPU without backend
  gloo, torch.distributed never initialized - in one line naming the fix; the rank then stops (`TrainsAlone`)
  before a second step.
  ORCHESTRATE_ALLOW_UNDISTRIBUTED=1 turns the check off.

Standard library only at import (the hooks' rule); torch and accelerate are looked at only where already imported.
"""

from __future__ import annotations

import os
import sys


def on_cpu_cluster() -> None:
    env = os.environ
    if env.get("ORCHESTRATE_ACCELERATOR") == "cpu" and env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        env["ACCELERATE_USE_CPU"] = "true"


def _world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 1


def trains_alone() -> str | None:
    """Why this rank of a WORLD_SIZE > 1 launch is not part of it (None: it is, or nothing can tell)."""
    world = _world()
    if world <= 1 or os.environ.get("ORCHESTRATE_ALLOW_UNDISTRIBUTED") == "1":
        return None
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None) or {}
    if shared.get("num_processes") == 1:
        kind = getattr(shared.get("distributed_type"), "value", shared.get("distributed_type"))
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            fix = "under DeepSpeed on CPU give accelerate backend gloo (InitProcessGroupKwargs(backend='gloo'))"
        else:
            fix = "create it with Accelerator() or PartialState(cpu=True) on a CPU cluster"
        return f"accelerate's state has 1 process ({kind}) but WORLD_SIZE is {world}: {fix}"
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return (f"WORLD_SIZE {world} but torch.distributed is not initialized: call "
                "torch.distributed.init_process_group() (or use accelerate's Accelerator()) before training")
    if dist.get_world_size() != world:
        return f"torch.distributed's world size is {dist.get_world_size()} but WORLD_SIZE is {world}"
    return None

