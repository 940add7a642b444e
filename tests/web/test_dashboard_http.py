"""The dashboard over HTTP (issue #35): `orchestrate dashboard` as a user starts it (the CLI, in a process of its own)
on a synthetic store: 2,000 finished jobs, one 1,024 x 8-rank job (bench/bench_status_scale.py's: the real planner's
plan, the real store, the RunDir writers, heartbeats in the hooks' format), one job rendered with a secret in its
environment, a QUEUED job waiting for a lease. Asserted: the token rules (a loopback server reads without it, Cancel
never works without it, cross-site POSTs are refused, a server on another address refuses every request without it),
a foreign Host is refused, path traversal finds nothing, unknown ids are 404 pages (never a traceback), secrets are
masked, and the jobs page with 2,000 jobs and the 1,024 x 8 job page each answer in < 0.5 s of server time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import OFFLINE_ENV, REPO

sys.path.insert(0, str(REPO / "bench"))
import bench_dashboard

SECRET = "hf_dashboard_secret_value_0123456789"


def start(home: Path, host: str = "127.0.0.1", extra_env: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    return bench_dashboard.start(home, host, {**OFFLINE_ENV, **(extra_env or {})})


stop = bench_dashboard.stop


def get(url: str, headers: dict | None = None, method: str = "GET", data: bytes | None = None
        ) -> tuple[int, str, dict]:
    req = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    # the store on a tmpfs where there is one: 2,000 records are 2,000 commits, each an fsync on a disk
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="dash-http-", dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else \
        tmp_path_factory.mktemp("dash")
    home, work = root / "home", root / "work"
    home.mkdir()
    work.mkdir()
    try:
        made = bench_dashboard.make_store(home, work, jobs=2000, nodes=1024, ranks=8, secret_env="HF_TOKEN")
        proc, base, token = start(home, extra_env={"HF_TOKEN": SECRET})
        try:
            yield {"home": home, "base": base, "token": token, **made}
        finally:
            stop(proc)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_pages_answer_and_unknown_ids_are_404_pages(site):
    base = site["base"]
    for path in ("/", "/queue", f"/jobs/{site['big']}", f"/jobs/{site['secret_job']}", f"/jobs/{site['queued']}"):
        code, body, headers = get(base + path)
        assert code == 200, (path, body[-2000:])
        assert "<!doctype html>" in body and "Traceback" not in body
        assert headers.get("x-frame-options") == "DENY" and "default-src 'self'" in headers["content-security-policy"]
    for path in ("/jobs/no-such-job", "/sweeps/sweep-20000101-000000-dead", "/nope", "/jobs/%00x", "/jobs/..%2f..",
                 "/api/jobs/no-such-job/log", "/api/jobs/no-such-job/series"):
        code, body, _ = get(base + path)
        assert code == 404, (path, code, body[-500:])
        assert "Traceback" not in body and "File \"" not in body, body
    assert "No job <code>no-such-job</code>" in get(base + "/jobs/no-such-job")[1]
    # the queued job: its place and who holds what it waits for
    code, body, _ = get(base + "/queue")
    assert site["queued"] in body and site["holder"] in body and "alice@submit-host" in body, body[-3000:]


def test_a_log_request_cannot_read_outside_the_run_dir(site):
    base, job = site["base"], site["secret_job"]
    for q in ("node=../../../etc/passwd", "rank=-1", "node=-3", "rank=x", "off=0:-5,../x:3"):
        code, body, _ = get(f"{base}/api/jobs/{job}/log?{q}")
        assert code in (400, 200), (q, code)
        assert "root:" not in body and "Traceback" not in body, (q, body[-500:])
        if code == 200:
            assert json.loads(body)["lines"] == [], (q, body)
    for path in ("/static/../data.py", "/static/%2e%2e/data.py", "/static/..%2fapp.py", "/jobs/../../etc/passwd",
                 "/api/jobs/..%2F..%2Fetc%2Fpasswd/log"):
        code, body, _ = get(base + path)
        assert code in (400, 404), (path, code)
        assert "import" not in body and "root:" not in body, (path, body[:300])
    code, body, _ = get(f"{base}/api/jobs/{job}/log?node=0")
    assert code == 200 and any("hello from the job" in ln for ln in json.loads(body)["lines"]), body


def test_secrets_are_masked(site):
    base, job = site["base"], site["secret_job"]
    code, body, _ = get(f"{base}/jobs/{job}")
    assert code == 200 and "HF_TOKEN=***" in body, body[-3000:]
    for path in (f"/jobs/{job}", f"/jobs/{job}?part=1", f"/api/jobs/{job}/log", f"/api/jobs/{job}/series", "/"):
        assert SECRET not in get(base + path)[1], path


def test_cancel_needs_the_token_a_post_and_the_same_origin(site):
    base, token, job = site["base"], site["token"], site["queued"]
    url = f"{base}/api/jobs/{job}/cancel"
    assert get(url)[0] == 405  # a link or an <img> cannot cancel
    assert get(url, method="POST")[0] == 403  # no token
    assert get(url, {"X-Orchestrate-Token": "wrong"}, method="POST")[0] == 403
    code, body, _ = get(url, {"X-Orchestrate-Token": token, "Origin": "http://evil.example"}, method="POST")
    assert code == 403 and "cross-site" in body
    code, body, _ = get(f"{url}?token={token}", {"Cookie": f"orchestrate_token={token}"}, method="POST")
    assert code == 403, body  # the cookie (sent by any cross-site form) is not enough: the header is needed
    # the page carries the token (for its Cancel button) only to a request that showed it
    assert token not in get(f"{base}/jobs/{job}")[1]
    assert token in get(f"{base}/jobs/{job}", {"Cookie": f"orchestrate_token={token}"})[1]
    # a foreign Host (DNS rebinding) is refused
    assert get(f"{base}/", {"Host": "evil.example:80"})[0] == 421


def test_another_address_needs_the_token_on_every_request(site):
    # a non-loopback bind (every address, 0.0.0.0), reached through loopback: the rule is the bind's, whoever asks
    proc, base, token = start(site["home"], host="0.0.0.0")
    try:
        port = base.rsplit(":", 1)[1]
        base = f"http://127.0.0.1:{port}"
        for path in ("/", f"/jobs/{site['big']}", "/queue", f"/api/jobs/{site['big']}/series", "/static/app.js"):
            code, body, _ = get(base + path)
            assert code == 403, (path, code)
            assert "token" in body
        code, body, headers = get(f"{base}/?token=wrong")
        assert code == 403
        req = urllib.request.Request(f"{base}/?token={token}")
        opener = urllib.request.build_opener(NoRedirect)
        try:
            opener.open(req, timeout=30)
            raise AssertionError("no redirect")
        except urllib.error.HTTPError as e:
            assert e.code == 303 and "token" not in e.headers["location"]
            cookie = e.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert get(f"{base}/", {"Cookie": f"orchestrate_token={token}"})[0] == 200
    finally:
        stop(proc)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_big_store_and_big_job_answer_in_under_half_a_second(site):
    """Server time (the time to the last byte, on loopback; median of 5), the jobs page with 2,000 jobs and the page of
    a 1,024 x 8-rank job, each with its live part."""
    base = site["base"]
    times = bench_dashboard.time_pages(base, [("/", "jobs"), ("/?part=1", "jobs part"),
                                              (f"/jobs/{site['big']}", "job 1024x8"),
                                              (f"/jobs/{site['big']}?part=1", "job 1024x8 part"),
                                              (f"/api/jobs/{site['big']}/series", "series 1024x8")], repeat=5)
    slow = {k: v for k, v in times.items() if v["median_s"] >= 0.5}
    assert not slow, times
    code, body, _ = get(f"{base}/jobs/{site['big']}")
    assert "8192 ranks: step 30-60" in body and 'data-rank="5000"' in body, body[-2000:]  # (the one behind)
    code, body, _ = get(f"{base}/jobs/{site['big']}?ranks_page=32")
    assert code == 200 and "page 32 of 32" in body and 'data-rank="8191"' in body
    code, body, _ = get(f"{base}/?page=20")
    assert code == 200 and "2004 of 2004 job(s)" in body and "<strong>20</strong>" in body, body[-2000:]
    code, body, _ = get(f"{base}/?state=FAILED&backend=local&text=job-0000")
    assert code == 200 and "3 of 2004 job(s)" in body and "job-00001" in body and "job-00004" in body, body[-3000:]


def test_live_pieces_move(site):
    """What a heartbeat changes is in the next answer: the series gains the new step, the log the new line."""
    base, job = site["base"], site["secret_job"]
    d = json.loads(get(f"{base}/api/jobs/{job}/series")[1])
    off = ",".join(f"{r}:{v['offset']}" for r, v in d["ranks"].items())
    before = max(s for s, _ in d["ranks"]["0"]["loss"])
    rd = Path(site["secret_run_dir"])
    with open(rd / "heartbeats" / "rank0.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), "rank": 0, "host": "h", "step": before + 1, "max_steps": 100,
                            "loss": 0.5, "tokens": 999999, "event": "step"}) + "\n")
    d2 = json.loads(get(f"{base}/api/jobs/{job}/series?off={off}")[1])
    assert [before + 1, 0.5] in d2["ranks"]["0"]["loss"], d2
    log = json.loads(get(f"{base}/api/jobs/{job}/log")[1])
    off = ",".join(f"{n}:{o}" for n, o in log["offsets"].items())
    with open(rd / "logs" / "node0.log", "a") as f:
        f.write("[rank0]: a new line\n")
    log2 = json.loads(get(f"{base}/api/jobs/{job}/log?off={off}")[1])
    assert log2["lines"] == [log2["lines"][0]] and log2["lines"][0].endswith("a new line"), log2
