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
  counted: they follow a program's own bug), inside a window: the pre-flight counts those of the last
  `health.xid_lookback_s` seconds (`xid_window`), not the whole log since boot;
- `compute_mode` = Prohibited (no process may use it), or Exclusive_Process with a process already on it;
- another process on the GPU (its memory and compute are not the job's);
- a failed `dcgmi diag -r 1` test.

During the job (`watch`, the node agent's GPU watch every `health.gpu_watch_s`): what CHANGED since the watch's first
look is judged by the same fields: uncorrectable ECC errors that rose, a retirement / remap that became pending, a
remap failure, a hardware XID stamped after the job started. A throttle reason of the hardware (`throttle`) is said,
not fatal. `kernel_log_note` says why XIDs could not be judged (an unreadable kernel log): said once, never skipped.
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


# clocks_throttle_reasons.active bits that mean the hardware slows the GPU (the others: idle, power cap, app clocks)
HW_THROTTLE = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
               0x80: "HW power brake slowdown"}


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

    def named(self) -> str:
        """`XID 79 (GPU has fallen off the bus) on GPU 1 of gpu02`: the watch's root cause, host and GPU named."""
        return f"{self.why} on GPU {self.gpu if self.gpu is not None else '?'} of {self.host}"


def xid_window(events: list[dict[str, Any]], since: float | None) -> list[dict[str, Any]]:
    """The XID events stamped at or after `since` (the kernel's seconds since boot, as the node's CLOCK_MONOTONIC
    reads them); None: every event. An event without a stamp (a log printed without times) cannot be placed: kept."""
    if since is None:
        return list(events)
    return [e for e in events if not isinstance(e.get("t"), (int, float)) or e["t"] >= since]


def kernel_log_note(host: str, health: dict[str, Any]) -> str | None:
    """Why XIDs could not be judged on `host` (its kernel log was unreadable), or None: a warning said once."""
    if health.get("missing") or health.get("xid") is not None or not health.get("gpus"):
        return None
    return (f"{host}: the kernel log could not be read ({health.get('xid_error') or 'no reason given'}): XID errors "
            f"are not checked")


def hardware_state(g: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, value, why) of every bad hardware fact of one GPU's health record (pre-flight and watch alike)."""
    out = []
    ecc = g.get("ecc_uncorrected_volatile")
    if isinstance(ecc, int) and ecc > 0:
        out.append(("ecc.errors.uncorrected.volatile.total", str(ecc), "uncorrectable ECC errors since the driver "
                    "loaded"))
    for field, name, why in (("retired_pages_pending", "retired_pages.pending", "page retirement pending a reset"),
                             ("remapped_rows_pending", "remapped_rows.pending", "row remap pending a reset"),
                             ("remapped_rows_failure", "remapped_rows.failure", "no spare rows left")):
        if str(g.get(field) or "").lower() == "yes":
            out.append((name, "Yes", why))
    return out


def judge(host: str, health: dict[str, Any], used: tuple[int, ...] | None = None,
          diag_asked: bool = False, xid_lookback_s: float = 0.0) -> list[GpuFinding]:
    """Every finding on `host`'s GPUs that the job would use (`used`: indices; None: every GPU). XIDs count within
    the last `xid_lookback_s` seconds before the node read its kernel log (health["clock"]); 0: since boot."""
    out: list[GpuFinding] = []
    if health.get("missing"):  # no nvidia-smi to ask: nothing is known, nothing is judged
        return out
    if health.get("error") and not health.get("gpus"):
        return [GpuFinding(host, None, "nvidia-smi", str(health["error"])[:200], "the GPUs' health cannot be read")]
    gpus = [g for g in health.get("gpus") or [] if used is None or g.get("index") in used]
    by_bus = {g.get("pci_bus"): g.get("index") for g in health.get("gpus") or []}
    for g in gpus:
        i = g.get("index")
        out.extend(GpuFinding(host, i, name, value, why) for name, value, why in hardware_state(g))
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
    clock = health.get("clock")
    since = clock - xid_lookback_s if xid_lookback_s > 0 and isinstance(clock, (int, float)) else None
    seen: set[tuple[int | None, int]] = set()
    for ev in xid_window(health.get("xid") or [], since):
        gpu = by_bus.get(ev.get("pci_bus"))
        code = ev.get("xid")
        if code not in CRITICAL_XID or (used is not None and gpu not in used) or (gpu, code) in seen:
            continue
        seen.add((gpu, code))
        out.append(GpuFinding(host, gpu, "xid", str(code), f"{CRITICAL_XID[code]} in the kernel log" + (
            f" of the last {xid_lookback_s:g} s" if since is not None else "")))
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


def watch(host: str, first: dict[str, Any], now: dict[str, Any], since: float, used: tuple[int, ...] | None = None,
          untimed: int = 0) -> list[GpuFinding]:
    """The fatal findings of the GPU watch: what changed on `host`'s used GPUs between the watch's `first` look and
    `now` (health records of orchestrator.node.gpus.health), by the pre-flight's fields (`hardware_state`): ECC errors
    that rose ("uncorrectable ECC errors rose 0->2"), a pending retirement / remap or a remap failure that appeared,
    and a hardware XID stamped at or after `since` (the job's start, node clock). An XID line without a stamp counts
    when it is beyond the `untimed` such lines the first look saw."""
    out: list[GpuFinding] = []
    before = {g.get("index"): g for g in first.get("gpus") or []}
    for g in now.get("gpus") or []:
        i = g.get("index")
        if used is not None and i not in used:
            continue
        old = before.get(i, {})
        was = {name for name, _, _ in hardware_state(old)}
        for name, value, why in hardware_state(g):
            if name == "ecc.errors.uncorrected.volatile.total":
                n0 = old.get("ecc_uncorrected_volatile") if isinstance(old.get("ecc_uncorrected_volatile"), int) else 0
                if int(value) > n0:
                    out.append(GpuFinding(host, i, name, value, f"uncorrectable ECC errors rose {n0}->{value}"))
            elif name not in was:
                out.append(GpuFinding(host, i, name, value, f"{name} became {value} ({why})"))
    by_bus = {g.get("pci_bus"): g.get("index") for g in now.get("gpus") or []}
    events = now.get("xid") or []
    stamped = [e for e in events if isinstance(e.get("t"), (int, float))]
    fresh = xid_window(stamped, since) + [e for e in events if not isinstance(e.get("t"), (int, float))][untimed:]
    seen: set[tuple[int | None, int]] = set()
    for ev in fresh:
        gpu, code = by_bus.get(ev.get("pci_bus")), ev.get("xid")
        if code not in CRITICAL_XID or (used is not None and gpu not in used) or (gpu, code) in seen:
            continue
        seen.add((gpu, code))
        out.append(GpuFinding(host, gpu, "xid", str(code), f"XID {code} ({CRITICAL_XID[code]})"))
    return out


def throttle(host: str, health: dict[str, Any], used: tuple[int, ...] | None = None) -> list[GpuFinding]:
    """The GPUs the hardware slows down now (clocks_throttle_reasons.active, HW_THROTTLE bits): said, not fatal."""
    out = []
    for g in health.get("gpus") or []:
        raw, i = g.get("throttle"), g.get("index")
        if (used is not None and i not in used) or raw is None:
            continue
        try:
            bits = int(str(raw), 0)
        except ValueError:
            continue
        names = [name for bit, name in HW_THROTTLE.items() if bits & bit]
        if names:
            out.append(GpuFinding(host, i, "clocks_throttle_reasons.active", str(raw), ", ".join(names)))
    return out
