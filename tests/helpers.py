"""Helpers shared by every suite (unit, local launcher, SSH, SLURM, recipes): waiting, finding a job's processes
from its run dir, reading heartbeats, starting children with known signal dispositions, and `JobGuard`, which
kills whatever a test's jobs left behind (the `job_guard` fixture of tests/conftest.py).

Import as `from helpers import ...` (tests/ is on sys.path through tests/conftest.py).

Facts they rely on (docs/CONTRACT.md; run dirs are read through orchestrator.node.rundir.RunDir):
RUN_DIR/nodes/<R>/agent.json records the node agent (agent_pid, agent_pgid, pid/pgid of its launch, token); every
process of a launch carries ORCHESTRATE_JOB_TOKEN=<token> and the ranks also RANK=<global rank>; ranks write
RUN_DIR/heartbeats/rank<G>.jsonl. Zombies count as gone (PID 1 here reaps orphans lazily).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from orchestrator.node.proctools import alive, group_members, marked, marked_ranks

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# ------------------------------------------------------------------------------------------------ waiting

def wait_until(pred: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1,
               what: str = "the condition") -> Any:
    """Call `pred()` every `interval` s until it returns something truthy and return that value; after `timeout`
    s raise AssertionError("timed out after T s waiting for WHAT"). The older order (pred, timeout, what) is also
    accepted (a str as third argument is `what`)."""
    if isinstance(interval, str):
        what, interval = interval, 0.1
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def closed_by_peer(sock: Any, within: float) -> bool:
    """True when the other end closed (or reset) the connection `sock` within `within` seconds, whatever it sent
    before; False when it is still open then."""
    import socket
    sock.settimeout(within)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True


def live(pids: Iterable[int]) -> list[int]:
    """The pids that are still running (a zombie counts as gone)."""
    return sorted({int(p) for p in pids if alive(int(p))})


def wait_gone(pids: Iterable[int] | Callable[[], Iterable[int]], timeout: float = 15.0,
              interval: float = 0.02) -> float:
    """Seconds until none of `pids` runs any more (zombies count as gone: /proc/PID/stat state Z). `pids` may be a
    callable returning the pids to check each time (e.g. `lambda: job_pids(run_dir)`, which also sees processes
    started later). Raises AssertionError listing what is left after `timeout` s."""
    fixed = None if callable(pids) else list(pids)

    def left() -> list[int]:
        return live(pids() if fixed is None else fixed)  # type: ignore[operator]

    t0 = time.monotonic()
    while True:
        still = left()
        if not still:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            raise AssertionError(f"processes left after {timeout} s: {describe(still)}")
        time.sleep(interval)


def processes(pred: Callable[[bytes], bool]) -> list[int]:
    """Live pids on this machine whose command line (/proc/PID/cmdline: NUL-separated arguments) satisfies `pred`.
    Every testbed host (sshd, private host) runs on this machine, so this sees a job's processes on all of them."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pred(cmd) and alive(int(pid)):
            found.append(int(pid))
    return found


def describe(pids: Iterable[int]) -> str:
    """`pid:comm(state)` for each pid, for failure messages."""
    out = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            comm, st = "?", "gone"
        out.append(f"{pid}:{comm}({st})")
    return ", ".join(out) or "none"


# ------------------------------------------------------------------------------------------------ run dirs

def agents(run_dir: Path | str, node: int | None = None) -> dict[int, dict]:
    """Node rank -> agent.json (as a dict: agent_pid, agent_pgid, pid, pgid, token, ...) of every node (or of
    `node`) that recorded an agent in RUN_DIR/nodes/<R>/, read through RunDir (the one reader of run dirs)."""
    from dataclasses import asdict

    from orchestrator.node.rundir import RunDir
    rd = RunDir(run_dir)
    if node is not None:
        rec = rd.agent(node)
        return {node: asdict(rec)} if rec is not None else {}
    return {r: asdict(rec) for r, rec in rd.agents().items()}


def rank_pids(run_dir: Path | str, node: int | None = None) -> dict[int, int]:
    """Global rank -> pid of the rank processes (ORCHESTRATE_JOB_TOKEN=<token from agent.json> and RANK set) of
    every node (or `node`) recorded in this run dir. Over SSH without a shared filesystem a host's agent.json is in
    that host's run dir: call it once per host's run dir."""
    out: dict[int, int] = {}
    for info in agents(run_dir, node).values():
        if info.get("token"):
            out.update(marked_ranks(str(info["token"])))
    return out


def job_pids(*run_dirs: Path | str) -> list[int]:
    """Every live process a job's node agents recorded in these run dirs: the agents, the members of their launch's
    process groups and every process carrying the job token (torchrun puts each rank in a session of its own)."""
    pids: set[int] = set()
    for run_dir in run_dirs:
        for info in agents(run_dir).values():
            for key in ("agent_pid", "pid"):
                if isinstance(info.get(key), int) and alive(info[key]):
                    pids.add(info[key])
            for key in ("agent_pgid", "pgid"):
                if isinstance(info.get(key), int) and info[key] > 1:
                    pids.update(group_members(info[key]))
            if info.get("token"):
                pids.update(marked(str(info["token"])))
    pids.discard(os.getpid())
    return sorted(pids)


def heartbeat_file(run_dir: Path | str | None, rank: int, heartbeat_dir: Path | str | None = None) -> Path:
    """RUN_DIR/heartbeats/rank<G>.jsonl, or HEARTBEAT_DIR/rank<G>.jsonl (ORCHESTRATE_HEARTBEAT_DIR of a bare launch)."""
    from orchestrator.node.rundir import RunDir
    if heartbeat_dir is not None:
        return Path(heartbeat_dir) / Path(RunDir.heartbeat_rel(rank)).name
    return RunDir(run_dir).path(RunDir.heartbeat_rel(rank))  # type: ignore[arg-type]


def heartbeats(run_dir: Path | str | None, rank: int, *, heartbeat_dir: Path | str | None = None) -> list[dict]:
    """The complete JSON records of rank<G>.jsonl in RUN_DIR/heartbeats (or in `heartbeat_dir`); [] if none yet."""
    path = heartbeat_file(run_dir, rank, heartbeat_dir)
    try:
        data = path.read_bytes()
    except OSError:
        return []
    out = []
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def saved_rank(home: Path, rank: int, step: int, timeout: float = 300) -> tuple[Path, int]:
    """(run dir, pid of rank `rank`) of the one job under ORCHESTRATE_HOME `home`, once that rank has saved a
    checkpoint at step >= `step` (its "save" heartbeat): the moment a test kills it to make the job restart."""
    run_dir = Path(wait_until(lambda: next((home / "runs").iterdir(), None) if (home / "runs").is_dir() else None,
                              120, 0.1, "the run dir"))
    wait_until(lambda: any(r.get("event") == "save" and r["step"] >= step for r in heartbeats(run_dir, rank)),
               timeout, 0.05, "a checkpoint saved")
    return run_dir, wait_until(lambda: rank_pids(run_dir).get(rank), 30, 0.05, f"rank {rank}'s pid")


def steps_seen(run_dir: Path | str | None, rank: int, *, heartbeat_dir: Path | str | None = None) -> int:
    """The highest training step rank `rank` reported (an `"event": "step"` record), 0 if none yet."""
    steps = [int(r.get("step") or 0) for r in heartbeats(run_dir, rank, heartbeat_dir=heartbeat_dir)
             if r.get("event") == "step"]
    return max(steps, default=0)


def first_step_seen(run_dir: Path | str | None, rank: int, *, heartbeat_dir: Path | str | None = None) -> bool:
    """True once rank `rank` has written an `"event": "step"` record with step >= 1 to
    RUN_DIR/heartbeats/rank<G>.jsonl (or to `heartbeat_dir`)."""
    return steps_seen(run_dir, rank, heartbeat_dir=heartbeat_dir) >= 1


# ------------------------------------------------------------------------------------------------ children

def _default_dispositions(new_group: bool = False) -> None:  # runs in the child between fork and exec
    if new_group:
        os.setpgid(0, 0)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def spawn(argv: list[str], *, group: bool = True, **kw: Any) -> subprocess.Popen:
    """subprocess.Popen(argv, **kw) with the dispositions a test means, whatever pytest inherited: SIGINT, SIGTERM,
    SIGQUIT, SIGHUP, SIGPIPE reset to SIG_DFL and no signal blocked in the child before exec (a background
    `bash .ci/run &` starts pytest with SIGINT ignored, and ignored dispositions survive exec, so a child Python
    would never see KeyboardInterrupt). `group=True` (default) starts it in a process group of its own (like
    process_group=0: a Ctrl-C at pytest's terminal does not reach it, and `kill_tree(p)` ends it with whatever it
    did not move elsewhere); pass start_new_session=True for a session of its own instead.
    Defaults: cwd=REPO, stdin=DEVNULL."""
    kw.setdefault("cwd", REPO)
    kw.setdefault("stdin", subprocess.DEVNULL)
    if kw.get("preexec_fn") is not None or kw.get("process_group") is not None:
        raise TypeError("spawn sets the child's process group and dispositions itself (use group=/start_new_session=)")
    kw.pop("preexec_fn", None)
    kw.pop("process_group", None)
    new_group = group and not kw.get("start_new_session")
    return subprocess.Popen([str(a) for a in argv], preexec_fn=lambda: _default_dispositions(new_group), **kw)


def run(argv: list[str], *, timeout: float = 120, check: bool = False, **kw: Any) -> subprocess.CompletedProcess:
    """Like subprocess.run(argv, capture_output=True, text=True) but started with `spawn` (default dispositions,
    own process group); on timeout the child's whole group is killed before TimeoutExpired propagates."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    p = spawn(argv, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        p.communicate()
        raise
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if check:
        r.check_returncode()
    return r


def cli(*args: Any, env: dict | None = None, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    """`python -m orchestrator.cli ARGS` through `run`, offline, with os.environ + `env`."""
    return run([PYTHON, "-m", "orchestrator.cli", *map(str, args)], env={**os.environ, **OFFLINE_ENV, **(env or {})},
               timeout=timeout, **kw)


class Submit:
    """An attached `orchestrate submit ARGS` in the background (registered with `job_guard`): its output (stdout and
    stderr together) collected line by line."""

    def __init__(self, args: list[str], cwd: Path, env: dict, job_guard: "JobGuard"):
        import threading
        self.proc = job_guard.proc(spawn([PYTHON, "-m", "orchestrator.cli", "submit", *map(str, args)], cwd=cwd,
                                         env={**os.environ, **OFFLINE_ENV, **env}, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def job_id(self) -> str:
        import re
        found = wait_until(lambda: re.search(r"job (\S+): run dir", self.text), 120, 0.1, "the submit's run dir line")
        return found.group(1)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(10)
        return rc


def cli_status(job: str, env: dict | None = None) -> tuple[dict, str]:
    """`orchestrate status JOB --json` (parsed) and `orchestrate status JOB` (its text), both exit 0."""
    js = cli("status", job, "--json", env=env)
    assert js.returncode == 0, js.stderr
    text = cli("status", job, env=env)
    assert text.returncode == 0, text.stderr
    return json.loads(js.stdout), text.stdout


def looping_job(tmp_path: Path) -> Path:
    """A job file (`run: script:`) whose every rank prints `LOOPING <pid>`, then a line every 0.2 s, forever."""
    import yaml
    script = tmp_path / "loop.py"
    script.write_text("import os, time\nprint('LOOPING', os.getpid(), flush=True)\nwhile True:\n"
                      "    time.sleep(0.2)\n    print('still here', flush=True)\n")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"run": {"script": str(script)}}))
    return job_file


def read_until(proc: subprocess.Popen, text: str) -> list[str]:
    """Lines of `proc`'s output up to and including the first that holds `text` (all of it when none does)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            break
    return lines


def read_looping_ranks(proc: subprocess.Popen, n: int) -> tuple[str, list[int]]:
    """Read an attached `orchestrate submit` of looping_job() until its `n` ranks loop: (job id, the ranks' pids)."""
    lines, ranks = [], []
    for line in proc.stdout:
        lines.append(line)
        if "LOOPING" in line:
            ranks.append(int(line.split()[-1]))
            if len(ranks) == n:
                break
    assert len(ranks) == n, "".join(lines) + proc.communicate(timeout=60)[0]
    return next(line.split()[1].rstrip(":") for line in lines if ": run dir " in line), ranks


def hang_up_cancels(proc: subprocess.Popen, how: str, home: Path, job: str) -> None:
    """The attached CLI submit `proc` loses its terminal (how="sighup") or its output's reader (how="output-gone":
    its stdout pipe closed, the next rank line meets a broken pipe). Checks what the local and SSH backends do:
    exit 130, the job recorded CANCELLED with that reason; stderr says why where it is still there."""
    from orchestrator.store import JobStore
    if how == "sighup":
        proc.send_signal(signal.SIGHUP)
        why = "the submitting terminal hung up (SIGHUP)"
    else:
        proc.stdout.close()
        why = "the reader of the submit's output went away (broken pipe)"
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err[-3000:]
    rec = JobStore(Path(home) / "jobs.db").get(job)
    assert rec.state == "CANCELLED" and rec.root_cause == why, rec.to_dict()
    if how == "output-gone":  # stderr is still there: it says why
        assert f"orchestrate: {why}" in err and f"job {job} CANCELLED: {why}" in err, err
    else:  # the terminal is gone: its last words go to /dev/null (a library's earlier warning may be there)
        assert why not in err and "CANCELLED" not in err and "Traceback" not in err, err


def kill_tree(p: subprocess.Popen | int, sig: int = signal.SIGKILL) -> None:
    """Signal a child and, when it leads a process group (spawn's default), that whole group."""
    pid = p if isinstance(p, int) else p.pid
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
            return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------------ teardown

def supervisor_pid(home: Path | str, job: str) -> int | None:
    try:
        return int((Path(home) / "supervisors" / f"{job}.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def store_jobs(home: Path | str) -> dict[str, str]:
    """job id -> run dir of every job recorded in HOME/jobs.db ({} when there is none or it cannot be read)."""
    db = Path(home) / "jobs.db"
    if not db.exists():
        return {}
    from orchestrator.store import JobStore
    try:
        return {r.id: r.run_dir for r in JobStore(db).list(1_000_000)}
    except Exception:  # noqa: BLE001 - a teardown reads what it can
        return {}


def _is_orchestrate(pid: int) -> bool:
    """The pid still runs one of ours (a recorded pid may have been reused since)."""
    try:
        return b"orchestrator" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _kill_recorded(run_dir: Path | str) -> None:
    """SIGKILL what the run dir's agent.json files record: marked processes, launch groups, agents."""
    from orchestrator.node.proctools import kill_marked
    for info in agents(run_dir).values():
        if info.get("token"):
            kill_marked(str(info["token"]), grace=0.5)
        for key in ("agent_pgid", "pgid"):
            if isinstance(info.get(key), int) and info[key] > 1 and info[key] != os.getpgrp():
                try:
                    os.killpg(info[key], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for key in ("agent_pid", "pid"):
            if isinstance(info.get(key), int) and alive(info[key]) and info[key] != os.getpid():
                try:
                    os.kill(info[key], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


class JobGuard:
    """Everything a test started, torn down at the end whether it passed or not.

    Register what the test starts: `home(path)` an ORCHESTRATE_HOME whose NEW jobs (ids absent when registered)
    are the test's: their supervisors (supervisors/<job>.pid) and run dirs; `run_dir(path)` a run dir (per host
    over SSH: `remote_run_dir(...)`); `token(t)` an ORCHESTRATE_JOB_TOKEN; `proc(p)` / `spawn(argv)` a child.
    `teardown()` SIGTERMs the children and supervisors (so they cancel what they hold), gives them `grace` s,
    SIGKILLs what is left, runs `python -m orchestrator.node RUN_DIR --kill` for every run dir that still has a
    recorded process alive, and kills every registered token's processes. Returns what it found alive."""

    def __init__(self, grace: float = 3.0):
        self.grace = grace
        self.homes: dict[Path, set[str]] = {}
        self.run_dirs: list[Path] = []
        self.tokens: list[str] = []
        self.procs: list[subprocess.Popen | int] = []

    def home(self, path: Path | str) -> Path:
        path = Path(path)
        self.homes.setdefault(path, set(store_jobs(path)))
        return path

    def run_dir(self, *paths: Path | str) -> None:
        for p in paths:
            if Path(p) not in self.run_dirs:
                self.run_dirs.append(Path(p))

    def token(self, token: str) -> str:
        self.tokens.append(token)
        return token

    def proc(self, p: subprocess.Popen | int) -> subprocess.Popen | int:
        self.procs.append(p)
        return p

    def spawn(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        return self.proc(spawn(argv, **kw))  # type: ignore[return-value]

    def jobs(self) -> dict[str, tuple[Path, str]]:
        """job id -> (home, run dir) of the jobs created under the registered homes since registration."""
        out = {}
        for home, before in self.homes.items():
            for job, run_dir in store_jobs(home).items():
                if job not in before:
                    out[job] = (home, run_dir)
        return out

    def teardown(self) -> list[str]:
        found: list[str] = []
        jobs = self.jobs()
        for _, recorded in jobs.values():
            self.run_dir(recorded)
        pids = []
        for p in self.procs:
            pid = p if isinstance(p, int) else p.pid
            if (p.poll() is None) if isinstance(p, subprocess.Popen) else alive(pid):
                pids.append(pid)
                found.append(f"child {pid}")
        for job, (home, _) in jobs.items():
            sup = supervisor_pid(home, job)
            if sup and sup != os.getpid() and alive(sup) and _is_orchestrate(sup):
                pids.append(sup)
                found.append(f"supervisor {sup} of job {job}")
        for pid in pids:
            kill_tree(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while live(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in live(pids):
            kill_tree(pid, signal.SIGKILL)
        for run_dir in self.run_dirs:
            left = job_pids(run_dir)
            if left:
                found.append(f"{run_dir}: {describe(left)}")
                try:
                    subprocess.run([PYTHON, "-m", "orchestrator.node", str(run_dir), "--kill", "--grace", "1"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   cwd=REPO, timeout=60, preexec_fn=_default_dispositions)
                except subprocess.TimeoutExpired:
                    pass
                _kill_recorded(run_dir)  # whatever `--kill` missed (or if its interface changed)
        for token in self.tokens:
            left = marked(token)
            if left:
                found.append(f"token {token}: {describe(left)}")
                from orchestrator.node.proctools import kill_marked
                kill_marked(token, grace=1.0)
        for p in self.procs:  # reap our own children (no zombies, no ResourceWarning)
            if isinstance(p, subprocess.Popen):
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                for f in (p.stdout, p.stderr, p.stdin):
                    if f:
                        f.close()
        return found


# ------------------------------------------------------------------------------------------------ goldens

def assert_golden(root: Path, files: dict[str, str]) -> None:
    """`files` (rel path -> text) equal the golden directory `root`, file set and bytes; UPDATE_GOLDEN=1 rewrites it."""
    if os.environ.get("UPDATE_GOLDEN") == "1":
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    on_disk = {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}
    assert on_disk.keys() == files.keys(), "golden file set differs (UPDATE_GOLDEN=1 to rewrite)"
    for rel, text in files.items():
        assert on_disk[rel] == text, f"{root.name}/{rel} differs from golden (UPDATE_GOLDEN=1 to rewrite)"


class WebhookServer:
    """A real HTTP server on 127.0.0.1 (a thread) that records every POST: `posts` = [{"path", "type", "json"}].
    `url` = its address + `path`; `status` is its answer, `delay` how long it takes to give it."""

    def __init__(self, status: int = 200, delay: float = 0.0, path: str = "/hook"):
        import http.server
        import threading
        self.posts: list[dict] = []
        self.status, self.delay = status, delay
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                time.sleep(hook.delay)
                hook.posts.append({"path": self.path, "type": self.headers.get("Content-Type"),
                                   "json": json.loads(body)})
                self.send_response(hook.status)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="webhook").start()

    def events(self) -> list[str]:
        return [p["json"]["event"] for p in self.posts]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------------------------------ a full disk

def small_tmpfs(mnt: Path, size: str):
    """Generator for a fixture: a tmpfs of `size` mounted at `mnt` (created), unmounted at the end, pass or fail.
    Needs root: skips without it, except under CI=true, where that is a failure (the suite must not shrink)."""
    import pytest

    def unavailable(reason: str):
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"full-disk test prerequisite missing under CI: {reason}", pytrace=False)
        pytest.skip(reason)
    if os.geteuid() != 0:
        unavailable("needs root to mount a small tmpfs (a full filesystem for ORCHESTRATE_HOME)")
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(mnt: Path, name: str = "filler") -> Path:
    """Fill the filesystem to the last byte; returns the filler (unlink it to make room again)."""
    filler = mnt / name
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (65536, 512):
            try:
                while os.write(fd, b"\0" * chunk):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    st = os.statvfs(mnt)
    assert st.f_bfree == 0, "the filesystem is not full"
    return filler
