"""The staging relay (host-to-host fan-out, docs/staging.md) as an attacker on the hosts' network sees it, on the real
private SSH hosts (tests/staging/conftest.py): a packet capture of every byte to and from the hosts never shows a
staged file's content; strangers connecting to the hosts' relay ports (sending garbage, or nothing) are dropped while
the stage goes through the relay at its normal speed; a host that starts reading late still gets its bytes through
the relay (no fallback to direct sends)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers import closed_by_peer
from private_hosts import unavailable

pytestmark = pytest.mark.slow


def _data(d: Path, n_bytes: int, marker: bytes = b"") -> Path:
    """4 files of n_bytes in all: random bytes, with `marker` repeated all through the first one."""
    d.mkdir()
    for i in range(4):
        body = os.urandom(n_bytes // 4)
        if i == 0 and marker:
            step = 4096
            body = b"".join(marker + body[j:j + step - len(marker)] for j in range(0, len(body), step))
        (d / f"part{i}.bin").write_bytes(body)
    return d


@pytest.fixture
def listen_spy(monkeypatch):
    """{host: relay port} of the stage, filled as each host answers `listen`; on_listen(host, port) hooks in there."""
    from launchers.ssh import stage as st
    ask = st.Session.ask
    ports: dict[str, int] = {}
    hooks: list = []

    def spy(self, req, payload=None):
        out = ask(self, req, payload)
        if req.get("op") == "listen":
            ports[self.host] = int(out["port"])
            for hook in hooks:
                hook(self.host, ports[self.host])
        return out
    monkeypatch.setattr(st.Session, "ask", spy)
    return ports, hooks


# ----------------------------------------------------------------------------------------- the capture

def _flows(pcap: bytes) -> dict[tuple, tuple[bytearray, int]]:
    """{(src, sport, dst, dport): (the TCP byte stream, how many of its bytes no captured packet held)} of a tcpdump
    file taken on Linux loopback (link type EN10MB): each payload put at its sequence number's offset (a
    retransmission lands on itself). Every packet must have been captured whole."""
    magic = struct.unpack("<I", pcap[:4])[0]
    assert magic in (0xA1B2C3D4, 0xA1B23C4D), hex(magic)
    link = struct.unpack("<I", pcap[20:24])[0]
    assert link == 1, f"link type {link} (expected EN10MB on lo)"
    segments: dict[tuple, list[tuple[int, bytes]]] = {}
    start: dict[tuple, int] = {}
    at = 24
    while at + 16 <= len(pcap):
        incl, orig = struct.unpack("<II", pcap[at + 8:at + 16])
        pkt = pcap[at + 16:at + 16 + incl]
        at += 16 + incl
        assert incl == orig, f"a packet was cut at {incl} of {orig} bytes: the capture would miss content"
        if struct.unpack("!H", pkt[12:14])[0] != 0x0800:
            continue
        ip = pkt[14:]
        ihl, proto = (ip[0] & 0xF) * 4, ip[9]
        if proto != 6:
            continue
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        key = (socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport)
        payload = tcp[(tcp[12] >> 4) * 4:]
        if tcp[13] & 0x02:  # SYN: the stream starts at the next sequence number
            start[key] = (seq + 1) % 2**32
        elif payload:
            start.setdefault(key, seq)  # (a connection older than the capture: from its first byte seen)
            segments.setdefault(key, []).append(((seq - start[key]) % 2**32, payload))
    flows = {}
    for key, segs in segments.items():
        stream = bytearray(max(off + len(p) for off, p in segs))
        covered = bytearray(len(stream))
        for off, p in segs:
            stream[off:off + len(p)] = p
            covered[off:off + len(p)] = b"\1" * len(p)
        flows[key] = (stream, covered.count(0))
    return flows


class Capture:
    """tcpdump on lo of every TCP packet to or from the given addresses, into a file; stop() -> its flows."""

    def __init__(self, path: Path, hosts: list[str]):
        tcpdump = shutil.which("tcpdump")
        if tcpdump is None:
            unavailable("tcpdump not found (scripts/install_ssh_deps.sh installs it)")
        self.path = path
        flt = "tcp and (" + " or ".join(f"host {h}" for h in hosts) + ")"
        self.p = subprocess.Popen([tcpdump, "-i", "lo", "-n", "--immediate-mode", "-U", "-s", "0", "-B", "65536",
                                   "-Z", "root",
                                   "-w", str(path), flt], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err = b""
        deadline = time.monotonic() + 20
        while b"listening on" not in self.err:  # tcpdump says so once its filter is in place
            line = self.p.stderr.readline()
            if not line or time.monotonic() > deadline:
                self.p.kill()
                raise RuntimeError(f"tcpdump did not start: {self.err.decode(errors='replace')}")
            self.err += line

    def stop(self) -> dict[tuple, tuple[bytearray, int]]:
        time.sleep(0.5)  # (the last packets reach the capture)
        self.p.send_signal(signal.SIGINT)
        self.err += self.p.communicate(timeout=30)[1]
        dropped = [ln for ln in self.err.decode(errors="replace").splitlines() if "dropped by kernel" in ln]
        assert dropped and dropped[0].split()[0] == "0", self.err.decode(errors="replace")
        return _flows(self.path.read_bytes())


def test_a_capture_of_the_hosts_traffic_never_shows_a_staged_files_content(private_testbed, tmp_path, stage_files,
                                                                           listen_spy):
    """A marker spread all through a staged file, staged to 3 hosts through the relay (submitter -> host 0 -> host 1
    -> host 2, each hop checked to be the relay): every TCP byte to and from the hosts (SSH and relay) is captured;
    the marker is nowhere in it, while each relay port carried at least the whole data set, and the same marker sent
    over a plain connection between two hosts' addresses during the capture is found (the capture sees plain text)."""
    tb = private_testbed
    ports, _ = listen_spy
    marker = f"MARKER-{secrets.token_hex(12)}-STAGED".encode()
    src = _data(tmp_path / "data", 12 << 20, marker)
    cap = Capture(tmp_path / "relay.pcap", tb.hosts)
    try:
        control = socket.socket()  # the control: plain text between two hosts' addresses
        control.bind((tb.hosts[2], 0))
        control.listen(1)
        sender = socket.create_connection(control.getsockname(), source_address=(tb.hosts[0], 0))
        sender.sendall(b"plain " + marker)
        sender.close()
        conn, _ = control.accept()
        while conn.recv(4096):
            pass
        conn.close()
        control_port = control.getsockname()[1]
        control.close()
        s, tree, facts, took = stage_files(src)
    finally:
        flows = cap.stop()
    print(f"12 MiB to 3 hosts through the relay in {took:.2f} s; {len(flows)} flows captured")
    assert s.relayed == {h: "ok" for h in tb.hosts}, s.relayed  # the relay, not the direct fallback
    assert all(f.sent_bytes == tree.size for f in facts.values())
    assert set(ports) == set(tb.hosts), ports
    hits = {k for k, (stream, _) in flows.items() if marker in stream}
    assert hits and all(k[3] == control_port for k in hits), f"the marker was seen in {sorted(hits)}"
    for h, port in ports.items():  # the bulk crossed each hop's port once, encrypted, and all of it was captured
        hop = [(len(stream), holes) for k, (stream, holes) in flows.items() if k[2] == h and k[3] == port]
        assert len(hop) == 1, (h, port, hop)
        size, holes = hop[0]
        assert tree.size <= size < tree.size * 1.01 and holes == 0, (h, port, size, holes, tree.size)


# ----------------------------------------------------------------------------------------- strangers

def test_strangers_on_the_relay_ports_are_dropped_and_the_stage_keeps_its_speed(private_testbed, tmp_path,
                                                                               stage_files, listen_spy):
    """The same stage twice (fresh data each time): alone, then with two strangers on each host's relay port from the
    moment it opens, one sending garbage, one sending nothing. Both are dropped (garbage at once, the silent one by
    the time the stage ends), every hop still goes through the relay, and the stage takes about as long as alone
    (before: one silent connection held a port ~10 s and broke the relay on every hop, 19 s instead of 6.5 s)."""
    from orchestrator.node.stagecache import RELAY_GREET_S
    tb = private_testbed
    ports, hooks = listen_spy
    n = 24 << 20
    s, tree, _, alone = stage_files(_data(tmp_path / "alone", n))
    assert s.relayed == {h: "ok" for h in tb.hosts}, s.relayed
    strangers: dict[str, list[socket.socket]] = {}

    def attack(host: str, port: int) -> None:
        garbage = socket.create_connection((host, port), timeout=5)
        garbage.sendall(b"\x16\x03\x01\x00\xff" + os.urandom(4000))  # a TLS record header, then noise
        idle = socket.create_connection((host, port), timeout=5)
        strangers[host] = [garbage, idle]
    hooks.append(attack)
    s, tree, facts, took = stage_files(_data(tmp_path / "attacked", n))
    try:
        print(f"24 MiB to 3 hosts: alone {alone:.2f} s, with a garbage and a silent stranger on every relay port "
              f"{took:.2f} s")
        assert s.relayed == {h: "ok" for h in tb.hosts}, s.relayed
        assert all(f.sent_bytes == tree.size for f in facts.values())
        assert set(strangers) == set(tb.hosts)
        assert took < alone * 1.5 + 1.0 and took < RELAY_GREET_S, (alone, took)
        for host, (garbage, idle) in strangers.items():
            assert closed_by_peer(garbage, 1.0), f"{host}: the garbage stranger is still connected"
            assert closed_by_peer(idle, 1.0), f"{host}: the silent stranger outlived the stage"
    finally:
        for pair in strangers.values():
            for sock in pair:
                sock.close()


# ----------------------------------------------------------------------------------------- a late reader

@pytest.mark.parametrize("late", [0, 2], ids=["first-host", "last-host"])
def test_a_host_that_starts_reading_late_still_gets_its_bytes_through_the_relay(private_testbed, tmp_path,
                                                                                stage_files, monkeypatch, late):
    """One host's `put` reaches it 3 s after the others' (a slow host): the hop feeding it (the submitter's own
    socket for the first host, the previous host's for the last) blocks on a full socket for those seconds and then
    carries on; every hop is the relay's (before: the submitter's first socket kept its 2 s connect timeout for its
    sends, so a first host reading > 2 s late broke the relay on every hop)."""
    from launchers.ssh import stage as st
    tb = private_testbed
    victim = tb.hosts[late]
    ask = st.Session.ask
    delayed = threading.Event()

    def slow(self, req, payload=None):
        if req.get("op") == "put" and self.host == victim and not delayed.is_set():
            delayed.set()
            time.sleep(3)
        return ask(self, req, payload)
    monkeypatch.setattr(st.Session, "ask", slow)
    s, tree, facts, took = stage_files(_data(tmp_path / "data", 24 << 20))
    print(f"24 MiB to 3 hosts, {victim}'s put 3 s late: {took:.2f} s, relay {s.relayed}")
    assert delayed.is_set()
    assert s.relayed == {h: "ok" for h in tb.hosts}, s.relayed
    assert all(f.sent_bytes == tree.size for f in facts.values())
    assert took >= 3
