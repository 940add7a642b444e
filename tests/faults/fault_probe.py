"""The rank program of the fault suite, a plain torch.distributed loop that never imports orchestrator and writes no
heartbeat itself: it joins the gloo group `accelerate launch` set up, then steps (an all-reduce and an SGD step of
its own optimizer per step); the heartbeats come from orchestrate's zero-code hook (torch's global optimizer-step
hook, installed by the sitecustomize the node agent puts on the ranks' PYTHONPATH). It writes its pid so a test can
signal it. Modes: `loop`; `exit:R:C`: rank R calls sys.exit(C) at step 5;
`restart:S`: the first attempt (counted in OUT/attempts) fails on rank 1 at step 5, the next sleeps S seconds before
its first step (a start-up slower than the stall timeout) and finishes at step 10."""

import os
import sys
import time

import torch
import torch.distributed as dist

out_dir, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
t = torch.tensor([1.0])
w = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([w], lr=0.1)
step = 0
attempt = 1
if mode.startswith("restart:"):
    counter = os.path.join(out_dir, "attempts")
    dist.barrier()
    if rank == 0:
        attempt = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
        open(counter, "w").write(str(attempt))
    dist.barrier()
    attempt = int(open(counter).read())
    if attempt > 1:
        time.sleep(float(mode.split(":")[1]))
while True:
    dist.all_reduce(t)
    step += 1
    opt.zero_grad()
    (w.sum() * 0.0 + float(step)).backward()
    opt.step()
    if mode.startswith("exit:") and rank == int(mode.split(":")[1]) and step == 5:
        print(f"fault probe: rank {rank} exits on purpose", flush=True)
        dist.destroy_process_group()  # local only; a live gloo group can abort the interpreter at exit (SIGABRT)
        sys.exit(int(mode.split(":")[2]))
    if mode.startswith("restart:") and attempt == 1 and rank == 1 and step == 5:
        dist.destroy_process_group()
        sys.exit(4)
    if mode.startswith("restart:") and attempt > 1 and step == 10:
        break
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
