#!/usr/bin/env python3
"""Bad-node checks on a real NVIDIA GPU (not CI; issue #26), with nothing but torch (+ transformers if present) there:

  health     orchestrator.node.gpus.health() against the real nvidia-smi (and the kernel log where readable), judged
             by orchestrator.core.gpuhealth under each policy: what a healthy GPU reports, how long it takes.
  overhead   the straggler evidence's cost on real CUDA training steps, one process: a Llama-style model (bf16,
             AdamW) in blocks of --block steps, alternately with the hooks' global forward hooks (CUDA timing events
             around the outermost forward) registered and removed, ABBA, --pairs pairs; per pair the relative
             step-time difference (median, mean, spread), and the recorded compute_s per step.
  straggler  2 ranks on the one GPU under torchrun (DDP over gloo: one GPU cannot hold 2 NCCL ranks), the zero-code
             hooks on their path exactly as the node agent sets them (sitecustomize, ORCHESTRATE_HEARTBEAT_DIR); once
             even, once with rank 1 made slow but alive (SIGSTOP/SIGCONT duty cycle, stopped --stop-ms of every
             --period-ms); the heartbeats judged by the one HealthMonitor (health.straggler defaults).

    python3 bench/gpu_straggler.py [--sections health,overhead,straggler] [--out DIR]

Prints `RESULT {json}` lines and writes DIR/gpu_straggler.json. Runs on CPU too (a dry run of the same code paths).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
HOOKS = REPO / "orchestrator" / "node" / "hooks"
RESULTS: dict = {}


def result(name: str, **data) -> None:
    RESULTS[name] = data
    print("RESULT " + json.dumps({"name": name, **data}), flush=True)


def section_health() -> None:
    from orchestrator.core.gpuhealth import judge, verdict
    from orchestrator.node import gpus
    t0 = time.perf_counter()
    raw = gpus.health()
    took = time.perf_counter() - t0
    findings = judge("this-host", raw, None, False)
    result("health", seconds=round(took, 3), gpus=raw.get("gpus"), error=raw.get("error"),
           xid=raw.get("xid"), findings=[f.text() for f in findings],
           verdicts={p: [len(x) for x in verdict(findings, p)] for p in ("fail", "warn", "exclude_host")})


def _model(device: str):
    import torch
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
        model = LlamaForCausalLM(cfg)
        kind = "llama-1024x8"
    except Exception:  # noqa: BLE001 - no transformers: a torch transformer stack
        layer = torch.nn.TransformerEncoderLayer(1024, 16, 2816, batch_first=True)
        model = torch.nn.Sequential(torch.nn.Embedding(32000, 1024), torch.nn.TransformerEncoder(layer, 8),
                                    torch.nn.Linear(1024, 32000))
        kind = "torch-encoder-1024x8"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype), kind


def _loss(model, x):
    out = model(x) if not hasattr(model, "config") else model(input_ids=x, labels=x)
    return out.loss if hasattr(out, "loss") else out.float().mean()


def section_overhead(pairs: int, block: int, batch: int, seq: int) -> None:
    import torch

    from orchestrator.node.hooks import orchestrate_heartbeat as hb
    from orchestrator.node.hooks import orchestrate_hooks as hooks
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, kind = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 32000, (batch, seq), device=device)
    nn_module = torch.nn.modules.module

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def run(steps: int, on: bool) -> tuple[float, float]:
        handles = []
        if on:
            handles = [nn_module.register_module_forward_pre_hook(hooks._forward_pre),
                       nn_module.register_module_forward_hook(hooks._forward_post)]
        hooks._Forward.cuda, hooks._Forward.pending, hb._compute[0] = None, [], 0.0
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = _loss(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            hooks._Forward.depth = 0
            if hooks._Forward.pending:
                hooks._read_events()
        sync()
        took = (time.perf_counter() - t0) / steps
        if hooks._Forward.pending:
            hooks._read_events()
        compute = hb._compute[0] / steps
        for h in handles:
            h.remove()
        return took, compute

    run(max(3, block // 4), False)  # warm-up (allocator, kernels)
    diffs, on_s, off_s, comp = [], [], [], []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {}
        for on in order:
            got[on] = run(block, on)
        on_s.append(got[True][0])
        off_s.append(got[False][0])
        comp.append(got[True][1])
        diffs.append(got[True][0] / got[False][0] - 1.0)
    result("overhead", device=device, gpu=torch.cuda.get_device_name(0) if device == "cuda" else None, model=kind,
           batch=batch, seq=seq, pairs=pairs, block=block, step_s_on=statistics.median(on_s),
           step_s_off=statistics.median(off_s), rel_diff_median=statistics.median(diffs),
           rel_diff_mean=statistics.fmean(diffs), rel_diff_min=min(diffs), rel_diff_max=max(diffs),
           compute_s_per_step=statistics.median(comp))


WORKER = r'''
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
width = int(os.environ.get("BENCH_WIDTH", "2048"))
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(6)])
model = model.to(device)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
x = torch.randn(int(os.environ.get("BENCH_BATCH", "256")), width, device=device)
steps = int(os.environ.get("BENCH_STEPS", "150"))
for s in range(steps):
    loss = ddp(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
if device == "cuda":
    torch.cuda.synchronize()
dist.destroy_process_group()
'''


def _ranks_of(marker: str) -> dict[int, int]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"BENCH_MARK={marker}".encode() in env:
            rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
            if rank is not None and rank.isdigit():
                out.setdefault(int(rank), int(pid))
    return out


def _one_run(tmp: Path, name: str, slow: bool, stop_ms: float, period_ms: float, steps: int, width: int) -> dict:
    from orchestrator.core.health import HealthMonitor, HealthSpec
    from orchestrator.node.heartbeat import read_all
    hbdir = tmp / name
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(HOOKS), ORCHESTRATE_HEARTBEAT_DIR=str(hbdir), ORCHESTRATE_JOB_ID=name,
               BENCH_MARK=name, BENCH_STEPS=str(steps), BENCH_WIDTH=str(width), ORCHESTRATE_HEARTBEAT_FLUSH_S="0",
               OMP_NUM_THREADS="2")
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(29400 + (os.getpid() % 500)), str(script)], env=env, start_new_session=True)
    cycles = 0
    done = threading.Event()

    def throttle():
        nonlocal cycles
        pid = None
        while not done.is_set():
            pid = pid or _ranks_of(name).get(1)
            if pid is None:
                time.sleep(0.05)
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stop_ms / 1000)
                os.kill(pid, signal.SIGCONT)
                cycles += 1
            except ProcessLookupError:
                return
            time.sleep(random.uniform(0, 2 * (period_ms - stop_ms)) / 1000)  # (random: never phase-locked to steps)

    t = threading.Thread(target=throttle, daemon=True)
    if slow:
        t.start()
    try:
        rc = p.wait(timeout=300)
    finally:
        done.set()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    mon = HealthMonitor(HealthSpec(), 2, started=t0)
    for rec in read_all(hbdir):
        mon.feed(rec, float(rec.get("t") or 0))
    named = mon.stragglers()
    return {"rc": rc, "seconds": round(time.time() - t0, 1), "throttle_cycles": cycles,
            "evidence_ms": {r: round(v * 1000, 3) for r, v in mon.evidence().items()},
            "named": [s.describe() for s in named]}


def section_straggler(runs: int, stop_ms: float, period_ms: float, steps: int, width: int) -> None:
    import torch
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        even = [_one_run(tmp, f"even{i}", False, stop_ms, period_ms, steps, width) for i in range(runs)]
        slow = [_one_run(tmp, f"slow{i}", True, stop_ms, period_ms, steps, width) for i in range(runs)]
    result("straggler", device="cuda" if torch.cuda.is_available() else "cpu", runs=runs, stop_ms=stop_ms,
           period_ms=period_ms, steps=steps, width=width, even=even, slow=slow,
           even_named=sum(bool(r["named"]) for r in even),
           slow_named_rank1=sum(any(n.startswith("rank 1 ") for n in r["named"]) for r in slow))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="health,overhead,straggler")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--stop-ms", type=float, default=15)
    ap.add_argument("--period-ms", type=float, default=30)
    a = ap.parse_args()
    secs = a.sections.split(",")
    if "health" in secs:
        section_health()
    if "overhead" in secs:
        section_overhead(a.pairs, a.block, a.batch, a.seq)
    if "straggler" in secs:
        section_straggler(a.runs, a.stop_ms, a.period_ms, a.steps, a.width)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "gpu_straggler.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
