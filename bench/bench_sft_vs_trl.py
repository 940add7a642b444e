"""Benchmark: training throughput (tokens/s) of our SFT recipe vs TRL's own `trl sft` CLI.

Same tiny model (built-in tiny-llama), same shipped data, same hyper-parameters, same accelerate
config and process count; runs alternate (ours, trl, ours, trl, ...) to spread machine noise, median of
N runs each, ratio = ours / trl in one run. Throughput = tokens / train_runtime, both read from the
Trainer's own log lines (`num_tokens`, `train_runtime`) the same way for both, so start-up (imports,
model build, tokenisation) is excluded and reported separately as wall time.

    python bench/bench_sft_vs_trl.py [--runs 5] [--steps 60] [--nprocs 1]

Prints a table and writes bench/results/bench_sft_vs_trl-<time>.json. Not run in CI.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
HP = {"per_device_train_batch_size": 8, "learning_rate": 0.003, "lr_scheduler_type": "constant_with_warmup",
      "warmup_steps": 2, "max_length": 256, "logging_steps": 10, "save_strategy": "no", "seed": 42,
      "activation_checkpointing": False, "bf16": False, "report_to": "none", "dataloader_num_workers": 0,
      "disable_tqdm": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_yaml(path: Path, nprocs: int) -> None:
    cfg = {"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "num_processes": nprocs, "machine_rank": 0,
           "main_process_ip": "127.0.0.1", "main_process_port": free_port(), "mixed_precision": "no",
           "rdzv_backend": "static", "same_network": True}
    cfg.update({"distributed_type": "MULTI_GPU", "use_cpu": False} if nprocs > 1 else
               {"distributed_type": "NO", "use_cpu": True})
    path.write_text(yaml.safe_dump(cfg))


def parse_logs(text: str) -> dict:
    tokens = runtime = None
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{'") and line.endswith("}")):
            continue
        try:
            d = ast.literal_eval(line)
        except (ValueError, SyntaxError):
            continue
        if "num_tokens" in d:
            tokens = float(d["num_tokens"])
        if "train_runtime" in d:
            runtime = float(d["train_runtime"])
    if tokens is None or runtime is None:
        raise RuntimeError("could not find num_tokens / train_runtime in the output:\n" + text[-3000:])
    return {"tokens": tokens, "train_runtime": runtime, "tokens_per_s": tokens / runtime}


def run(argv: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"{argv[:6]} failed ({p.returncode}):\n{out[-3000:]}")
    return {**parse_logs(out), "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nprocs", type=int, default=1)
    ap.add_argument("--packing", action="store_true", help="both sides with BFD packing")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_sft_"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GLOO_SOCKET_IFNAME": "lo", "ORCHESTRATE_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO),
           "ORCHESTRATE_CACHE": str(work / "cache")}
    sys.path.insert(0, str(REPO))
    os.environ["ORCHESTRATE_CACHE"] = env["ORCHESTRATE_CACHE"]
    from recipes.tiny import resolve_model_path

    model = resolve_model_path("tiny-llama")
    data_dir = work / "data"
    data_dir.mkdir()
    shutil.copy(REPO / "recipes/data/sft_tiny.jsonl", data_dir / "train.jsonl")
    hp = {**HP, "max_steps": a.steps, **({"packing": True, "packing_strategy": "bfd"} if a.packing else {})}

    acc = work / "accelerate.yaml"
    accelerate_yaml(acc, a.nprocs)
    recipe = yaml.safe_load((REPO / "recipes/configs/sft_tiny.yaml").read_text())
    recipe["model"]["name_or_path"] = model
    recipe["data"]["path"] = str(data_dir / "train.jsonl")
    recipe["trainer"] = {**hp, "output_dir": str(work / "ours")}
    recipe["checkpoint"]["resume"] = "never"
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    ours_argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc),
                 "-m", "recipes.run", str(work / "recipe.yaml")]
    trl_bin = shutil.which("trl") or str(Path(sys.executable).parent / "trl")
    trl_argv = [trl_bin, "sft", "--accelerate_config", str(acc), "--model_name_or_path", model,
                "--dataset_name", str(data_dir), "--dtype", "float32", "--attn_implementation", "sdpa",
                "--output_dir", str(work / "trl"), "--use_cpu", "true"]
    for k, v in hp.items():
        trl_argv += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]

    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for i in range(a.runs):
        for name, argv in (("ours", ours_argv), ("trl", trl_argv)):
            r = run(argv, env)
            results[name].append(r)
            print(f"run {i + 1}/{a.runs} {name:4s}: {r['tokens_per_s']:9.0f} tok/s  "
                  f"train {r['train_runtime']:.2f}s  wall {r['wall_s']:.1f}s  tokens {r['tokens']:.0f}", flush=True)

    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in results.items()}
    wall = {k: statistics.median(r["wall_s"] for r in v) for k, v in results.items()}
    ratio = med["ours"] / med["trl"]
    best_ratio = best["ours"] / best["trl"]
    print("\n| runner | median tokens/s | best tokens/s | median wall s |\n|---|---:|---:|---:|")
    for k in ("ours", "trl"):
        print(f"| {k} | {med[k]:.0f} | {best[k]:.0f} | {wall[k]:.1f} |")
    print(f"\nratio ours/trl: median {ratio:.3f}, best-of-{a.runs} {best_ratio:.3f} (goal >= 0.98; "
          "on a shared machine best-of-N is the less noisy estimate)")
    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"bench_sft_vs_trl-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"config": {**vars(a), "hp": hp}, "median_tokens_per_s": med,
                               "best_tokens_per_s": best, "median_wall_s": wall,
                               "ratio": ratio, "best_ratio": best_ratio, "runs": results}, indent=2))
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
