#!/usr/bin/env python3
"""Container start overhead (issue #25; not CI): time to the first optimizer step of a 2-node job (local backend) with
its ranks in the test image under podman, against the same job native, and against a hand-run `podman run ...
python3 -m accelerate.commands.launch --config_file nodeR.yaml train.py ...` per node (the same rendered configs, the
same image, the same mounts), interleaved (the order of the three sides rotates each round), same run.

    python bench/bench_container.py [--repeat 6] [--steps 4]

The user script is tests/faults/user_train.py (an HF Trainer script that knows nothing of orchestrate) wrapped to
print when rank 0's first step ended (bench_own_code.first_step_script). Reports each side's median and the paired
added seconds (ours in podman minus ours native: what the container costs; ours in podman minus the hand-run podman:
what orchestrate adds around the same containers). Results: bench/results/container.json. Needs root and podman
(scripts/install_container_deps.sh); builds the test image once (scripts/container_image.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))
from bench_own_code import OFFLINE, first_step, first_step_script, run_until_first_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    import container_image
    image = container_image.build("podman")
    env = {**os.environ, **OFFLINE}
    tmp = Path(tempfile.mkdtemp(prefix="bench-container-"))
    env["ORCHESTRATE_HOME"] = str(tmp / "home")
    sys.path.insert(0, str(REPO))
    os.environ.update(OFFLINE)
    from recipes.tiny import resolve_model_path
    model = resolve_model_path("tiny-llama")
    script = tmp / "train.py"
    script.write_text(first_step_script(REPO / "tests" / "faults" / "user_train.py"))
    data = REPO / "recipes" / "data" / "sft_tiny.jsonl"
    mounts = [f"{tmp}:{tmp}", f"{model}:{model}:ro"]
    (tmp / "podman.yaml").write_text(json.dumps({"kind": "local", "env": OFFLINE, "container": {
        "image": image, "runtime": "podman", "mounts": mounts}}))
    cli = [sys.executable, "-m", "orchestrator.cli"]

    def job(tag: str) -> Path:
        p = tmp / f"{tag}.yaml"
        p.write_text(json.dumps({"run": {"script": str(script), "args": [model, str(data), str(tmp / tag / "out"),
                                                                          str(args.steps)]}}))
        return p

    def ours(i: int, container: bool) -> float:
        tag = f"{'podman' if container else 'native'}{i}"
        t0 = time.time()
        p = subprocess.Popen([*cli, "submit", str(job(tag)), "--nodes", "2",
                              *(["--cluster", str(tmp / "podman.yaml")] if container else [])],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        out = run_until_first_step([p], lambda _t: None)[0]
        assert p.returncode == 0, out[-5000:]
        return first_step(out) - t0

    def hand(i: int) -> float:
        d = tmp / f"hand{i}"
        r = subprocess.run([*cli, "render", str(job(f"hand{i}")), "--nodes", "2", "--out", str(d)],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        assert r.returncode == 0, r.stderr
        t0 = time.time()
        procs = []
        for rank in range(2):
            argv = ["podman", "run", "--rm", "--network", "host", "--ipc", "host", "-w", str(REPO),
                    "-v", f"{REPO}:{REPO}:ro", *(x for m in mounts for x in ("-v", m)),
                    "-e", "GLOO_SOCKET_IFNAME=lo", *(x for k, v in OFFLINE.items() for x in ("-e", f"{k}={v}")),
                    image, "python3", "-m", "accelerate.commands.launch", "--config_file",
                    str(d / "nodes" / str(rank) / "accelerate.yaml"), str(script), model, str(data),
                    str(tmp / f"hand{i}" / "out"), str(args.steps)]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = run_until_first_step(procs, lambda _t: None)
        first = first_step(outs[0] + outs[1])
        assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
        return first - t0

    sides = {"native": lambda i: ours(i, False), "podman": lambda i: ours(i, True), "hand_podman": hand}
    ours(99, True)  # warm: the model, the datasets cache, the page cache, the image's layers
    runs: dict[str, list[float]] = {s: [] for s in sides}
    order = list(sides)
    for i in range(args.repeat):
        for side in order[i % 3:] + order[:i % 3]:
            runs[side].append(sides[side](i))
        print(f"round {i}: " + ", ".join(f"{s} {r[-1]:.2f}s" for s, r in runs.items()), flush=True)
    med = {s: statistics.median(r) for s, r in runs.items()}
    added = {name: sorted(a - b for a, b in zip(runs[x], runs[y], strict=True))
             for name, (x, y) in {"podman_minus_native": ("podman", "native"),
                                  "podman_minus_hand_podman": ("podman", "hand_podman"),
                                  "hand_podman_minus_native": ("hand_podman", "native")}.items()}
    result = {"repeat": args.repeat, "steps": args.steps, "image": image, "machine": f"{os.cpu_count()} cores",
              "first_step_median_s": med,
              "paired_added_s_median": {k: statistics.median(v) for k, v in added.items()},
              "paired_added_s_range": {k: [v[0], v[-1]] for k, v in added.items()}, "runs": runs}
    print(f"time to first step, median of {args.repeat}: " + ", ".join(f"{s} {m:.2f}s" for s, m in med.items()))
    print("paired added seconds, median (range): " + ", ".join(
        f"{k} {statistics.median(v):+.2f}s ({v[0]:+.2f} to {v[-1]:+.2f})" for k, v in added.items()))
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "container.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
