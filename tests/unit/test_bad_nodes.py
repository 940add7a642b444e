"""Bad nodes, the pure parts (issue #26): the GPU health judge and policy (orchestrator.core.gpuhealth), what a
failure is attributable to (supervise.judge), and the one RestartPolicy's host rules (take a host out at once when it
was lost or failed its health check, when its rank crashed twice in a row; a spare must be left; no crash-loop stop
across a replacement)."""

from __future__ import annotations

import pytest

from orchestrator.core.gpuhealth import judge as judge_gpus
from orchestrator.core.gpuhealth import verdict
from orchestrator.events import NodeEnded
from orchestrator.node.gpus import xid_events
from orchestrator.node.rundir import AttemptRecord, ExitRecord
from orchestrator.supervise import RestartPolicy, judge

GOOD = {"index": 0, "pci_bus": "0000:10:00", "ecc_uncorrected_volatile": 0, "retired_pages_pending": "No",
        "remapped_rows_failure": "No", "remapped_rows_pending": "No", "persistence_mode": "Enabled",
        "compute_mode": "Default", "memory_used_mib": 0, "processes": []}


def gpu(i: int, **over) -> dict:
    return dict(GOOD, index=i, pci_bus=f"0000:{0x10 + i:02x}:00", **over)


@pytest.mark.parametrize("over, field, value", [
    ({"ecc_uncorrected_volatile": 2}, "ecc.errors.uncorrected.volatile.total", "2"),
    ({"retired_pages_pending": "Yes"}, "retired_pages.pending", "Yes"),
    ({"remapped_rows_failure": "Yes"}, "remapped_rows.failure", "Yes"),
    ({"remapped_rows_pending": "Yes"}, "remapped_rows.pending", "Yes"),
    ({"compute_mode": "Prohibited"}, "compute_mode", "Prohibited"),
    ({"processes": [{"pid": 77, "used_mib": 1234}]}, "processes", "pid 77 (1234 MiB)"),
])
def test_each_bad_field_is_named_with_host_gpu_and_value(over, field, value):
    found = judge_gpus("gpu02", {"gpus": [gpu(0), gpu(1, **over)]})
    assert [(f.host, f.gpu, f.field, f.value) for f in found] == [("gpu02", 1, field, value)]
    assert found[0].text().startswith(f"GPU 1: {field} = {value} (")


def test_healthy_gpus_and_unused_ones_say_nothing():
    assert judge_gpus("h", {"gpus": [gpu(0), gpu(1)], "xid": []}) == []
    bad = {"gpus": [gpu(0), gpu(1, ecc_uncorrected_volatile=5)]}
    assert judge_gpus("h", bad, used=(0,)) == []  # the job binds GPU 0 only
    assert judge_gpus("h", bad, used=(1,))[0].gpu == 1


def test_xid_errors_from_the_kernel_log_map_to_gpus_and_only_hardware_ones_count():
    log = ("[ 10.1] NVRM: Xid (PCI:0000:11:00): 79, pid=1234, GPU has fallen off the bus.\n"
           "[ 10.2] NVRM: Xid (PCI:0000:10:00): 13, pid=99, Graphics Exception\n"  # a program's fault: not counted
           "[ 10.3] NVRM: Xid (PCI:0000:11:00): 79, pid=1234, GPU has fallen off the bus.\n")
    found = judge_gpus("h", {"gpus": [gpu(0), gpu(1)], "xid": xid_events(log)})
    assert [(f.gpu, f.field, f.value) for f in found] == [(1, "xid", "79")]  # once, however often it was logged


def test_nvidia_smi_failing_is_a_finding_of_the_host():
    found = judge_gpus("h", {"gpus": [], "error": "nvidia-smi exited 9: NVIDIA-SMI has failed"})
    assert found[0].gpu is None and "cannot be read" in found[0].why


def test_dcgm_failures_count_only_when_asked():
    h = {"gpus": [gpu(0)], "dcgm": {"ran": True, "failures": [{"gpu": 0, "test": "memory", "info": "bad page"}]}}
    assert judge_gpus("h", h) == []
    assert judge_gpus("h", h, diag_asked=True)[0].field == "dcgmi diag memory"


def test_policy():
    found = judge_gpus("b", {"gpus": [gpu(0, ecc_uncorrected_volatile=1)]})
    assert verdict(found, "fail") == (found, [], set())
    assert verdict(found, "warn") == ([], found, set())
    assert verdict(found, "exclude_host") == ([], found, {"b"})


# ------------------------------------------------------------------------------------------------ attribution

def ended(node: int, host: str, rc: int | None, tail: str = "", lost: str = "", rank_death: str | None = None):
    rec = None if lost else ExitRecord(returncode=rc or 0, time=100.0 + node, rank_death=rank_death)
    return NodeEnded(node, host, rc, tail, rec, lost)


def test_a_failure_names_its_host_and_how():
    r = judge({0: ended(0, "a", 0), 1: ended(1, "b", 137, rank_death="rank 1 died of SIGKILL")},
              torn_down_at=None, hang=None, cancel=None)
    assert (r.state, r.culprit_host, r.culprit_kind) == ("FAILED", "b", "crash")
    r = judge({0: ended(0, "a", 0), 1: ended(1, "b", None, lost="ssh connection lost")}, torn_down_at=None, hang=None,
              cancel=None)
    assert (r.culprit_host, r.culprit_kind) == ("b", "lost")
    r = judge({0: ended(0, "a", 0), 1: ended(1, "b", 2, tail="PreflightError: GPU health: GPU 1: ...")},
              torn_down_at=None, hang=None, cancel=None)
    assert (r.culprit_host, r.culprit_kind) == ("b", "health")
    r = judge({0: ended(0, "a", 124)}, torn_down_at=1.0, hang="rank 1 on b hung", cancel=None, hang_host="b")
    assert (r.hung, r.culprit_host, r.culprit_kind) == (True, "b", "hang")
    assert judge({0: ended(0, "a", 0)}, torn_down_at=None, hang=None, cancel=None).culprit_host == ""
    # SLURM: a node agent's own verdict; the analysis named rank 3, which runs on b (not stopped: no "is stopped")
    text = ("hang at all_reduce #5 (group 0): rank 3 never entered it; rank 3 is in train.py:4 in load; 3 ranks wait "
            "in all_reduce #5; rank 3 runs on b; RUN_DIR/diagnosis.json")
    hung = NodeEnded(0, "a", 124, "", ExitRecord(returncode=124, time=1.0, hang=text, stop_reason="hang: " + text))
    r = judge({0: hung, 1: ended(1, "b", 143)}, torn_down_at=None, hang=None, cancel=None)
    assert (r.hung, r.culprit_host, r.culprit_kind) == (True, "b", "hang"), r


def test_nodes_the_scheduler_stopped_after_the_cause_are_stopped_not_failed():
    """SLURM: --kill-on-bad-exit SIGTERMs the other nodes at once; the supervisor hears of every end only at the job's
    end, seconds later (16 nodes: 3.7 s). Those nodes were stopped because node 1 failed, not failures of their own."""
    def node(r: int, rc: int, t: float, stop: str = "", death: str | None = None) -> NodeEnded:
        return NodeEnded(r, f"node{r + 1}", rc, "", ExitRecord(returncode=rc, time=t, stop_reason=stop,
                                                                 rank_death=death))
    ends = {0: node(0, 143, 100.3, "signal SIGTERM"), 1: node(1, 137, 100.0), 2: node(2, 143, 100.4, "signal SIGTERM"),
            3: node(3, 1, 100.2, death="rank 24 died of SIGSEGV")}
    r = judge(ends, torn_down_at=104.0, hang=None, cancel=None)
    assert r.state == "FAILED" and r.root_cause.startswith("node 1 "), r.root_cause
    assert [n.end for n in r.nodes] == ["stopped", "failed", "stopped", "failed"], r.nodes
    early = {0: node(0, 143, 99.0, "signal SIGTERM"), 1: node(1, 137, 100.0)}  # told to stop BEFORE the failure
    assert [n.end for n in judge(early, torn_down_at=104.0, hang=None, cancel=None).nodes] == ["failed", "failed"]

    # the step's TERM reached the launch before its agent's own TERM: no stop reason, the launch died of SIGTERM
    def termed(r: int, t: float) -> NodeEnded:
        return NodeEnded(r, f"node{r + 1}", 143, "", ExitRecord(returncode=143, time=t, signal=15))
    r = judge({0: termed(0, 100.3), 1: node(1, 137, 100.0)}, torn_down_at=104.0, hang=None, cancel=None)
    assert r.root_cause.startswith("node 1 "), r.root_cause
    assert [(n.end, n.note) for n in r.nodes] == [("stopped", "SIGTERM from outside (the scheduler's teardown)"),
                                                  ("failed", "")], r.nodes


# ------------------------------------------------------------------------------------------------ RestartPolicy

def attempt(n: int, host: str = "", kind: str = "", decision: str = "restart", step: int | None = 5, exclude=""):
    return AttemptRecord(t=float(n), attempt=n, decision=decision, reason="r", step=step, host=host, kind=kind,
                         exclude=exclude)


P = RestartPolicy(3)


@pytest.mark.parametrize("kind", ["lost", "health", "straggler"])
def test_a_lost_unhealthy_or_slow_host_goes_at_once_when_a_spare_is_left(kind):
    d = P.decide([], 10, culprit_host="b", culprit_kind=kind, spares=1)
    assert d.restart and d.exclude == "b" and "without b" in d.why
    d = P.decide([], 10, culprit_host="b", culprit_kind=kind, spares=0)
    assert not d.restart and "no spare host is left" in d.why


def test_a_crash_is_retried_on_the_same_hosts_once_then_the_host_goes():
    d = P.decide([], 10, culprit_host="b", culprit_kind="crash", spares=1)
    assert d.restart and d.exclude == ""
    d = P.decide([attempt(0, "b", "crash", step=10)], 10, culprit_host="b", culprit_kind="crash", spares=1)
    assert d.restart and d.exclude == "b" and "twice in a row" in d.why  # no progress, yet not a crash loop: replaced
    d = P.decide([attempt(0, "a", "crash", step=10)], 12, culprit_host="b", culprit_kind="crash", spares=1)
    assert d.restart and d.exclude == ""  # another host's crash before: not twice on b


def test_no_host_rules_where_hosts_cannot_be_replaced_and_the_old_rules_hold():
    assert P.decide([], 10, culprit_host="localhost", culprit_kind="lost", spares=None).exclude == ""
    d = P.decide([attempt(0), attempt(1), attempt(2)], 10, culprit_host="b", culprit_kind="lost", spares=1)
    assert not d.restart and "budget spent" in d.why
    d = P.decide([attempt(0, step=10)], 10)
    assert not d.restart and "crash loop" in d.why
    d = P.decide([attempt(0, step=10, exclude="b")], 10)  # the host set changed since: worth the restart
    assert d.restart


def test_no_nvidia_smi_to_ask_is_no_finding_but_a_failing_one_is():
    assert judge_gpus("h", {"gpus": [], "error": "nvidia-smi not found", "missing": True}) == []
    assert judge_gpus("h", {"gpus": [], "error": "nvidia-smi exited 9"})[0].field == "nvidia-smi"


def test_no_spare_is_named_where_spares_are_not_the_question():
    """Restarts off: the agent's host was lost, but no restart was to come anyway (not 'no spare host is left'); a
    pre-flight problem that a spare cannot fix (the job's main port taken, the same missing image on two hosts) names
    no spare either, one that only a host has does."""
    from orchestrator.supervise import spares_matter
    d = RestartPolicy(0).decide([], 10, culprit_host="b", culprit_kind="lost", spares=0)
    assert not d.restart and d.why == "restarts are off (health.max_restarts=0)", d.why
    d = RestartPolicy(1).decide([attempt(0)], 10, culprit_host="b", culprit_kind="lost", spares=0)
    assert not d.restart and "budget spent" in d.why and "spare" not in d.why, d.why
    assert not spares_matter({"a": "a: main port 29500 is in use on the main node (Address already in use)"})
    assert not spares_matter({"h1": "image x:1 not found on h1", "h2": "image x:1 not found on h2"})
    assert spares_matter({"h2": "h2: remote python /usr/bin/python3 cannot import accelerate"})
    assert spares_matter({"h1": "image x:1 not found on h1", "h2": "unreachable: timed out"})
