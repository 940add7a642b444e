"""Notifications: the submit host's supervising process tells someone when a job starts, restarts or ends.

A job's `notify:` block (core.spec.NotifySpec; a cluster file's block for every job on it, the job's keys winning)
names the events (`on`) and where they go: `command`, run on the submit host with the event's JSON on stdin (argv as
written, no shell; ORCHESTRATE_EVENT / ORCHESTRATE_JOB_ID / ORCHESTRATE_JOB_STATE in its environment), and/or
`webhook` (or the URL in the submit environment's variable `webhook_env`), which gets the same JSON as an HTTP POST.
The JSON's fields are docs/CONTRACT.md's ("Notifications").

`Notifier` is fed by running.submit, in the supervising process (attached, or the `--detach`ed supervisor, which is the
same submit run again): `started`, each restart decision and SLURM requeue as it appears in RUN_DIR/restarts.jsonl
(`restarted` / `preempted`; a watcher thread reads it while the job runs), and the end (`completed`, `failed`,
`hung` for a FAILED end by a hang, `cancelled`). One worker thread delivers in event order, each delivery bounded by
`timeout_s` (a command that outlives it is killed with its process group). Delivery never changes the job's state
or exit code: every outcome is one line in RUN_DIR/notify.log, a failure also one line of the supervisor's output;
`close` waits, bounded, for what is still pending before the process exits. The URL is written only through
core.schema.mask_url (and scrubbed from any error text), so a token in it reaches no file, log or output.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from orchestrator import __version__
from orchestrator.core.schema import mask_url
from orchestrator.core.spec import NotifySpec
from orchestrator.node.rundir import RunDir
from orchestrator.types import JobResult, JobState

WATCH_S = 2.0  # how often restarts.jsonl is read while the job runs (a SLURM requeue appears there)
OUTPUT_TAIL = 300  # characters of a failed command's output kept in the log line


def event_of(result: JobResult) -> str:
    """The end event of a job's result: completed | cancelled | hung (FAILED by a hang) | failed."""
    if result.state == JobState.COMPLETED:
        return "completed"
    if result.state == JobState.CANCELLED:
        return "cancelled"
    return "hung" if result.hung else "failed"


TEXT_LIMIT = 1000  # characters of the one-line `text` (Discord's `content` takes at most 2000)
_HEADS = {"restarted": "restarting", "preempted": "preempted, requeued", "hung": "FAILED (hung)", "failed": "FAILED",
          "completed": "COMPLETED", "cancelled": "CANCELLED"}


def text_of(p: dict[str, Any]) -> str:
    """An event's payload in one line, what chat incoming webhooks show (`text`: Slack, Teams; `content`: Discord):
    `orchestrate: job J FAILED (cluster, N nodes) at step S/M, loss L: root cause`."""
    nodes = p.get("nodes")
    where = [w for w in (p.get("cluster") or p.get("backend"),
                         f"{nodes} node{'' if nodes == 1 else 's'}" if isinstance(nodes, int) else None) if w]
    text = f"orchestrate: job {p.get('job_id', '?')} {_HEADS.get(p['event'], p['event'])}"
    text += f" ({', '.join(map(str, where))})" if where else ""
    if p.get("attempt") is not None:
        text += f", attempt {p['attempt']},"
    if p["event"] != "started" and p.get("step") is not None:
        text += f" at step {p['step']}" + (f"/{p['max_steps']}" if p.get("max_steps") else "")
        text += f", loss {p['loss']:.4g}" if isinstance(p.get("loss"), float) else ""
    why = p.get("root_cause") or p.get("reason")
    text += f": {why}" if why else ""
    return " ".join(text.split())[:TEXT_LIMIT]


class Notifier:
    """Deliver one job's notifications (see the module docstring). `facts`: what every event carries (job id,
    backend, cluster, nodes, hosts, run dir, ...); `say(line)`: where a failure is told besides RUN_DIR/notify.log."""

    def __init__(self, spec: NotifySpec, facts: dict[str, Any], rd: RunDir,
                 say: Callable[[str], None] | None = None, env: dict[str, str] | None = None):
        self.spec = spec
        env = os.environ if env is None else env
        self.url = env.get(spec.webhook_env, "") if spec.webhook_env else (spec.webhook or "")
        self.facts = dict(facts)
        self.rd = rd
        self.say = say
        self.started_t = time.time()
        self.step: int | None = None
        self.max_steps: int | None = None
        self.loss: float | None = None
        self._seen = len(rd.attempts())  # records of earlier runs of this job are not news
        self._lock = threading.RLock()
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None  # the command being run (killed if `close` gives up on it)

    # ------------------------------------------------------------------------------------------- events in
    def beat(self, rec: dict) -> None:
        """A heartbeat record: the furthest step and the latest loss go into every event."""
        step = rec.get("step")
        if isinstance(step, int) and (self.step is None or step >= self.step):
            self.step = step
            if isinstance(rec.get("max_steps"), int):
                self.max_steps = rec["max_steps"]
        if isinstance(rec.get("loss"), (int, float)) and not isinstance(rec.get("loss"), bool):
            self.loss = float(rec["loss"])

    def started(self, handle: str = "") -> None:
        self.send("started", state=JobState.RUNNING.value, handle=handle)

    def attempts(self) -> None:
        """The restart decisions written to restarts.jsonl since the last look: `restarted` (the submitter's
        RestartPolicy) or `preempted` (a requeue inside a SLURM allocation: its RestartPolicy, or SLURM itself)."""
        with self._lock:  # (the watcher and the api's thread both look: each record is sent once, in order)
            records = self.rd.attempts()
            new, self._seen = records[self._seen:], len(records)
            restarts = sum(1 for a in records[:len(records) - len(new)] if a.decision == "restart")
            for a in new:
                if a.decision != "restart":
                    continue
                restarts += 1  # (as of this record)
                self.send("restarted" if a.by == "supervisor" else "preempted", state=JobState.RESTARTING.value,
                          reason=a.reason, attempt=a.attempt + 1, restarts=restarts,
                          step=a.step if a.step is not None else self.step, by=a.by,
                          **({"slurm_job_id": a.slurm_job_id} if a.slurm_job_id else {}))

    def watch(self, interval: float = WATCH_S) -> None:
        """Read restarts.jsonl every `interval` s while the job runs (until `close`)."""
        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.attempts()
                except Exception as e:  # noqa: BLE001 - a watcher must never end the supervision
                    self._log("restarts", "watch", f"failed: {type(e).__name__}: {e}", failed=True)
        self._watcher = threading.Thread(target=loop, daemon=True, name="notify-watch")
        self._watcher.start()

    def finished(self, result: JobResult) -> None:
        """The job's end (restart records not yet sent go first)."""
        self.attempts()
        self.send(event_of(result), state=result.state.value, root_cause=result.root_cause or None,
                  exit_code=result.returncode, hung=result.hung, restarts=result.restarts,
                  step=result.max_step if result.max_step is not None else self.step)

    def send(self, event: str, **facts: Any) -> None:
        """Queue `event` for delivery if the block subscribes to it (never blocks, never raises)."""
        if not self.spec.wants(event):
            return
        now = time.time()
        payload = dict(self.facts, event=event, t=round(now, 3), elapsed_s=round(now - self.started_t, 3),
                       step=self.step, max_steps=self.max_steps, loss=self.loss, root_cause=None, exit_code=None,
                       hung=False, restarts=self.rd.restarts())
        payload.update(facts)
        if payload.get("step") is None:
            payload["step"] = self.rd.furthest_step()
        payload["text"] = payload["content"] = text_of(payload)
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, daemon=True, name="notify")
                self._worker.start()
        self._queue.put(payload)

    # ------------------------------------------------------------------------------------------- delivery
    def close(self, wait_s: float | None = None) -> None:
        """Stop watching; wait (at most `wait_s`, default two deliveries' time limits) for pending deliveries."""
        self._stop.set()
        if self._worker is None:
            return
        self._queue.put(None)
        per_event = self.spec.timeout_s * (bool(self.spec.command) + bool(self.url) or 1)
        self._worker.join(2 * per_event + 1 if wait_s is None else wait_s)
        if self._worker.is_alive():
            proc = self._proc
            if proc is not None:
                _kill_group(proc)
            self._log("pending", "notify", f"gave up waiting for {max(1, self._queue.qsize())} notification(s) "
                                           "still being delivered", failed=True)

    def _work(self) -> None:
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            body = json.dumps(payload, sort_keys=True, default=str).encode()
            for channel in (self._command, self._post):
                try:
                    channel(payload, body)
                except Exception as e:  # noqa: BLE001 - a notification never fails the job
                    self._log(payload["event"], channel.__name__.strip("_"),
                              f"failed: {type(e).__name__}: {e}", failed=True)

    def _command(self, payload: dict, body: bytes) -> None:
        argv = list(self.spec.command or ())
        if not argv:
            return
        event, name = payload["event"], f"command {argv[0]}"
        env = dict(os.environ, ORCHESTRATE_EVENT=event, ORCHESTRATE_JOB_ID=str(payload.get("job_id", "")),
                   ORCHESTRATE_JOB_STATE=str(payload.get("state", "")))
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)
        except OSError as e:
            self._log(event, name, f"failed: cannot start it: {e.strerror or e}", failed=True)
            return
        self._proc = proc
        try:
            out, _ = proc.communicate(body, timeout=self.spec.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            self._log(event, name, f"failed: still running after {self.spec.timeout_s:g} s (notify.timeout_s): "
                                   "killed", failed=True)
            return
        finally:
            self._proc = None
        took = time.monotonic() - t0
        if proc.returncode != 0:
            tail = out.decode(errors="replace").strip().splitlines()[-1:] if out else []
            self._log(event, name, f"failed: exit {proc.returncode}" + (f": {tail[0][-OUTPUT_TAIL:]}" if tail else ""),
                      failed=True)
        else:
            self._log(event, name, f"ok ({took:.2f} s)")

    def _post(self, payload: dict, body: bytes) -> None:
        if not self.url:
            if self.spec.webhook_env:
                self._log(payload["event"], "webhook", f"failed: ${self.spec.webhook_env} is not set", failed=True)
            return
        import http.client
        import urllib.error
        import urllib.request
        event, name = payload["event"], f"webhook {mask_url(self.url)}"
        req = urllib.request.Request(self.url, data=body, method="POST", headers={
            "Content-Type": "application/json", "User-Agent": f"orchestrate/{__version__}"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=self.spec.timeout_s) as resp:
                resp.read(65536)
                status = resp.status
        except urllib.error.HTTPError as e:
            self._log(event, name, f"failed: HTTP {e.code} {e.reason}", failed=True)
            return
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            why = getattr(e, "reason", None) or e
            self._log(event, name, f"failed: {type(why).__name__ if isinstance(why, Exception) else ''} {why}".strip()
                      .replace("  ", " "), failed=True)
            return
        self._log(event, name, f"ok (HTTP {status}, {time.monotonic() - t0:.2f} s)")

    # ------------------------------------------------------------------------------------------- the record
    def scrub(self, text: str) -> str:
        """`text` with the webhook URL, and each part of it that may be a secret, masked."""
        if not self.url:
            return text
        text = text.replace(self.url, mask_url(self.url))
        try:
            p = urlsplit(self.url)
            parts = (p.username, p.password, p.path, p.query, p.fragment)
        except ValueError:
            parts = ()
        for part in parts:
            if part and len(part) > 3 and part != "/":
                text = text.replace(part, "***")
        return text

    def _log(self, event: str, channel: str, outcome: str, failed: bool = False) -> None:
        line = self.scrub(f"{event} {channel} {outcome}")
        try:
            self.rd.append_line(RunDir.NOTIFY, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}")
        except OSError:
            pass
        if failed and self.say is not None:
            try:
                self.say(f"notify: {line}")
            except Exception:  # noqa: BLE001 - the output may be gone (a hung-up terminal)
                pass


def describe(spec: NotifySpec) -> str:
    """One line for the submit summary: what is sent where (the URL masked)."""
    where = ([f"command {' '.join(spec.command)}"] if spec.command else []) + \
        ([f"webhook {mask_url(spec.webhook)}"] if spec.webhook else []) + \
        ([f"webhook ${spec.webhook_env}"] if spec.webhook_env else [])
    return f"notify     {', '.join(spec.on)} -> {'; '.join(where)}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a notify command's session (it and whatever it started), close its pipes, reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def job_facts(prepared: Any, run_dir: str) -> dict[str, Any]:
    """What every notification of a job carries about it (docs/CONTRACT.md)."""
    plan, cluster = prepared.plan, prepared.cluster
    return {"job_id": plan.job_id, "backend": cluster.kind, "cluster": cluster.name, "recipe": prepared.recipe.source,
            "nodes": plan.nodes, "world_size": plan.world_size,
            "hosts": [n.host or "localhost" for n in plan.node_plans], "run_dir": run_dir,
            "max_restarts": plan.health.max_restarts, "submitted": round(time.time(), 3),
            "submit_host": socket.gethostname(), "orchestrate": __version__}
