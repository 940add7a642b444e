"""Staging end to end (issue #13) on SSH hosts that share nothing with the submitter (tests/staging/conftest.py):
no orchestrate, no checkout, no /tmp there. `orchestrate submit` ships the node package, stages data / code / model,
trains on 2 nodes, fetches the checkpoint back byte-identical; a resubmit moves 0 bytes; bad inputs fail before any
node starts, naming host and path or package."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers import cli, processes
from private_hosts import host_read_bytes, host_run

REPO = Path(__file__).resolve().parents[2]
USER_SCRIPT = REPO / "tests" / "faults" / "user_train.py"
WORK = "/var/tmp/orchestrate-host/work"

pytestmark = pytest.mark.slow


def _cluster(tmp_path: Path, tb, **over) -> Path:
    f = tmp_path / f"private-{len(list(tmp_path.glob('private-*')))}.yaml"
    f.write_text(yaml.safe_dump(tb.cluster("privlab", **over)))
    return f


def _run_dirs(home: Path) -> list[Path]:
    return sorted((home / "runs").iterdir(), key=lambda p: p.stat().st_mtime)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_builtin_sft_trains_fetches_back_and_a_resubmit_moves_nothing(private_testbed, tmp_path):
    tb = private_testbed
    home, out = tmp_path / "home", tmp_path / "out"
    cluster = _cluster(tmp_path, tb)
    for h in tb.hosts[:2]:  # hosts that hold nothing yet (earlier tests on this testbed staged the same files)
        host_run(tb, h, ["rm", "-rf", f"{WORK}/cache"])
    args = ["submit", REPO / "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", cluster,
            "trainer.max_steps=6", "trainer.save_strategy=steps", "trainer.save_steps=3", f"trainer.output_dir={out}",
            "outputs.fetch=last_checkpoint"]
    p = cli(*args, env={"ORCHESTRATE_HOME": home}, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rd = _run_dirs(home)[-1]
    staged = json.loads((rd / "staged.json").read_text())
    for h in tb.hosts[:2]:  # save_on_each_node: every host holds whole checkpoints (each node can resume alone)
        have = host_run(tb, h, ["ls", f"{WORK}/{staged['output_key']}/checkpoint-6"]).stdout.decode().split()
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(have), (h, have)
    assert all(h["sent_bytes"] > 0 for h in staged["hosts"].values()), staged  # the package and the data went over
    # the checkpoint came back, byte-identical to what node 0's host wrote
    fetched = json.loads((rd / "fetched.json").read_text())
    assert fetched["files"] > 0 and not fetched["errors"], fetched
    local = sorted(p for p in (out / "checkpoint-6").rglob("*") if p.is_file())
    assert local and not (out / "checkpoint-3").exists()  # last_checkpoint: only the newest
    remote_dir = f"{WORK}/{staged['output_key']}/checkpoint-6"
    from_node1 = []
    for f in local:  # each file from the host that wrote it: node 0 first (rank 1 saves its rng state on node 1)
        rel = f.relative_to(out / "checkpoint-6")
        try:
            remote = host_read_bytes(tb, tb.hosts[0], f"{remote_dir}/{rel}")
        except FileNotFoundError:
            remote = host_read_bytes(tb, tb.hosts[1], f"{remote_dir}/{rel}")
            from_node1.append(str(rel))
        assert _sha(f.read_bytes()) == _sha(remote), rel
    assert from_node1 == ["rng_state_1.pth"], from_node1
    assert f"; checkpoint: {out / 'checkpoint-6'}" in p.stdout, p.stdout[-2000:]  # the fetched copy, here
    st = cli("status", rd.name, env={"ORCHESTRATE_HOME": home})
    assert f"outputs  node 0: {tb.hosts[0]}:{WORK}/{staged['output_key']}" in st.stdout, st.stdout
    # staged files on the host: owner-only, read-only
    mode = host_run(tb, tb.hosts[1], ["stat", "-c", "%a", f"{WORK}/cache", f"{WORK}/runs/{rd.name}/staged/data0/"
                                      "sft_tiny.jsonl"]).stdout.decode().split()
    assert mode == ["700", "400"], mode

    # the same job again: nothing unchanged crosses the wire; it resumes from the hosts' output dir and completes
    # (and this time the whole output dir comes back: outputs.fetch=final)
    t0 = time.monotonic()
    p2 = cli(*args, "outputs.fetch=final", env={"ORCHESTRATE_HOME": home}, timeout=600)
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-3" / "optimizer.pt").is_file()
    assert _sha((out / "model.safetensors").read_bytes()) == _sha(host_read_bytes(
        tb, tb.hosts[0], f"{WORK}/{staged['output_key']}/model.safetensors"))
    staged2 = json.loads((_run_dirs(home)[-1] / "staged.json").read_text())
    assert staged2["sent_bytes"] == 0 and all(h["sent_bytes"] == 0 for h in staged2["hosts"].values()), staged2
    assert staged2["hosts"][tb.hosts[0]]["trees_built"] == 0
    assert time.monotonic() - t0 < 120


def test_users_script_and_model_dir_are_staged(private_testbed, tmp_path):
    """A user's HF-Trainer script (never imports orchestrate) with a local model dir and data file as args: the code
    root (its git repository's files), the model and the data reach hosts that have none of them."""
    from recipes.tiny import resolve_model_path
    tb = private_testbed
    home = tmp_path / "home"
    model = resolve_model_path("tiny-llama")
    job = tmp_path / "my_job.yaml"
    job.write_text(yaml.safe_dump({
        "run": {"script": str(USER_SCRIPT),
                "args": [model, str(REPO / "recipes/data/sft_tiny.jsonl"), str(tmp_path / "out"), "4"]},
        "health": {"stall_timeout": 120, "startup_timeout": 300}}))
    p = cli("submit", job, "--nodes", "2", "--cluster", _cluster(tmp_path, tb), env={"ORCHESTRATE_HOME": home},
            timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    params = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if "USER_PARAMS " in line
              for line in [line[line.index("USER_PARAMS "):]]]
    assert sorted(x["rank"] for x in params) == [0, 1] and len({x["sha"] for x in params}) == 1, p.stdout[-2000:]
    doc = json.loads((_run_dirs(home)[-1] / "stage.json").read_text())
    kinds = {s["label"]: s["kind"] for s in doc["sources"]}
    assert kinds["code"] == "code" and "model" in kinds.values() or "data" in kinds.values(), kinds
    assert any(s["path"] == str(REPO) for s in doc["sources"])  # the script's git repository


def test_staging_off_and_a_missing_path_is_a_preflight_error_naming_host_and_path(private_testbed, tmp_path):
    tb = private_testbed

    def runs() -> bytes:
        return host_run(tb, tb.hosts[0], ["sh", "-c", f"ls {WORK}/runs 2>/dev/null"]).stdout

    before = runs()
    t0 = time.monotonic()
    p = cli("submit", REPO / "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster",
            _cluster(tmp_path, tb, stage=False), env={"ORCHESTRATE_HOME": tmp_path / "home"}, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stdout + p.stderr
    data = str(REPO / "recipes/data/sft_tiny.jsonl")
    for host in tb.hosts[:2]:
        assert f"{host}: {data}: not found on the host" in p.stderr, p.stderr
    assert took < 30, took
    assert runs() == before  # no run dir made, no node started


def test_too_little_disk_on_the_hosts_is_refused_before_anything_starts(private_testbed, tmp_path):
    tb = private_testbed
    p = cli("submit", REPO / "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster",
            _cluster(tmp_path, tb, min_free_gb=100000), env={"ORCHESTRATE_HOME": tmp_path / "home"}, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    for host in tb.hosts[:2]:
        assert f"{host}: {WORK}: " in p.stderr and "GiB free, staging needs" in p.stderr, p.stderr
        assert "ssh.min_free_gb = 100000 GiB" in p.stderr, p.stderr


def test_a_package_version_differing_across_hosts_is_refused(private_testbed, tmp_path):
    """trl's metadata on host 1 says another version (a bind mount in that host's namespace only)."""
    tb = private_testbed
    import importlib.metadata as md
    dist = md.distribution("trl")
    meta = Path(dist._path) / "METADATA"  # type: ignore[attr-defined]
    target = "/opt/hostenv/" + str(meta.resolve().relative_to(Path(__import__("sys").prefix).resolve()))
    fake = f"{WORK}/../fake-METADATA"
    text = meta.read_text().replace(f"Version: {dist.version}", "Version: 0.0.1", 1)
    host_run(tb, tb.hosts[1], ["sh", "-c", 'cat > "$1"', "sh", fake], input=text.encode(), check=True)
    host_run(tb, tb.hosts[1], ["mount", "--bind", fake, target], check=True)
    try:
        p = cli("submit", REPO / "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", _cluster(tmp_path, tb),
                env={"ORCHESTRATE_HOME": tmp_path / "home"}, timeout=120)
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"{tb.hosts[1]}: trl 0.0.1 differs from {tb.hosts[0]}'s {dist.version}" in p.stderr, p.stderr
        p = cli("submit", REPO / "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster",
                _cluster(tmp_path, tb, allow_version_mismatch=True), "--dry-run",
                env={"ORCHESTRATE_HOME": tmp_path / "home"}, timeout=120)
        assert p.returncode == 0, p.stderr
    finally:
        host_run(tb, tb.hosts[1], ["umount", target])


def test_a_symlink_leaving_the_code_root_is_refused_before_any_host(private_testbed, tmp_path):
    tb = private_testbed
    code = tmp_path / "proj"
    code.mkdir()
    (code / "train.py").write_text("print('never runs')\n")
    (tmp_path / "secret.txt").write_text("outside")
    (code / "leak.txt").symlink_to(tmp_path / "secret.txt")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": "train.py"}}))
    p = cli("submit", job, "--nodes", "2", "--cluster", _cluster(tmp_path, tb),
            env={"ORCHESTRATE_HOME": tmp_path / "h"}, cwd=code, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{code / 'leak.txt'}: refused: a symlink leaving {code}" in p.stderr, p.stderr


def _stage_dir(stage_files, tmp_path, n_bytes: int):
    """4 random files of n_bytes in all under tmp_path/data (made once: a second call stages the same files again),
    staged to all 3 private hosts (conftest's stage_files: every host's copy checked): (stager, tree, facts)."""
    src = tmp_path / "data"
    if not src.exists():
        src.mkdir()
        for i in range(4):
            (src / f"part{i}.bin").write_bytes(os.urandom(n_bytes // 4))
    return stage_files(src)[:3]


def test_large_stages_fan_out_host_to_host(private_testbed, tmp_path, stage_files):
    s, tree, facts = _stage_dir(stage_files, tmp_path, 12 << 20)
    assert s.relayed == {h: "ok" for h in private_testbed.hosts}, s.relayed
    assert all(f.sent_bytes == tree.size for f in facts.values())


def _staging_servers() -> list[int]:
    """The private hosts' staging servers (`python -c ... serve WORKDIR`; every host is a namespace of this machine)."""
    return processes(lambda cmd: b"\0serve\0" in cmd and WORK.encode() in cmd)


def test_a_cancel_stops_a_relayed_push_at_once(private_testbed, tmp_path, monkeypatch, stage_files):
    """A submit's Ctrl-C (the pool's cancel event) in the middle of a relayed push (the submitter -> host 0 -> host
    1 -> host 2, slowed down here to last seconds): the push stops within a poll, every host's staging server goes,
    and a later stage of the same files leaves every host byte-right (nothing half-written counts as staged)."""
    from orchestrator.core.spec import parse_cluster
    from orchestrator.errors import SubmitCancelled
    from launchers.ssh import stage as st
    from launchers.ssh.transport import Pool
    tb = private_testbed
    src = tmp_path / "data"
    src.mkdir()
    for i in range(4):
        (src / f"part{i}.bin").write_bytes(os.urandom(3 << 20))
    payload = st.Stager._payload

    def slow(self, batch, progress):  # 1 MiB chunks, 0.25 s each: 12 MiB take 3 s
        return payload(self, batch, lambda n: (time.sleep(0.25), progress(n)))
    monkeypatch.setattr(st.Stager, "_payload", slow)
    cluster = parse_cluster({"kind": "ssh", "accelerator": "cpu", "ssh": tb.ssh_block(hosts=tb.hosts)}, source="<t>")
    tree = st.make_tree("data", src, st.list_root(src), st.HashCache(None))
    pool = Pool(cluster.ssh)
    pool.cancel = threading.Event()
    try:
        s = st.Stager(pool, cluster.ssh, [tree], {}, ())
        s.hello(list(tb.hosts))
        assert all(s.hosts[h].missing for h in tb.hosts)
        timer = threading.Timer(1.0, pool.cancel.set)
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(SubmitCancelled):
            s.push()
        took = time.monotonic() - t0
    finally:
        pool.close()
    print(f"cancel 1.0 s into a 3 s relayed push: push ended after {took:.2f} s")
    assert 1.0 <= took < 2.0, took
    gone = time.monotonic() + 1.5  # (the first hop's direct stream is shut too: nobody feeds host 0 for 2 s more)
    while _staging_servers() and time.monotonic() < gone:
        time.sleep(0.05)
    assert not _staging_servers(), "a host's staging server outlived the cancel"
    monkeypatch.undo()
    _stage_dir(stage_files, tmp_path, 12 << 20)  # the same files again: every host byte-right (it checks)


def test_a_broken_relay_hop_falls_back_to_direct_sends(private_testbed, tmp_path, monkeypatch, stage_files):
    from launchers.ssh import stage as st
    ask = st.Session.ask
    victim = private_testbed.hosts[2]

    def wrong_token(self, req, payload=None):  # the hop to the victim presents a token it does not know
        if req.get("op") == "put" and (req.get("forward") or {}).get("host") == victim:
            req = dict(req, forward=dict(req["forward"], token="not-the-token"))
        return ask(self, req, payload)
    monkeypatch.setattr(st.Session, "ask", wrong_token)
    t0 = time.monotonic()
    s, tree, facts = _stage_dir(stage_files, tmp_path, 12 << 20)
    # the victim drops the peer with the wrong token; the hop before it breaks and releases it at once
    assert s.relayed[victim] != "ok" and s.relayed[private_testbed.hosts[1]] != "ok", s.relayed
    assert "aborted" in s.relayed[victim], s.relayed
    assert time.monotonic() - t0 < 20
    # every host holds every file (checked by _stage_dir); a blob written before a hop broke is not sent again
    assert all(f.sent_bytes <= tree.size for f in facts.values()), {h: f.sent_bytes for h, f in facts.items()}


def test_a_host_that_cannot_open_a_relay_port_gets_everything_straight_from_the_submitter(private_testbed, tmp_path,
                                                                                          monkeypatch, stage_files):
    """One host's `listen` fails (as on a host whose python has no ssl module): no relay at all, every host is sent
    the files straight from the submitter (_stage_dir checks each host's copy)."""
    from launchers.ssh import stage as st
    ask = st.Session.ask
    victim = private_testbed.hosts[1]

    def no_ssl(self, req, payload=None):
        if req.get("op") == "listen" and self.host == victim:
            raise RuntimeError("ModuleNotFoundError: No module named '_ssl'")
        return ask(self, req, payload)
    monkeypatch.setattr(st.Session, "ask", no_ssl)
    s, tree, facts = _stage_dir(stage_files, tmp_path, 12 << 20)
    assert "no relay port" in s.relayed[victim] and "_ssl" in s.relayed[victim], s.relayed
    assert all(why != "ok" for why in s.relayed.values()), s.relayed
    assert all(f.sent_bytes == tree.size for f in facts.values())


def test_a_corrupted_file_in_a_hosts_cache_is_detected_and_sent_again_over_ssh(private_testbed, tmp_path,
                                                                                stage_files):
    """A staged file changed in place on one host (its blob, hence the tree's hard link to it): the next stage finds
    it, sends exactly that file to exactly that host, and every host's tree is byte-right again (_stage_dir checks)."""
    tb = private_testbed
    _, tree, _ = _stage_dir(stage_files, tmp_path, 64 << 10)
    rel, sha, size, _mode = tree.entries[1]
    victim = tb.hosts[1]
    host_run(tb, victim, ["sh", "-c", 'printf X | dd of="$1" bs=1 seek=100 conv=notrunc 2>/dev/null', "sh",
                          f"{WORK}/cache/blobs/{sha}"], check=True)
    assert _sha(host_read_bytes(tb, victim, f"{WORK}/cache/trees/{tree.sha}/{rel}")) != sha  # the tree sees it too
    s, tree2, facts = _stage_dir(stage_files, tmp_path, 64 << 10)
    assert tree2.sha == tree.sha
    assert {h: f.sent_bytes for h, f in facts.items()} == {h: (size if h == victim else 0) for h in tb.hosts}
    assert facts[victim].sent_files == 1
