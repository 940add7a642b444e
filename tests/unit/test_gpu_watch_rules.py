"""GPU health during the job (issue #34 item 6), the pure parts and the node's watch without a job: the XID window
(the pre-flight's look-back, the watch's job start), what the watch judges fatal (orchestrator.core.gpuhealth.watch:
what changed since its first look, by the pre-flight's own fields), the hardware throttle said not fatal, an unreadable
kernel log said once (orchestrator.node.gpuwatch.GpuWatch), and the supervisor's attribution of a GPU fault to its
host (a health failure: the restart policy takes a spare)."""

from __future__ import annotations

import pytest

from orchestrator.core.gpuhealth import judge, kernel_log_note, throttle, watch, xid_window
from orchestrator.core.spec import parse_recipe
from orchestrator.errors import ConfigError
from orchestrator.events import NodeEnded
from orchestrator.node.gpus import xid_events
from orchestrator.node.gpuwatch import GpuWatch
from orchestrator.node.rundir import ExitRecord, RunDir
from orchestrator.supervise import RestartPolicy
from orchestrator.supervise import judge as judge_attempt

GOOD = {"ecc_uncorrected_volatile": 0, "retired_pages_pending": "No", "remapped_rows_failure": "No",
        "remapped_rows_pending": "No", "compute_mode": "Default", "processes": [], "throttle": "0x0000000000000000"}


def gpu(i: int, **over) -> dict:
    return dict(GOOD, index=i, pci_bus=f"0000:{0x10 + i:02x}:00", **over)


def xid(t: float | None, bus: int, code: int) -> str:
    return (f"[{t:12.6f}] " if t is not None else "") + f"NVRM: Xid (PCI:0000:{bus:02x}:00): {code}, pid=7, x\n"


def test_xid_stamps_and_the_pre_flight_look_back():
    log = xid(100.0, 0x11, 79) + xid(4000.0, 0x10, 48) + "[ 4001.0] unrelated\n"
    events = xid_events(log)
    assert [(e["t"], e["pci_bus"], e["xid"]) for e in events] == [(100.0, "0000:11:00", 79), (4000.0, "0000:10:00", 48)]
    assert xid_window(events, 3000.0) == events[1:] and xid_window(events, None) == events
    health = {"gpus": [gpu(0), gpu(1)], "xid": events, "clock": 4100.0}
    # the last hour: only GPU 0's XID 48 of 100 s ago; GPU 1's XID 79 of an hour before is not this host's now
    assert [(f.gpu, f.value) for f in judge("h", health, xid_lookback_s=3600)] == [(0, "48")]
    assert judge("h", health, xid_lookback_s=3600)[0].text().endswith("in the kernel log of the last 3600 s)")
    assert [(f.gpu, f.value) for f in judge("h", health)] == [(1, "79"), (0, "48")]  # 0: since boot
    untimed = dict(health, xid=xid_events(xid(None, 0x11, 79)))  # no stamp: cannot be placed, counted
    assert [(f.gpu, f.value) for f in judge("h", untimed, xid_lookback_s=60)] == [(1, "79")]


def test_the_watch_judges_what_changed_since_its_first_look():
    first = {"gpus": [gpu(0), gpu(1, ecc_uncorrected_volatile=3)], "xid": xid_events(xid(50.0, 0x10, 79))}
    assert watch("gpu02", first, first, since=100.0) == []  # an old XID and ECC errors the job began with: not new
    now = {"gpus": [gpu(0, ecc_uncorrected_volatile=2), gpu(1, ecc_uncorrected_volatile=3)],
           "xid": first["xid"] + xid_events(xid(120.0, 0x11, 79) + xid(121.0, 0x11, 13))}
    found = watch("gpu02", first, now, since=100.0)
    assert [f.named() for f in found] == ["uncorrectable ECC errors rose 0->2 on GPU 0 of gpu02",
                                          "XID 79 (GPU has fallen off the bus) on GPU 1 of gpu02"]  # 13: a program's
    assert [f.gpu for f in watch("gpu02", first, now, since=100.0, used=(1,))] == [1]  # GPU 0 is not this node's
    flipped = {"gpus": [gpu(0, remapped_rows_pending="Yes"), gpu(1, ecc_uncorrected_volatile=3)], "xid": []}
    assert [f.named() for f in watch("h", first, flipped, since=100.0)] == [
        "remapped_rows.pending became Yes (row remap pending a reset) on GPU 0 of h"]
    # a log printed without stamps: only lines beyond those of the first look are new
    plain = {"gpus": [gpu(0)], "xid": xid_events(xid(None, 0x10, 79) + xid(None, 0x10, 48))}
    assert [f.value for f in watch("h", plain, plain, since=0.0, untimed=1)] == ["48"]


def test_throttle_is_said_for_the_hardware_reasons_only():
    health = {"gpus": [gpu(0, throttle="0x0000000000000001"), gpu(1, throttle="0x0000000000000044"),
                       gpu(2, throttle=None)]}
    found = throttle("h", health)
    assert [(f.gpu, f.why) for f in found] == [(1, "HW thermal slowdown")]  # 0x4 power cap, 0x1 idle: normal
    assert throttle("h", health, used=(0,)) == []


def test_an_unreadable_kernel_log_is_said_once_and_a_fault_recorded(tmp_path):
    said: list[str] = []
    looks = [{"gpus": [gpu(0)], "xid": None, "xid_error": "dmesg: read kernel buffer failed: Operation not permitted",
              "clock": 10.0}] * 3
    looks.append({"gpus": [gpu(0, ecc_uncorrected_volatile=1)], "xid": None, "xid_error": "same", "clock": 12.0})
    rd = RunDir(tmp_path)
    w = GpuWatch(rd, 1, "gpu02", (0,), 1.0, health=lambda: looks.pop(0), say=said.append)
    assert [w.poll() for _ in range(3)] == [None, None, None]
    assert said == ["orchestrate node agent: warning: GPU watch: gpu02: the kernel log could not be read (dmesg: read "
                    "kernel buffer failed: Operation not permitted): XID errors are not checked"]
    assert w.poll() == "uncorrectable ECC errors rose 0->1 on GPU 0 of gpu02"
    rec = rd.gpu_watch(1)
    assert rec is not None and rec.polls == 4 and rec.fault == w.record.fault and rec.used == [0]
    assert len(rec.warnings) == 1 and rec.findings == ["uncorrectable ECC errors rose 0->1 on GPU 0 of gpu02"]
    assert kernel_log_note("h", {"gpus": [gpu(0)], "xid": []}) is None
    assert kernel_log_note("h", {"missing": True, "gpus": []}) is None


def test_warn_says_the_finding_and_runs_on(tmp_path):
    said: list[str] = []
    looks = [{"gpus": [gpu(0)], "xid": []}, {"gpus": [gpu(0, retired_pages_pending="Yes")], "xid": []}]
    w = GpuWatch(RunDir(tmp_path), 0, "h", None, 1.0, policy="warn", health=lambda: looks[min(1, w.record.polls)],
                 say=said.append)
    assert [w.poll() for _ in range(3)] == [None, None, None] and len(said) == 1 and "GPU 0 of h" in said[0]


def test_a_gpu_fault_is_the_root_cause_and_a_health_failure_of_its_host():
    fault = "XID 79 (GPU has fallen off the bus) on GPU 1 of b"
    ends = {0: NodeEnded(0, "a", 1, "Connection reset by peer", ExitRecord(returncode=1, time=100.0,
                                                                            rank_death="rank 0 died")),
            1: NodeEnded(1, "b", 74, "", ExitRecord(returncode=74, time=103.0, gpu_fault=fault))}
    r = judge_attempt(ends, torn_down_at=100.5, hang=None, cancel=None)
    assert r.root_cause == f"node 1 (b) failed: GPU watch: {fault}", r.root_cause
    assert (r.culprit_host, r.culprit_kind) == ("b", "health") and r.nodes[1].note == fault
    d = RestartPolicy(1).decide([], 5, culprit_host="b", culprit_kind="health", spares=1)
    assert d.restart and d.exclude == "b"


@pytest.mark.parametrize("key", ["gpu_watch_s", "xid_lookback_s"])
def test_the_keys_are_validated(key):
    base = {"recipe": "sft", "model": {"name_or_path": "m"}, "data": {"path": "/d.jsonl"}}
    assert getattr(parse_recipe(base).health, key) == {"gpu_watch_s": 30.0, "xid_lookback_s": 3600.0}[key]
    with pytest.raises(ConfigError) as e:
        parse_recipe(dict(base, health={key: -1}))
    assert f"health.{key}: must be a number >= 0, got -1" in str(e.value)
