"""Jobs in a container (issue #25), with real podman on this machine: 2 local nodes run a built-in recipe and a
user's own Hugging Face Trainer script in the test image (which holds the CPU training stack and no orchestrate),
the ranks proven inside it (the image's marker file under each rank's /proc/PID/root) while their node agents stay
outside; a SIGKILLed submitter and `orchestrate cancel` leave no container and no process; bad container input is
refused before anything starts (exit 2, one line); the image missing on the host is a pre-flight error naming the
host and the image. The fault suite's `podman` backend (tests/faults/test_faults.py) covers a SIGKILLed rank, a
SIGSTOPped rank and a rank that exits, with the teardown time."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import OFFLINE_ENV, cli, job_pids, steps_seen, wait_gone, wait_until
from orchestrator.node.proctools import marked_ranks
from orchestrator.node.rundir import RunDir
from orchestrator.store import JobStore
from podman_testbed import containers_of, in_image

REPO = Path(__file__).resolve().parents[2]
TINY = Path(os.environ.get("ORCHESTRATE_CACHE", Path.home() / ".cache" / "orchestrate")) / "tiny" / "tiny-llama-v1"


def _job_id(text: str) -> str:
    m = re.search(r"job (\S+) (?:COMPLETED|FAILED|CANCELLED|RUNNING|PENDING)", text) or \
        re.search(r"job (\S+): run dir", text)
    assert m, text
    return m.group(1)


class InsideWatch:
    """While a job runs: which of its ranks were seen running inside the image (their agents' marked processes)."""

    def __init__(self, run_dir: Path):
        self.rd, self.inside, self.outside = RunDir(run_dir), set(), set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            for agent in self.rd.agents().values():
                for rank, pid in marked_ranks(agent.token).items():
                    (self.inside if in_image(pid) else self.outside).add(rank)
                if in_image(agent.agent_pid):
                    self.outside.add(-1)  # an agent inside: wrong
            time.sleep(0.2)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)


def _submit(job_guard, tmp_path: Path, args: list[str], *, cwd: Path = REPO) -> tuple[subprocess.Popen, str]:
    """`orchestrate submit ARGS` in the background; returns (process, job id) once the job is recorded."""
    home = job_guard.home(os.environ["ORCHESTRATE_HOME"])
    before = set(JobStore().list(1000) and [r.id for r in JobStore().list(1000)])
    proc = job_guard.spawn([sys.executable, "-m", "orchestrator.cli", "submit", *args], cwd=cwd,
                           env={**os.environ, **OFFLINE_ENV, "ORCHESTRATE_HOME": str(home)},
                           stdout=open(tmp_path / "submit.log", "w"), stderr=subprocess.STDOUT)
    job = wait_until(lambda: next((r.id for r in JobStore().list(50) if r.id not in before), None), 120, 0.1,
                     "the job recorded")
    return proc, job


@pytest.mark.slow
@pytest.mark.parametrize("what", ["builtin", "own_trainer"])
def test_training_runs_in_the_container_and_leaves_nothing(what, podman_cluster, tmp_path, job_guard):
    """COMPLETED, heartbeats from both ranks, both ranks inside the image and both agents outside, the image's id
    recorded for `status --json`, then no container and no process of the job left."""
    out = tmp_path / "out"
    if what == "builtin":
        cluster = podman_cluster(f"{tmp_path}:{tmp_path}")
        args = ["recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", str(cluster), "trainer.max_steps=8",
                f"trainer.output_dir={out}"]
    else:
        from recipes.tiny import resolve_model_path
        model = resolve_model_path("tiny-llama")
        cluster = podman_cluster(f"{tmp_path}:{tmp_path}", f"{model}:{model}:ro")
        args = ["examples/own_code/my_job.yaml", "--nodes", "2", "--cluster", str(cluster),
                f"run.args.model_name_or_path={model}", "run.args.max_steps=8", f"run.args.output_dir={out}",
                "run.args.use_cpu=true"]  # (a CPU cluster: else each node trains alone, see TrainingArguments)
    proc, job = _submit(job_guard, tmp_path, args)
    rd = RunDir(JobStore().get(job).run_dir)
    watch = InsideWatch(rd.root)
    try:
        proc.wait(300)
    finally:
        watch.stop()
    log = (tmp_path / "submit.log").read_text()
    assert proc.returncode == 0 and f"job {job} COMPLETED" in log, log[-3000:]
    assert watch.inside == {0, 1} and not watch.outside, (watch.inside, watch.outside)
    assert steps_seen(rd.root, 0) >= 1 and steps_seen(rd.root, 1) >= 1
    st = json.loads(cli("status", job, "--json").stdout)
    c = st["container"]
    assert c["runtime"] == "podman" and c["image"].startswith("localhost/orchestrate-test:"), c
    assert c["hosts"]["localhost"]["image"]["id"] and c["hosts"]["localhost"]["versions"]["torch"], c
    assert "image    localhost/orchestrate-test:" in cli("status", job).stdout
    assert containers_of(job) == []
    wait_gone(lambda: job_pids(rd.root), 10)


@pytest.mark.parametrize("how", ["sigkill_submitter", "cancel", "podman_kill"])
def test_killed_submitter_or_cancel_leaves_no_container(how, podman_cluster, tmp_path, job_guard):
    """...nor `podman kill` of a node's container, whose cause names that container and the signal (#37 item 18:
    it was "rank 1 exited (status unknown)", exit 1)."""
    cluster = podman_cluster(f"{tmp_path}:{tmp_path}")
    proc, job = _submit(job_guard, tmp_path, ["recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster",
                                              str(cluster), "trainer.max_steps=100000",
                                              f"trainer.output_dir={tmp_path / 'out'}"])
    rd = RunDir(JobStore().get(job).run_dir)
    wait_until(lambda: steps_seen(rd.root, 0) >= 2 and steps_seen(rd.root, 1) >= 2, 240, 0.2, "both ranks training")
    assert len(containers_of(job)) == 2
    for a in rd.agents().values():
        job_guard.token(a.token)
    t0 = time.monotonic()
    if how == "cancel":
        c = cli("cancel", job, timeout=90)
        assert c.returncode == 0 and "CANCELLED" in c.stdout, c.stdout + c.stderr
        proc.wait(60)
    elif how == "podman_kill":
        from orchestrator.core.container import container_name
        name = container_name(job, 1)
        k = subprocess.run(["podman", "kill", name], capture_output=True, text=True, timeout=60)
        assert k.returncode == 0, k.stderr
        proc.wait(90)
        st = json.loads(cli("status", job, "--json").stdout)
        # the signal always; the container named when the rank's own status was lost with it (its init reaped it)
        assert st["state"] == "FAILED" and ("died of SIGKILL" in st["root_cause"] or f"its container {name} was "
                                            "killed" in st["root_cause"]), st["root_cause"]
        assert "exited (status unknown)" not in st["root_cause"] and st["exit_code"] == 137, (st["exit_code"],
                                                                                               st["root_cause"])
    else:
        proc.kill()
        proc.wait(10)
    wait_until(lambda: not containers_of(job), 30, 0.05, "the job's containers gone")
    took = time.monotonic() - t0
    wait_gone(lambda: job_pids(rd.root), 15)
    print(f"{how}: last container gone {took:.2f}s after it")
    state = json.loads(cli("status", job, "--json").stdout)["state"]
    assert state == ("CANCELLED" if how == "cancel" else "FAILED"), state


@pytest.mark.parametrize("override, key", [
    ("container.runtime=podmn", "container.runtime: must be one of"),
    ("container.imag=x", "container.imag: unknown key (did you mean 'image'?)"),
    ("container.mounts=[data:/data]", "container.mounts[0]: host path must be absolute"),
    ("container.mounts=[/no/such/dir:/data]", "container.mounts[0]: host path /no/such/dir does not exist"),
    ("container.workdir=rel", "container.workdir: must be an absolute path"),
    ("container.runtime=pyxis", "container.runtime: pyxis runs containers only on SLURM"),
    ("container.image=/no/such/image.sif", "container.image: image file not found"),
])
def test_bad_container_input_is_refused_before_anything_starts(override, key, podman_cluster, tmp_path):
    home = tmp_path / "home"
    r = cli("submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", podman_cluster(), override,
            cwd=REPO, env={"ORCHESTRATE_HOME": str(home)})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and key in lines[0], r.stderr
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


def test_an_image_the_host_lacks_is_a_preflight_error_naming_host_and_image(podman_cluster, tmp_path, job_guard):
    """Not present and not pullable (no registry here): exit 2 before any node starts, host and image named."""
    home = job_guard.home(tmp_path / "home")
    r = cli("submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", podman_cluster(),
            "container.image=localhost/orchestrate-no-such-image:1", cwd=REPO, env={"ORCHESTRATE_HOME": str(home)},
            timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "localhost: container image localhost/orchestrate-no-such-image:1 is not on" in r.stderr, r.stderr
    assert "cannot be pulled" in r.stderr, r.stderr
    for run_dir in (home / "runs").iterdir():
        assert not (run_dir / "nodes" / "0" / "agent.json").exists(), "a node agent started"


def test_the_exact_rendered_apptainer_command_reaches_the_node(tmp_path, job_guard):
    """runtime apptainer on 2 local nodes, with a stand-in `apptainer` on PATH (tests/fakes/apptainer: records its
    argv, then runs the command natively): each node agent runs exactly the line `render` shows for its node (the
    node package and the run dir bound), and the job completes."""
    import yaml
    image = tmp_path / "train.sif"
    image.write_bytes(b"not really an image")
    log = tmp_path / "apptainer.jsonl"
    cluster = tmp_path / "apptainer.yaml"
    cluster.write_text(yaml.safe_dump({"kind": "local", "container": {
        "image": str(image), "runtime": "apptainer", "python": sys.executable,
        "mounts": [f"{REPO}/tests/faults:{REPO}/tests/faults:ro"]}}))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests" / "faults" / "beat_loop.py"), "args": ["5"]},
                                   "launch": {"nodes": 2}}))
    home = job_guard.home(tmp_path / "home")
    env = {"ORCHESTRATE_HOME": str(home), "FAKE_APPTAINER_LOG": str(log),
           "PATH": f"{REPO / 'tests' / 'fakes'}{os.pathsep}{os.environ['PATH']}"}
    r = cli("submit", job, "--cluster", cluster, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0 and "COMPLETED" in r.stdout, r.stdout + r.stderr
    jid = _job_id(r.stdout)
    run_dir = Path(JobStore(home / "jobs.db").get(jid).run_dir)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    launches = [c for c in calls if "accelerate.commands.launch" in c]
    assert len(launches) == 2, calls
    for node in (0, 1):
        shown = (run_dir / "nodes" / str(node) / "command.txt").read_text().strip().splitlines()[-1]
        want = [w.replace("${NODE_PACKAGE}", str(REPO)) for w in shlex.split(shown)]
        got = next(c for c in launches if f"nodes/{node}/accelerate.yaml" in " ".join(c))
        assert [Path(got[0]).name] + got[1:] == want, (got, want)
    assert any(c[1:4] == ["exec", str(image), sys.executable] for c in calls), calls  # the pre-flight's stack check


@pytest.mark.parametrize("grace", [10, 0])
def test_an_earlier_attempts_container_gets_its_grace_to_end_before_it_is_removed(grace, image, tmp_path):
    """What a new attempt's node agent does with its node's container from an earlier attempt that is still there
    (SLURM's requeue killed that attempt's agent, not the container, whose ranks may be saving a checkpoint):
    with a grace the container gets TERM and time to finish (its 'checkpoint' lands), then it is gone; removed at
    once (grace 0, what the agent did before) the save is cut off. Real podman, the test image."""
    from orchestrator.core.container import LABEL, container_name
    from orchestrator.node.containers import remove
    job = f"earlier-{time.time_ns()}"
    name = container_name(job, 0)
    saver = ("import signal, sys, time\n"
             "def stop(*_):\n"
             "    time.sleep(2)\n"
             "    open('/out/saved', 'w').write('whole')\n"
             "    sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             "open('/out/ready', 'w').write('1')\n"
             "time.sleep(600)\n")
    run = subprocess.run(["podman", "run", "-d", "--rm", "--name", name, "--label", f"{LABEL}={job}",
                          "-v", f"{tmp_path}:/out", image, "python3", "-c", saver],
                         capture_output=True, text=True, timeout=120)
    try:
        assert run.returncode == 0, run.stderr
        wait_until(lambda: (tmp_path / "ready").exists(), 60, 0.1, "the container's process up")
        t0 = time.monotonic()
        assert remove("podman", job, 0, grace=grace) == ""
        took = time.monotonic() - t0
        assert containers_of(job) == []
        if grace:
            assert (tmp_path / "saved").read_text() == "whole"
            assert 2 <= took < grace + 5, took
        else:
            assert not (tmp_path / "saved").exists()
    finally:
        subprocess.run(["podman", "rm", "-f", "--time", "0", "--ignore", name], capture_output=True, timeout=120)
