"""Notifications (orchestrator/notify.py, core.spec.NotifySpec): the `notify:` block's checks and merge, the one URL
masking rule, and delivery to a real HTTP server on loopback and to real commands: the JSON, which events a
subscription covers, restart records turned into events, and failures (a command exiting non-zero, one that hangs past
its timeout, an HTTP error, nobody listening) that are one logged line and never an exception. Real jobs that notify:
tests/local_backend/test_notify_jobs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import WebhookServer
from orchestrator.core.schema import mask_url
from orchestrator.core.spec import NotifySpec, load
from orchestrator.errors import ConfigError
from orchestrator.node.rundir import AttemptRecord, RunDir
from orchestrator.notify import Notifier, event_of
from orchestrator.types import JobResult, JobState

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cr3t-T0KEN-xyz"


class Hook(WebhookServer):
    def __init__(self, status: int = 200, delay: float = 0.0):
        super().__init__(status, delay, path=f"/hooks/T000/{TOKEN}?token={TOKEN}")


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


def _notifier(tmp_path, said=None, **spec) -> Notifier:
    rd = RunDir(tmp_path / "run")
    rd.mkdir()
    facts = {"job_id": "j-1", "backend": "local", "nodes": 1, "run_dir": str(rd.root)}
    return Notifier(NotifySpec(**spec), facts, rd, say=(said.append if said is not None else None))


# ------------------------------------------------------------------------------------------- masking, checks

@pytest.mark.parametrize("url, masked", [
    ("https://hooks.slack.com/services/T000/B000/XXXX", "https://hooks.slack.com/***"),
    ("https://discord.com/api/webhooks/123/abc-TOKEN", "https://discord.com/***"),
    ("https://user:pw@example.org:8443/x?token=abc#frag", "https://***@example.org:8443/***?***#***"),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://[::1]:9/?k=v", "http://[::1]:9?***"),
    ("not a url", "***"),
    ("http://h:99999999/", "***"),
])
def test_mask_url_keeps_where_and_hides_what_may_be_a_secret(url, masked):
    assert mask_url(url) == masked


def _load(tmp_path, job: dict, cluster: dict | None = None):
    jf = tmp_path / "job.yaml"
    jf.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests/faults/beat_loop.py")}, **job}))
    cf = None
    if cluster is not None:
        cf = tmp_path / "cluster.yaml"
        cf.write_text(yaml.safe_dump({"kind": "local", **cluster}))
    return load(str(jf), str(cf) if cf else None)


def test_the_notify_block_and_its_merge_with_the_cluster_file(tmp_path):
    # `on:` as YAML 1.1 reads it (a bare `on` key is true), a string command split into words without a shell
    jf = tmp_path / "j.yaml"
    jf.write_text("run: {script: tests/faults/beat_loop.py}\nnotify:\n  on: [completed]\n"
                  "  command: notify-send 'job done' --urgency=low\n")
    job, _ = load(str(jf))
    assert job.notify == NotifySpec(on=("completed",), command=("notify-send", "job done", "--urgency=low"))
    assert _load(tmp_path, {"notify": {"on": "failed", "command": ["x"]}})[0].notify.on == ("failed",)
    # the cluster's block for every job; the job's keys win; webhook and webhook_env are one destination
    team = {"notify": {"webhook": "https://hooks.slack.com/services/T/B/X", "on": ["failed"], "timeout_s": 5}}
    job, _ = _load(tmp_path, {}, team)
    assert job.notify.webhook.endswith("/X") and job.notify.on == ("failed",)
    job, _ = _load(tmp_path, {"notify": {"on": ["completed"], "command": ["mail"]}}, team)
    assert (job.notify.on, job.notify.command, job.notify.timeout_s) == (("completed",), ("mail",), 5)
    assert job.notify.webhook.endswith("/X")
    job, _ = _load(tmp_path, {"notify": {"webhook_env": "MY_HOOK"}}, team)
    assert job.notify.webhook is None and job.notify.webhook_env == "MY_HOOK"
    assert _load(tmp_path, {"notify": None}, team)[0].notify is None  # notify: null turns the cluster's off
    assert _load(tmp_path, {})[0].notify is None


@pytest.mark.parametrize("job, key, words", [
    ({"notify": {"webhook": f"ftp://u:{TOKEN}@h/x"}}, "notify.webhook", "http:// or https:// URL"),
    ({"notify": {"webhook": f"https://h/{TOKEN}", "webhook_env": "X"}}, "notify", "not both"),
    ({"notify": {"on": ["failed", "hungg"], "command": ["x"]}}, "notify.on", "did you mean 'hung'"),
    ({"notify": {"on": ["failed"]}}, "notify", "nothing to deliver"),
    ({"notify": {"command": "x 'unclosed"}}, "notify.command", "cannot split"),
    ({"notify": {"command": ["x"], "timeout_s": 0}}, "notify.timeout_s", "> 0"),
    ({"notify": {"webhook_env": "not-a-name"}}, "notify.webhook_env", "environment variable name"),
    ({"notify": {"command": ["x"], "when": ["failed"]}}, "notify.when", "unknown key"),
])
def test_a_bad_notify_block_is_refused_naming_the_key_and_never_showing_the_token(tmp_path, job, key, words):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, job)
    text = str(e.value)
    assert key in text and words in text and TOKEN not in text, text


def test_bad_input_exits_2_before_anything_and_webhook_env_must_hold_a_url(tmp_path):
    """Through the CLI: exit 2, one line naming the key, the token nowhere in the output, no run dir written."""
    env = {**os.environ, "ORCHESTRATE_HOME": str(tmp_path / "home")}
    job = tmp_path / "job.yaml"
    cases = [({"webhook": f"gopher://h/{TOKEN}"}, {}, "notify.webhook"),
             ({"webhook_env": "NOTIFY_URL_TEST"}, {}, "NOTIFY_URL_TEST is not set"),
             ({"webhook_env": "NOTIFY_URL_TEST"}, {"NOTIFY_URL_TEST": f"file:///{TOKEN}"}, "$NOTIFY_URL_TEST: must be")]
    for block, extra, words in cases:
        job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests/faults/beat_loop.py")}, "notify": block}))
        p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(job), "--dry-run"],
                           env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and words in p.stderr and TOKEN not in p.stdout + p.stderr, (p.stdout, p.stderr)
        assert not (tmp_path / "home" / "runs").exists() or not any((tmp_path / "home" / "runs").iterdir())
    # set and valid: the dry run shows where notifications go, the URL masked
    job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests/faults/beat_loop.py")},
                                   "notify": {"webhook_env": "NOTIFY_URL_TEST", "on": ["failed", "hung"]}}))
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(job), "--dry-run"],
                       env={**env, "NOTIFY_URL_TEST": f"https://h.example/{TOKEN}"}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "notify     failed, hung -> webhook $NOTIFY_URL_TEST" in p.stdout, p.stdout
    assert TOKEN not in p.stdout + p.stderr


def test_render_masks_the_webhook_in_the_files_it_writes(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests/faults/beat_loop.py")},
                                   "notify": {"webhook": f"https://user:{TOKEN}@h.example/x/{TOKEN}?t={TOKEN}"}}))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "render", str(job), "--out", str(out)],
                       env={**os.environ, "ORCHESTRATE_HOME": str(tmp_path / "home")}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load((out / "recipe.yaml").read_text())["notify"]["webhook"] == "https://***@h.example/***?***"
    leaked = [str(f) for f in out.rglob("*") if f.is_file() and TOKEN in f.read_text(errors="replace")]
    assert not leaked and TOKEN not in p.stdout + p.stderr, leaked


# ------------------------------------------------------------------------------------------- delivery

def test_webhook_gets_the_json_of_each_subscribed_event_in_order(tmp_path, hook):
    n = _notifier(tmp_path, on=("started", "failed", "completed"), webhook=hook.url)
    n.beat({"step": 7, "max_steps": 10, "loss": 1.25})
    n.started("local://j-1")
    n.send("restarted", state="RESTARTING")  # not subscribed
    n.finished(JobResult(JobState.FAILED, 3, "node 1 (h2) failed: rank 1 exited with code 3", max_step=7))
    n.close()
    assert [p["json"]["event"] for p in hook.posts] == ["started", "failed"]
    post = hook.posts[-1]
    assert post["type"] == "application/json" and post["path"] == f"/hooks/T000/{TOKEN}?token={TOKEN}"
    body = post["json"]
    assert {k: body[k] for k in ("job_id", "state", "exit_code", "root_cause", "step", "max_steps", "loss", "hung",
                                 "restarts", "backend", "nodes")} == {
        "job_id": "j-1", "state": "FAILED", "exit_code": 3,
        "root_cause": "node 1 (h2) failed: rank 1 exited with code 3", "step": 7, "max_steps": 10, "loss": 1.25,
        "hung": False, "restarts": 0, "backend": "local", "nodes": 1}
    log = (tmp_path / "run" / "notify.log").read_text()
    assert log.count("ok (HTTP 200") == 2 and TOKEN not in log, log


def test_every_event_carries_one_line_of_text_that_chat_webhooks_show(tmp_path, hook):
    """Slack's and Teams' incoming webhooks show a JSON body's `text`, Discord's its `content`: the event in one line,
    besides the job's fields (a root cause of several lines becomes one)."""
    n = _notifier(tmp_path, on=("started", "restarted", "failed", "completed"), webhook=hook.url)
    n.started("local://j-1")
    n.beat({"step": 7, "max_steps": 10, "loss": 1.25})
    n.send("restarted", state="RESTARTING", reason="node 0 died", attempt=1, restarts=1)
    n.finished(JobResult(JobState.FAILED, 3, "node 1 (h2) failed: rank 1 exited with code 3\n  ValueError: bad",
                         max_step=7))
    n.close()
    assert [p["json"]["text"] for p in hook.posts] == [
        "orchestrate: job j-1 started (local, 1 node)",
        "orchestrate: job j-1 restarting (local, 1 node), attempt 1, at step 7/10, loss 1.25: node 0 died",
        "orchestrate: job j-1 FAILED (local, 1 node) at step 7/10, loss 1.25: node 1 (h2) failed: rank 1 exited with "
        "code 3 ValueError: bad"]
    assert all(p["json"]["content"] == p["json"]["text"] for p in hook.posts)
    assert hook.posts[-1]["json"]["root_cause"].count("\n") == 1  # the job's fields as they were


def test_what_a_subscription_covers_and_the_end_event_of_a_result():
    spec = NotifySpec(on=("failed", "restarted"), command=("x",))
    assert spec.wants("failed") and spec.wants("hung") and spec.wants("restarted") and spec.wants("preempted")
    assert not spec.wants("completed") and not spec.wants("cancelled") and not spec.wants("started")
    assert not NotifySpec(on=("hung",), command=("x",)).wants("failed")
    assert event_of(JobResult(JobState.FAILED, 124, "hang", hung=True)) == "hung"
    assert event_of(JobResult(JobState.FAILED, 1, "x")) == "failed"
    assert event_of(JobResult(JobState.CANCELLED, 130, "x")) == "cancelled"
    assert event_of(JobResult(JobState.COMPLETED, 0)) == "completed"


def test_restart_records_become_restarted_and_preempted_events(tmp_path, hook):
    """The supervisor's own restarts and the requeues a SLURM allocation writes into restarts.jsonl (seen by the
    watcher while the job runs), each once, before the end."""
    n = _notifier(tmp_path, on=("restarted", "completed"), webhook=hook.url)
    rd = n.rd
    n.watch(interval=0.1)
    rd.append_attempt(AttemptRecord(t=time.time(), attempt=0, decision="restart", reason="preempted (SLURM signal)",
                                    step=40, by="slurm-requeue", slurm_job_id="77"))
    deadline = time.monotonic() + 10
    while not hook.posts and time.monotonic() < deadline:
        time.sleep(0.05)
    rd.append_attempt(AttemptRecord(t=time.time(), attempt=1, decision="restart", reason="node 0 died", step=55))
    rd.append_attempt(AttemptRecord(t=time.time(), attempt=2, decision="stop", reason="crash loop"))
    n.finished(JobResult(JobState.COMPLETED, 0, restarts=2))
    n.close()
    got = [(p["json"]["event"], p["json"].get("attempt"), p["json"]["step"]) for p in hook.posts]
    assert got == [("preempted", 1, 40), ("restarted", 2, 55), ("completed", None, None)], got
    assert hook.posts[0]["json"]["slurm_job_id"] == "77" and hook.posts[0]["json"]["state"] == "RESTARTING"
    assert [p["json"]["restarts"] for p in hook.posts[:2]] == [1, 2]
    assert hook.posts[2]["json"]["restarts"] == 2


def test_command_gets_the_json_on_stdin_and_its_failures_are_one_line_never_an_exception(tmp_path, hook):
    said: list[str] = []
    out = tmp_path / "got.json"
    n = _notifier(tmp_path, said, on=("completed",), webhook=hook.url,
                  command=("sh", "-c", f'cat > {out}; echo "$ORCHESTRATE_EVENT $ORCHESTRATE_JOB_ID" >&2; exit 5'))
    n.finished(JobResult(JobState.COMPLETED, 0))
    n.close()
    assert json.loads(out.read_text())["event"] == "completed"
    assert said == ["notify: completed command sh failed: exit 5: completed j-1"], said
    assert len(hook.posts) == 1  # the webhook is still sent


def test_a_command_that_hangs_is_killed_with_its_children_at_timeout_s(tmp_path):
    said: list[str] = []
    pids = tmp_path / "pids"
    n = _notifier(tmp_path, said, on=("failed",), timeout_s=1,
                  command=("sh", "-c", f"sleep 300 & echo $! > {pids}; echo $$ >> {pids}; wait"))
    t0 = time.monotonic()
    n.finished(JobResult(JobState.FAILED, 1, "x"))
    n.close()
    took = time.monotonic() - t0
    assert 0.9 < took < 5, took
    assert said and "still running after 1 s (notify.timeout_s): killed" in said[0], said
    for pid in map(int, pids.read_text().split()):  # the command and what it started: gone (or a zombie)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state in ("Z", "X"), (pid, state)


def test_http_errors_nobody_listening_and_a_missing_command_are_logged_with_the_url_masked(tmp_path):
    bad = Hook(status=500)
    said: list[str] = []
    try:
        n = _notifier(tmp_path, said, on=("failed",), webhook=bad.url, command=("no-such-notify-command-xyz",))
        n.finished(JobResult(JobState.FAILED, 1, "x"))
        n.close()
    finally:
        bad.close()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    n2 = _notifier(tmp_path, said, on=("failed",), webhook=f"http://127.0.0.1:{port}/x/{TOKEN}")
    n2.finished(JobResult(JobState.FAILED, 1, "x"))
    n2.close()
    assert any("cannot start it" in s for s in said), said
    assert any("HTTP 500" in s for s in said), said
    assert any("Connection refused" in s or "ConnectionRefusedError" in s for s in said), said
    text = "\n".join(said) + (tmp_path / "run" / "notify.log").read_text()
    assert TOKEN not in text and "http://127.0.0.1:" in text


def test_close_waits_for_a_slow_webhook_but_only_so_long(tmp_path):
    slow = Hook(delay=0.5)
    try:
        n = _notifier(tmp_path, on=("completed",), webhook=slow.url, timeout_s=5)
        n.finished(JobResult(JobState.COMPLETED, 0))
        n.close()  # waits for the pending one: it arrives
        assert [p["json"]["event"] for p in slow.posts] == ["completed"]
        slow.delay = 30
        said: list[str] = []
        n = _notifier(tmp_path, said, on=("completed",), webhook=slow.url, timeout_s=5)
        n.finished(JobResult(JobState.COMPLETED, 0))
        t0 = time.monotonic()
        n.close(wait_s=0.5)
        assert time.monotonic() - t0 < 2 and any("gave up waiting" in s for s in said), said
    finally:
        slow.close()


def test_webhook_env_is_read_from_the_environment_at_delivery(tmp_path, hook):
    n = Notifier(NotifySpec(on=("completed",), webhook_env="HOOK_URL"), {"job_id": "j"}, RunDir(tmp_path / "r"),
                 env={"HOOK_URL": hook.url})
    n.finished(JobResult(JobState.COMPLETED, 0))
    n.close()
    assert len(hook.posts) == 1
