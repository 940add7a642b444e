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
if mode in ("loop",) or mode.startswith("fail:"):
    while True:
        dist.all_reduce(t)
        time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
