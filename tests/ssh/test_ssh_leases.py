"""A queue with leases on SSH host pools (issue #27 part 2), on real sshd hosts: two submitters with DIFFERENT job
stores (ORCHESTRATE_HOMEs: two users) on overlapping hosts never double-book a host; the lease lives on the host (the
node agent's flock), so it ends with its holder.

- Job A on hosts [a, b] and job B on [b, c], started at the same time: both COMPLETED; per host, the agents' intervals
  (agent.json `started` .. exit.json `time`) never overlap; the one that waited said QUEUED, naming the holder.
- SIGKILL of the holder's agent on the shared host: the waiting job's agent starts within seconds of the last
  process of the holder's job there (its ranks save for SAVE_S on the way out), never beside them.
- `submit --no-wait` while the host is held: exit 75 at once, one line naming the host, the lease and the holder job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from helpers import OFFLINE_ENV, PYTHON, cli, looping_job, read_looping_ranks, read_until, wait_until
from orchestrator.node.proctools import alive
from ssh_helpers import REPO, agent_info, live_members, remote_run_dir

EXIT_BUSY = 75


def _cluster(testbed, tmp_path: Path, name: str, hosts: list[str]) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(testbed.cluster(name, hosts=hosts)))
    return path


def _short_job(tmp_path: Path, seconds: float) -> Path:
    """A `run: script:` job whose every rank works `seconds` and ends well (in a dir of its own: the code staged)."""
    tmp_path = tmp_path / "short"
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "work.py"
    script.write_text(f"import time\nprint('WORKING', flush=True)\ntime.sleep({seconds})\nprint('DONE', flush=True)\n")
    job = tmp_path / "short.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(script)}}))
    return job


def _looping(tmp_path: Path) -> Path:
    d = tmp_path / "looping"  # (a dir of its own: the job's code dir is staged, the stores beside it are not)
    d.mkdir(exist_ok=True)
    return looping_job(d)


def _port() -> str:
    """A free main port of its own per job (this machine's 29500 may be any other test's rendezvous)."""
    from orchestrator.api import free_port
    return f"launch.port={free_port()}"


def _spawn_submit(job_guard, home: Path, job_file: Path, cluster: Path, *extra: str, port: str | None = None
                  ) -> subprocess.Popen:
    env = {**os.environ, **OFFLINE_ENV, "ORCHESTRATE_HOME": str(home)}
    return job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "submit", str(job_file), "--nodes", "2", "--cluster",
                            str(cluster), port or _port(), *extra], env=env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _job_id(out: str) -> str:
    return next(line.split()[1].rstrip(":") for line in out.splitlines() if ": run dir " in line)


def _interval(run_dir: Path, rank: int) -> tuple[float, float]:
    agent = json.loads((run_dir / "nodes" / str(rank) / "agent.json").read_text())
    end = json.loads((run_dir / "nodes" / str(rank) / "exit.json").read_text())
    return float(agent["started"]), float(end["time"])


def test_two_stores_on_overlapping_hosts_never_double_book(testbed, tmp_path, job_guard):
    a, b, c = testbed.hosts[:3]
    job = _short_job(tmp_path, 1)
    homes = {"A": job_guard.home(tmp_path / "homeA"), "B": job_guard.home(tmp_path / "homeB")}
    clusters = {"A": _cluster(testbed, tmp_path, "poolA", [a, b]), "B": _cluster(testbed, tmp_path, "poolB", [b, c])}
    t0, wall0 = time.monotonic(), time.time()
    procs = {k: _spawn_submit(job_guard, homes[k], job, clusters[k]) for k in "AB"}
    outs = {k: p.communicate(timeout=120)[0] for k, p in procs.items()}
    took = time.monotonic() - t0
    for k, p in procs.items():
        assert p.returncode == 0, f"job {k}:\n{outs[k][-3000:]}"
    ids = {k: _job_id(outs[k]) for k in "AB"}
    waited = [k for k in "AB" if "QUEUED" in outs[k]]
    assert len(waited) == 1, outs  # exactly one of them had to wait for b
    other = "B" if waited == ["A"] else "A"
    line = next(ln for ln in outs[waited[0]].splitlines() if "QUEUED" in ln)
    assert f"host {b} is leased by job {ids[other]}" in line and "#1 in this store's queue" in line, line
    # per host, from the agents' own records: the intervals of the two jobs never overlap
    hosts = {"A": [a, b], "B": [b, c]}
    per_host: dict[str, list[tuple[float, float, str]]] = {}
    for k in "AB":
        st = json.loads(cli("status", ids[k], "--json", env={"ORCHESTRATE_HOME": homes[k]}).stdout)
        assert st["state"] == "COMPLETED", st
        for rank, host in enumerate(hosts[k]):
            start, end = _interval(remote_run_dir(testbed, host, ids[k]), rank)
            per_host.setdefault(host, []).append((start, end, k))
    spans = sorted(per_host[b])
    assert len(spans) == 2 and spans[0][1] <= spans[1][0], spans  # b: one after the other
    assert spans[1][0] - spans[0][1] < 10, spans  # ... and the waiter started within seconds of the end
    print(f"two overlapping jobs, serialized on {b}: {took:.1f} s; on b (s from the submits): "
          + ", ".join(f"{k} {s0 - wall0:.1f}-{s1 - wall0:.1f}" for s0, s1, k in spans))


def test_sigkill_of_the_holders_agent_frees_the_host_within_seconds(testbed, tmp_path, job_guard):
    a, b, c = testbed.hosts[:3]
    home_a, home_b = job_guard.home(tmp_path / "homeA"), job_guard.home(tmp_path / "homeB")
    holder = _spawn_submit(job_guard, home_a, _saving(tmp_path), _cluster(testbed, tmp_path, "poolA", [a, b]))
    job_a, _ = read_looping_ranks(holder, 2)
    job_guard.run_dir(*(remote_run_dir(testbed, h, job_a) for h in (a, b)))
    agent_b = agent_info(testbed, b, job_a, 1)
    waiter = _spawn_submit(job_guard, home_b, _short_job(tmp_path, 1), _cluster(testbed, tmp_path, "poolB", [b, c]))
    lines = read_until(waiter, "QUEUED")
    assert any(f"host {b} is leased by job {job_a}" in ln for ln in lines), "".join(lines)
    job_b = _job_id("".join(lines))
    ls = cli("ls", env={"ORCHESTRATE_HOME": home_b}).stdout
    assert any(job_b[:44] in ln and "QUEUED #1" in ln for ln in ls.splitlines()), ls
    st = cli("status", job_b, env={"ORCHESTRATE_HOME": home_b}).stdout
    assert "state    QUEUED" in st and f"waiting: host {b} is leased by job {job_a}" in st, st
    procs_b = [p for p in live_members([agent_b["token"], agent_b["pgid"]]) if p != agent_b["agent_pid"]]
    assert procs_b, agent_b  # the holder's launch and ranks on b
    killed = time.time()
    os.kill(agent_b["agent_pid"], signal.SIGKILL)
    last_seen = killed  # the latest time one of the holder's processes on b was seen alive (a look's start)
    while time.time() - killed < 20 and not _started(testbed, b, job_b):
        look = time.time()
        if any(alive(p) for p in procs_b):
            last_seen = look
        time.sleep(0.01)
    started = wait_until(lambda: _started(testbed, b, job_b), 20, 0.1, f"job {job_b}'s agent on {b}")
    if any(alive(p) for p in procs_b):
        last_seen = time.time()
    # the lease lives as long as the last process of the holder's job on b, not its agent alone
    assert started >= last_seen, f"job {job_b} started on {b} {last_seen - started:.2f} s before the holder's launch " \
                                 f"and ranks there were gone"
    assert started - killed < 8 + SAVE_S, f"the waiting job started {started - killed:.1f} s after the agent died"
    out = "".join(lines) + waiter.communicate(timeout=90)[0]
    assert waiter.returncode == 0 and "COMPLETED" in out, out[-3000:]
    holder.send_signal(signal.SIGINT)  # job A lost its node on b: it ends (failed or cancelled), nothing left
    holder.communicate(timeout=60)
    print(f"waiting job started {started - killed:.2f} s after SIGKILL of the holder's agent")


def _saving(tmp_path: Path) -> Path:
    """looping_job's ranks, which take SAVE_S to end on SIGTERM (a checkpoint saved on the way out)."""
    d = tmp_path / "saving"
    d.mkdir(exist_ok=True)
    job = looping_job(d)
    script = d / "loop.py"
    script.write_text("import signal, sys, time\n"
                      f"signal.signal(signal.SIGTERM, lambda *_: (time.sleep({SAVE_S}), sys.exit(143)))\n"
                      + script.read_text())
    return job


SAVE_S = 4.0  # longer than a QUEUED job's look (api.QUEUE_POLL_S): a lease dropped early is seen


def _started(testbed, host: str, job: str) -> float | None:
    path = remote_run_dir(testbed, host, job) / "nodes" / "0" / "agent.json"
    try:
        return float(json.loads(path.read_text())["started"])
    except (OSError, ValueError, KeyError):
        return None


def test_no_wait_exits_75_naming_host_lease_and_holder(testbed, tmp_path, job_guard):
    a, b, c = testbed.hosts[:3]
    home_a, home_b = job_guard.home(tmp_path / "homeA"), job_guard.home(tmp_path / "homeB")
    holder = _spawn_submit(job_guard, home_a, _looping(tmp_path), _cluster(testbed, tmp_path, "poolA", [a, b]))
    t0 = time.monotonic()
    job_a, _ = read_looping_ranks(holder, 2)
    print(f"holder looping after {time.monotonic() - t0:.1f} s")
    job_guard.run_dir(*(remote_run_dir(testbed, h, job_a) for h in (a, b)))
    t0 = time.monotonic()
    cluster_b = _cluster(testbed, tmp_path, "poolB", [b, c])
    p = cli("submit", _short_job(tmp_path, 1), "--nodes", "2", "--cluster", cluster_b, "--no-wait", _port(),
            env={"ORCHESTRATE_HOME": home_b}, cwd=REPO, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == EXIT_BUSY, p.stdout[-2000:] + p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("orchestrate: error:")]
    assert len(errors) == 1 and f"host {b} is leased by job {job_a} (" in errors[0], p.stderr
    assert "agent pid" in errors[0] and "since" in errors[0], errors
    assert took < 30, took
    rows = json.loads(cli("ls", "--json", env={"ORCHESTRATE_HOME": home_b}).stdout)
    assert [r["state"] for r in rows] == ["CANCELLED"] and "--no-wait" in rows[0]["root_cause"], rows
    job_b = rows[0]["id"]
    for rank, host in enumerate((b, c)):  # nothing of it started anywhere
        assert not (remote_run_dir(testbed, host, job_b) / "nodes" / str(rank) / "agent.json").exists()
    holder.send_signal(signal.SIGINT)
    holder.communicate(timeout=60)
    assert holder.returncode == 130


def test_a_job_waiting_for_the_holders_main_host_and_port_is_queued_not_refused(testbed, tmp_path, job_guard):
    """Jobs of one user queue on the same main host with the same main port (29500 unless launch.port says
    otherwise): the holder's rendezvous has that port open, which is the lease's business (wait), not a broken
    host (the pre-flight refusing the waiter with 'main port ... is in use')."""
    a, b, c = testbed.hosts[:3]
    home = job_guard.home(tmp_path / "home")
    port = _port()
    holder = _spawn_submit(job_guard, home, _looping(tmp_path), _cluster(testbed, tmp_path, "poolA", [a, b]), port=port)
    job_a, _ = read_looping_ranks(holder, 2)
    job_guard.run_dir(*(remote_run_dir(testbed, h, job_a) for h in (a, b)))
    cluster_c = _cluster(testbed, tmp_path, "poolC", [a, c])
    p = cli("submit", _short_job(tmp_path, 1), "--nodes", "2", "--cluster", cluster_c, "--no-wait", port,
            env={"ORCHESTRATE_HOME": home}, cwd=REPO, timeout=60)
    assert p.returncode == EXIT_BUSY, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"host {a} is leased by job {job_a} (" in p.stderr and "main port" not in p.stderr, p.stderr
    holder.send_signal(signal.SIGINT)
    holder.communicate(timeout=60)
    assert holder.returncode == 130


def test_a_queued_job_keeps_its_agents_and_starts_when_the_holder_ends(testbed, tmp_path, job_guard):
    """One store, the same hosts: the waiting job's agents, started for its first look, wait on their open channels
    with their leases dropped, and are asked again when the holder ends (no new connection, staging or agent: they
    started before the holder ended), and the waiter's launch follows the holder's end within seconds."""
    a, b = testbed.hosts[:2]
    home = job_guard.home(tmp_path / "home")
    cluster = _cluster(testbed, tmp_path, "pool", [a, b])
    holder = _spawn_submit(job_guard, home, _looping(tmp_path), cluster)
    job_a, _ = read_looping_ranks(holder, 2)
    job_guard.run_dir(*(remote_run_dir(testbed, h, job_a) for h in (a, b)))
    waiter = _spawn_submit(job_guard, home, _short_job(tmp_path, 1), cluster)
    lines = read_until(waiter, "QUEUED")
    job_b = _job_id("".join(lines))
    job_guard.run_dir(*(remote_run_dir(testbed, h, job_b) for h in (a, b)))
    assert any(f"is leased by job {job_a}" in ln for ln in lines), "".join(lines)
    holder.send_signal(signal.SIGINT)
    holder.communicate(timeout=60)
    out = "".join(lines) + waiter.communicate(timeout=120)[0]
    assert waiter.returncode == 0 and "COMPLETED" in out, out[-3000:]
    ended = max(_interval(remote_run_dir(testbed, h, job_a), r)[1] for r, h in enumerate((a, b)))
    agents = [json.loads((remote_run_dir(testbed, h, job_b) / "nodes" / str(r) / "agent.json").read_text())
              for r, h in enumerate((a, b))]
    assert all(ag["agent_proc_start"] < ended for ag in agents), (ended, agents)  # its first look's agents
    gap = min(float(ag["started"]) for ag in agents) - ended
    print(f"the holder's last node ended -> the waiter's first launch: {gap:.2f} s")
    assert gap < 8, gap
