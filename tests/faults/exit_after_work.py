"""A plain torch.distributed job that never imports orchestrate: every rank trains a few optimizer steps over gloo
(gradients all-reduced), then rank 1 leaves with exit code 3 once the work is done while rank 0 ends well.

Under a hand-run `accelerate launch` per node, node 1's torchrun agent reports the failed worker and exits without
reaching torchelastic's exit barrier, so node 0's agent, whose worker succeeded, waits at that barrier for its whole
timeout (300 s) before it gives up.

usage: exit_after_work.py STEPS
"""

import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    steps = int(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    dist.barrier()
    dist.destroy_process_group()
    rank = int(os.environ.get("RANK", "0"))
    sys.stdout.write(f"WORK_DONE rank {rank}\n")
    sys.stdout.flush()
    if rank == 1:
        sys.exit(3)


if __name__ == "__main__":
    main()
