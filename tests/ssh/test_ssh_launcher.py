"""SSHLauncher with the real node agent and trivial node commands: pre-flight refusals, fail-fast
teardown, no orphans, secrets, and the submitting process dying or being interrupted."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import spawn
from ssh_helpers import REPO, agent_info, live_members, remote_run_dir, wait_gone
from orchestrator.errors import ConfigError, PreflightError
from orchestrator.node.rundir import RunDir
import jobrun

SLEEP = ("sleep", "60")


def _nothing_started(testbed, jid):
    for h in testbed.hosts:
        assert not remote_run_dir(testbed, h, jid).exists(), f"something was started on {h}"
    # the agents of the good hosts probed, then waited for a go that never came: they must be gone
    deadline = time.monotonic() + 5
    while True:
        waiting = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), jid.encode())]
        if not waiting:
            break
        assert time.monotonic() < deadline, f"agents of job {jid} still waiting after a refused pre-flight: {waiting}"
        time.sleep(0.05)


def _cmdline_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes() and Path(f"/proc/{pid}/stat").read_text(
        ).rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _expect_preflight(testbed, launcher, sub, plan, *needles):
    with pytest.raises(PreflightError) as ei:
        launcher.submit(sub, RunDir(plan.run_dir))
    msg = ei.value.one_line()
    assert ei.value.exit_code == 2
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    _nothing_started(testbed, plan.job_id)
    return msg


# ------------------------------------------------------------------------------------ pre-flight

def test_preflight_unknown_host_key(testbed, trivial_job, tmp_path):
    kh = tmp_path / "kh"
    kh.write_text("".join(line for line in Path(testbed.known_hosts).read_text().splitlines(keepends=True)
                          if testbed.hosts[1] not in line))
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, known_hosts=str(kh))
    _expect_preflight(testbed, launcher, sub, plan, testbed.hosts[1], "host key unknown")


def test_preflight_wrong_key(testbed, trivial_job, tmp_path):
    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, key=str(key))
    _expect_preflight(testbed, launcher, sub, plan, testbed.hosts[0], "authentication failed")


def test_preflight_unreachable_host(testbed, trivial_job):
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, hosts=[testbed.hosts[0], "127.0.10.250"])
    _expect_preflight(testbed, launcher, sub, plan, "127.0.10.250", "unreachable")


def test_preflight_fewer_hosts_than_nodes(testbed, trivial_job):
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP, 2: SLEEP}, hosts=testbed.hosts[:2])
    _expect_preflight(testbed, launcher, sub, plan, "3 nodes requested but only 2 hosts")


def test_duplicate_hosts_rejected(testbed, make_cluster, trivial_job):
    with pytest.raises(ConfigError, match="duplicate hosts"):
        make_cluster(hosts=[testbed.hosts[0], testbed.hosts[0]])
    import dataclasses
    launcher, _, _, plan = trivial_job({0: SLEEP, 1: SLEEP})
    nps = tuple(dataclasses.replace(n, host=testbed.hosts[0]) for n in plan.node_plans)
    plan = dataclasses.replace(plan, node_plans=nps)
    _expect_preflight(testbed, launcher, launcher.prepare(plan), plan, "duplicate hosts", testbed.hosts[0])


@pytest.mark.fault
def test_preflight_port_in_use_on_main_node(testbed, trivial_job):
    """[private]: staging runs first and links the job's files into runs/<job> on every host; the refusal on one host
    must leave no run dir (no staged or output link) on any host (docs/ssh.md)."""
    with socket.socket() as s:
        s.bind((testbed.hosts[0], 0))
        s.listen()
        port = s.getsockname()[1]
        launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, port=port)
        _expect_preflight(testbed, launcher, sub, plan, testbed.hosts[0], f"main port {port} is in use")
    if testbed.private:  # staging did run (its report), and _expect_preflight found no run dir on any host
        assert (Path(plan.run_dir) / "staged.json").exists()


@pytest.mark.fault
@pytest.mark.parametrize("workdir", ["/proc/orchestrate-work/{host}", "/dev/null/work"])
def test_preflight_unusable_workdir_is_one_line_naming_the_key_and_host(testbed, trivial_job, workdir):
    """A workdir that cannot be created (ENOENT under /proc, ENOTDIR under a file): the probe ([shared]) and the
    staging session ([private]) both answer one line naming ssh.workdir and the host, exit 2, no raw OSError."""
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, workdir=workdir)
    msg = _expect_preflight(testbed, launcher, sub, plan, testbed.hosts[0], testbed.hosts[1], "ssh.workdir ")
    assert "Errno" not in msg and "FileNotFoundError" not in msg and "NotADirectoryError" not in msg, msg


def test_preflight_missing_remote_python(testbed, trivial_job):
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, python="/nonexistent/python3")
    _expect_preflight(testbed, launcher, sub, plan, testbed.hosts[0], testbed.hosts[1],
                      "remote python '/nonexistent/python3' not found")


def test_preflight_remote_python_without_orchestrator(testbed, trivial_job):
    """A python that exists but lacks the package: named as such, on every host, before anything starts."""
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, python="/usr/bin/python3")
    _expect_preflight(testbed, launcher, sub, plan, testbed.hosts[0], testbed.hosts[1],
                      "remote python '/usr/bin/python3' cannot import orchestrator")


# ------------------------------------------------------------------------------------ running

def _groups(testbed, plan):
    out = []
    for n in plan.node_plans:
        a = agent_info(testbed, n.host, plan.job_id, n.node_rank)
        out += [a["agent_pgid"], a["pgid"], a["token"]]
    return out


def test_success_byte_exact_env_and_args_through_the_agent(testbed, trivial_job):
    weird = ["a b", "it's", 'dq"', "$(id)", "`id`", "new\nline", "ünï©ødé", "*", "~", "--flag=x;y", ""]
    env = {"PLAIN_VALUE": "x y $HOME 'q' \"d\" \\ \n end", "EMPTY_ONE": ""}
    prog = ("import json,os,sys;print('ECHO '+json.dumps({'argv':[os.fsencode(a).hex() for a in sys.argv[1:]],"
            "'env':{k:os.environb[k.encode()].hex() for k in ('PLAIN_VALUE','EMPTY_ONE')}}))")
    cmd = (testbed.python, "-c", prog, *weird)
    launcher, sub, local, plan = trivial_job({0: cmd, 1: cmd}, env={0: env, 1: env}, tag="echo")
    lines = []
    res = jobrun.run(launcher, plan, submission=sub, lines=lines)
    assert res.state == "COMPLETED", res
    echoes = [json.loads(line[5:]) for _, line in lines if line.startswith("ECHO ")]
    assert len(echoes) == 2
    for e in echoes:
        assert [bytes.fromhex(a) for a in e["argv"]] == [w.encode() for w in weird]
        assert {k: bytes.fromhex(v) for k, v in e["env"].items()} == {k: v.encode() for k, v in env.items()}
    log = (local / "logs" / "node1.log").read_text()
    assert "ECHO " in log
    # owner-only on the hosts
    rd = remote_run_dir(testbed, testbed.hosts[1], plan.job_id)
    assert oct(rd.stat().st_mode & 0o777) == oct(0o700)
    assert oct((rd / "plan.json").stat().st_mode & 0o777) == oct(0o600)


@pytest.mark.fault
def test_fail_fast_names_failed_node_and_leaves_nothing(testbed, trivial_job):
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: ("sh", "-c", "echo about to fail; sleep 1; exit 3")},
                                         tag="ff")
    job = jobrun.start(launcher, plan, submission=sub)
    groups = _groups(testbed, plan)
    res = job.result()
    t_done = time.monotonic()
    assert res.state == "FAILED" and res.returncode == 3, res
    assert f"node 1 ({testbed.hosts[1]})" in res.root_cause and "exit code 3" in res.root_cause, res.root_cause
    assert "about to fail" in res.nodes[1].log_tail
    assert wait_gone(groups, timeout=1) < 1
    assert time.monotonic() - t_done < 2


@pytest.mark.fault
@pytest.mark.parametrize("what", ["rank", "agent"])
def test_sigkill_rank_or_agent_tears_everything_down(testbed, trivial_job, what, record_property):
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, tag=f"kill{what}")
    job = jobrun.start(launcher, plan, submission=sub)
    groups = _groups(testbed, plan)
    a1 = agent_info(testbed, testbed.hosts[1], plan.job_id, 1)
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(a1["pid"] if what == "rank" else a1["agent_pid"], signal.SIGKILL)
    gone = wait_gone(groups, timeout=10)
    res = job.result(20)
    record_property("fault_to_all_gone_s", round(gone, 3))
    print(f"SIGKILL {what}: all processes gone {gone:.2f}s after the fault, wait returned "
          f"{time.monotonic() - t0:.2f}s after")
    assert res.state == "FAILED"
    assert f"node 1 ({testbed.hosts[1]})" in res.root_cause, res.root_cause
    assert "SIGKILL" in res.root_cause, res.root_cause
    if what == "agent":  # the agent itself is named, not a bare wait status
        assert "node agent was killed by SIGKILL" in res.root_cause, res.root_cause
    # an honest code: a signal death is 128 + N (137 = SIGKILL) for the job and the node, never `exit 9`; the node
    # table agrees with the cause: node 1 failed, node 0 was stopped by the teardown (whatever it exited with)
    assert res.returncode == 137, res
    ends = {n.node_rank: (n.end, n.returncode) for n in res.nodes}
    assert ends[1] == ("failed", 137) and ends[0][0] == "stopped", ends
    assert gone < 5


@pytest.mark.fault
def test_sigstop_rank_then_cancel_kills_stopped_group(testbed, trivial_job):
    launcher, sub, _, plan = trivial_job({0: SLEEP, 1: SLEEP}, tag="stop")
    job = jobrun.start(launcher, plan, submission=sub)
    groups = _groups(testbed, plan)
    a1 = agent_info(testbed, testbed.hosts[1], plan.job_id, 1)
    os.kill(a1["pid"], signal.SIGSTOP)
    time.sleep(1.0)
    assert job.thread.is_alive(), "a stopped rank alone does not end the job (the health monitor will)"
    job.cancel()
    gone = wait_gone(groups, timeout=10)
    assert job.result(20).state == "CANCELLED"
    assert gone < 5


def test_secrets_reach_ranks_but_no_file_log_or_cmdline(testbed, trivial_job):
    canaries = {"HF_TOKEN": "hf_CANARY_" + os.urandom(6).hex(), "MY_API_KEY": "key-CANARY-" + os.urandom(6).hex(),
                "DB_PASSWORD": "pw CANARY '\"$" + os.urandom(6).hex()}
    prog = ("import hashlib,os,sys,time;"
            "print('SHA', {k: hashlib.sha256(os.environb[k.encode()]).hexdigest() for k in sys.argv[1:]}, flush=True);"
            "time.sleep(1.5)")
    cmd = (testbed.python, "-c", prog, *canaries)
    launcher, sub, local, plan = trivial_job({0: cmd, 1: cmd}, secret_env=tuple(canaries), tag="secret")
    old = {k: os.environ.get(k) for k in canaries}
    os.environ.update(canaries)
    try:
        lines = []
        job = jobrun.start(launcher, plan, submission=sub, lines=lines)
        time.sleep(0.8)
        cmdlines = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmdlines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
                except OSError:
                    pass
        res = job.result()
        lines = [line for _, line in lines]
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert res.state == "COMPLETED", res
    want = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in canaries.items()}
    shas = [line for line in lines if line.startswith("SHA ")]
    assert len(shas) == 2 and all(str(want) in s for s in shas), shas
    blobs = list(cmdlines)
    roots = [local, Path(testbed.dir)]
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                blobs.append(p.read_bytes())
    blobs.append("\n".join(lines).encode())
    blobs.append(json.dumps(sub.extra).encode())
    for name, value in canaries.items():
        assert not any(value.encode() in b for b in blobs), f"{name} leaked"


# ------------------------------------------------------------------------------------ the submitter dies

def _driver(testbed, trivial_job, tag):
    launcher, sub, local, plan = trivial_job({0: SLEEP, 1: SLEEP}, tag=tag)
    proc = spawn([sys.executable, str(REPO / "tests/ssh/submit_driver.py"), json.dumps(testbed.cluster()), str(local)],
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # SIGINT at its default
    for line in proc.stdout:
        if line.startswith("SUBMITTED "):
            break
    else:
        pytest.fail(f"driver did not submit: rc {proc.wait()}")
    return proc, plan, _groups(testbed, plan)


@pytest.mark.fault
def test_sigkill_of_submitting_process_tears_down_remote_nodes(testbed, trivial_job, record_property):
    proc, plan, groups = _driver(testbed, trivial_job, "orchkill")
    assert live_members(groups)
    proc.kill()
    proc.wait()
    gone = wait_gone(groups, timeout=15)
    record_property("fault_to_all_gone_s", round(gone, 3))
    print(f"SIGKILL submitter: all remote processes gone after {gone:.2f}s")
    for r in (0, 1):
        ex = remote_run_dir(testbed, testbed.hosts[r], plan.job_id) / "nodes" / str(r) / "exit.json"
        deadline = time.monotonic() + 5
        while not ex.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "stdin EOF" in json.loads(ex.read_text())["stop_reason"]


@pytest.mark.fault
def test_ctrl_c_of_submitting_process_cancels_everything(testbed, trivial_job, record_property):
    proc, plan, groups = _driver(testbed, trivial_job, "sigint")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=30)[0]
    gone = wait_gone(groups, timeout=10)
    record_property("fault_to_all_gone_s", round(time.monotonic() - t0, 3))
    assert proc.returncode == 130, out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    assert result["state"] == "CANCELLED" and "Ctrl-C" in result["root_cause"]
    assert gone < 5


@pytest.mark.parametrize("how", ["sighup", "output-gone"])
def test_hang_up_of_an_attached_cli_submit_cancels_the_ssh_job(testbed, tmp_path, job_guard, how):
    """`orchestrate submit --cluster ssh.yaml` whose terminal hangs up (SIGHUP), or whose output's reader goes away
    (`submit ... | head`): nothing of an SSH job runs on without its submitter, so the job is cancelled on every
    host, recorded with the reason, exit 130 (on SLURM it runs on: tests/slurm)."""
    import yaml
    from helpers import PYTHON, hang_up_cancels, looping_job, read_looping_ranks
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(testbed.cluster()))
    home = job_guard.home(tmp_path / "home")
    proc = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "submit", str(looping_job(tmp_path)), "--nodes", "2",
                            "--cluster", str(cluster)], env={**os.environ, "ORCHESTRATE_HOME": str(home)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # SIGHUP at its default
    job, ranks = read_looping_ranks(proc, 2)
    job_guard.run_dir(*(remote_run_dir(testbed, h, job) for h in testbed.hosts[:2]))
    tokens = [agent_info(testbed, h, job, n)["token"] for n, h in enumerate(testbed.hosts[:2])]
    hang_up_cancels(proc, how, home, job)
    wait_gone(ranks + tokens, timeout=10)  # (each rank leads a session, so a group, of its own)
