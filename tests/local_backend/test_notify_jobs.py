"""Notifications of real jobs on the local backend (2 nodes each, tiny scripts): a webhook on a loopback HTTP server
gets `started` and `completed` of a job that completes and `failed` (root cause, exit code) of one whose rank exits 3;
a notify command that exits non-zero, and one that hangs past notify.timeout_s, change neither the job's state nor its
exit code; a `--detach`ed supervisor notifies too (the block from the cluster file); the token in the webhook URL is
in no file of the run dirs, the store or the supervisor's log, nor in the output. Delivery as a unit:
tests/unit/test_notify.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import WebhookServer, cli, wait_until

REPO = Path(__file__).resolve().parents[2]
TOKEN = "xoxb-NOTIFY-t0ken-9f8e"

pytestmark = pytest.mark.slow


@pytest.fixture
def hook():
    h = WebhookServer(path=f"/services/T0/{TOKEN}?token={TOKEN}")
    yield h
    h.close()


def _leaks(home: Path, *texts: str) -> list[str]:
    """Every file under ORCHESTRATE_HOME (run dirs, jobs.db and its WAL, supervisor logs) and output that holds the
    token."""
    found = [str(p) for p in home.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    return found + [f"output {i}" for i, t in enumerate(texts) if TOKEN in t]


def _job_id(text: str) -> str:
    return next(line.split()[1].rstrip(":") for line in text.splitlines() if ": run dir " in line)


def test_webhook_gets_completed_and_failed_and_a_failing_notify_changes_nothing(tmp_path, hook, job_guard):
    home = tmp_path / "home"
    job_guard.home(home)
    env = {"ORCHESTRATE_HOME": home}
    got = tmp_path / "got"
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump({
        "run": {"script": str(REPO / "tests/faults/beat_loop.py"), "args": ["3", "0.05"]},
        "notify": {"on": ["started", "failed", "completed"], "webhook": hook.url,
                   "command": ["sh", "-c", f'cat > {got}-"$ORCHESTRATE_EVENT".json; exit 7']}}))
    p = cli("submit", ok, "--nodes", "2", env=env, timeout=300)
    assert p.returncode == 0 and " COMPLETED" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    job = _job_id(p.stdout)
    assert hook.events() == ["started", "completed"], hook.posts
    done = hook.posts[-1]["json"]
    assert (done["job_id"], done["state"], done["exit_code"], done["root_cause"]) == (job, "COMPLETED", 0, None)
    assert (done["backend"], done["nodes"], done["world_size"], done["step"], done["max_steps"]) == ("local", 2, 2,
                                                                                                     3, 3)
    assert done["run_dir"] == str(home / "runs" / job) and done["hosts"] == ["localhost", "localhost"]
    assert json.loads(Path(f"{got}-completed.json").read_text()) == done  # the command got the same JSON on stdin
    assert f"job {job}: notify: completed command sh failed: exit 7" in p.stderr, p.stderr
    st = json.loads(cli("status", job, "--json", env=env).stdout)
    assert (st["state"], st["exit_code"]) == ("COMPLETED", 0)

    fail_script = tmp_path / "fail.py"
    fail_script.write_text("import os, sys, time\nif os.environ.get('RANK') == '1':\n    sys.exit(3)\ntime.sleep(60)\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"run": {"script": str(fail_script)},
                                   "notify": {"webhook": hook.url, "command": ["sleep", "60"], "timeout_s": 1}}))
    p2 = cli("submit", bad, "--nodes", "2", env=env, timeout=300)
    assert p2.returncode == 1, p2.stdout[-3000:] + p2.stderr[-3000:]
    bad_id = _job_id(p2.stdout)
    assert hook.events() == ["started", "completed", "failed"], hook.posts
    failed = hook.posts[-1]["json"]
    assert failed["job_id"] == bad_id and failed["state"] == "FAILED" and failed["exit_code"] == 3, failed
    assert "rank 1" in failed["root_cause"] and "code 3" in failed["root_cause"] and failed["hung"] is False
    assert "failed command sleep failed: still running after 1 s (notify.timeout_s): killed" in p2.stderr
    rec = json.loads(cli("status", bad_id, "--json", env=env).stdout)
    assert (rec["state"], rec["exit_code"], rec["root_cause"]) == ("FAILED", 3, failed["root_cause"])
    log = (home / "runs" / bad_id / "notify.log").read_text()
    assert "failed webhook http://127.0.0.1:" in log and "/***?*** ok (HTTP 200" in log, log
    assert yaml.safe_load((home / "runs" / bad_id / "recipe.yaml").read_text())["notify"]["webhook"].endswith(
        "/***?***")
    assert not _leaks(home, p.stdout, p.stderr, p2.stdout, p2.stderr)


def test_a_detached_supervisor_notifies_from_the_cluster_files_block(tmp_path, hook, job_guard):
    home = tmp_path / "home"
    job_guard.home(home)
    env = {"ORCHESTRATE_HOME": home}
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(yaml.safe_dump({"kind": "local", "notify": {"webhook": hook.url,
                                                                   "command": ["sh", "-c", "exit 9"]}}))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests/faults/beat_loop.py"), "args": ["3", "0.05"]},
                                   "notify": {"on": ["completed"]}}))  # the job's keys over the cluster's
    p = cli("submit", job, "--nodes", "2", "--cluster", cluster, "--detach", env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    job_id = next(w for w in p.stdout.split() if w.startswith("job-"))
    wait_until(lambda: hook.posts, 120, what="the detached supervisor's notification")
    assert hook.events() == ["completed"] and hook.posts[0]["json"]["job_id"] == job_id
    wait_until(lambda: not (home / "supervisors" / f"{job_id}.pid").exists(), 30, what="the supervisor to end")
    sup_log = (home / "supervisors" / f"{job_id}.log").read_text()
    assert f"job {job_id}: notify: completed command sh failed: exit 9" in sup_log, sup_log
    cluster_json = json.loads((home / "runs" / job_id / "cluster.json").read_text())
    assert cluster_json["notify"]["webhook"] == "http://127.0.0.1:" + hook.url.split(":")[2].split("/")[0] + "/***?***"
    assert not _leaks(home, p.stdout, p.stderr)


def test_a_restart_is_notified_before_the_end(tmp_path, hook, job_guard):
    """health.max_restarts: 1 and a script that fails its first attempt: `restarted` (why, which attempt), then
    `completed` counting that restart."""
    home = tmp_path / "home"
    job_guard.home(home)
    script = tmp_path / "once.py"
    marker = tmp_path / "failed-once"
    script.write_text(f"import os, sys\nif not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, 'w')"
                      ".close()\n    sys.exit(4)\nprint('second attempt ok')\n")
    job = tmp_path / "once.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(script)}, "health": {"max_restarts": 1},
                                   "notify": {"on": ["restarted", "completed"], "webhook": hook.url}}))
    p = cli("submit", job, env={"ORCHESTRATE_HOME": home}, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert hook.events() == ["restarted", "completed"], hook.posts
    restarted, completed = (x["json"] for x in hook.posts)
    assert (restarted["state"], restarted["attempt"], restarted["restarts"], restarted["by"]) == (
        "RESTARTING", 1, 1, "supervisor"), restarted
    assert "code 4" in restarted["reason"], restarted
    assert (completed["state"], completed["restarts"]) == ("COMPLETED", 1), completed
