"""A user's own plain torch.distributed training loop (gloo, DDP, its own optimizer, no Trainer): it knows
nothing of orchestrate. With `--beat` it also calls the opt-in one-line heartbeat (only if it is on the path).

usage: train_plain.py STEPS [--beat] [--sleep S] [--two-optimizers] [--width W] [--switch-interval S]
        [--no-destroy]
--no-destroy: end after the final barrier without destroying the process group (as many scripts do).
--switch-interval S: sys.setswitchinterval(S) before the final barrier (the main thread then keeps the GIL for up
to S seconds while a gloo worker thread waits for it: the exit race of torch's issue #190489 made likely).
Prints `PLAIN_RESULT {json}` from every rank at the end (loop_s: wall time of the training loop).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

try:
    import orchestrate_heartbeat  # present only when run by orchestrate (hooks directory on the path)
except ImportError:
    orchestrate_heartbeat = None


def main() -> None:
    steps = int(sys.argv[1])
    beat = "--beat" in sys.argv
    sleep = float(sys.argv[sys.argv.index("--sleep") + 1]) if "--sleep" in sys.argv else 0.0
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    width = int(sys.argv[sys.argv.index("--width") + 1]) if "--width" in sys.argv else 64
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    extra = torch.optim.SGD(model.parameters(), lr=0.0) if "--two-optimizers" in sys.argv else None
    gen = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(16, 32, generator=gen)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if extra is not None:
            extra.step()
        if beat and orchestrate_heartbeat:
            orchestrate_heartbeat.beat(step, loss=loss.item(), max_steps=steps)
        if sleep:
            time.sleep(sleep)
    loop_s = time.perf_counter() - t0
    loaded = sorted(m for m in sys.modules if m.startswith("orchestrat"))  # what the hooks brought in
    # one write per line: ranks share the launcher's stdout and run unbuffered, where print() writes the text and
    # the newline separately, so two ranks' lines could interleave
    sys.stdout.write("PLAIN_RESULT " + json.dumps({"rank": int(os.environ.get("RANK", "0")), "steps": steps,
                                                   "modules": loaded, "loop_s": loop_s}) + "\n")
    sys.stdout.flush()
    if "--switch-interval" in sys.argv:
        sys.setswitchinterval(float(sys.argv[sys.argv.index("--switch-interval") + 1]))
    if distributed:
        dist.barrier()
        if "--no-destroy" not in sys.argv:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
