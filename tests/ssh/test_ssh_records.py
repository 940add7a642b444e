"""Records that agree with what happened (issue #28 item 7) on real sshd hosts, through the CLI as a user runs it:
`orchestrate status JOB` (and `--json`) after the job ended in a way its supervisor did not (fully) see.

- The `orchestrate submit` of a 2-host job on private hosts (they share nothing with the submitter) is SIGKILLed:
  every agent stops its ranks (stdin EOF) and nothing is left on the hosts; `status` asks the hosts and records
  what they say: the cause and the node table (HOST: the SSH host, END, EXIT from each agent's exit record) agree.
- One host's network is cut mid-training (nftables, this test's own table): the cause names that node; once the link
  is back its ranks save on the stop and its agent ends with exit 0, and `status` still shows the node as the cause
  says (not a node that finished well), the other one stopped by the teardown.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest
import yaml

from helpers import PYTHON, Submit, cli_status, first_step_seen, looping_job, read_looping_ranks, wait_until
from ssh_helpers import REPO, agent_info, remote_run_dir, wait_gone


def _port() -> str:
    """A free main port of its own (29500 may be any other test's or benchmark's rendezvous on this machine)."""
    from orchestrator.api import free_port
    return f"launch.port={free_port()}"


def _table(text: str) -> dict[int, list[str]]:
    """The NODE table of `status` text: {node: [HOST, RANKS, END, EXIT, NOTE...]}."""
    rows = text.split("\nNODE ", 1)[1].splitlines()[1:]
    out = {}
    for row in rows:
        cols = row.split()
        if not cols or not cols[0].isdigit():
            break
        out[int(cols[0])] = cols[1:]
    return out


def _exit_record(testbed, host: str, job: str, rank: int) -> dict:
    path = remote_run_dir(testbed, host, job) / "nodes" / str(rank) / "exit.json"
    return wait_until(lambda: json.loads(path.read_text()) if path.exists() else None, 30, 0.1,
                      f"node {rank}'s exit record on {host}")


def test_a_sigkilled_submit_on_private_hosts_is_recorded_as_the_hosts_say(private_ssh_testbed, tmp_path, job_guard):
    tb = private_ssh_testbed
    hosts = tb.hosts[:2]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(tb.cluster()))
    home = job_guard.home(tmp_path / "home")
    env = {"ORCHESTRATE_HOME": str(home)}
    proc = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "submit", str(looping_job(tmp_path)), "--nodes", "2",
                            "--cluster", str(cluster), _port()], env={**os.environ, **env}, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job, ranks = read_looping_ranks(proc, 2)
    job_guard.run_dir(*(remote_run_dir(tb, h, job) for h in hosts))
    groups = []
    for r, h in enumerate(hosts):
        a = agent_info(tb, h, job, r)
        groups += [a["agent_pgid"], a["pgid"], job_guard.token(a["token"])]
    proc.kill()  # SIGKILL: no handler of ours runs, nothing is recorded by the submitter
    proc.wait(30)
    gone = wait_gone(groups + ranks, timeout=20)
    print(f"submit SIGKILLed: every process of the job gone from both hosts after {gone:.2f}s")
    records = [_exit_record(tb, h, job, r) for r, h in enumerate(hosts)]
    st, text = cli_status(job, env)
    print(text)
    assert st["state"] == "FAILED", st
    cause = st["root_cause"]
    assert cause.startswith("the supervising process is gone and no node of the job is running"), cause
    nodes = {n["node"]: n for n in st["nodes"]}
    table = _table(text)
    for r, host in enumerate(hosts):
        rec, n = records[r], nodes[r]
        assert "stdin EOF" in rec["stop_reason"], rec
        # each node as its host's agent recorded it: stopped (told to, no rank of its own died), with its code
        assert (n["host"], n["end"], n["exit_code"]) == (host, "stopped", rec["returncode"]), (n, rec)
        assert n["exit_code"] is not None, n
        assert table[r][0] == host and table[r][2] == "stopped" and table[r][3] != "-", (r, text)
        assert socket.gethostname() not in table[r][0]
    # the node the cause names, with the exit it names, is the one the table shows so
    named = re.search(r"node (\d+) \((\S+)\) (\w+) \(exit (\d+)", cause)
    assert named, cause
    r = int(named.group(1))
    assert (named.group(2), named.group(3), int(named.group(4))) == \
        (hosts[r], nodes[r]["end"], nodes[r]["exit_code"]), (cause, nodes[r])
    assert cli_status(job, env)[0]["nodes"] == st["nodes"]  # recorded (outcome.json): the same table again


PRETRAIN_STEPS = 2000  # far more than the test waits for: the job is mid-training when the link goes


@pytest.mark.slow
def test_a_host_cut_off_mid_training_is_the_node_the_cause_and_the_table_name(testbed, cut_off, tmp_path,
                                                                                job_guard):
    hosts = testbed.hosts[:2]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(testbed.cluster()))
    home = job_guard.home(tmp_path / "home")
    env = {"ORCHESTRATE_HOME": str(home)}
    sub = Submit([REPO / "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", cluster,
                  f"trainer.max_steps={PRETRAIN_STEPS}", f"trainer.output_dir={tmp_path / 'out'}", _port(),
                  "health.max_restarts=0"], REPO, env, job_guard)
    job = sub.job_id()
    job_guard.run_dir(*(remote_run_dir(testbed, h, job) for h in hosts))
    wait_until(lambda: first_step_seen(remote_run_dir(testbed, hosts[1], job), 1), 120, 0.2, "node 1 training")
    cut = agent_info(testbed, hosts[1], job, 1)
    job_guard.token(agent_info(testbed, hosts[0], job, 0)["token"])
    job_guard.token(cut["token"])
    t0 = time.monotonic()
    cut_off(hosts[1])
    rc = sub.wait(60)
    print(f"{hosts[1]} cut off: submit exit {rc} after {time.monotonic() - t0:.1f}s")
    assert rc != 0, sub.text[-3000:]
    cut_off.restore()  # its agent hears its connection is gone: its ranks save on the stop and end
    wait_gone([cut["agent_pgid"], cut["pgid"], cut["token"]], timeout=60)
    rec = _exit_record(testbed, hosts[1], job, 1)
    print(f"node 1's own exit record once the link was back: {rec}")
    st, text = cli_status(job, env)
    print(text)
    cause = st["root_cause"]
    assert st["state"] == "FAILED" and f"node 1 ({hosts[1]}) failed: host {hosts[1]} stopped answering" in cause, st
    nodes = {n["node"]: n for n in st["nodes"]}
    table = _table(text)
    # the named node ended as the cause says: failed, its exit not known to the supervisor when it judged (never the
    # 0 its agent recorded later, after saving on the stop, as if it had finished well)
    assert (nodes[1]["host"], nodes[1]["end"]) == (hosts[1], "failed"), nodes[1]
    assert nodes[1]["exit_code"] != 0 and table[1][2] == "failed" and table[1][3] != "0", (nodes[1], text)
    assert (nodes[0]["host"], nodes[0]["end"]) == (hosts[0], "stopped"), nodes[0]
    assert table[0][2] == "stopped", text
