#!/usr/bin/env python3
"""Real sshd "hosts" on loopback addresses for tests and benchmarks (the SSH testbed).

Owns: bringing up N sshd daemons on 127.0.0.2, 127.0.0.3, ... (each with its own config,
ed25519 host key, pid file and log; key auth only), a client key, a known_hosts file, an
authorized_keys file, a `python` wrapper that can import this repository, and tearing them
down again by pid file (the pid is checked to still run sshd with our config before it is killed).

    scripts/sshd_hosts.py up 2 --dir /tmp/sshlab [--base-ip 127.0.0.2] [--port 2222] [--user NAME]
    scripts/sshd_hosts.py down --dir /tmp/sshlab

Python API (used by tests/ssh/conftest.py and bench/bench_ssh.py): `up(...) -> Testbed`,
`down(dir)`, `load(dir)`, `prerequisites() -> reason or None`.
Needs root (sshd must switch users) and Debian's openssh-server (scripts/install_ssh_deps.sh).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "ssh-keygen"
REPO = Path(__file__).resolve().parent.parent
STATE = "testbed.json"


@dataclass
class Testbed:
    """What `up` made: everything a cluster file's ssh block needs."""

    dir: str
    hosts: list[str]
    port: int
    user: str
    key: str  # client private key
    known_hosts: str
    python: str  # wrapper: the repo's interpreter with the repo on PYTHONPATH
    pids: dict[str, int] = field(default_factory=dict)

    def ssh_block(self, **over) -> dict:
        """An `ssh:` block for a cluster YAML / parse_cluster()."""
        block = {"hosts": list(self.hosts), "port": self.port, "user": self.user, "key": self.key,
                 "known_hosts": self.known_hosts, "strict_host_keys": True, "python": self.python,
                 "workdir": str(Path(self.dir) / "work" / "{host}"), "shared_fs": False,
                 "connect_timeout": 5}
        block.update(over)
        return block

    def host_dir(self, host: str) -> Path:
        return Path(self.dir) / "hosts" / host


def prerequisites() -> str | None:
    """None when this machine can run the testbed, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (sshd has to switch users)"
    if not Path(SSHD).is_file():
        return f"{SSHD} not found (run scripts/install_ssh_deps.sh)"
    if shutil.which(SSH_KEYGEN) is None:
        return "ssh-keygen not found (run scripts/install_ssh_deps.sh)"
    return None


def _keygen(path: Path, comment: str) -> str:
    if not path.exists():
        subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       check=True, stdin=subprocess.DEVNULL)
    return Path(str(path) + ".pub").read_text().split()[1]


def _port_busy(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((ip, port)) == 0


def known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _sshd_config(hd: Path, ip: str, port: int, authorized: Path, user: str) -> str:
    return "\n".join([
        f"ListenAddress {ip}:{port}",
        f"HostKey {hd / 'ssh_host_ed25519_key'}",
        f"PidFile {hd / 'sshd.pid'}",
        f"AuthorizedKeysFile {authorized}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        f"AllowUsers {user}",
        "UsePAM no",
        "StrictModes no",
        "UseDNS no",
        "PrintMotd no",
        "X11Forwarding no",
        "PermitUserEnvironment no",
        "MaxStartups 100:30:200",
        "MaxSessions 64",
        "LogLevel INFO",
        "Subsystem sftp internal-sftp",
        "",
    ])


def ensure_user(name: str) -> None:
    """A non-root login user (no password, not locked) for fan-out benchmarks."""
    import pwd
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "-M", "-d", "/tmp", "-s", "/bin/sh", name], check=True)
    subprocess.run(["usermod", "-p", "*", name], check=True)  # '*' = no password, but not "locked"


def up(n: int, dir: str | Path, base_ip: str = "127.0.0.2", port: int = 2222, user: str = "root",
       python: str | None = None, timeout: float = 20.0) -> Testbed:
    """Start n sshd hosts. Raises RuntimeError (after tearing down what it started) on failure."""
    why = prerequisites()
    if why:
        raise RuntimeError(f"sshd testbed unavailable: {why}")
    d = Path(dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if (d / STATE).exists():
        down(d)
    base = ipaddress.IPv4Address(base_ip)
    hosts = [str(base + i) for i in range(n)]
    for h in hosts:
        if not ipaddress.IPv4Address(h).is_loopback:
            raise RuntimeError(f"{h} is not a loopback address; the testbed only uses 127.0.0.0/8")
    busy = [h for h in hosts if _port_busy(h, port)]
    if busy:
        raise RuntimeError(f"port {port} already in use on {', '.join(busy[:5])}")
    if user != "root":
        ensure_user(user)
        os.chmod(d, 0o755)  # the user's sshd child reads authorized_keys with the user's rights
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir

    key = d / "client_ed25519"
    client_pub = _keygen(key, "orchestrate-testbed")
    authorized = d / "authorized_keys"
    authorized.write_text(f"ssh-ed25519 {client_pub} orchestrate-testbed\n")
    authorized.chmod(0o644)

    def make_host(h: str) -> str:
        hd = d / "hosts" / h
        hd.mkdir(parents=True, exist_ok=True)
        pub = _keygen(hd / "ssh_host_ed25519_key", f"host-{h}")
        (hd / "sshd_config").write_text(_sshd_config(hd, h, port, authorized, user))
        (hd / "sshd.pid").unlink(missing_ok=True)
        return f"{known_hosts_name(h, port)} ssh-ed25519 {pub}\n"

    with ThreadPoolExecutor(8) as ex:
        lines = list(ex.map(make_host, hosts))
    known = d / "known_hosts"
    known.write_text("".join(lines))

    # A wrapper interpreter: the repo's python with the repo importable (no install needed).
    wrapper = d / "python"
    real = python or sys.executable
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}} exec {real} \"$@\"\n")
    wrapper.chmod(0o755)

    tb = Testbed(dir=str(d), hosts=hosts, port=port, user=user, key=str(key), known_hosts=str(known),
                 python=str(wrapper))
    (d / STATE).write_text(json.dumps(asdict(tb), indent=1))
    try:
        for h in hosts:  # each sshd daemonizes at once; then wait for all of them together
            hd = d / "hosts" / h
            subprocess.run([SSHD, "-f", str(hd / "sshd_config"), "-E", str(hd / "sshd.log")], check=True,
                           stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        pending = list(hosts)
        while pending:
            pending = [h for h in pending if not (_read_pid(d / "hosts" / h / "sshd.pid") and _port_busy(h, port))]
            if not pending:
                break
            if time.monotonic() > deadline:
                logs = (d / "hosts" / pending[0] / "sshd.log")
                tail = logs.read_text()[-500:] if logs.exists() else ""
                raise RuntimeError(f"sshd did not come up on {', '.join(pending[:5])}: {tail}")
            time.sleep(0.05)
        tb.pids = {h: _read_pid(d / "hosts" / h / "sshd.pid") for h in hosts}
        (d / STATE).write_text(json.dumps(asdict(tb), indent=1))
    except BaseException:
        down(d)
        raise
    return tb


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def load(dir: str | Path) -> Testbed:
    return Testbed(**json.loads((Path(dir) / STATE).read_text()))


def _is_our_sshd(pid: int, config: Path) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    # The listener's argv holds "-f <our config>"; sshd rewrites its title into one string
    # ("sshd: /usr/sbin/sshd -f CFG -E LOG [listener] ..."), so accept both forms.
    cfg = str(config).encode()
    words = raw.replace(b"\0", b" ").split()
    return exe.endswith("/sshd") and any(w == cfg and i > 0 and words[i - 1] == b"-f" for i, w in enumerate(words))


def down(dir: str | Path, grace: float = 3.0) -> int:
    """Stop every sshd started in dir (by pid file, verified). Returns how many were signalled."""
    d = Path(dir)
    victims = []
    for pidfile in sorted(d.glob("hosts/*/sshd.pid")):
        pid = _read_pid(pidfile)
        if pid is None:
            continue
        if _is_our_sshd(pid, pidfile.parent / "sshd_config"):
            try:
                os.kill(pid, signal.SIGTERM)
                victims.append(pid)
            except ProcessLookupError:
                pass
        pidfile.unlink(missing_ok=True)
    deadline = time.monotonic() + grace
    for pid in victims:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    (d / STATE).unlink(missing_ok=True)
    return len(victims)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start N sshd hosts")
    u.add_argument("n", type=int)
    u.add_argument("--dir", required=True)
    u.add_argument("--base-ip", default="127.0.0.2")
    u.add_argument("--port", type=int, default=2222)
    u.add_argument("--user", default="root", help="login user (created if missing, e.g. for benchmarks)")
    u.add_argument("--python", default=None, help="interpreter the wrapper runs (default: this one)")
    dn = sub.add_parser("down", help="stop the hosts started in --dir")
    dn.add_argument("--dir", required=True)
    a = p.parse_args(argv)
    if a.cmd == "up":
        try:
            tb = up(a.n, a.dir, base_ip=a.base_ip, port=a.port, user=a.user, python=a.python)
        except RuntimeError as e:
            print(f"sshd_hosts: {e}", file=sys.stderr)
            return 1
        print(json.dumps(tb.ssh_block(), indent=1))
        return 0
    n = down(a.dir)
    print(f"stopped {n} sshd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
