#!/usr/bin/env python3
"""Real sshd "hosts" on loopback addresses for tests and benchmarks (the SSH testbed).

Owns: bringing up N sshd daemons on 127.0.0.2, 127.0.0.3, ... (each with its own config,
ed25519 host key, pid file and log; key auth only), a client key, a known_hosts file, an
authorized_keys file, a `python` wrapper that can import this repository, and tearing them
down again by pid file (the pid is checked to still run sshd with our config before it is killed).

Private hosts (`up(..., private=True)`, CLI `--private`) share nothing with the submitter: each sshd runs in
a mount namespace of its own (`unshare -m --propagation private`) where the test venv (sys.prefix) is bound
read-only at /opt/hostenv, empty tmpfs mounts hide the checkout's parent directory, /tmp, the venv's own
location, ORCHESTRATE_HOME, ORCHESTRATE_CACHE and the Hugging Face cache, and a fresh tmpfs at
/var/tmp/orchestrate-host is the host's own work area (jobs: workdir /var/tmp/orchestrate-host/work,
python /opt/hostenv/bin/python, which imports torch/accelerate/transformers/trl but not orchestrator).
Their sshd files live under /run/orchestrate-sshd-private/<ip>-<port>/. `down` kills every process left in
each host's namespace (found by the host's tmpfs in /proc/PID/mountinfo), so the namespace and its mounts go.

    scripts/sshd_hosts.py up 2 --dir /tmp/sshlab [--base-ip 127.0.0.2] [--port 2222] [--user NAME]
    scripts/sshd_hosts.py up --private -n 8 --dir /var/tmp/privlab [--base-ip 127.0.13.2] [--port 2224]
    scripts/sshd_hosts.py down --dir /tmp/sshlab
    scripts/sshd_hosts.py down --stale-private [--port 2224]   # private hosts of a killed run (--dir gone)

Python API (used by tests/ssh/conftest.py, tests/private_hosts.py and the benchmarks): `up(...) -> Testbed`,
`down(dir)`, `load(dir)`, `prerequisites() -> reason or None`, `host_pid(tb, host)`, `leftovers(tb)`.
Needs root (sshd must switch users) and Debian's openssh-server (scripts/install_ssh_deps.sh);
private hosts also need util-linux's unshare, nsenter and mount.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shlex
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

# Private hosts (own mount namespace each): fixed paths every host and the submitter agree on.
PRIVATE_BASE_IP = "127.0.13.2"
PRIVATE_PORT = 2224
PRIVATE_ROOT = Path("/run/orchestrate-sshd-private")  # <ip>-<port>/: sshd config, keys, pid file, log
HOSTENV = "/opt/hostenv"  # the test venv, read-only
HOST_WORK_AREA = "/var/tmp/orchestrate-host"  # the host's own tmpfs (staged files)
WORK_AREA_SIZE = "4g"
HIDE_SIZE = "256m"


@dataclass
class Testbed:
    """What `up` made: everything a cluster file's ssh block needs."""

    dir: str
    hosts: list[str]
    port: int
    user: str
    key: str  # client private key
    known_hosts: str
    python: str  # wrapper: the repo's interpreter with the repo on PYTHONPATH (private: /opt/hostenv/bin/python)
    pids: dict[str, int] = field(default_factory=dict)
    private: bool = False
    runtime: dict[str, str] = field(default_factory=dict)  # private: host -> its sshd files' dir (under /run)
    tags: dict[str, str] = field(default_factory=dict)  # private: host -> source name of its work-area tmpfs
    mnt_ns: dict[str, str] = field(default_factory=dict)  # private: host -> "mnt:[inode]" of its namespace
    hostenv: str = ""  # private: the venv bound at /opt/hostenv
    hidden: list[str] = field(default_factory=list)  # private: directories hidden under empty tmpfs mounts

    def ssh_block(self, **over) -> dict:
        """An `ssh:` block for a cluster YAML / parse_cluster()."""
        workdir = f"{HOST_WORK_AREA}/work" if self.private else str(Path(self.dir) / "work" / "{host}")
        block = {"hosts": list(self.hosts), "port": self.port, "user": self.user, "key": self.key,
                 "known_hosts": self.known_hosts, "strict_host_keys": True, "python": self.python,
                 "workdir": workdir, "shared_fs": False, "connect_timeout": 5}
        block.update(over)
        return block

    def ssh_options(self) -> list[str]:
        """OpenSSH client options for these hosts (the benches' anchors: ssh, rsync -e, pdsh), checking host keys
        like orchestrate does and with the key exchange paramiko uses, so both sides pay the same handshake."""
        return ["-p", str(self.port), "-i", self.key, "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                "-o", "KexAlgorithms=curve25519-sha256"]

    def cluster(self, name: str = "testlab", hosts: list[str] | None = None, **ssh_over) -> dict:
        """A whole cluster file on these hosts (default: the first two): kind ssh, cpu, over loopback."""
        return {"kind": "ssh", "name": name, "accelerator": "cpu", "network_interface": "lo",
                "ssh": self.ssh_block(hosts=list(self.hosts[:2] if hosts is None else hosts), **ssh_over)}

    def host_dir(self, host: str) -> Path:
        """The dir of the host's sshd_config, sshd.pid and sshd.log."""
        if self.private:
            return Path(self.runtime[host])
        return Path(self.dir) / "hosts" / host


def prerequisites(private: bool = False) -> str | None:
    """None when this machine can run the testbed (private=True: private hosts), else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (sshd has to switch users)"
    if not Path(SSHD).is_file():
        return f"{SSHD} not found (run scripts/install_ssh_deps.sh)"
    if shutil.which(SSH_KEYGEN) is None:
        return "ssh-keygen not found (run scripts/install_ssh_deps.sh)"
    if private:
        for tool in ("unshare", "nsenter", "mount"):
            if shutil.which(tool) is None:
                return f"{tool} not found (util-linux / mount packages)"
        if not Path("/proc/self/ns/mnt").exists():
            return "no mount namespaces (/proc/self/ns/mnt missing)"
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


def _private_dir(host: str, port: int) -> Path:
    return PRIVATE_ROOT / f"{host}-{port}"


def _hostenv_dir(hostenv: str | Path | None) -> Path:
    env = Path(hostenv or sys.prefix).resolve()
    if not (env / "pyvenv.cfg").is_file() or not (env / "bin" / "python").exists():
        raise RuntimeError(f"{env} is not a venv (no pyvenv.cfg / bin/python): private hosts bind the test venv "
                           f"at {HOSTENV}; run under the project's venv or pass hostenv=")
    return env


def _under(path: Path, top: Path) -> bool:
    return path == top or path.is_relative_to(top)


def _hidden_dirs(env: Path, testbed_dir: Path, extra: list[str | Path] | tuple = ()) -> list[Path]:
    """Directories a private host must not see, each to be covered by an empty tmpfs: the checkout's parent
    (the checkout itself when that is "/" or holds something the host needs), /tmp and $TMPDIR, the venv's own
    location, the testbed dir (client key), ORCHESTRATE_HOME, ORCHESTRATE_CACHE, the Hugging Face cache and
    `extra` (e.g. pytest's basetemp when it is not under /tmp)."""
    import tempfile
    home = Path.home()
    py = Path(os.path.realpath(env / "bin" / "python"))
    keep = [PRIVATE_ROOT, Path("/run/sshd"), Path(SSHD).parent, Path(HOSTENV), Path(HOST_WORK_AREA), home,
            Path(os.path.realpath(sys.base_prefix)), py.parent]
    if _under(py, env):
        keep.remove(py.parent)  # an interpreter copied into the venv comes along with the bind mount

    def covers(top: Path) -> Path | None:
        return next((k for k in keep if _under(k, top)), None)

    checkout = REPO.parent if REPO.parent != Path("/") and covers(REPO.parent) is None else REPO
    orch_home = Path(os.environ.get("ORCHESTRATE_HOME") or "~/.orchestrate").expanduser()
    orch_cache = Path(os.environ.get("ORCHESTRATE_CACHE") or "~/.cache/orchestrate").expanduser()
    hf = Path(os.environ.get("HF_HOME") or "~/.cache/huggingface").expanduser()
    wanted: list[Path] = []
    for cand, create in ((checkout, False), (Path("/tmp"), False), (Path(tempfile.gettempdir()), False),
                         (env, False), (testbed_dir, False), (orch_home, True), (orch_cache, True), (hf, False),
                         *((Path(x), False) for x in extra)):
        cand = Path(os.path.abspath(cand))
        if any(_under(cand, w) for w in wanted):
            continue
        if not cand.exists():
            if not create:
                continue
            cand.mkdir(mode=0o700, parents=True, exist_ok=True)  # what orchestrate makes on first use anyway
        cand = cand.resolve()
        if not cand.is_dir():
            continue
        k = covers(cand)
        if k is not None or cand == Path("/"):
            raise RuntimeError(f"cannot hide {cand} from private hosts: it holds {k or '/'}, which they need")
        wanted = [w for w in wanted if not _under(w, cand)] + [cand]
    return sorted(wanted)


def _start_private(tb: Testbed, host: str, size: str) -> None:
    """Start one private host: a new mount namespace, its mounts, then sshd (which daemonizes in it)."""
    hd = tb.host_dir(host)
    q = shlex.quote
    script = ["set -e",
              f"mount --bind {q(tb.hostenv)} {HOSTENV}",
              f"mount -o remount,bind,ro {HOSTENV}",
              f"mount -t tmpfs -o size={q(size)},mode=0755 {q(tb.tags[host])} {HOST_WORK_AREA}",
              f"mkdir -m 0755 {HOST_WORK_AREA}/work"]
    if tb.user != "root":
        script.append(f"chown {q(tb.user)} {HOST_WORK_AREA}/work")
    for hidden in tb.hidden:
        mode = "1777" if hidden == "/tmp" else "0755"
        script.append(f"mount -t tmpfs -o size={HIDE_SIZE},mode={mode} orchestrate-hide {q(hidden)}")
    script.append(f"exec {SSHD} -f {q(str(hd / 'sshd_config'))} -E {q(str(hd / 'sshd.log'))}")
    with open(hd / "start.log", "wb") as log:
        rc = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                             "\n".join(script)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            timeout=30).returncode
    if rc != 0:
        raise RuntimeError(f"private host {host} did not start (rc {rc}): "
                           f"{(hd / 'start.log').read_text(errors='replace')[-500:]}")


def _start(tb: Testbed, host: str, work_area_size: str = WORK_AREA_SIZE) -> None:
    """Start one host's sshd (it daemonizes): in a fresh mount namespace of its own for a private host."""
    if tb.private:
        _start_private(tb, host, work_area_size)
    else:
        hd = tb.host_dir(host)
        subprocess.run([SSHD, "-f", str(hd / "sshd_config"), "-E", str(hd / "sshd.log")], check=True,
                       stdin=subprocess.DEVNULL)


def up(n: int, dir: str | Path, base_ip: str | None = None, port: int | None = None, user: str = "root",
       python: str | None = None, timeout: float = 20.0, private: bool = False, hostenv: str | None = None,
       work_area_size: str = WORK_AREA_SIZE, hide: list[str | Path] | tuple = ()) -> Testbed:
    """Start n sshd hosts. Raises RuntimeError (after tearing down what it started) on failure.

    Defaults: 127.0.0.2 and port 2222; private hosts 127.0.13.2 and port 2224. `private=True`: each host in a
    mount namespace of its own (see the module's doc); `hostenv`: the venv bound at /opt/hostenv (default:
    sys.prefix); `work_area_size`: the size limit of each host's tmpfs at /var/tmp/orchestrate-host; `hide`: more
    directories the private hosts must not see."""
    why = prerequisites(private)
    if why:
        raise RuntimeError(f"sshd testbed unavailable: {why}")
    base_ip = base_ip or (PRIVATE_BASE_IP if private else "127.0.0.2")
    port = port or (PRIVATE_PORT if private else 2222)
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
        stale = [h for h in busy if (_private_dir(h, port) / "sshd.pid").exists()]
        hint = (f" (private hosts of an earlier run that was killed? stop them with `{Path(__file__).name} down "
                "--stale-private` when no test run uses them)") if stale else ""
        raise RuntimeError(f"port {port} already in use on {', '.join(busy[:5])}{hint}")
    env: Path | None = None
    hidden: list[Path] = []
    if private:
        env = _hostenv_dir(hostenv)
        hidden = _hidden_dirs(env, d, hide)
        for mnt in (HOSTENV, HOST_WORK_AREA):  # empty mount points, in the root namespace too
            Path(mnt).mkdir(mode=0o755, parents=True, exist_ok=True)
        PRIVATE_ROOT.mkdir(mode=0o755, parents=True, exist_ok=True)
    if user != "root":
        ensure_user(user)
        os.chmod(d, 0o755)  # the user's sshd child reads authorized_keys with the user's rights
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir

    key = d / "client_ed25519"
    client_pub = _keygen(key, "orchestrate-testbed")
    authorized = d / "authorized_keys"
    authorized.write_text(f"ssh-ed25519 {client_pub} orchestrate-testbed\n")
    authorized.chmod(0o644)
    runtime = {h: (_private_dir(h, port) if private else d / "hosts" / h) for h in hosts}

    def make_host(h: str) -> str:
        hd = runtime[h]
        if private:  # a stale dir of a crashed run (its port is free: checked above); fresh keys every time
            shutil.rmtree(hd, ignore_errors=True)
        hd.mkdir(mode=0o755, parents=True, exist_ok=True)
        pub = _keygen(hd / "ssh_host_ed25519_key", f"host-{h}")
        auth = authorized
        if private:  # the testbed dir is hidden from the host: its sshd reads a copy next to its config
            auth = hd / "authorized_keys"
            shutil.copyfile(authorized, auth)
            auth.chmod(0o644)
        (hd / "sshd_config").write_text(_sshd_config(hd, h, port, auth, user))
        (hd / "sshd.pid").unlink(missing_ok=True)
        return f"{known_hosts_name(h, port)} ssh-ed25519 {pub}\n"

    with ThreadPoolExecutor(8) as ex:
        lines = list(ex.map(make_host, hosts))
    known = d / "known_hosts"
    known.write_text("".join(lines))

    if private:
        interpreter = f"{HOSTENV}/bin/python"
    else:  # a wrapper interpreter: the repo's python with the repo importable (no install needed)
        wrapper = d / "python"
        real = python or sys.executable
        wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}} exec {real} \"$@\"\n")
        wrapper.chmod(0o755)
        interpreter = str(wrapper)

    tb = Testbed(dir=str(d), hosts=hosts, port=port, user=user, key=str(key), known_hosts=str(known),
                 python=interpreter, private=private)
    if private:
        tb.runtime = {h: str(runtime[h]) for h in hosts}
        tb.tags = {h: f"orchestrate-host-{h}-{port}-{secrets.token_hex(6)}" for h in hosts}
        for h in hosts:  # for `down --stale-private`, when the testbed dir is gone
            (runtime[h] / "tag").write_text(tb.tags[h] + "\n")
        tb.hostenv = str(env)
        tb.hidden = [str(p) for p in hidden]
    (d / STATE).write_text(json.dumps(asdict(tb), indent=1))  # before any start: down() can clean a failed up
    try:
        if private:  # (a namespace and its mounts take a moment: in parallel)
            with ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda h: _start(tb, h, work_area_size), hosts))
        else:
            for h in hosts:  # each sshd daemonizes at once; then wait for all of them together
                _start(tb, h)
        deadline = time.monotonic() + timeout
        pending = list(hosts)
        while pending:
            pending = [h for h in pending if not (_read_pid(runtime[h] / "sshd.pid") and _port_busy(h, port))]
            if not pending:
                break
            if time.monotonic() > deadline:
                logs = (runtime[pending[0]] / "sshd.log")
                tail = logs.read_text()[-500:] if logs.exists() else ""
                raise RuntimeError(f"sshd did not come up on {', '.join(pending[:5])}: {tail}")
            time.sleep(0.05)
        tb.pids = {h: _read_pid(runtime[h] / "sshd.pid") for h in hosts}
        if private:
            own = os.readlink("/proc/self/ns/mnt")
            for h in hosts:
                tb.mnt_ns[h] = os.readlink(f"/proc/{tb.pids[h]}/ns/mnt")
                if tb.mnt_ns[h] == own:
                    raise RuntimeError(f"sshd of {h} runs in the submitter's mount namespace")
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
    """Stop every sshd started in dir (by pid file, verified). Returns how many were signalled.
    Private hosts: also every other process left in their namespaces, so that the namespaces and their
    mounts are gone on return; then their /run dirs are removed."""
    d = Path(dir)
    try:
        tb = load(d)
    except (OSError, ValueError, TypeError):
        tb = None
    if tb is not None and tb.private:
        n = _down_private(tb, grace)
        (d / STATE).unlink(missing_ok=True)
        return n
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


def host_pid(tb: Testbed, host: str) -> int:
    """The pid of the host's sshd listener, checked to still run sshd with the host's config (for nsenter)."""
    hd = tb.host_dir(host)
    pid = _read_pid(hd / "sshd.pid")
    if pid is None or not _is_our_sshd(pid, hd / "sshd_config"):
        raise RuntimeError(f"sshd of {host} is not running (pid file {hd / 'sshd.pid'}: {pid})")
    return pid


def restart(tb: Testbed, host: str, timeout: float = 10.0) -> None:
    """Start `host`'s sshd again after it was killed (same config and host key). A private host gets a fresh mount
    namespace and work area (its old one went with its last process). Updates tb.pids (and tb.mnt_ns)."""
    hd = tb.host_dir(host)
    (hd / "sshd.pid").unlink(missing_ok=True)
    _start(tb, host)
    deadline = time.monotonic() + timeout
    while not (_read_pid(hd / "sshd.pid") and _port_busy(host, tb.port)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd of {host} did not come back: {(hd / 'sshd.log').read_text()[-500:]}")
        time.sleep(0.05)
    tb.pids[host] = _read_pid(hd / "sshd.pid")
    if tb.private:
        tb.mnt_ns[host] = os.readlink(f"/proc/{tb.pids[host]}/ns/mnt")


def _members(tags: set[str] | list[str]) -> list[int]:
    """Live processes that see one of these work-area tmpfs mounts (source name `tag`): the processes of
    those private hosts' namespaces (and of any namespace copied from them). Zombies hold no namespace."""
    needles = [f" - tmpfs {t} ".encode() for t in tags]
    me = os.getpid()
    found = []
    for e in os.scandir("/proc"):
        if not e.name.isdigit() or int(e.name) == me:
            continue
        try:
            info = Path(f"/proc/{e.name}/mountinfo").read_bytes()
        except OSError:
            continue
        if any(n in info for n in needles) and _alive(int(e.name)):
            found.append(int(e.name))
    return found


def leftovers(tb: Testbed) -> list[int]:
    """Processes still holding one of tb's private namespaces (so its mounts): [] once down() is done."""
    return _members(list(tb.tags.values())) if tb.private else []


def down_stale_private(port: int | None = None, grace: float = 3.0) -> int:
    """Stop every private host (on `port`, if given) whose files are under /run/orchestrate-sshd-private (their
    testbed dirs may be gone: a killed test run), with everything in their namespaces. Only when no test run
    uses them."""
    n = 0
    for hd in sorted(PRIVATE_ROOT.glob(f"*-{port}/tag" if port else "*/tag")):
        host = hd.parent.name.rsplit("-", 1)[0]
        tb = Testbed(dir="", hosts=[host], port=0, user="", key="", known_hosts="", python="", private=True,
                     runtime={host: str(hd.parent)}, tags={host: hd.read_text().strip()})
        n += _down_private(tb, grace)
    return n


def _down_private(tb: Testbed, grace: float) -> int:
    victims = []
    for h in tb.hosts:  # the listeners first: no new sessions
        hd = tb.host_dir(h)
        pid = _read_pid(hd / "sshd.pid")
        if pid is not None and _is_our_sshd(pid, hd / "sshd_config"):
            try:
                os.kill(pid, signal.SIGTERM)
                victims.append(pid)
            except ProcessLookupError:
                pass
    # Then whatever else lives in the namespaces (sessions, jobs left running, nsenter'd helpers): TERM, then
    # KILL after the grace period. A namespace (and every mount in it) goes with its last process.
    tags = list(tb.tags.values())
    termed: set[int] = set()
    deadline = time.monotonic() + grace
    left = _members(tags)
    while left and time.monotonic() < deadline + 5.0:
        late = time.monotonic() >= deadline
        for pid in left:
            if late or pid not in termed:
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                termed.add(pid)
        time.sleep(0.02)
        left = _members(tags)
    if left:
        print(f"sshd_hosts: processes of private hosts survived SIGKILL: {left}", file=sys.stderr)
        return len(victims)
    for h in tb.hosts:
        hd = Path(tb.runtime.get(h, ""))
        if hd.parent == PRIVATE_ROOT:
            shutil.rmtree(hd, ignore_errors=True)
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
    u.add_argument("n", type=int, nargs="?", help="how many hosts (or -n N)")
    u.add_argument("-n", "--hosts", type=int, dest="n_opt", default=None, help="how many hosts")
    u.add_argument("--dir", required=True)
    u.add_argument("--base-ip", default=None, help="first host's address (default 127.0.0.2; private 127.0.13.2)")
    u.add_argument("--port", type=int, default=None, help="sshd port (default 2222; private 2224)")
    u.add_argument("--user", default="root", help="login user (created if missing, e.g. for benchmarks)")
    u.add_argument("--python", default=None, help="interpreter the wrapper runs (default: this one)")
    u.add_argument("--private", action="store_true",
                   help=f"each host in a mount namespace of its own: sees only {HOSTENV} (the venv), its own "
                        f"{HOST_WORK_AREA}, and none of the checkout, /tmp or the submitter's caches")
    u.add_argument("--hostenv", default=None, help="private: the venv bound at /opt/hostenv (default: this one's)")
    u.add_argument("--work-area-size", default=WORK_AREA_SIZE, help="private: tmpfs size of each host's work area")
    u.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for the hosts to listen")
    u.add_argument("--hide", action="append", default=[], help="private: one more directory to hide (repeatable)")
    dn = sub.add_parser("down", help="stop the hosts started in --dir")
    dn.add_argument("--dir")
    dn.add_argument("--stale-private", action="store_true",
                    help=f"stop every private host with files under {PRIVATE_ROOT} (left by a killed run)")
    dn.add_argument("--port", type=int, default=None, help="--stale-private: only the hosts on this port")
    a = p.parse_args(argv)
    if a.cmd == "up":
        n = a.n_opt if a.n_opt is not None else a.n
        if n is None or (a.n is not None and a.n_opt is not None and a.n != a.n_opt):
            p.error("up: give the number of hosts once (N or -n N)")
        if n < 1:
            p.error("up: at least one host")
        try:
            tb = up(n, a.dir, base_ip=a.base_ip, port=a.port, user=a.user, python=a.python, timeout=a.timeout,
                    private=a.private, hostenv=a.hostenv, work_area_size=a.work_area_size, hide=a.hide)
        except RuntimeError as e:
            print(f"sshd_hosts: {e}", file=sys.stderr)
            return 1
        print(json.dumps(tb.ssh_block(), indent=1))
        return 0
    if a.dir is None and not a.stale_private:
        p.error("down: --dir DIR or --stale-private")
    n = down(a.dir) if a.dir else 0
    if a.stale_private:
        n += down_stale_private(a.port)
    print(f"stopped {n} sshd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
