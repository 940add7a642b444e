"""The private SSH hosts share nothing with the submit host, proven over real SSH (orchestrator's own transport):
each host's /opt/hostenv/bin/python has the training stack but not orchestrate, the checkout, the submitter's /tmp
and caches are not there, each host's work area is its own, and down() leaves no process, namespace or mount."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

import sshd_hosts
from launchers.ssh.transport import Pool, remote_command
from private_hosts import host_path, host_read_bytes, host_run, host_write_bytes, private_down, private_up

REPO = Path(__file__).resolve().parents[2]
WORK = f"{sshd_hosts.HOST_WORK_AREA}/work"
HOSTPY = f"{sshd_hosts.HOSTENV}/bin/python"


@pytest.fixture
def pool(private_testbed, make_private_cluster):
    """A transport Pool connected to all 3 private hosts with the cluster's SSHSpec."""
    cluster = make_private_cluster(hosts=private_testbed.hosts)
    p = Pool(cluster.ssh)
    try:
        res = p.connect_all(cluster.ssh.hosts)
        assert not [c for c in res.values() if isinstance(c, Exception)], res
        yield p
    finally:
        p.close()


def sh(pool, host: str, script: str, *args: str, timeout: float = 120) -> tuple[int, str, str]:
    rc, out, err = pool.conns[host].run(remote_command(["sh", "-c", script, "sh", *args]), timeout=timeout)
    return rc, out.decode(errors="replace"), err.decode(errors="replace")


def all_mountinfo_holding(tag: str) -> list[int]:
    """Every process of this machine whose mount table shows a mount named `tag` (any namespace)."""
    hits = []
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                if tag.encode() in Path(f"/proc/{e.name}/mountinfo").read_bytes():
                    hits.append(int(e.name))
            except OSError:
                pass
    return hits


def test_cluster_block_points_at_the_host_env_and_work_area(private_testbed, make_private_cluster):
    c = make_private_cluster()
    assert c.ssh.python == HOSTPY
    assert c.ssh.workdir == WORK
    assert c.ssh.shared_fs is False
    assert list(c.ssh.hosts) == private_testbed.hosts[:2]
    assert private_testbed.hosts == ["127.0.13.2", "127.0.13.3", "127.0.13.4"] or os.environ.get(
        "ORCHESTRATE_TEST_PRIVATE_BASE_IP")
    assert private_testbed.port == int(os.environ.get("ORCHESTRATE_TEST_PRIVATE_PORT", "2224"))


PROBE = r"""
import importlib, json, sys
out = {"prefix": sys.prefix}
for m in ("torch", "accelerate", "transformers", "trl"):
    out[m] = importlib.import_module(m).__version__
for m in ("orchestrator", "recipes"):
    try:
        importlib.import_module(m)
        out[m] = "imported"
    except Exception as e:
        out[m] = type(e).__name__
print(json.dumps(out))
"""


def test_host_python_has_training_stack_but_not_orchestrate(private_testbed, pool):
    res = pool.run_all(remote_command([HOSTPY, "-c", PROBE]), timeout=240)
    want = {m: metadata.version(m) for m in ("torch", "accelerate", "transformers", "trl")}
    for host in private_testbed.hosts:
        r = res[host]
        assert not isinstance(r, Exception), r
        rc, out, err = r
        assert rc == 0, (host, err.decode()[-2000:])
        got = json.loads(out)
        assert got["prefix"] == sshd_hosts.HOSTENV, got
        assert {m: got[m] for m in want} == want, (host, got)
        # the editable install points into the hidden checkout: orchestrate is not importable on the host
        assert got["orchestrator"] == "ModuleNotFoundError", (host, got)
        assert got["recipes"] == "ModuleNotFoundError", (host, got)


VIEW = r"""
import json, os, sys
def view(p):
    if not os.path.lexists(p):
        return None
    return sorted(os.listdir(p)) if os.path.isdir(p) else "file"
print(json.dumps([view(p) for p in sys.argv[1:]]))
"""


def test_checkout_tmp_and_submitter_dirs_are_not_there(private_testbed, pool, tmp_path):
    marker = tmp_path / f"submitter-marker-{secrets.token_hex(4)}"
    marker.write_text("only on the submit host\n")
    tmp_top = Path("/tmp", *tmp_path.resolve().relative_to("/tmp").parts[:1]) if tmp_path.resolve().is_relative_to(
        "/tmp") else tmp_path
    paths = {"repo": str(REPO), "parent": str(REPO.parent), "marker": str(marker), "tmp_path": str(tmp_path),
             "tmp_top": str(tmp_top), "tmp": "/tmp", "venv": sys.prefix, "key": private_testbed.key,
             "orch_home": os.environ["ORCHESTRATE_HOME"],
             "orch_cache": os.environ.get("ORCHESTRATE_CACHE") or str(Path.home() / ".cache/orchestrate"),
             "hostenv": sshd_hosts.HOSTENV, "pyenv": str(Path.home() / ".pyenv")}
    assert Path(paths["orch_home"]).exists() and Path(paths["key"]).exists() and Path(sys.prefix).exists()
    for host in private_testbed.hosts:
        rc, out, err = pool.conns[host].run(remote_command([HOSTPY, "-c", VIEW, *paths.values()]), timeout=120)
        assert rc == 0, (host, err)
        seen = dict(zip(paths, json.loads(out), strict=True))
        for name in ("repo", "marker", "tmp_path", "tmp_top", "key", "orch_home"):
            assert seen[name] is None, (host, name, paths[name], seen[name])
        if REPO.parent != Path("/"):  # an empty tmpfs covers the checkout's parent (when that is /tmp: the host's own
            # /tmp, where its jobs' lease files and torchrun's temporary dirs may lie; nothing of the submit host's)
            own = [e for e in seen["parent"] if e != "orchestrate-leases" and not e.startswith("torchelastic_")]
            assert own == [] if REPO.parent != Path("/tmp") else REPO.name not in own, (host, seen["parent"])
        assert seen["venv"] in (None, []), (host, seen["venv"])  # the venv only at /opt/hostenv
        assert seen["orch_cache"] in (None, []), (host, seen["orch_cache"])  # no tiny model / data of ours
        assert seen["tmp"] is not None and tmp_top.name not in seen["tmp"], (host, seen["tmp"])
        assert "pyvenv.cfg" in seen["hostenv"] and seen["pyenv"], (host, seen)  # root's home stays visible
        # the host env is read-only; the host's /tmp is writable but its own
        rc, _, _ = sh(pool, host, 'touch "$1"/x-test', sshd_hosts.HOSTENV)
        assert rc != 0
        name = f"/tmp/host-only-{secrets.token_hex(4)}"
        rc, _, err = sh(pool, host, 'echo host > "$1" && test -s "$1"', name)
        assert rc == 0, err
        assert not Path(name).exists()


def test_work_area_is_private_per_host(private_testbed, pool):
    a, b, c = private_testbed.hosts
    token = secrets.token_hex(8)
    path = f"{WORK}/isolation-{token}/file"
    rc, _, err = sh(pool, a, 'mkdir -p "${1%/*}" && printf %s "$2" > "$1"', path, token)
    assert rc == 0, err
    try:
        rc, out, _ = sh(pool, a, 'cat "$1"', path)
        assert (rc, out) == (0, token)
        assert host_read_bytes(private_testbed, a, path) == token.encode()
        assert host_path(private_testbed, a, path).read_bytes() == token.encode()
        for other in (b, c):
            rc, out, _ = sh(pool, other, 'test -e "$1"; echo $?; ls -A "$2"', path, WORK)
            assert rc == 0 and out.split("\n")[0] == "1", (other, out)
            assert f"isolation-{token}" not in out
            assert host_run(private_testbed, other, ["test", "-e", path]).returncode == 1
            with pytest.raises(FileNotFoundError):
                host_read_bytes(private_testbed, other, path)
        assert not Path(path).exists()  # nor on the submit host
        assert not os.path.ismount(sshd_hosts.HOST_WORK_AREA) and not os.path.ismount(sshd_hosts.HOSTENV)
        # one mount namespace per host, none of them the submitter's
        ns = {h: os.readlink(f"/proc/{sshd_hosts.host_pid(private_testbed, h)}/ns/mnt")
              for h in private_testbed.hosts}
        assert len(set(ns.values())) == len(ns) and os.readlink("/proc/self/ns/mnt") not in ns.values()
        rc, out, _ = sh(pool, a, "readlink /proc/self/ns/mnt")
        assert out.strip() == ns[a]  # the SSH session runs in host a's namespace
    finally:
        host_run(private_testbed, a, ["rm", "-rf", f"{WORK}/isolation-{token}"])


def test_helpers_read_and_corrupt_a_host_file(private_testbed):
    h = private_testbed.hosts[2]
    path = f"{WORK}/helper-{secrets.token_hex(4)}.bin"
    data = os.urandom(4096)
    host_write_bytes(private_testbed, h, path, data)
    try:
        r = host_run(private_testbed, h, ["sha256sum", path])
        assert r.returncode == 0 and r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
        bad = bytearray(data)
        bad[100] ^= 0xFF
        host_write_bytes(private_testbed, h, path, bytes(bad))  # e.g. corrupt a staged file
        assert host_read_bytes(private_testbed, h, path) == bytes(bad)
        r = host_run(private_testbed, h, ["ls", "-A", WORK])
        assert path.rsplit("/", 1)[1] in r.stdout.decode()
    finally:
        host_run(private_testbed, h, ["rm", "-f", path])


def test_down_leaves_no_process_namespace_or_mount(tmp_path, tmp_path_factory):
    """A 1-host private testbed of its own (127.0.13.20:2225): a detached job left running, an open session and a
    process that joined the namespace from outside all die with down(); then no process anywhere shows its mounts."""
    from orchestrator.core.spec import SSHSpec
    tb = private_up(1, tmp_path / "tb", "127.0.13.20", 2225, hide=[tmp_path_factory.getbasetemp()])
    host = tb.hosts[0]
    tag = tb.tags[host]
    sshd_pid = sshd_hosts.host_pid(tb, host)
    joined = None
    p = Pool(SSHSpec(hosts=(host,), port=tb.port, user=tb.user, key=tb.key, known_hosts=tb.known_hosts,
                     connect_timeout=5))
    try:
        conn = p.connect(host)
        pidfile = f"{WORK}/lingering.pid"
        rc, _, err = conn.run(remote_command(["sh", "-c", 'setsid sh -c \'echo $$ > "$1"; exec sleep 600\' sh "$1" '
                                              '</dev/null >/dev/null 2>&1 &', "sh", pidfile]))
        assert rc == 0, err
        chan = conn.open(remote_command(["sleep", "600"]))  # a session still open at down()
        joined = subprocess.Popen(["nsenter", "--target", str(sshd_pid), "--mount", "--", "sleep", "600"])
        deadline = time.monotonic() + 10
        lingering = None
        while time.monotonic() < deadline:
            try:
                lingering = int(host_read_bytes(tb, host, pidfile))
            except (FileNotFoundError, ValueError):
                lingering = None
            members = sshd_hosts.leftovers(tb)
            if lingering in members and joined.pid in members and len(members) >= 4:
                break
            time.sleep(0.05)
        members = sshd_hosts.leftovers(tb)
        assert lingering in members and joined.pid in members and sshd_pid in members, (lingering, members)
        assert all_mountinfo_holding(tag)  # the check below can see the mounts while they exist
        assert not chan.exit_status_ready()
        t0 = time.monotonic()
        assert sshd_hosts.down(tb.dir) == 1
        took = time.monotonic() - t0
        joined.wait(timeout=10)
        assert not [pid for pid in members if sshd_hosts._alive(pid)], members
        assert sshd_hosts.leftovers(tb) == []
        assert all_mountinfo_holding(tag) == []  # the namespace, with its tmpfs mounts, is gone
        assert not Path(tb.runtime[host]).exists()
        assert not (Path(tb.dir) / sshd_hosts.STATE).exists()
        assert not sshd_hosts._port_busy(host, tb.port)
        assert not os.path.ismount(sshd_hosts.HOST_WORK_AREA) and not os.listdir(sshd_hosts.HOST_WORK_AREA)
        assert took < 10, took
    finally:
        p.close()
        if joined is not None and joined.poll() is None:
            joined.kill()
            joined.wait()
        private_down(tb)


def test_eight_private_hosts_via_the_cli(tmp_path):
    """`scripts/sshd_hosts.py up --private -n 8` / `down`: 8 hosts, each answering over SSH from its own view."""
    from orchestrator.core.spec import parse_cluster
    why = sshd_hosts.prerequisites(private=True)
    if why:
        from private_hosts import unavailable
        unavailable(why)
    d = tmp_path / "eight"
    cli = [sys.executable, str(REPO / "scripts/sshd_hosts.py")]
    t0 = time.monotonic()
    r = subprocess.run([*cli, "up", "--private", "-n", "8", "--dir", str(d), "--base-ip", "127.0.13.40",
                        "--port", "2226"], capture_output=True, text=True, timeout=120)
    up_s = time.monotonic() - t0
    tb = sshd_hosts.load(d) if (d / sshd_hosts.STATE).exists() else None
    p = None
    try:
        assert r.returncode == 0, r.stderr
        block = json.loads(r.stdout)
        assert block["hosts"] == [f"127.0.13.{40 + i}" for i in range(8)]
        assert (block["python"], block["workdir"], block["shared_fs"]) == (HOSTPY, WORK, False)
        cluster = parse_cluster({"kind": "ssh", "name": "priv8", "accelerator": "cpu", "ssh": block}, source="<t>")
        p = Pool(cluster.ssh)
        res = p.connect_all(cluster.ssh.hosts)
        assert not [c for c in res.values() if isinstance(c, Exception)], res
        script = ('test ! -e "$1" && mkdir -p "$2" && echo "$3" > "$2/me" && cat "$2/me" && ls -A "$2" | wc -l '
                  '&& readlink /proc/self/ns/mnt && "$4" -c "import sys; print(sys.prefix)"')
        out = p.run_all(lambda h: remote_command(["sh", "-c", script, "sh", str(REPO), WORK, h, HOSTPY]))
        ns = set()
        for h in block["hosts"]:
            assert not isinstance(out[h], Exception), out[h]
            rc, o, e = out[h]
            assert rc == 0, (h, e)
            me, count, mnt, prefix = o.decode().split()
            assert (me, count, prefix) == (h, "1", sshd_hosts.HOSTENV), (h, o)  # only its own file
            ns.add(mnt)
        assert len(ns) == 8
    finally:
        if p is not None:
            p.close()
        t1 = time.monotonic()
        r2 = subprocess.run([*cli, "down", "--dir", str(d)], capture_output=True, text=True, timeout=120)
        down_s = time.monotonic() - t1
    print(f"8 private hosts: up {up_s:.2f}s (CLI, incl. interpreter start), down {down_s:.2f}s")
    assert r2.returncode == 0 and "stopped 8 sshd" in r2.stdout, (r2.stdout, r2.stderr)
    assert tb is not None and sshd_hosts.leftovers(tb) == []
    assert all(all_mountinfo_holding(t) == [] for t in tb.tags.values())


def test_stale_private_hosts_of_a_killed_run_can_be_stopped(tmp_path, tmp_path_factory):
    """A run killed before its teardown leaves private hosts whose testbed dir may be gone: a new up() on the
    same address says how to stop them, and `down --stale-private --port P` does (only that port's hosts)."""
    import shutil
    tb = private_up(2, tmp_path / "old", "127.0.13.30", 2228, hide=[tmp_path_factory.getbasetemp()])
    try:
        shutil.rmtree(tb.dir)  # the killed run's testbed dir is gone (pytest's tmp retention)
        with pytest.raises(RuntimeError, match="--stale-private"):
            sshd_hosts.up(2, tmp_path / "new", base_ip="127.0.13.30", port=2228, private=True)
        r = subprocess.run([sys.executable, str(REPO / "scripts/sshd_hosts.py"), "down", "--stale-private",
                            "--port", "2228"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "stopped 2 sshd" in r.stdout, (r.stdout, r.stderr)
        assert sshd_hosts.leftovers(tb) == []
        assert not any(Path(d).exists() for d in tb.runtime.values())
        assert not any(sshd_hosts._port_busy(h, 2228) for h in tb.hosts)
    finally:
        sshd_hosts.down_stale_private(2228)
