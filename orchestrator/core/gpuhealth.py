"""GPU health rules of the pre-flight: pure. A node reports what its driver says (orchestrator.node.gpus.health:
nvidia-smi's fields, the processes on each GPU, XID errors from the kernel log, `dcgmi diag` when asked); `judge`
names every finding on the GPUs the job would use, with host, GPU index, the field and its value; `verdict` applies
the job's policy (`health.gpu_check`): fail (refuse to start, exit 2), warn (start, say it), exclude_host (the host
is not used: a spare takes its place, docs/CONTRACT.md "Bad nodes").

What counts as bad (each a reason a job on that GPU fails or corrupts its results):
- `ecc_uncorrected_volatile` > 0: uncorrectable ECC errors since the driver loaded;
- `retired_pages_pending` / `remapped_rows_pending` = Yes: a retirement or remap that needs a reset to take effect;
  `remapped_rows_failure` = Yes: the GPU ran out of spare rows;
- an XID in the kernel log that means hardware trouble (CRITICAL_XID; application faults such as 13, 31, 43 are not
  counted: they follow a program's own bug);
- `compute_mode` = Prohibited (no process may use it), or Exclusive_Process with a process already on it;
- another process on the GPU (its memory and compute are not the job's);
- a failed `dcgmi diag -r 1` test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POLICIES = ("fail", "warn", "exclude_host")
DIAGS = ("none", "dcgm")
# XID codes that mean the hardware (not the program) is in trouble (NVIDIA's XID catalogue).
CRITICAL_XID = {48: "double-bit ECC error", 61: "internal micro-controller breakpoint", 62: "internal micro-controller "
                "halt", 63: "ECC page retirement or row remapping event", 64: "ECC page retirement or row remap "
                "failure", 74: "NVLink error", 79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate",
                94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
                140: "ECC unrecovered error"}


@dataclass(frozen=True)
class GpuFinding:
    host: str
    gpu: int | None  # None: the host as a whole (nvidia-smi failed)
    field: str
    value: str
    why: str

    def text(self) -> str:
        where = f"GPU {self.gpu}" if self.gpu is not None else "GPUs"
        return f"{where}: {self.field} = {self.value} ({self.why})"


def judge(host: str, health: dict[str, Any], used: tuple[int, ...] | None = None,
          diag_asked: bool = False) -> list[GpuFinding]:
    """Every finding on `host`'s GPUs that the job would use (`used`: indices; None: every GPU)."""
    out: list[GpuFinding] = []
    if health.get("missing"):  # no nvidia-smi to ask: nothing is known, nothing is judged
        return out
    if health.get("error") and not health.get("gpus"):
        return [GpuFinding(host, None, "nvidia-smi", str(health["error"])[:200], "the GPUs' health cannot be read")]
    gpus = [g for g in health.get("gpus") or [] if used is None or g.get("index") in used]
    by_bus = {g.get("pci_bus"): g.get("index") for g in health.get("gpus") or []}
    for g in gpus:
        i = g.get("index")
        ecc = g.get("ecc_uncorrected_volatile")
        if isinstance(ecc, int) and ecc > 0:
            out.append(GpuFinding(host, i, "ecc.errors.uncorrected.volatile.total", str(ecc),
                                  "uncorrectable ECC errors since the driver loaded"))
        for field, name, why in (("retired_pages_pending", "retired_pages.pending", "page retirement pending a reset"),
                                 ("remapped_rows_pending", "remapped_rows.pending", "row remap pending a reset"),
                                 ("remapped_rows_failure", "remapped_rows.failure", "no spare rows left")):
            if str(g.get(field) or "").lower() == "yes":
                out.append(GpuFinding(host, i, name, "Yes", why))
        mode = str(g.get("compute_mode") or "")
        procs = g.get("processes") or []
        if mode.lower() == "prohibited":
            out.append(GpuFinding(host, i, "compute_mode", mode, "no process may use this GPU"))
        if procs:
            shown = ", ".join(f"pid {p.get('pid')} ({p.get('used_mib')} MiB)" for p in procs[:3])
            out.append(GpuFinding(host, i, "processes", shown + (f" and {len(procs) - 3} more" if len(procs) > 3
                                                                  else ""),
                                  "another process already uses this GPU" + (" (Exclusive_Process: the job cannot)"
                                                                             if "exclusive" in mode.lower() else "")))
    seen: set[tuple[int | None, int]] = set()
    for ev in health.get("xid") or []:
        gpu = by_bus.get(ev.get("pci_bus"))
        code = ev.get("xid")
        if code not in CRITICAL_XID or (used is not None and gpu not in used) or (gpu, code) in seen:
            continue
        seen.add((gpu, code))
        out.append(GpuFinding(host, gpu, "xid", str(code), f"{CRITICAL_XID[code]} in the kernel log"))
    if diag_asked:
        dcgm = health.get("dcgm") or {}
        for f in dcgm.get("failures") or []:
            gpu = f.get("gpu")
            gpu = int(gpu) if isinstance(gpu, (int, str)) and str(gpu).isdigit() else None
            if used is None or gpu is None or gpu in used:
                out.append(GpuFinding(host, gpu, f"dcgmi diag {f.get('test')}", "fail", str(f.get("info") or "")))
    return out


def verdict(findings: list[GpuFinding], policy: str) -> tuple[list[GpuFinding], list[GpuFinding], set[str]]:
    """(refusals, warnings, hosts to exclude) under `policy` (health.gpu_check)."""
    if policy == "warn":
        return [], list(findings), set()
    if policy == "exclude_host":
        return [], list(findings), {f.host for f in findings}
    return list(findings), [], set()
