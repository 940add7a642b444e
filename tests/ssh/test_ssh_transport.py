"""The paramiko transport against real sshd hosts: host-key policy, auth, the remote boundary byte for byte."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.core.spec import SSHSpec
from launchers.ssh.transport import HostError, Pool, remote_command


def opts(tb, **over) -> SSHSpec:
    base = dict(port=tb.port, user=tb.user, key=tb.key, known_hosts=tb.known_hosts, strict_host_keys=True,
                connect_timeout=5)
    base.update(over)
    return SSHSpec(**base)


def test_connect_and_exec_over_open_connections(testbed):
    pool = Pool(opts(testbed))
    try:
        res = pool.connect_all(testbed.hosts)
        assert all(not isinstance(c, Exception) for c in res.values()), res
        out = pool.run_all("echo ok")
        assert {h: r[0] for h, r in out.items()} == {h: 0 for h in testbed.hosts}
        assert all(r[1] == b"ok\n" for r in out.values())
    finally:
        pool.close()


def test_unknown_host_key_refused_naming_host(testbed, tmp_path):
    kh = tmp_path / "known_hosts"
    lines = Path(testbed.known_hosts).read_text().splitlines(keepends=True)
    kh.write_text("".join(line for line in lines if testbed.hosts[1] not in line))
    pool = Pool(opts(testbed, known_hosts=str(kh)))
    try:
        with pytest.raises(HostError, match="host key unknown") as ei:
            pool.connect(testbed.hosts[1])
        assert ei.value.host == testbed.hosts[1]
        assert testbed.hosts[1] in str(ei.value)
        pool.connect(testbed.hosts[0])  # the known one still works
    finally:
        pool.close()


def test_non_strict_accepts_unknown_but_refuses_changed(testbed, tmp_path):
    kh = tmp_path / "known_hosts"
    h0, h1 = testbed.hosts[0], testbed.hosts[1]
    lines = Path(testbed.known_hosts).read_text().splitlines(keepends=True)
    key_of = {line.split()[0]: line.split(None, 1)[1] for line in lines}
    name0, name1 = f"[{h0}]:{testbed.port}", f"[{h1}]:{testbed.port}"
    # h0 unknown; h1 listed with h0's key (= changed)
    kh.write_text(f"{name1} {key_of[name0]}")
    pool = Pool(opts(testbed, known_hosts=str(kh), strict_host_keys=False))
    try:
        pool.connect(h0)
        with pytest.raises(HostError, match="HOST KEY CHANGED") as ei:
            pool.connect(h1)
        assert h1 in str(ei.value)
    finally:
        pool.close()
    strict = Pool(opts(testbed, known_hosts=str(kh)))
    try:
        with pytest.raises(HostError, match="HOST KEY CHANGED"):
            strict.connect(h1)
    finally:
        strict.close()


def test_wrong_client_key_refused(testbed, tmp_path):
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    pool = Pool(opts(testbed, key=str(key)))
    try:
        with pytest.raises(HostError, match="authentication failed") as ei:
            pool.connect(testbed.hosts[0])
        assert ei.value.host == testbed.hosts[0]
    finally:
        pool.close()


def test_unreachable_host(testbed):
    pool = Pool(opts(testbed))
    try:
        with pytest.raises(HostError, match="unreachable") as ei:
            pool.connect("127.0.10.250")  # nothing listens there
        assert "127.0.10.250" in str(ei.value)
    finally:
        pool.close()


def test_remote_command_quotes_every_word():
    cmd = remote_command(["echo", "$(id)", "`id`", "a b"], {"X": "; rm -rf /"})
    assert cmd == "exec env 'X=; rm -rf /' echo '$(id)' '`id`' 'a b'"
    with pytest.raises(ValueError):
        remote_command(["x"], {"BAD NAME": "1"})
    with pytest.raises(ValueError):
        remote_command(["x\0y"])


# Echo back argv and the chosen env as hex of the raw bytes (os.environb / sys.argv via fsencode).
ECHO = ("import json,os,sys;"
        "print(json.dumps({'argv':[os.fsencode(a).hex() for a in sys.argv[1:]],"
        "'env':{k:os.environb.get(k.encode(),b'').hex() for k in sys.argv[1].split(',') if k}}))")

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
_names = st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,12}\Z", fullmatch=True).filter(
    lambda n: n not in ("_", "PWD", "SHLVL", "OLDPWD") and not n.startswith(("LC_", "LD_", "PYTHON")))


@pytest.fixture(scope="module")
def open_pool(testbed):
    pool = Pool(opts(testbed))
    pool.connect(testbed.hosts[0])
    yield pool, testbed.hosts[0]
    pool.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(_text, max_size=5), env=st.dictionaries(_names, _text, max_size=4))
def test_argv_and_env_arrive_byte_for_byte(open_pool, testbed, args, env):
    pool, host = open_pool
    argv = [testbed.python, "-I", "-S", "-c", ECHO, ",".join(env), *args]
    rc, out, err = pool.conns[host].run(remote_command(argv, env))
    assert rc == 0, err
    got = json.loads(out)
    assert [bytes.fromhex(a) for a in got["argv"]] == [a.encode() for a in [",".join(env), *args]]
    assert {k: bytes.fromhex(v) for k, v in got["env"].items()} == {k: v.encode() for k, v in env.items()}


def test_sftp_from_many_threads_on_one_connection(testbed, tmp_path):
    """Threads share a host's one SFTP session (the output pumps read exit.json while the submitter reads
    agent.json): each request gets its own answer and none waits forever. paramiko's SFTPClient alone is not safe
    for this: a thread can read and drop another's response (seen as a hang of the whole submit)."""
    import threading
    import time
    files = {}
    for i in range(4):
        p = tmp_path / f"f{i}.json"  # loopback hosts share this filesystem
        p.write_text(json.dumps({"i": i, "pad": "x" * (1000 * i)}))
        files[i] = p
    pool = Pool(opts(testbed))
    errors: list = []
    try:
        conn = pool.connect(testbed.hosts[0])

        def reader(i: int) -> None:
            try:
                for _ in range(60):
                    with conn.sftp() as sftp, sftp.open(str(files[i]), "rb") as fh:
                        assert json.loads(fh.read().decode())["i"] == i
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # 240 reads take ~1 s
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "an SFTP request waited forever"
        assert not errors, errors
    finally:
        pool.close()
