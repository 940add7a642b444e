"""Staging units: what a job stages and where it appears on the hosts, the refusals, the host cache's protocol.

The host cache (orchestrator.node.stagecache) runs here in a subprocess exactly as over SSH (`python -c SOURCE serve
WORKDIR`, JSON lines on stdin/stdout); the end-to-end runs on hosts that share nothing are in tests/staging/.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import closed_by_peer
from orchestrator.errors import ConfigError
from launchers.ssh import stage as st
from orchestrator.node import stagecache

REPO = Path(__file__).resolve().parents[2]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Host:
    """A stagecache server in a subprocess, spoken to as the submitter does."""

    def __init__(self, workdir: Path):
        self.p = subprocess.Popen([sys.executable, "-c", Path(stagecache.__file__).read_text(), "serve", str(workdir)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={"PATH": os.environ["PATH"]})

    def ask(self, req: dict, payload: bytes = b"") -> dict:
        self.p.stdin.write((json.dumps(req) + "\n").encode() + payload)
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> int:
        self.p.stdin.close()
        return self.p.wait(timeout=10)


@pytest.fixture
def host(tmp_path):
    h = Host(tmp_path / "w")
    yield h
    h.p.kill()
    h.p.wait()


def test_host_cache_receives_verifies_and_reuses(host, tmp_path):
    a, b = b"print('hi')\n", os.urandom(3 << 20)
    blobs = [[_sha(a), len(a)], [_sha(b), len(b)]]
    hello = host.ask({"op": "hello", "packages": ["torch", "no-such-package-xyz"], "paths": ["/", "/no/such"]})
    assert hello["workdir"] == str((tmp_path / "w").resolve()) and hello["free"] > 0
    assert hello["versions"]["no-such-package-xyz"] is None and hello["versions"]["torch"]
    assert hello["absent"] == ["/no/such"]
    assert sorted(host.ask({"op": "check", "blobs": blobs})["missing"]) == sorted([_sha(a), _sha(b)])
    assert host.ask({"op": "put", "blobs": blobs}, a + b) == {"bytes": len(a) + len(b), "bad": []}
    assert host.ask({"op": "check", "blobs": blobs})["missing"] == []
    tree = {"t1": [["pkg/run.py", _sha(a), len(a), 0o500], ["data/w.bin", _sha(b), len(b), 0o400]]}
    out = host.ask({"op": "build", "trees": tree, "links": {"runs/j/staged/code": "t1", "runs/j/output": "outputs/k"}})
    assert out == {"built": ["t1"]}
    w = tmp_path / "w"
    assert (w / "runs/j/staged/code/pkg/run.py").read_bytes() == a
    assert (w / "runs/j/output").resolve() == (w / "outputs/k").resolve()
    assert os.stat(w / "cache/trees/t1/pkg/run.py").st_mode & 0o777 == 0o500
    assert os.stat(w / "cache/trees/t1/data/w.bin").st_mode & 0o777 == 0o400
    assert os.stat(w / "cache").st_mode & 0o077 == 0
    # the same tree again: nothing to build
    assert host.ask({"op": "build", "trees": tree, "links": {"runs/j/staged/code": "t1"}}) == {"built": []}


def test_a_corrupted_cached_file_is_detected_resent_and_its_trees_rebuilt(host, tmp_path):
    data = os.urandom(1 << 20)
    blobs = [[_sha(data), len(data)]]
    host.ask({"op": "put", "blobs": blobs}, data)
    tree = {"t": [["w.bin", _sha(data), len(data), 0o400]]}
    host.ask({"op": "build", "trees": tree})
    staged = tmp_path / "w/cache/trees/t/w.bin"
    os.chmod(staged, 0o600)
    with open(staged, "r+b") as fh:  # bit rot through the staged tree's hard link
        fh.write(b"\0\0\0\0")
    assert host.ask({"op": "check", "blobs": blobs})["missing"] == [_sha(data)]
    host.ask({"op": "put", "blobs": blobs}, data)
    assert host.ask({"op": "build", "trees": tree}) == {"built": ["t"]}
    assert staged.read_bytes() == data


def test_two_stages_of_the_same_files_at_once_both_succeed_and_keep_one_copy(tmp_path):
    """Queued jobs stage the same files onto a host at the same time (two submitters, two cache servers on one
    workdir): neither fails on the other's temporary files, and the trees link the one kept copy."""
    import threading
    datas = [os.urandom(2048) + bytes([i % 256]) for i in range(150)]
    blobs = [[_sha(d), len(d)] for d in datas]
    tree = {"t": [[f"f{i}", b[0], b[1], 0o400] for i, b in enumerate(blobs)]}
    hosts = [Host(tmp_path / "w"), Host(tmp_path / "w")]
    replies: dict[int, list] = {}

    def stage(i: int) -> None:
        replies[i] = [hosts[i].ask({"op": "put", "blobs": blobs}, b"".join(datas)),
                      hosts[i].ask({"op": "build", "trees": tree, "links": {f"runs/j{i}/staged/code": "t"}})]
    try:
        threads = [threading.Thread(target=stage, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for h in hosts:
            h.p.kill()
            h.p.wait()
    for i in range(2):
        put, build = replies[i]
        assert "error" not in put and put["bad"] == [], put
        assert "error" not in build, build
    w = tmp_path / "w"
    for i, d in enumerate(datas):
        assert os.stat(w / f"cache/trees/t/f{i}").st_ino == os.stat(w / f"cache/blobs/{blobs[i][0]}").st_ino
        assert (w / f"runs/j1/staged/code/f{i}").read_bytes() == d
    assert not [p.name for p in (w / "cache/blobs").iterdir() if ".tmp" in p.name or ".part" in p.name]


def test_host_cache_refuses_bad_content_and_paths(host):
    data = b"x" * 100
    out = host.ask({"op": "put", "blobs": [["0" * 64, len(data)]]}, data)
    assert out["bad"] == ["0" * 64]  # content that does not have the announced hash is not kept
    host.ask({"op": "put", "blobs": [[_sha(data), len(data)]]}, data)
    for rel in ("../escape", "/etc/x", "a/../../b", "a//b"):
        out = host.ask({"op": "build", "trees": {"t": [[rel, _sha(data), len(data), 0o400]]}})
        assert "refused manifest path" in out["error"], rel
    out = host.ask({"op": "build", "links": {"../../x": "t"}})
    assert "refused link" in out["error"]


# ----------------------------------------------------------------------------------------- the relay's hops

def test_a_relay_port_takes_only_the_stages_key_and_token_and_strangers_do_not_delay_the_real_peer(tmp_path):
    """Mutual TLS pinned to the stage's certificate, then the hop's token: a stranger that sends garbage, one that
    sends nothing, one without a client certificate, one with another stage's key and one with the key but the wrong
    token are all dropped, each on its own thread; the real peer, connecting after all of them, is taken at once."""
    import socket
    import ssl
    import time
    cert, key = st.relay_credentials()
    other_cert, other_key = st.relay_credentials()
    tls = stagecache.RelayTLS(cert, key, str(tmp_path))
    token = "ab" * 16
    lst = stagecache.Listener("127.0.0.1", tls, token, greet_s=3.0)
    addr = ("127.0.0.1", lst.port)
    try:
        idle = socket.create_connection(addr)
        garbage = socket.create_connection(addr)
        garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(4096))
        no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        no_cert.check_hostname, no_cert.verify_mode = False, ssl.CERT_NONE
        anon = no_cert.wrap_socket(socket.create_connection(addr))
        try:  # (TLS 1.3: the client learns of the refusal of its missing certificate on its next read or write)
            anon.sendall(stagecache.PUT + token.encode())
        except OSError:
            pass
        with pytest.raises(OSError):  # another stage's key: the handshake or the next read fails
            with stagecache.RelayTLS(other_cert, other_key, str(tmp_path)).connect(
                    "127.0.0.1", lst.port, stagecache.PUT + token.encode(), timeout=3) as s:
                s.settimeout(3)
                s.recv(1)
        wrong = tls.connect("127.0.0.1", lst.port, stagecache.PUT + b"cd" * 16, timeout=3)
        t0 = time.monotonic()
        real = tls.connect("127.0.0.1", lst.port, stagecache.PUT + token.encode(), timeout=3)
        real.sendall(b"payload")
        peer = lst.peer_in(10)
        took = time.monotonic() - t0
        assert peer.recv(7) == b"payload"
        assert took < 2.0, took  # not held up by the idle stranger (greet_s = 3)
        assert peer.getpeercert(binary_form=True) == tls.pin
        for name, s in (("garbage", garbage), ("no certificate", anon), ("wrong token", wrong)):
            assert closed_by_peer(s, 2.0), f"the {name} stranger is still connected"
        assert closed_by_peer(idle, 2.0), "the idle stranger outlived the port"  # peer_in closed it and its greetings
        assert lst.refused >= 3, lst.refused
        with pytest.raises(OSError):  # the port is closed once the real peer is in
            socket.create_connection(addr, timeout=1)
        peer.close()
    finally:
        lst.close()


def test_an_idle_stranger_is_dropped_after_the_greeting_time_and_an_abort_ends_the_wait(tmp_path):
    import socket
    import time
    cert, key = st.relay_credentials()
    tls = stagecache.RelayTLS(cert, key, str(tmp_path))
    token = "0f" * 16
    lst = stagecache.Listener("127.0.0.1", tls, token, greet_s=1.0)
    try:
        idle = socket.create_connection(("127.0.0.1", lst.port))
        t0 = time.monotonic()
        assert closed_by_peer(idle, 3.0)
        assert 0.9 <= time.monotonic() - t0 < 3.0
        with pytest.raises(TimeoutError, match="1 refused"):
            lst.peer_in(0.3)
    finally:
        lst.close()
    lst = stagecache.Listener("127.0.0.1", tls, token)
    try:
        tls.connect("127.0.0.1", lst.port, stagecache.ABORT + token.encode(), timeout=3).close()
        t0 = time.monotonic()
        with pytest.raises(ConnectionAbortedError):
            lst.peer_in(10)
        assert time.monotonic() - t0 < 2.0
    finally:
        lst.close()


def test_relay_credentials_load_without_a_file_and_verify_under_strict_x509(tmp_path, monkeypatch):
    """The key reaches ssl through an anonymous memory file (nothing written); where there is none, through a 0600
    file in a 0700 directory under the given (owner-only) dir, removed at once. The certificate passes OpenSSL's
    strict X.509 checks (Python 3.13's default)."""
    import ssl
    cert, key = st.relay_credentials()
    tls = stagecache.RelayTLS(cert, key, str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    seen = []
    real = ssl.SSLContext.load_cert_chain

    def spy(self, path, *a):
        seen.append((path, oct(os.stat(path).st_mode & 0o777), oct(os.stat(os.path.dirname(path)).st_mode & 0o777)))
        return real(self, path, *a)
    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", spy)
    monkeypatch.delattr(os, "memfd_create")
    stagecache.RelayTLS(cert, key, str(tmp_path))
    assert [s[0].startswith(str(tmp_path)) for s in seen] == [True, True] and {s[1:] for s in seen} == {
        ("0o600", "0o700")}, seen
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    for ctx in (tls.server, tls.client):
        ctx.verify_flags |= getattr(ssl, "VERIFY_X509_STRICT", 0)
    lst = stagecache.Listener("127.0.0.1", tls, "12" * 16)
    try:
        tls.connect("127.0.0.1", lst.port, stagecache.PUT + b"12" * 16, timeout=3).close()
        lst.peer_in(5).close()
    finally:
        lst.close()


def _relay_put(host: Host, req: dict, out: dict, key: str) -> None:
    out[key] = host.ask(req)


def test_a_relayed_put_through_two_host_caches_survives_a_host_that_starts_reading_late(tmp_path):
    """submitter -TLS-> host a -TLS-> host b, with host a's `put` sent 3 s after the submitter began sending (its
    first hop's sends then wait on a full socket for seconds, as on a slow host): every byte arrives, hashed. The
    stream (300 small blobs, then a large one) is read and passed on in pieces spanning blobs; a blob host a already
    holds is only passed on."""
    import threading
    import time
    cert, key = st.relay_credentials()
    tls = stagecache.RelayTLS(cert, key, str(tmp_path))
    parts = [os.urandom(5000 + i) for i in range(300)] + [os.urandom(24 << 20)]
    data = b"".join(parts)
    blobs = [[_sha(p), len(p)] for p in parts]
    hosts = [Host(tmp_path / "a"), Host(tmp_path / "b")]
    try:
        held = parts[150]
        assert hosts[0].ask({"op": "put", "blobs": [[_sha(held), len(held)]]}, held)["bytes"] == len(held)
        tokens = ["a1" * 16, "b2" * 16]
        ports = [h.ask({"op": "listen", "token": t, "tls": {"cert": cert, "key": key}})["port"]
                 for h, t in zip(hosts, tokens, strict=True)]
        out: dict = {}
        tb = threading.Thread(target=_relay_put, args=(hosts[1], {"op": "put", "blobs": blobs, "relay": True}, out,
                                                       "b"))
        tb.start()
        first = tls.connect("127.0.0.1", ports[0], stagecache.PUT + tokens[0].encode(), timeout=2)
        sender = threading.Thread(target=first.sendall, args=(data,))
        sender.start()
        time.sleep(3)
        assert sender.is_alive()  # blocked on host a, which has not started reading
        _relay_put(hosts[0], {"op": "put", "blobs": blobs, "relay": True,
                              "forward": {"host": "127.0.0.1", "port": ports[1], "token": tokens[1]}}, out, "a")
        sender.join(10)
        tb.join(10)
        first.close()
        assert out == {"a": {"bytes": len(data) - len(held), "bad": []}, "b": {"bytes": len(data), "bad": []}}, out
        for h in ("a", "b"):
            for p in parts:
                assert (tmp_path / h / "cache/blobs" / _sha(p)).read_bytes() == p
    finally:
        for h in hosts:
            h.p.kill()
            h.p.wait()


def test_list_root_excludes_secrets_and_refuses_escaping_symlinks(tmp_path):
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "train.py").write_text("print(1)\n")
    (code / "pkg" / "m.py").write_text("")
    for secret in (".env", "id_ed25519", "server.pem", ".netrc"):
        (code / secret).write_text("s3cr3t")
    (code / "__pycache__").mkdir()
    (code / "__pycache__" / "x.pyc").write_text("")
    (code / "big.ckpt").write_text("")
    (code / "inside").symlink_to(code / "pkg" / "m.py")
    assert st.list_root(code, ("*.ckpt",)) == ("inside", "pkg/m.py", "train.py")
    (tmp_path / "outside.txt").write_text("x")
    (code / "leak").symlink_to(tmp_path / "outside.txt")
    with pytest.raises(ConfigError, match="symlink leaving"):
        st.list_root(code)
    assert "leak" not in st.list_root(code, ("leak",))


def test_git_root_stages_tracked_and_unignored_files(tmp_path):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "train.py").write_text("print(1)\n")
    (repo / "notes.txt").write_text("n")
    (repo / "ignored.log").write_text("x")
    (repo / ".gitignore").write_text("*.log\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "src/train.py", ".gitignore"], check=True)
    assert st.git_root(repo / "src") == repo
    assert st.list_root(repo) == (".gitignore", "notes.txt", "src/train.py")


def _cluster_ssh(**over):
    from orchestrator.core.spec import parse_cluster
    block = {"hosts": ["127.0.0.2", "127.0.0.3"], "shared_fs": False, **over}
    return parse_cluster({"kind": "ssh", "accelerator": "cpu", "ssh": block}, source="<test>")


def test_render_of_a_recipe_stages_data_and_rewrites_paths(tmp_path, monkeypatch):
    from orchestrator import api
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(json.dumps({"kind": "ssh", "accelerator": "cpu",
                                   "ssh": {"hosts": ["127.0.0.2", "127.0.0.3"], "workdir": "/srv/w"}}))
    p = api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(cluster), nodes=2, cwd=REPO,
                    check_trainer=False, overrides=["outputs.fetch=last_checkpoint"])
    recipe = p.files["recipe.yaml"]
    assert "${RUN_DIR}/staged/data0/sft_tiny.jsonl" in recipe and "output_dir: ${RUN_DIR}/output" in recipe
    assert str(REPO) not in recipe
    doc = json.loads(p.files[st.STAGE_FILE])
    assert [s["label"] for s in doc["sources"]] == ["data0"] and doc["fetch"] == "last_checkpoint"
    assert doc["output_local"] == str(REPO / "outputs/sft_tiny") and doc["package"] == p.plan.node_package
    from launchers.ssh.launcher import SSHLauncher
    sub = SSHLauncher(p.cluster).prepare(p.plan)
    argv = sub.nodes[1].argv
    assert argv[2:4] == ("env", f"PYTHONPATH=/srv/w/cache/trees/{p.plan.node_package}")


def test_own_code_script_and_args_are_staged_under_the_code_root(tmp_path, monkeypatch):
    from orchestrator import api
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    proj = tmp_path / "proj"
    (proj / "lib").mkdir(parents=True)
    (proj / "lib" / "util.py").write_text("")
    (proj / "train.py").write_text("print(1)\n")
    (proj / "conf.json").write_text("{}")
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"run": {"script": "train.py", "args": {
        "config": "conf.json", "data": str(data), "output_dir": "out", "logging_dir": "out/logs"}}}))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(json.dumps({"kind": "ssh", "accelerator": "cpu", "ssh": {"hosts": ["127.0.0.2"]}}))
    p = api.prepare(str(job), str(cluster), nodes=1, cwd=proj, check_trainer=False)
    cmd = p.plan.node(0).command
    assert "${RUN_DIR}/staged/code/train.py" in cmd
    assert "${RUN_DIR}/staged/code/conf.json" in cmd  # a relative arg resolved against cwd, inside the code root
    assert "${RUN_DIR}/staged/input1/data.jsonl" in cmd  # outside it: staged on its own
    assert "${RUN_DIR}/output" in cmd and "${RUN_DIR}/output/logs" in cmd
    assert p.plan.rank_cwd == "${RUN_DIR}/staged/code"  # the ranks start where you ran orchestrate
    doc = json.loads(p.files[st.STAGE_FILE])
    assert [(s["label"], s["files"]) for s in doc["sources"]] == [
        ("code", ["conf.json", "lib/util.py", "train.py"]), ("input1", [])]


def test_staging_off_keeps_paths_and_checks_them_on_hosts(tmp_path, monkeypatch):
    from orchestrator import api
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(json.dumps({"kind": "ssh", "accelerator": "cpu",
                                   "ssh": {"hosts": ["127.0.0.2", "127.0.0.3"], "stage": False}}))
    p = api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(cluster), nodes=2, cwd=REPO, check_trainer=False)
    doc = json.loads(p.files[st.STAGE_FILE])
    assert doc["sources"] == [] and doc["inputs"] == [str(REPO / "recipes/data/sft_tiny.jsonl")]
    assert str(REPO / "recipes/data/sft_tiny.jsonl") in p.files["recipe.yaml"]


def test_hash_cache_reads_an_unchanged_file_once(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    c = st.HashCache(tmp_path / "h.json")
    assert c.sha(f)[0] == _sha(b"abc")
    c.save()
    c2 = st.HashCache(tmp_path / "h.json")
    c2.data[str(f)][3] = "remembered"
    assert c2.sha(f)[0] == "remembered"  # not read again
    f.write_bytes(b"abcd")
    assert c2.sha(f)[0] == _sha(b"abcd")



def test_hash_cache_forgets_what_no_submit_used_for_a_while(tmp_path, monkeypatch):
    """The cache is pruned when saved: entries not used for KEEP_DAYS go (files deleted or moved away, old runs'
    checkpoints), and past MAX_ENTRIES the least recently used go first; a hit refreshes its entry at most once a
    day, so an unchanged tree does not rewrite the file on every submit."""
    files = []
    for i in range(4):
        f = tmp_path / f"f{i}"
        f.write_bytes(b"x%d" % i)
        files.append(f)
    now = [1_000_000.0 * 86400]
    monkeypatch.setattr(st.time, "time", lambda: now[0])
    c = st.HashCache(tmp_path / "h.json")
    for f in files:
        c.sha(f)
    c.data["/gone/legacy"] = [1, 2, 3, "old entry without a day"]  # written by an older orchestrate: kept for now
    c.save()
    now[0] += (st.HashCache.KEEP_DAYS - 1) * 86400
    c = st.HashCache(tmp_path / "h.json")
    c.sha(files[0])  # used again: refreshed
    assert c.dirty
    c.save()
    c = st.HashCache(tmp_path / "h.json")
    c.sha(files[0])  # the same day: nothing to write
    assert not c.dirty
    now[0] += 2 * 86400  # files 1-3 and the legacy entry are now unused for more than KEEP_DAYS
    c = st.HashCache(tmp_path / "h.json")
    c.sha(files[1])
    c.save()
    assert set(json.loads((tmp_path / "h.json").read_text())) == {str(files[0]), str(files[1])}
    monkeypatch.setattr(st.HashCache, "MAX_ENTRIES", 1)
    now[0] += 86400
    c = st.HashCache(tmp_path / "h.json")
    c.sha(files[2])
    c.save()
    assert set(json.loads((tmp_path / "h.json").read_text())) == {str(files[2])}  # the most recently used

def test_hash_cache_stops_hashing_when_the_submit_is_cancelled(tmp_path):
    import threading
    from orchestrator.errors import SubmitCancelled
    f = tmp_path / "big"
    f.write_bytes(b"y" * (3 * st.CHUNK))
    c = st.HashCache(None)
    c.cancel = threading.Event()
    c.sha(f)
    f2 = tmp_path / "big2"
    f2.write_bytes(b"z" * (3 * st.CHUNK))
    c.cancel.set()
    assert c.sha(f)[0] == _sha(b"y" * (3 * st.CHUNK))  # known already: nothing to read
    with pytest.raises(SubmitCancelled):
        c.sha(f2)


def test_hash_cache_drops_malformed_entries(tmp_path):
    (tmp_path / "h.json").write_text(json.dumps({"/a": "x", "/b": [1, 2], "/c": [1, 2, 3, "sha", 5], "/d": {}}))
    assert set(st.HashCache(tmp_path / "h.json").data) == {"/c"}
    (tmp_path / "h.json").write_text("[1, 2]")
    assert st.HashCache(tmp_path / "h.json").data == {}


def test_the_node_package_is_the_installed_orchestrator_and_recipes(tmp_path):
    t = st.package_tree(st.HashCache(None))
    rels = {e[0] for e in t.entries}
    assert {"orchestrator/node/agent.py", "orchestrator/node/hooks/sitecustomize.py", "recipes/run.py"} <= rels
    assert not any("__pycache__" in r or r.endswith(".pyc") for r in rels)


@pytest.mark.parametrize("handle", [{"uri": "slurm://7", "data": {"nodes": 2, "job_id": "7"}}, ["odd"],
                                    {"uri": "ssh://j", "data": {"nodes": [
                                        {"rank": 0, "host": "h0", "outputs": "h0:/w/outputs/k"}]}}])
def test_status_reads_any_backends_handle_and_shows_where_outputs_are(tmp_path, handle):
    """The SLURM handle's `nodes` is a count, the SSH one's a list with each node's outputs (host:path)."""
    from orchestrator.cli.views import job_status, status_text
    rd = tmp_path / "run"
    (rd / "nodes" / "0").mkdir(parents=True)
    (rd / "handle.json").write_text(json.dumps(handle))
    (rd / "plan.json").write_text(json.dumps({"world_size": 1, "node_plans": [{"node_rank": 0, "ranks": [0],
                                                                                "host": "h0"}]}))
    (rd / "fetched.json").write_text(json.dumps({"files": 3, "bytes": 2_000_000, "errors": {}}))
    rec = {"id": "j", "state": "COMPLETED", "backend": "ssh", "handle": "", "cluster": "c", "world_size": 1,
           "run_dir": str(rd), "created": 0, "updated": 0}
    st = job_status(rec)
    text = status_text(st)
    assert "fetched  3 file(s), 2.0 MB fetched back" in text
    ssh = isinstance(handle, dict) and isinstance(handle["data"]["nodes"], list)
    assert ("outputs  node 0: h0:/w/outputs/k" in text) == ssh, text
