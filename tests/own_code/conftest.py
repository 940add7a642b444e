"""Fixtures for the zero-code hook tests: the tiny model, and `launch_user` (a user's script under a real
`accelerate launch`, torn down after the test; see own_code_helpers)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from own_code_helpers import HERE, Launch, base_env, free_port


@pytest.fixture
def launch_user(tmp_path):
    """launch_user(script, args, nprocs=2, env=None, tag) -> Launch (started; .wait(timeout) or poll it)."""
    started: list[Launch] = []

    def start(script: str, args: list[str], nprocs: int = 2, env: dict | None = None, tag: str = "run") -> Launch:
        acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 1,
               "num_processes": nprocs, "machine_rank": 0, "main_process_ip": "127.0.0.1",
               "main_process_port": free_port(), "use_cpu": False, "mixed_precision": "no",
               "rdzv_backend": "static", "same_network": True}
        acc_path = tmp_path / f"{tag}_accelerate.yaml"
        acc_path.write_text(yaml.safe_dump(acc))
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc_path),
                str(HERE / script), *args]
        log_path = tmp_path / f"{tag}.log"
        with open(log_path, "w") as log:
            p = subprocess.Popen(argv, cwd=tmp_path, env=base_env(GLOO_SOCKET_IFNAME="lo", **(env or {})),
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        launch = Launch(p, log_path)
        started.append(launch)
        return launch

    yield start
    for launch in started:
        launch.teardown()
