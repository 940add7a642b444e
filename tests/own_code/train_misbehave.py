"""A plain torch.distributed loop (gloo, DDP; no orchestrate imports) where ONE rank misbehaves at a given step.

usage: train_misbehave.py STEPS RANK STEP MODE
MODE: sleep (blocked in Python outside any collective, in load_batch), lock (a deadlock on a lock), busy (a busy loop
in pure Python), stop (the rank stops its own process: SIGSTOP), desync (an all_gather where the others all-reduce).
Every other rank goes on into its next collective and waits there. Prints `MISBEHAVE rank R at step S` first.
slow: from step S on, the rank sleeps 0.05 s more per step in load_batch (a slow data path: a straggler, never hung);
even: nobody misbehaves. Both end normally.
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


def load_batch(gen, bad: bool, mode: str):
    if bad and mode == "slow":
        time.sleep(0.05)  # a slow data path
    if bad and mode == "sleep":
        time.sleep(3600)  # a data loader that never returns
    if bad and mode == "lock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # a deadlock
    if bad and mode == "busy":
        while True:  # a busy loop
            pass
    if bad and mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    return torch.randn(16, 32, generator=gen)


def main() -> None:
    steps, bad_rank, bad_step, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        bad = rank == bad_rank and (step == bad_step or (mode == "slow" and step >= bad_step))
        if bad and step == bad_step:
            sys.stdout.write(f"MISBEHAVE rank {rank} at step {step} ({mode}) t={time.time():.3f}\n")
            sys.stdout.flush()
        x = load_batch(gen, bad, mode)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = torch.ones(4)
        if bad and mode == "desync":
            out = [torch.zeros(4) for _ in range(dist.get_world_size())]
            dist.all_gather(out, t)  # the others all-reduce here
        else:
            dist.all_reduce(t)
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
