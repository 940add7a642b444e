"""A trivial rank payload for the SLURM mechanics tests (no torch): heartbeats, signals, exit codes.

python payload.py STEPS [--sleep S] [--fail-at STEP --fail-node R] [--save-dir D]
Writes ORCHESTRATE_HEARTBEAT_DIR/rank<node>.jsonl; on SIGUSR2/SIGTERM it "saves a checkpoint"
(the current step into save-dir/ckpt.json) and exits 0 / 143; on start it resumes from that step.
"""
import argparse
import json
import os
import signal
import socket
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("steps", type=int)
ap.add_argument("--sleep", type=float, default=0.2)
ap.add_argument("--fail-at", type=int, default=-1)
ap.add_argument("--fail-node", type=int, default=-1)
ap.add_argument("--save-dir", default=None)
a = ap.parse_args()
node = int(os.environ["ORCHESTRATE_NODE_RANK"])
hb_dir = os.environ["ORCHESTRATE_HEARTBEAT_DIR"]
os.makedirs(hb_dir, exist_ok=True)
hb = open(os.path.join(hb_dir, f"rank{node}.jsonl"), "a")
if a.save_dir:
    os.makedirs(a.save_dir, exist_ok=True)
ckpt = os.path.join(a.save_dir, "ckpt.json") if a.save_dir else None
step = 0
if ckpt and os.path.exists(ckpt):
    step = json.load(open(ckpt))["step"]
    print(f"payload: resumed from step {step}", flush=True)


def beat(event):
    hb.write(json.dumps({"t": time.time(), "rank": node, "host": socket.gethostname(), "step": step,
                         "max_steps": a.steps, "loss": None, "tokens": None, "event": event}) + "\n")
    hb.flush()


def on_signal(signum, frame):
    if ckpt and node == 0:
        tmp = ckpt + ".tmp"
        json.dump({"step": step}, open(tmp, "w"))
        os.replace(tmp, ckpt)
    beat("save")
    print(f"payload: node {node} got signal {signum}, saved step {step}", flush=True)
    sys.exit(0 if signum == signal.SIGUSR2 else 128 + signum)


signal.signal(signal.SIGUSR2, on_signal)
signal.signal(signal.SIGTERM, on_signal)
print(f"payload: node {node} on {socket.gethostname()} pid {os.getpid()} nodeid_env={os.environ.get('SLURM_NODEID')}",
      flush=True)
beat("start")
while step < a.steps:
    time.sleep(a.sleep)
    step += 1
    beat("step")
    if step == a.fail_at and node == a.fail_node:
        print(f"payload: node {node} failing at step {step}", flush=True)
        os._exit(7)
beat("end")
print(f"payload: node {node} done at step {step}", flush=True)
