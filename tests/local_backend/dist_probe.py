"""A minimal distributed program for launcher tests: joins the gloo group that `accelerate launch`
(torchrun path) set up, all-reduces its rank, records what it saw, and optionally keeps running
(mode 'loop') so tests can kill one rank mid-run, or fails on a chosen rank (mode 'fail:R')."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

out_dir, mode = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "sum": t.item(), "node": os.environ.get("ORCHESTRATE_NODE_RANK"),
               "local_rank": int(os.environ.get("LOCAL_RANK", -1)), "secret": os.environ.get("PROBE_TOKEN")}, f)
print(f"probe rank {rank}/{world} sum {t.item()}", flush=True)
if mode.startswith("fail:") and rank == int(mode.split(":")[1]):
    print("probe: failing on purpose", flush=True)
    sys.exit(3)
if mode.startswith("fail_until:"):  # fail on rank 1 until the Nth attempt (counted in a file), then finish
    n = int(mode.split(":")[1])
    counter = os.path.join(out_dir, "attempts")
    dist.barrier()
    if rank == 0:
        k = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
        open(counter, "w").write(str(k))
    dist.barrier()
    k = int(open(counter).read())
    if rank == 1 and k < n:
        print(f"probe: attempt {k} failing on purpose", flush=True)
        sys.exit(4)
hb_dir = os.environ.get("ORCHESTRATE_HEARTBEAT_DIR")
hb = open(os.path.join(hb_dir, f"rank{rank}.jsonl"), "a") if hb_dir else None
step0 = 0
if hb_dir and mode.startswith("steps:"):  # resume-like: continue from the furthest step any rank reached
    import glob
    for path in glob.glob(os.path.join(hb_dir, "rank*.jsonl")):
        for line in open(path):
            step0 = max(step0, json.loads(line)["step"])
if mode in ("loop",) or mode.startswith(("fail:", "steps:")):
    steps = int(mode.split(":")[1]) if mode.startswith("steps:") else 10**9
    step = step0
    while step < steps:
        dist.all_reduce(t)
        step += 1
        if hb:
            hb.write(json.dumps({"t": time.time(), "rank": rank, "host": "localhost", "step": step, "max_steps": None,
                                 "loss": 1.0 / step, "tokens": step * 10, "event": "step"}) + "\n")
            hb.flush()
        time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
