"""A node's GPUs: the inventory (`nvidia-smi`, else /proc/driver/nvidia) and the CUDA_VISIBLE_DEVICES binding.

Standard library only (runs on a bare node: the SSH probe, the node agent, `python -m orchestrator.node.gpus`).

- `inventory()` -> {"gpus": [{"index", "name", "memory_mib", "driver"}], "source", "error"} from
  `nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader`, else from
  /proc/driver/nvidia (count and model, no memory). `ORCHESTRATE_NVIDIA_SMI` names another program (tests put a fake
  one there); no nvidia-smi and no driver: no GPUs, no error.
- `visible(env)`: the GPUs a process started with `env` may use: CUDA_VISIBLE_DEVICES when it is set (SLURM sets it
  for an allocation), else None (every GPU of the node).
- `bind_visible(planned, inherited)`: the plan's CUDA_VISIBLE_DEVICES are indices into what the node can use; where
  the node is already restricted (SLURM's allocation, a user's CUDA_VISIBLE_DEVICES) they are mapped through it, so
  `gpus: [0, 1]` on a SLURM node given GPUs 4-7 binds 4,5.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from typing import Any

QUERY = ("--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader")
OVERRIDE_VAR = "ORCHESTRATE_NVIDIA_SMI"
PROC_DIR = "/proc/driver/nvidia"


def nvidia_smi() -> str | None:
    """The nvidia-smi to ask: ORCHESTRATE_NVIDIA_SMI, else the one on PATH (None: none)."""
    override = os.environ.get(OVERRIDE_VAR, "").strip()
    if override:
        return override
    return shutil.which("nvidia-smi")


def parse_query(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader` -> records."""
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        mem = parts[-2].split()[0] if parts[-2] else ""  # "81559 MiB"
        out.append({"index": int(parts[0]), "name": ", ".join(parts[1:-2]), "memory_mib": int(mem) if mem.isdigit()
                    else None, "driver": parts[-1]})
    return out


def _from_proc() -> list[dict[str, Any]]:
    """The GPUs the driver lists under /proc/driver/nvidia/gpus (model; no memory there)."""
    driver = ""
    try:
        with open(os.path.join(PROC_DIR, "version"), encoding="utf-8") as f:
            words = f.readline().split()
        driver = next((w for w in words if w[:1].isdigit() and "." in w), "")
    except OSError:
        pass
    out: list[dict[str, Any]] = []
    for i, path in enumerate(sorted(glob.glob(os.path.join(PROC_DIR, "gpus", "*", "information")))):
        name = ""
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.startswith("Model:"):
                        name = line.split(":", 1)[1].strip()
        except OSError:
            continue
        out.append({"index": i, "name": name, "memory_mib": None, "driver": driver})
    return out


def inventory(timeout: float = 20.0) -> dict[str, Any]:
    """{"gpus": [...], "source": "nvidia-smi" | "/proc/driver/nvidia" | None, "error": str | None}."""
    smi = nvidia_smi()
    if smi:
        try:
            r = subprocess.run([smi, *QUERY], capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"gpus": _from_proc(), "source": PROC_DIR, "error": f"{smi}: {e}"}
        if r.returncode == 0:
            return {"gpus": parse_query(r.stdout), "source": "nvidia-smi", "error": None}
        last = (r.stderr or r.stdout).strip().splitlines()
        err = f"{smi} exited {r.returncode}" + (f": {last[-1]}" if last else "")
        gpus = _from_proc()
        return {"gpus": gpus, "source": PROC_DIR if gpus else None, "error": err}
    gpus = _from_proc()
    return {"gpus": gpus, "source": PROC_DIR if gpus else None, "error": None}


def has_driver() -> bool:
    """A cheap look (no subprocess): NVIDIA device files, the driver's /proc entry, or an nvidia-smi override."""
    return bool(os.environ.get(OVERRIDE_VAR, "").strip()) or any(
        os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", PROC_DIR))


def visible(env: dict[str, str] | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (the node is restricted to these), or None when unset (all GPUs)."""
    value = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def count_visible(env: dict[str, str] | None = None) -> int | None:
    """How many GPUs this node lets a process use (CUDA_VISIBLE_DEVICES honoured); None: unknown."""
    env = dict(os.environ) if env is None else env
    vis = visible(env)
    if vis is not None:
        return len(vis)
    slurm = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if slurm.isdigit():
        return int(slurm)
    if not has_driver():
        return 0
    inv = inventory()
    return len(inv["gpus"]) if inv["source"] or not inv["error"] else None


def bind_visible(planned: str, inherited: list[str] | None) -> tuple[str, str | None]:
    """(CUDA_VISIBLE_DEVICES for the ranks, problem or None): the plan's indices mapped through what the node was
    already restricted to (None: not restricted, the indices are the node's own)."""
    ids = [p.strip() for p in planned.split(",") if p.strip()]
    if inherited is None:
        return ",".join(ids), None
    bad = [i for i in ids if not i.isdigit() or int(i) >= len(inherited)]
    if bad:
        return "", (f"the plan binds GPU(s) {','.join(bad)} but this node may use only {len(inherited)} "
                     f"(CUDA_VISIBLE_DEVICES={','.join(inherited) or '(empty)'})")
    return ",".join(inherited[int(i)] for i in ids), None


def main(argv: list[str] | None = None) -> int:
    """`python -m orchestrator.node.gpus`: print this node's inventory as one JSON line (the SSH fact gathering)."""
    inv = inventory()
    inv["visible"] = visible()
    print(json.dumps(inv, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
