"""FSDP2 on CPU: make accelerate keep the FSDP plugin on CPU-only runs, so parameters really shard.

accelerate 1.15 drops the FSDP plugin when the process is on CPU (AcceleratorState only switches to
DistributedType.FSDP from the MULTI_GPU family) and then trains plain DDP without a word. With
`enable()` installed, an AcceleratorState created with an FSDP2 plugin on a MULTI_CPU (gloo) run gets
`distributed_type = FSDP` and keeps its plugin; accelerate's FSDP2 path (`fully_shard`) then works on
CPU tensors. Only FSDP2 is enabled this way; FSDP1 on CPU is refused by `recipes.common`.
The recipe result proves it (`ranks[*].local_param_numel` is about half the full count on 2 ranks).
"""

from __future__ import annotations

_installed = False


def enable() -> None:
    global _installed
    if _installed:
        return
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if (fsdp_plugin is not None and getattr(fsdp_plugin, "fsdp_version", 1) == 2
                and self.distributed_type == DistributedType.MULTI_CPU):
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__
    _installed = True
