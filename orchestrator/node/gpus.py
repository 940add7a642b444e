"""A node's GPUs: the inventory (`nvidia-smi`, else /proc/driver/nvidia), their health (nvidia-smi's ECC / retired
page / row remap / mode / memory fields, the processes on them, XID errors from the kernel log, `dcgmi diag` when
asked: `health()`, judged by orchestrator.core.gpuhealth) and the CUDA_VISIBLE_DEVICES binding.

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


# ------------------------------------------------------------------------------------------------ health

HEALTH_QUERY = ("--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,retired_pages.pending,"
                "remapped_rows.failure,remapped_rows.pending,persistence_mode,compute_mode,memory.used,"
                "clocks_throttle_reasons.active", "--format=csv,noheader,nounits")
HEALTH_FIELDS = ("index", "pci_bus", "ecc_uncorrected_volatile", "retired_pages_pending", "remapped_rows_failure",
                 "remapped_rows_pending", "persistence_mode", "compute_mode", "memory_used_mib", "throttle")
APPS_QUERY = ("--query-compute-apps=gpu_bus_id,pid,used_memory", "--format=csv,noheader,nounits")
_UNKNOWN = ("[N/A]", "[Not Supported]", "N/A", "")


def _value(text: str) -> Any:
    """A health field: an int, a word ("Yes", "Default", ...), or None when the GPU does not report it."""
    text = text.strip()
    if text in _UNKNOWN:
        return None
    return int(text) if text.isdigit() else text


def _bus(text: str) -> str:
    """A PCI bus id in one spelling for nvidia-smi (00000000:3B:00.0) and the kernel log (0000:3b:00)."""
    t = text.strip().lower()
    parts = t.split(":")
    if len(parts) >= 3:
        domain = parts[-3][-4:].rjust(4, "0")
        return f"{domain}:{parts[-2]}:{parts[-1].split('.')[0]}"
    return t


def xid_events(text: str) -> list[dict[str, Any]]:
    """`[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.` lines of a kernel log ->
    records {pci_bus, xid, text, t}: `t` the kernel's stamp (seconds since boot; the node's CLOCK_MONOTONIC, which
    `time.monotonic()` reads, counts the same), None for a line printed without one."""
    import re
    out = []
    line = r"^(?:\[\s*(\d+(?:\.\d+)?)\])?[^\n]*?NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+),?[ \t]*(.*)$"
    for m in re.finditer(line, text, re.MULTILINE):
        out.append({"pci_bus": _bus(m.group(2)), "xid": int(m.group(3)), "text": m.group(4).strip()[:160],
                    "t": float(m.group(1)) if m.group(1) else None})
    return out


def kernel_log(timeout: float = 10.0) -> tuple[str | None, str | None]:
    """(the kernel log's text, why it could not be read): `dmesg` (ORCHESTRATE_DMESG names another program)."""
    prog = os.environ.get("ORCHESTRATE_DMESG", "").strip() or shutil.which("dmesg")
    if not prog:
        return None, "dmesg not found"
    try:
        r = subprocess.run([prog], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:160]
    return r.stdout, None


def dcgm_diag(timeout: float = 600.0) -> dict[str, Any]:
    """`dcgmi diag -r 1 -j` (ORCHESTRATE_DCGMI names another program): {"ran", "failures": [{"gpu", "test", "info"}],
    "error"}; not installed: ran False."""
    prog = os.environ.get("ORCHESTRATE_DCGMI", "").strip() or shutil.which("dcgmi")
    if not prog:
        return {"ran": False, "failures": [], "error": "dcgmi not found"}
    try:
        r = subprocess.run([prog, "diag", "-r", "1", "-j"], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        doc = json.loads(r.stdout or "{}")
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        return {"ran": True, "failures": [], "error": f"dcgmi diag: {e}"}
    failures = []
    for cat in (doc.get("DCGM GPU Diagnostic") or {}).get("test_categories") or []:
        for test in cat.get("tests") or []:
            for res in test.get("results") or []:
                if str(res.get("status", "")).lower() == "fail":
                    failures.append({"gpu": res.get("gpu_id"), "test": test.get("name"),
                                     "info": str(res.get("info") or res.get("warnings") or "")[:200]})
    return {"ran": True, "failures": failures, "error": None if r.returncode in (0, 226) else f"exit {r.returncode}"}


def health(diag: bool = False, timeout: float = 30.0, apps: bool = True) -> dict[str, Any]:
    """What the node says of its GPUs' health, for the pre-flight's judge (orchestrator.core.gpuhealth):
    {"gpus": [{index, pci_bus, ecc_uncorrected_volatile, retired_pages_pending, remapped_rows_failure,
    remapped_rows_pending, persistence_mode, compute_mode, memory_used_mib, processes: [{pid, used_mib}]}],
    "xid": [{pci_bus, xid, text, t}] or None (kernel log unreadable: "xid_error" says why), "clock": the node's
    time.monotonic() when the kernel log was read (the XIDs' look-back counts back from it), "dcgm": {...} when
    asked, "error": why nvidia-smi could not tell}. `apps` False: the processes are not asked (the GPU watch: the
    job's own), one nvidia-smi less."""
    out: dict[str, Any] = {"gpus": [], "xid": None, "xid_error": None, "error": None}
    smi = nvidia_smi()
    if not smi:  # nothing to ask (not a finding: the GPUs' own checks need the driver's tool)
        out["error"], out["missing"] = "nvidia-smi not found", True
        return out
    try:
        r = subprocess.run([smi, *HEALTH_QUERY], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        if r.returncode != 0 and "valid field" in r.stdout + r.stderr:  # a driver without the throttle field: the rest
            r = subprocess.run([smi, HEALTH_QUERY[0].rsplit(",", 1)[0], HEALTH_QUERY[1]], capture_output=True,
                               text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        procs = subprocess.run([smi, *APPS_QUERY], capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL) if apps else None
    except (OSError, subprocess.TimeoutExpired) as e:
        out["error"] = f"{smi}: {e}"
        return out
    if r.returncode != 0:
        last = (r.stderr or r.stdout).strip().splitlines()
        out["error"] = f"{smi} exited {r.returncode}" + (f": {last[-1]}" if last else "")
        return out
    by_bus: dict[str, dict[str, Any]] = {}
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) not in (len(HEALTH_FIELDS), len(HEALTH_FIELDS) - 1) or not parts[0].isdigit():
            continue
        gpu = {k: _value(v) for k, v in zip(HEALTH_FIELDS[:len(parts)], parts, strict=True)}  # (no throttle: left out)
        gpu["pci_bus"] = _bus(parts[1])
        gpu["processes"] = []
        out["gpus"].append(gpu)
        by_bus[gpu["pci_bus"]] = gpu
    if procs is not None and procs.returncode == 0:
        for line in procs.stdout.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[1].isdigit() and _bus(parts[0]) in by_bus:
                by_bus[_bus(parts[0])]["processes"].append({"pid": int(parts[1]), "used_mib": _value(parts[2])})
    import time
    out["clock"] = time.monotonic()
    log, why = kernel_log()
    out["xid"], out["xid_error"] = (xid_events(log), None) if log is not None else (None, why)
    if diag:
        out["dcgm"] = dcgm_diag()
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m orchestrator.node.gpus`: print this node's inventory as one JSON line (the SSH fact gathering)."""
    inv = inventory()
    inv["visible"] = visible()
    print(json.dumps(inv, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
