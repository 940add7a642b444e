"""Containers on SSH hosts that share nothing with the submitter (issue #25): orchestrate is neither in the image nor
on the hosts (the node package is staged, then mounted read-only in the container); the built-in recipe and a user's
HF Trainer script run in the test image with podman on 2 private hosts, the ranks proven inside it, the stack's
versions read inside the image on every host, and no container left on any host."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers import cli
from podman_testbed import OFFLINE, containers_of, in_image, ranks_of, test_image

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.containers]


@pytest.mark.parametrize("what", ["builtin", "own_trainer"])
def test_podman_jobs_on_private_hosts(what, private_testbed, tmp_path):
    image = test_image()
    tb = private_testbed
    cluster = tmp_path / "private-podman.yaml"
    cluster.write_text(yaml.safe_dump(dict(tb.cluster("privlab"), env=dict(OFFLINE),
                                           container={"image": image, "runtime": "podman"})))
    home = tmp_path / "home"
    if what == "builtin":
        args = [REPO / "recipes/configs/sft_tiny.yaml", "trainer.max_steps=6"]
    else:
        from recipes.tiny import resolve_model_path
        model = resolve_model_path("tiny-llama")
        args = [REPO / "examples/own_code/my_job.yaml", f"run.args.model_name_or_path={model}", "run.args.max_steps=6",
                "run.args.use_cpu=true"]
    seen: dict[int, bool] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for run_dir in (home / "runs").glob("*") if (home / "runs").exists() else []:
                for rank, pid in ranks_of(run_dir.name).items():
                    seen[rank] = seen.get(rank, False) or in_image(pid)
            time.sleep(0.2)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        p = cli("submit", args[0], "--nodes", "2", "--cluster", cluster, *args[1:], cwd=REPO,
                env={"ORCHESTRATE_HOME": home}, timeout=900)
    finally:
        done.set()
        t.join(5)
    assert p.returncode == 0 and "COMPLETED" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert seen == {0: True, 1: True}, seen
    job = next((home / "runs").iterdir()).name
    st = json.loads(cli("status", job, "--json", env={"ORCHESTRATE_HOME": home}).stdout)
    hosts = st["container"]["hosts"]
    assert set(hosts) == set(tb.hosts[:2]) and all(h["versions"]["torch"] for h in hosts.values()), hosts
    assert containers_of(job) == []
