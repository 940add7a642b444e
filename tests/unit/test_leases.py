"""Leases on hosts and GPUs (orchestrator.core.leases: the scheme, pure; orchestrator.node.lease: flock on the host).

The pure part: lock names (the host as the plan names it, file-safe, one file per GPU), which locks a node of each kind
of job takes, when two sets conflict, the holder's text, the queue position (FIFO among conflicting jobs). The host
part with real processes: a lock lives exactly as long as its holder process (SIGKILL frees it at once), GPU-subset
jobs on disjoint GPUs run side by side while a whole-host job waits for them, the busy answer names the holder, the
files are usable by every user (dir 1777, files 0666).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.core.leases import (EXIT_BUSY, Lock, busy_text, conflict, holder, holder_text, lease_request,
                                      lock_name, node_gpus, node_locks, plan_locks, queue_position)

REPO = Path(__file__).resolve().parents[2]


def test_lock_names_carry_the_host_as_the_plan_names_it():
    assert lock_name("127.0.10.2") == "host-127.0.10.2.lock"
    assert lock_name("127.0.10.2") != lock_name("127.0.10.3")  # loopback "hosts" of one machine: no blocking
    assert lock_name("gpu01", 3) == "host-gpu01.gpu3.lock"
    assert lock_name("a/b c") == "host-a%2Fb%20c.lock"  # never a path, never two hosts on one name
    assert lock_name("a/b") != lock_name("a_b") and lock_name("") == "host-%.lock"


def test_whole_host_exclusive_gpu_subset_host_shared_plus_each_gpu():
    assert node_locks("h", None) == (Lock("host-h.lock", True, "host h"),)
    assert node_locks("h", (3, 1, 1)) == (Lock("host-h.lock", False, "host h"), Lock("host-h.gpu1.lock", True,
                                          "GPU 1 of h"), Lock("host-h.gpu3.lock", True, "GPU 3 of h"))
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "0,2"}) == (0, 2) and node_gpus({}) is None
    assert node_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None


def test_conflicts():
    whole, g01, g2 = node_locks("h", None), node_locks("h", (0, 1)), node_locks("h", (2,))
    assert conflict(whole, g01) and conflict(g01, whole) and conflict(whole, whole)
    assert conflict(g01, node_locks("h", (1,)))
    assert not conflict(g01, g2)  # disjoint GPUs of one host: side by side
    assert not conflict(whole, node_locks("other", None))


class _Node:
    def __init__(self, rank, host, env):
        self.node_rank, self.host, self.env = rank, host, env


class _Plan:
    def __init__(self, kind, accelerator, nodes, job_id="j1"):
        self.cluster_kind, self.accelerator, self.node_plans, self.job_id = kind, accelerator, nodes, job_id
        self.nodes = len(nodes)
        self.submitter = "alice@box"

    def node(self, rank):
        return self.node_plans[rank]


def test_which_backend_leases_what():
    gpu_nodes = [_Node(0, "a", {"CUDA_VISIBLE_DEVICES": "0,1"}), _Node(1, "b", {})]
    ssh = _Plan("ssh", "gpu", gpu_nodes)
    assert plan_locks(ssh, 0) == node_locks("a", (0, 1)) and plan_locks(ssh, 1) == node_locks("b", None)
    cpu = _Plan("ssh", "cpu", [_Node(0, "a", {"CUDA_VISIBLE_DEVICES": "0"})])
    assert plan_locks(cpu, 0) == node_locks("a", None)  # a CPU job on SSH: the whole host
    assert plan_locks(_Plan("local", "cpu", [_Node(0, "localhost", {})]), 0) == ()  # free port each: no lease
    assert plan_locks(_Plan("local", "gpu", gpu_nodes), 0) == node_locks("localhost", (0, 1))
    assert plan_locks(_Plan("slurm", "gpu", gpu_nodes), 0) == ()  # the scheduler allocates
    req = lease_request(ssh, 0)
    assert req == {"host": "a", "job": "j1", "submitter": "alice@box",
                   "locks": [lk.to_list() for lk in node_locks("a", (0, 1))]}
    assert json.loads(json.dumps(req)) == req and lease_request(_Plan("slurm", "gpu", gpu_nodes), 0) is None


def test_holder_text_names_job_submitter_pid_and_since():
    h = holder("t-abc", "alice@box", 4242, 1_700_000_000.0, "host-a.lock")
    assert holder_text(h) == "job t-abc (alice@box, agent pid 4242, since 22:13:20 UTC)"
    assert holder_text(None) == holder_text({}) == "another job (holder not recorded yet)"
    assert busy_text({"host": "a", "what": "GPU 1 of a", "holder": h}).startswith("GPU 1 of a is leased by job t-abc")
    assert EXIT_BUSY == 75


def test_queue_position_fifo_among_conflicting_jobs_only():
    a, ab, c = node_locks("a", None), node_locks("a", None) + node_locks("b", None), node_locks("c", None)
    queued = [("j3", 3.0, a), ("j1", 1.0, ab), ("j2", 2.0, c), ("j4", 3.0, node_locks("a", (0,)))]
    assert queue_position("j1", queued) == 1
    assert queue_position("j2", queued) == 1  # wants other hosts: nobody ahead of it
    assert queue_position("j3", queued) == 2  # j1 wants a too and came first
    assert queue_position("j4", queued) == 3  # GPU 0 of a vs whole-host a: conflicts with j1 and j3 (same time, id)
    assert queue_position("nope", queued) == 1


# ------------------------------------------------------------------------------------------- on the host

HOLD = """
import json, sys, time
from orchestrator.core.leases import Lock
from orchestrator.node.lease import take
locks = [Lock.from_list(x) for x in json.loads(sys.argv[1])]
held, busy = take(locks, {"job": sys.argv[2], "submitter": "bob@elsewhere", "pid": __import__("os").getpid(),
                           "since": time.time()}, "h")
print(json.dumps({"held": held is not None, "busy": busy}), flush=True)
time.sleep(600)
"""


@pytest.fixture
def lease_dir(tmp_path, monkeypatch):
    d = tmp_path / "leases"
    monkeypatch.setenv("ORCHESTRATE_LEASE_DIR", str(d))
    return d


def _holder(locks, job, env_dir):
    p = subprocess.Popen([sys.executable, "-c", HOLD, json.dumps([lk.to_list() for lk in locks]), job],
                         stdout=subprocess.PIPE, text=True, cwd=REPO,
                         env=dict(os.environ, ORCHESTRATE_LEASE_DIR=str(env_dir), PYTHONPATH=str(REPO)))
    line = json.loads(p.stdout.readline())
    return p, line


def test_a_lease_lives_exactly_as_long_as_its_holder_process(lease_dir):
    from orchestrator.node.lease import held, take
    p, line = _holder(node_locks("h", None), "j-first", lease_dir)
    try:
        assert line["held"], line
        t = time.monotonic()
        got, busy = take(list(node_locks("h", None)), {"job": "j-second"}, "h", try_s=0.3)
        assert got is None and time.monotonic() - t >= 0.3
        assert busy["what"] == "host h" and busy["holder"]["job"] == "j-first", busy
        assert busy["holder"]["submitter"] == "bob@elsewhere" and busy["holder"]["pid"] == p.pid
        assert "host h is leased by job j-first (bob@elsewhere, agent pid" in busy_text(busy)
        assert held(list(node_locks("other", None)), "other") is None  # another host's lock: free
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    t = time.monotonic()
    got, busy = take(list(node_locks("h", None)), {"job": "j-second"}, "h")
    assert got is not None and busy is None and time.monotonic() - t < 0.5  # the kernel freed it with the process
    assert json.loads((lease_dir / "host-h.lock").read_text())["job"] == "j-second"
    got.release()
    assert stat.S_IMODE(lease_dir.stat().st_mode) == 0o1777
    assert stat.S_IMODE((lease_dir / "host-h.lock").stat().st_mode) == 0o666


def test_gpu_subsets_side_by_side_whole_host_waits_and_names_a_gpu_holder(lease_dir):
    from orchestrator.node.lease import held, leased_gpus
    p, line = _holder(node_locks("h", (0, 1)), "j-gpus01", lease_dir)
    try:
        assert line["held"]
        assert held(list(node_locks("h", (2, 3))), "h") is None  # disjoint GPUs: free
        busy = held(list(node_locks("h", (1, 2))), "h")
        assert busy["what"] == "GPU 1 of h" and busy["holder"]["job"] == "j-gpus01", busy
        busy = held(list(node_locks("h", None)), "h")  # the whole host: held shared, the holder found by its GPU
        assert busy["what"] == "host h" and busy["holder"]["job"] == "j-gpus01", busy
        assert leased_gpus("h") == (0, 1) and leased_gpus("other") == ()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert held(list(node_locks("h", None)), "h") is None and leased_gpus("h") == ()


def test_a_whole_host_holder_blocks_gpu_jobs(lease_dir):
    from orchestrator.node.lease import held
    p, line = _holder(node_locks("h", None), "j-whole", lease_dir)
    try:
        busy = held(list(node_locks("h", (0,))), "h")
        assert busy["what"] == "host h" and busy["holder"]["job"] == "j-whole", busy
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


def test_the_queues_wake_up_counts_a_move_since_a_stamp_taken_before(tmp_path):
    """A queued submitter's try takes time (staging, a probe on every host): a job of the store that ends meanwhile
    must wake the wait that follows the try at once, not after QUEUE_POLL_S."""
    from orchestrator.store import JobStore
    store = JobStore(tmp_path / "jobs.db")
    stamp = store.wake_stamp()
    time.sleep(0.01)
    store.moved()  # a job ended while the waiter was trying
    t0 = time.monotonic()
    assert store.wait_moved(5.0, lambda s: time.sleep(s) or False, since=stamp) is True
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()  # without the stamp: only a move after the call counts
    assert store.wait_moved(0.3, lambda s: time.sleep(s) or False) is False
    assert time.monotonic() - t0 >= 0.3


def test_a_job_queued_behind_a_live_job_of_its_own_store_waits_for_its_end_not_the_poll(tmp_path, monkeypatch):
    """Its holder's end wakes it: trying every QUEUE_POLL_S meanwhile (staging, a probe per host) would only take
    CPU from the job it waits for. Another store's holder, a holder whose supervisor is gone, or one not recorded
    yet: QUEUE_POLL_S."""
    from orchestrator import running
    from orchestrator.errors import LeasesBusy
    from orchestrator.node.proctools import process_start_time
    from orchestrator.store import JobStore
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path))
    store = JobStore()
    for j in ("mine", "dead"):
        store.create(job_id=j, recipe="r", recipe_digest="d", cluster="c", backend="ssh", nodes=2, world_size=2,
                     run_dir=str(tmp_path / j))
    sup = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "supervisors").mkdir(exist_ok=True)
        (tmp_path / "supervisors" / "mine.pid").write_text(f"{sup.pid} {process_start_time(sup.pid):.3f}\n")
        (tmp_path / "supervisors" / "dead.pid").write_text("999999999 1.0\n")

        def busy(*jobs):
            return LeasesBusy([{"host": "h", "holder": {"job": j} if j else None} for j in jobs], "busy")
        assert running.queue_poll_s(store, busy("mine")) == running.QUEUE_OWN_POLL_S
        for other in (busy("mine", "dead"), busy("elsewhere"), busy(None), busy()):
            assert running.queue_poll_s(store, other) == running.QUEUE_POLL_S
    finally:
        sup.kill()
        sup.wait()


HOLD_WITH_CHILD = """
import json, subprocess, sys, time
from orchestrator.core.leases import Lock
from orchestrator.node.lease import take
from orchestrator.node.proctools import process_start_time
held, busy = take([Lock.from_list(x) for x in json.loads(sys.argv[1])], {"job": sys.argv[2]}, "h")
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
held.note([[child.pid, process_start_time(child.pid)]])  # as the agent names its launch and ranks
print(json.dumps({"child": child.pid}), flush=True)
time.sleep(600)
"""


def test_a_lease_lives_on_while_a_process_its_holder_named_lives(lease_dir):
    """A killed agent's launch and ranks live on for a while (saving, torchrun stopping them): the next taker finds
    the lock free but the host still in use, and waits (busy, naming the last holder) until the last of them is gone."""
    from orchestrator.node.lease import take
    locks = node_locks("h", None)
    p = subprocess.Popen([sys.executable, "-c", HOLD_WITH_CHILD, json.dumps([lk.to_list() for lk in locks]), "j-old"],
                         stdout=subprocess.PIPE, text=True, cwd=REPO,
                         env=dict(os.environ, ORCHESTRATE_LEASE_DIR=str(lease_dir), PYTHONPATH=str(REPO)))
    child = json.loads(p.stdout.readline())["child"]
    try:
        p.send_signal(signal.SIGKILL)  # the holder dies; the process it named does not
        p.wait()
        got, busy = take(list(locks), {"job": "j-new"}, "h", try_s=0.2)
        assert got is None and busy["holder"]["job"] == "j-old", busy
        assert json.loads((lease_dir / "host-h.lock").read_text())["job"] == "j-old"  # a look overwrites nothing
    finally:
        os.kill(child, signal.SIGKILL)
    wait = time.monotonic()
    got, busy = None, None
    while got is None and time.monotonic() - wait < 5:
        got, busy = take(list(locks), {"job": "j-new"}, "h", try_s=0.1)
    assert got is not None, busy
    assert json.loads((lease_dir / "host-h.lock").read_text())["job"] == "j-new"
    got.release()

