#!/usr/bin/env python3
"""GPU checks that CI cannot run (not CI): orchestrate on a machine with one real NVIDIA GPU, in one go.

Sections (--sections, comma-separated; default all):
  env      nvidia-smi, torch/CUDA, the package versions, `python -m orchestrator.node.gpus`, api.detect_accelerator
  dryrun   `orchestrate submit --dry-run` / `render` on the real GPU: procs_per_node, CUDA_VISIBLE_DEVICES, the
           accelerate config; the refusals a 1-GPU machine must give (--nodes 2, the cp recipe)
  runs     real local runs on the GPU, 1 node: the built-in sft recipe (fp32 and bf16), the test-owned HF Trainer
           script tests/own_code/train_hf.py through `run: script:` (as shipped: it says use_cpu=True, so it trains on
           the CPU, and a copy with use_cpu=False that trains on the GPU), the cp recipe (refused on one GPU)
  hooks    the injected callbacks' step-time overhead with real CUDA steps, 1 rank: bench/bench_hooks.py's in-run
           toggle (blocks of --block steps, ABBA, callbacks on/off) around a GPU copy of tests/faults/user_train.py,
           logging every step and every 50 steps; and the torch optimizer-step hook in-process on a CUDA MLP
  owncode  time to first step on the GPU, 1 node: `orchestrate submit` of the job vs hand-run `accelerate launch` with
           the same rendered config (bench/bench_own_code.py's method, --nodes 1, GPU copy of the user script), ABBA
  cpu2     the shipped 2-rank benches as they are (bench_hooks.py section 4, bench_own_code.py --nodes 2) with
           CUDA_VISIBLE_DEVICES="" (2 CPU ranks / nodes on this machine: one GPU cannot hold 2 NCCL ranks)

The shipped sft_tiny.yaml is used as it is, also on a transformers without TrainingArguments.activation_checkpointing
(< 5.2x, as the H100 image's 5.17): orchestrate passes that key as gradient_checkpointing there (spec.TRAINER_ALIASES;
the first GPU run of this driver had to use a copy, which found that bug).

    python3 bench/bench_gpu.py [--sections env,dryrun,runs,hooks,owncode,cpu2] [--out DIR]

On the lent H100 (2026-11-23, results: bench/results/gpu-h100-2026-11-23.txt) every run paid ~20 s of start-up
(imports, CUDA init) before its first step, so the sections took: env+dryrun ~40 s, runs ~135 s, hooks ~205 s,
owncode --repeat 4 ~240 s, cpu2 --cpu2-ranks 1 --cpu2-repeat 2 ~230 s; split them over calls of < 10 min, e.g.
`--sections env,dryrun,runs,hooks` and `--sections owncode,cpu2 --repeat 4 --cpu2-ranks 1 --cpu2-repeat 2`.

Prints one JSON line per measurement (`RESULT {...}`) and writes DIR/summary.json (and DIR/runs.tar.gz: the run
dirs' logs and heartbeats).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PY = sys.executable
CLI = [PY, "-m", "orchestrator.cli"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
DATA = REPO / "recipes" / "data" / "sft_tiny.jsonl"
TMP = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
ENV = {**os.environ, **OFFLINE, "ORCHESTRATE_HOME": str(TMP / "home")}
SUMMARY: dict = {}
RUN_DIRS: list[Path] = []
OUT_DIR: list[Path] = []


def say(*a) -> None:
    print(*a, flush=True)


def result(section: str, name: str, data) -> None:
    SUMMARY.setdefault(section, {})[name] = data
    if OUT_DIR:  # written after every result: a run stopped at its time limit keeps what it measured
        (OUT_DIR[0] / "summary.json").write_text(json.dumps(SUMMARY, indent=2, default=str) + "\n")
    say("RESULT " + json.dumps({"section": section, "name": name, **(data if isinstance(data, dict) else
                                                                       {"value": data})}, default=str))


def sh(argv, timeout=300, env=None, head=12, tail=25, cwd=REPO, quiet=False) -> tuple[int, str, float]:
    """Run argv, print its head and tail, return (rc, output, seconds). A timeout is rc 124."""
    say(f"\n$ {' '.join(str(a) for a in argv)}")
    t0 = time.time()
    try:
        p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env or ENV, cwd=cwd,
                           timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except OSError as e:
        rc, out = 127, f"{type(e).__name__}: {e}"
    except subprocess.TimeoutExpired as e:
        rc = 124
        out = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")) + \
            ((e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        out += f"\n[bench_gpu: timed out after {timeout} s]"
    took = time.time() - t0
    if not quiet:
        lines = out.splitlines()
        shown = lines if len(lines) <= head + tail else lines[:head] + [f"... ({len(lines) - head - tail} lines)"] + \
            lines[-tail:]
        say("\n".join("  | " + x for x in shown))
    say(f"  -> rc {rc} in {took:.1f} s")
    return rc, out, took


# ------------------------------------------------------------------------------------------------ configs

def has_activation_checkpointing() -> bool:
    import dataclasses

    from transformers import TrainingArguments
    return any(f.name == "activation_checkpointing" for f in dataclasses.fields(TrainingArguments))


SFT_TINY = REPO / "recipes" / "configs" / "sft_tiny.yaml"


def gpu_copy(src: Path, name: str, logging_steps: int | None = None) -> Path:
    """A copy of a test-owned user script that trains on the GPU (use_cpu=False) and prints where it trained."""
    text = src.read_text()
    assert "use_cpu=True" in text, src
    text = text.replace("use_cpu=True", "use_cpu=False")
    if logging_steps is not None:
        assert "logging_steps=1," in text
        text = text.replace("logging_steps=1,", f"logging_steps={logging_steps},")
    m = re.search(r"^(\s*)((?:out = )?trainer\.train\(\))$", text, re.M)
    assert m, src
    text = text.replace(m.group(0), m.group(0) + "\n" + m.group(1) +
                        "print('USER_DEVICE', int(os.environ.get('RANK', '0')), trainer.args.device, "
                        "next(trainer.model.parameters()).device, flush=True)")
    p = TMP / name
    p.write_text(text)
    return p


def tiny_model() -> str:
    os.environ.update(OFFLINE)
    from recipes.tiny import resolve_model_path
    return resolve_model_path("tiny-llama")


# ------------------------------------------------------------------------------------------------ a run's facts

def run_facts(out: str, rc: int, took: float, skip: int = 5) -> dict:
    """From a submit's output and its run dir: state, accelerator, heartbeats, step time."""
    m = re.search(r"^job (\S+): run dir (\S+)$", out, re.M)
    facts: dict = {"rc": rc, "wall_s": round(took, 2)}
    final = [x for x in out.splitlines() if re.match(r"^job \S+ [A-Z_]{4,}\b", x)]
    facts["final_line"] = final[-1] if final else None
    if not m:
        facts["error_tail"] = out.splitlines()[-8:]
        return facts
    job, run_dir = m.group(1), Path(m.group(2))
    RUN_DIRS.append(run_dir)
    st = subprocess.run([*CLI, "status", job, "--json"], capture_output=True, text=True, env=ENV, cwd=REPO)
    try:
        status = json.loads(st.stdout)
        facts["state"] = status.get("state")
        facts["root_cause"] = status.get("root_cause")
    except ValueError:
        facts["status_error"] = (st.stdout + st.stderr)[-500:]
    try:
        plan = json.loads((run_dir / "plan.json").read_text())
        facts["plan_accelerator"] = plan.get("accelerator")
        facts["procs_per_node"] = plan.get("procs_per_node")
        facts["distributed_type"] = plan.get("distributed_type")
    except (OSError, ValueError) as e:
        facts["plan_error"] = str(e)
    hb = run_dir / "heartbeats"
    files = sorted(p.name for p in hb.glob("*.jsonl")) if hb.is_dir() else []
    facts["heartbeat_files"] = files
    if "rank0.jsonl" in files:
        recs = [json.loads(x) for x in (hb / "rank0.jsonl").read_text().splitlines() if x.strip()]
        ev = [r["event"] for r in recs]
        facts["heartbeat_events"] = {e: ev.count(e) for e in dict.fromkeys(ev)}
        steps = [r for r in recs if r["event"] in ("step", "save_start")]
        ts = [r["t"] for r in steps]
        d = [b - a for a, b in zip(ts, ts[1:], strict=False)][skip:]
        if d:
            facts["hb_step_ms_median"] = round(statistics.median(d) * 1e3, 3)
            facts["hb_step_ms_p10_p90"] = [round(sorted(d)[len(d) // 10] * 1e3, 3),
                                           round(sorted(d)[(len(d) * 9) // 10] * 1e3, 3)]
            facts["hb_steps_per_s"] = round(1.0 / statistics.median(d), 2)
        facts["last_step"] = steps[-1]["step"] if steps else None
    r = re.search(r"ORCHESTRATE_RESULT (\{.*\})", out)
    if r:
        res = json.loads(r.group(1))
        facts["recipe_result"] = {k: res.get(k) for k in ("global_step", "first_loss", "final_loss", "train_runtime",
                                                          "heartbeat_overhead_frac", "runtime", "world_size")}
        if res.get("train_runtime") and res.get("global_step"):
            facts["trainer_steps_per_s"] = round(res["global_step"] / res["train_runtime"], 2)
    for key in ("USER_RESULT", "USER_DEVICE", "TRAIN_RESULT"):
        hits = [x.split(key, 1)[1].strip() for x in out.splitlines() if key + " " in x]
        if hits:
            facts[key.lower()] = hits
    tr = re.findall(r"'train_runtime': '?([\d.]+)'?.*?'train_steps_per_second': '?([\d.]+)'?", out)
    if tr:
        facts["trainer_reported"] = {"train_runtime": float(tr[-1][0]), "train_steps_per_second": float(tr[-1][1])}
    errs = [x for x in out.splitlines() if re.search(r"(Error|Exception|Traceback|error:)", x)]
    if errs:
        facts["error_lines"] = errs[-6:]
    return facts


class GpuSampler:
    """Polls nvidia-smi while a run goes: the most GPU memory any compute process held, the peak utilisation."""

    def __init__(self, every: float = 0.25):
        import threading
        self.every, self.stop, self.samples = every, threading.Event(), []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                       "nounits"], capture_output=True, text=True, timeout=5).stdout
                util = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,"
                                       "noheader,nounits"], capture_output=True, text=True, timeout=5).stdout
                mem = [int(x.split(",")[1]) for x in apps.strip().splitlines() if "," in x]
                u = [int(v) for v in util.strip().splitlines()[0].split(",")] if util.strip() else [0, 0]
                self.samples.append((len(mem), max(mem or [0]), u[0], u[1]))
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self.stop.wait(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)

    def facts(self) -> dict:
        if not self.samples:
            return {"gpu_samples": 0}
        return {"gpu_samples": len(self.samples), "gpu_compute_procs_max": max(x[0] for x in self.samples),
                "gpu_proc_mem_mib_max": max(x[1] for x in self.samples),
                "gpu_util_pct_max": max(x[2] for x in self.samples),
                "gpu_mem_used_mib_max": max(x[3] for x in self.samples)}


def submit(job: Path, *over: str, nodes: int = 1, timeout: int = 300, env=None) -> dict:
    with GpuSampler() as g:
        rc, out, took = sh([*CLI, "submit", job, "--nodes", str(nodes), *over], timeout=timeout, env=env)
    return {**run_facts(out, rc, took), **g.facts()}


# ------------------------------------------------------------------------------------------------ sections

def section_env(a) -> None:
    sh(["nvidia-smi"], timeout=30, head=30, tail=5)
    rc, out, _ = sh(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
                    timeout=30)
    result("env", "nvidia_smi_query", out.strip())
    code = ("import torch, sys, importlib.metadata as md; "
            "print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available(), "
            "torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else None); "
            "print({n: md.version(n) for n in ('accelerate','transformers','trl','datasets','omegaconf','submitit',"
            "'pyarrow','fsspec','huggingface-hub','tokenizers','rich','pyyaml','psutil','py-spy')})")
    rc, out, _ = sh([PY, "-c", code], timeout=120)
    result("env", "python_torch_versions", out.strip().splitlines())
    rc, out, _ = sh([PY, "-m", "orchestrator.node.gpus"], timeout=30)
    result("env", "orchestrator_node_gpus", json.loads(out.strip().splitlines()[-1]) if rc == 0 else out)
    code = ("from orchestrator import api; from orchestrator.core.spec import load; "
            "j, c = load('examples/own_code/my_job.yaml'); "
            "print(api.detect_accelerator(c), api.gpu_facts(j, c, 'gpu'))")
    rc, out, _ = sh([PY, "-c", code], timeout=60)
    result("env", "detect_accelerator_local", out.strip().splitlines()[-1:] if out.strip() else out)


def section_dryrun(a) -> None:
    cfg = SFT_TINY
    rc, out, _ = sh([*CLI, "submit", cfg, "--dry-run"], timeout=120)
    result("dryrun", "shipped_sft_tiny", {"rc": rc, "output": out.strip().splitlines()[-12:],
                                          "activation_checkpointing_in_transformers": has_activation_checkpointing()})
    rd = TMP / "render"
    rc, out, _ = sh([*CLI, "render", cfg, "--out", rd], timeout=120)
    files = {}
    for rel in ("nodes/0/command.txt", "nodes/0/accelerate.yaml"):
        p = rd / rel
        files[rel] = p.read_text() if p.exists() else None
        say(f"--- {rel}\n{files[rel]}")
    result("dryrun", "render_sft", {"rc": rc, **files})
    rc, out, _ = sh([*CLI, "submit", cfg, "--dry-run", "--nodes", "2"], timeout=120)
    result("dryrun", "sft_nodes2_on_1gpu", {"rc": rc, "output": out.strip().splitlines()[-4:]})
    rc, out, _ = sh([*CLI, "submit", cfg, "--dry-run"], timeout=120, env={**ENV, "CUDA_VISIBLE_DEVICES": ""})
    result("dryrun", "sft_with_CUDA_VISIBLE_DEVICES_empty", {"rc": rc, "output": out.strip().splitlines()[:3]})
    job = own_job("dry", REPO / "tests" / "own_code" / "train_hf.py", [tiny_model(), DATA, TMP / "dry_out", "30"])
    rc, out, _ = sh([*CLI, "submit", job, "--dry-run"], timeout=120)
    result("dryrun", "own_code_train_hf", {"rc": rc, "output": out.strip().splitlines()})
    for cp in (1, 2):
        rc, out, _ = sh([*CLI, "submit", cp_config(), "--dry-run",
                         *cp_overrides(cp)], timeout=120)
        result("dryrun", f"cp_recipe_cp{cp}_on_1gpu", {"rc": rc, "output": out.strip().splitlines()[-4:]})
    rc, out, _ = sh([*CLI, "submit", cp_config(), "--dry-run", *cp_overrides(2), "launch.procs_per_node=2"],
                    timeout=120)
    result("dryrun", "cp_recipe_cp2_procs2_on_1gpu", {"rc": rc, "output": out.strip().splitlines()[-4:]})


def cp_overrides(cp: int) -> list[str]:
    over = ["model.name_or_path=tiny-llama", f"data.path={DATA}", "launch.procs_per_node=auto",
            "launch.parallelism.dp_shard=1", f"launch.parallelism.cp={cp}", "trainer.max_length=256",
            "trainer.max_steps=20", 'trainer.save_strategy="no"', "launch.secret_env=[]",
            f"trainer.output_dir={TMP / 'cp_out'}"]
    return over


def cp_config() -> Path:
    """The shipped cp config, or (transformers without activation_checkpointing) a copy without that key."""
    shipped = REPO / "recipes" / "configs" / "cp_qwen2.5_0.5b_ring.yaml"
    if has_activation_checkpointing():
        return shipped
    text = shipped.read_text()
    assert "  activation_checkpointing: true\n" in text
    p = TMP / "cp_ring.yaml"
    p.write_text(text.replace("  activation_checkpointing: true\n", ""))
    return p


def own_job(tag: str, script: Path, args: list, launch: dict | None = None) -> Path:
    p = TMP / f"{tag}.yaml"
    job = {"run": {"script": str(script), "args": [str(a) for a in args]}}
    if launch:
        job["launch"] = launch
    p.write_text(json.dumps(job))
    return p


def section_runs(a) -> None:
    cfg = SFT_TINY
    out_dir = TMP / "sft_out"
    result("runs", "sft_fp32_200steps", submit(cfg, "trainer.max_steps=200", "trainer.logging_steps=10",
                                               f"trainer.output_dir={out_dir}"))
    result("runs", "sft_bf16_200steps", submit(cfg, "trainer.max_steps=200", "trainer.logging_steps=10",
                                               "trainer.bf16=true", f"trainer.output_dir={out_dir}_bf16"))
    model = tiny_model()
    train_hf = REPO / "tests" / "own_code" / "train_hf.py"
    job = own_job("train_hf_as_shipped", train_hf, [model, DATA, TMP / "hf_out", "30"])
    result("runs", "train_hf_as_shipped_30steps", submit(job))
    job = own_job("train_hf_gpu", gpu_copy(train_hf, "train_hf_gpu.py"), [model, DATA, TMP / "hf_gpu_out", "200"])
    result("runs", "train_hf_gpu_copy_200steps", submit(job))
    facts = submit(cp_config(), *cp_overrides(2), timeout=120)
    result("runs", "cp_recipe_cp2", facts)


def toggle_runs(script: Path, runs: int, blocks: int, block: int, warmup: int, tag: str) -> dict:
    """bench_hooks.two_ranks' method on 1 node (1 GPU rank): ABBA blocks of callbacks on/off inside each run."""
    sys.path.insert(0, str(REPO / "bench"))
    import bench_hooks
    model = tiny_model()
    wrapper = TMP / "toggle.py"
    wrapper.write_text(bench_hooks.TOGGLE)
    pairs = bench_hooks.ToggleBlocks(block)
    walls, dev = [], []
    steps = warmup + block * blocks + 1
    for i in range(runs):
        job = own_job(f"{tag}{i}", wrapper, [script, model, DATA, TMP / f"{tag}{i}_out", steps],
                      launch={"env": {"BENCH_TOGGLE": f"{warmup},{block},{blocks}"}})
        rc, out, took = sh([*CLI, "submit", job, "--nodes", "1"], timeout=400, head=0, tail=6)
        walls.append(round(took, 1))
        if rc != 0 or not pairs.add(out):
            return {"error": f"rc {rc}", "tail": out.splitlines()[-30:]}
        dev = [x for x in out.splitlines() if "USER_DEVICE" in x]
    return {"runs": runs, "warmup": warmup, "device": dev[-1:] if dev else None, "wall_s": walls, **pairs.summary()}


def gpu_in_process(width: int, pairs: int, block: int, flush_s: float) -> dict:
    """bench_hooks.in_process on CUDA tensors: the torch optimizer-step hook."""
    sys.path.insert(0, str(REPO / "bench"))
    import bench_hooks
    return bench_hooks.in_process(width, pairs, block, flush_s, str(TMP / f"inproc_{width}_{flush_s}"), device="cuda")


def section_hooks(a) -> None:
    user = REPO / "tests" / "faults" / "user_train.py"
    for ls in (1, 50):
        script = gpu_copy(user, f"user_train_gpu_log{ls}.py", logging_steps=ls)
        r = toggle_runs(script, a.hook_runs, a.hook_blocks, a.hook_block, 20, f"tog{ls}_")
        result("hooks", f"gpu_1rank_trainer_toggle_logging_steps_{ls}", r)
    for width in (64, 2048):
        for flush_s in (0.0, 0.5):
            result("hooks", f"gpu_in_process_optimizer_hook_w{width}_flush{flush_s}",
                   gpu_in_process(width, 20, 200, flush_s))


def section_owncode(a) -> None:
    """bench_own_code.py's method with --nodes 1 and a GPU copy of the user script."""
    model = tiny_model()
    user = gpu_copy(REPO / "tests" / "faults" / "user_train.py", "user_train_gpu_first.py")
    script = TMP / "first_step.py"
    sys.path.insert(0, str(REPO / "bench"))
    import bench_own_code
    script.write_text(bench_own_code.first_step_script(user))
    subprocess.run([PY, "-m", "compileall", "-q", *(str(REPO / d) for d in ("orchestrator", "launchers", "recipes"))],
                   check=True)
    first = bench_own_code.first_step

    def ours(i: int) -> float:
        job = own_job(f"ours{i}", script, [model, DATA, TMP / f"ours{i}_out", a.steps])
        t0 = time.time()
        r = subprocess.run([*CLI, "submit", str(job), "--nodes", "1"], capture_output=True, text=True, env=ENV,
                           cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        return first(r.stdout) - t0

    def anchor(i: int) -> float:
        d = TMP / f"anchor{i}"
        job = own_job(f"anchor{i}", script, [model, DATA, TMP / f"anchor{i}_out", a.steps])
        r = subprocess.run([*CLI, "render", str(job), "--nodes", "1", "--out", str(d)], capture_output=True,
                           text=True, env=ENV, cwd=REPO, timeout=120)
        assert r.returncode == 0, r.stderr
        node_env = {**ENV, "CUDA_VISIBLE_DEVICES": "0", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        t0 = time.time()
        p = subprocess.run([PY, "-m", "accelerate.commands.launch", "--config_file",
                            str(d / "nodes" / "0" / "accelerate.yaml"), str(script), model, str(DATA),
                            str(TMP / f"anchor{i}_out"), str(a.steps)], capture_output=True, text=True,
                           env=node_env, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        return first(p.stdout + p.stderr) - t0

    ours(99)  # warm caches for both
    runs = {"ours": [], "anchor": []}
    for i in range(a.repeat):
        for side in (("anchor", "ours") if i % 2 == 0 else ("ours", "anchor")):
            runs[side].append((anchor if side == "anchor" else ours)(i))
        say(f"run {i}: ours {runs['ours'][-1]:.2f}s anchor {runs['anchor'][-1]:.2f}s")
    med = {k: statistics.median(v) for k, v in runs.items()}
    paired = sorted(o / x for o, x in zip(runs["ours"], runs["anchor"], strict=True))
    r = {"nodes": 1, "repeat": a.repeat, "steps": a.steps, "first_step_s": {k: round(v, 3) for k, v in med.items()},
         "ratio_of_medians": round(med["ours"] / med["anchor"], 3),
         "paired_ratio_median": round(statistics.median(paired), 3),
         "paired_ratio_range": [round(paired[0], 3), round(paired[-1], 3)],
         "runs": {k: [round(x, 3) for x in v] for k, v in runs.items()}}
    say(f"own code (GPU, 1 node), time to first step (median of {a.repeat}): ours {med['ours']:.2f}s, hand-run "
        f"accelerate launch {med['anchor']:.2f}s, ratio of medians {r['ratio_of_medians']:.3f}; paired median "
        f"{r['paired_ratio_median']:.3f}, range {paired[0]:.3f}-{paired[-1]:.3f}")
    result("owncode", "gpu_1node_time_to_first_step", r)


def section_cpu2(a) -> None:
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""}
    out_json = Path(a.out) / "hooks_cpu2.json"
    rc, out, _ = sh([PY, "bench/bench_hooks.py", "--widths", "", "--trainer", "0", "--e2e", "0", "--ranks",
                     str(a.cpu2_ranks), "--out", out_json], timeout=500, env=env, tail=6)
    result("cpu2", "bench_hooks_section4_2ranks_cpu", [json.loads(x) for x in out.splitlines() if x.startswith("{")]
           or {"rc": rc, "tail": out.splitlines()[-20:]})
    rc, out, _ = sh([PY, "bench/bench_own_code.py", "--repeat", str(a.cpu2_repeat)], timeout=500, env=env, tail=12)
    result("cpu2", "bench_own_code_2nodes_cpu", {"rc": rc, "lines": [x for x in out.splitlines()
                                                                     if x.startswith(("run ", "own code"))]
                                                 or out.splitlines()[-20:]})


SECTIONS = {"env": section_env, "dryrun": section_dryrun, "runs": section_runs, "hooks": section_hooks,
            "owncode": section_owncode, "cpu2": section_cpu2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="env,dryrun,runs,hooks,owncode,cpu2")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    ap.add_argument("--hook-runs", type=int, default=2)
    ap.add_argument("--hook-blocks", type=int, default=24)
    ap.add_argument("--hook-block", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5, help="owncode pairs")
    ap.add_argument("--steps", type=int, default=4, help="owncode steps per run")
    ap.add_argument("--cpu2-ranks", type=int, default=1)
    ap.add_argument("--cpu2-repeat", type=int, default=4)
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    OUT_DIR.append(Path(a.out))
    say(f"bench_gpu: tmp {TMP}, out {a.out}, sections {a.sections}")
    t0 = time.time()
    for name in a.sections.split(","):
        ts = time.time()
        say(f"\n===================== section {name}")
        try:
            SECTIONS[name](a)
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others' numbers
            import traceback
            tb = traceback.format_exc()
            say(tb)
            result(name, "section_error", {"error": f"{type(e).__name__}: {e}", "traceback": tb.splitlines()[-15:]})
        say(f"===================== section {name} took {time.time() - ts:.1f} s")
    SUMMARY["total_s"] = round(time.time() - t0, 1)
    (Path(a.out) / "summary.json").write_text(json.dumps(SUMMARY, indent=2, default=str) + "\n")
    with tarfile.open(Path(a.out) / "runs.tar.gz", "w:gz") as tar:
        for rd in RUN_DIRS:
            for sub in ("logs", "heartbeats", "plan.json", "nodes"):
                if (rd / sub).exists():
                    tar.add(rd / sub, arcname=f"{rd.name}/{sub}")
    say(f"\nbench_gpu: done in {SUMMARY['total_s']} s; summary {Path(a.out) / 'summary.json'}")
    shutil.rmtree(TMP, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
