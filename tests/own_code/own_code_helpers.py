"""Helpers for the zero-code hook tests (tests/own_code): a user's own script launched the way the node agent
will launch it (`accelerate launch` on the torchrun path, 2 processes, gloo on CPU) with the hooks directory first
on PYTHONPATH,
and a teardown that kills exactly what the test started (the launcher's process group and every rank, which
torchrun puts in sessions of their own)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

from orchestrator.node.hooks import HOOKS_DIR

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DATA = REPO / "recipes" / "data" / "sft_tiny.jsonl"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}
CONTRACT_FIELDS = {"t", "rank", "host", "step", "max_steps", "loss", "tokens", "event"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra) -> dict:
    """The environment of a launch: no orchestrate variable of the calling shell leaks in."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ORCHESTRATE_HEARTBEAT", "ORCHESTRATE_RESUME", "ORCHESTRATE_HOOKS", "ORCHESTRATE_JOB",
                                "WANDB_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(OFFLINE)
    env.update({"PYTHONPATH": HOOKS_DIR + os.pathsep + str(REPO), "OMP_NUM_THREADS": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


class Launch:
    def __init__(self, popen: subprocess.Popen, log_path: Path):
        self.p = popen
        self.log_path = log_path
        self.rc: int | None = None

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ranks(self, script: str) -> list[psutil.Process]:
        out = []
        for c in descendants(self.p.pid):
            try:
                cmd = " ".join(c.cmdline())
                if script in cmd and "accelerate.commands.launch" not in cmd:
                    out.append(c)
            except psutil.Error:
                continue
        return out

    def wait(self, timeout: float) -> int:
        try:
            self.rc = self.p.wait(timeout=timeout)
        finally:
            self.teardown()
        return self.rc

    def teardown(self) -> None:
        procs = descendants(self.p.pid)
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for c in procs:  # ranks live in sessions of their own
            try:
                c.kill()
            except psutil.Error:
                pass
        if self.p.poll() is None:
            self.p.wait(timeout=30)


def wait_for(cond, timeout: float, launch: Launch | None = None, what: str = "") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if launch is not None and launch.p.poll() is not None:
            raise AssertionError(f"launch ended (rc {launch.p.returncode}) while waiting for {what}:\n"
                                 + launch.output[-3000:])
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + ("\n" + launch.output[-3000:] if launch else ""))
