"""SSH transport: a pool of paramiko connections with strict host keys, and the one remote boundary.

Owns: loading the client key and known_hosts ONCE per pool (shared by every connection),
connecting with TCP_NODELAY and no agent / no key search / no prompt, host-key checking
(unknown -> refused unless strict_host_keys is false; CHANGED -> always refused), running commands
over already-open connections, SFTP, and `remote_command`, the only place a shell string is built
(every word shlex-quoted). paramiko is imported here and only here (lazily by launchers.ssh.launcher).
"""

from __future__ import annotations

import logging
import re
import time
import shlex
import contextlib
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from orchestrator.core.spec import SSHSpec
from orchestrator.errors import SubmitCancelled


def _import_paramiko():
    """paramiko, without `invoke`: paramiko's ssh_config reader imports it (when installed, and paramiko >= 3.4
    requires it) only for `Match exec` lines, and it costs ~50 ms of CPU (asyncio, unittest.mock) at every SSH
    submit, status and cancel. Nothing here reads an ssh_config file, so its import is refused while paramiko loads
    (paramiko.config keeps invoke = None, as when it is not installed); anything else may import it later."""
    import sys
    if "invoke" in sys.modules or "paramiko" in sys.modules:
        import paramiko as module
        return module
    sys.modules["invoke"] = None  # type: ignore[assignment]  # (an ImportError for `import invoke`)
    try:
        import paramiko as module
    finally:
        if sys.modules.get("invoke", 0) is None:
            del sys.modules["invoke"]
    return module


paramiko = _import_paramiko()

# paramiko logs protocol oddities of a dying link ("Success for unrequested channel!") at ERROR: they reach nobody.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

POOL_THREADS = 16
CANCEL_POLL_S = 0.1
# How often each connection's paramiko reader thread wakes when nothing arrives (paramiko: 0.1 s, i.e. 2,560 wakeups a
# second at 256 hosts). Nothing of ours waits on it: closing a transport does not join its thread.
READER_WAKE_S = 1.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class HostError(Exception):
    """One host is not usable; `str()` is one line: 'HOST: cause'."""

    def __init__(self, host: str, cause: str):
        self.host = host
        self.cause = cause
        super().__init__(f"{host}: {cause}")


def login(ssh: SSHSpec) -> str:
    """The remote user: the cluster's `ssh.user`, else the local user (as ssh does)."""
    if ssh.user:
        return ssh.user
    import getpass
    return getpass.getuser()


def known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def remote_command(argv: Sequence[str], env: Mapping[str, str] | None = None, *, exec_: bool = True) -> str:
    """The single remote boundary: argv (+ env) -> one shell string, every word shlex-quoted.

    Values may hold any characters but NUL (they cannot exist in argv/env); names must be
    identifiers. `env` travels as `env NAME=VALUE ...` -- never pass secrets here (command lines
    are world-readable in /proc); secrets go over stdin.
    """
    words: list[str] = []
    for name, value in (env or {}).items():
        if not _ENV_NAME.match(name):
            raise ValueError(f"bad environment variable name {name!r}")
        if "\0" in value:
            raise ValueError(f"environment value of {name} contains NUL")
        words.append(shlex.quote(f"{name}={value}"))
    for a in argv:
        if "\0" in a:
            raise ValueError("argument contains NUL")
    if not argv:
        raise ValueError("empty argv")
    body = " ".join(shlex.quote(a) for a in argv)
    if words:
        body = "env " + " ".join(words) + " " + body
    return ("exec " + body) if exec_ else body


class HostKeys:
    """known_hosts parsed once, shared by every connection of a pool (thread-safe)."""

    def __init__(self, path: str, strict: bool):
        self.path = str(Path(path).expanduser())
        self.strict = strict
        self._lock = threading.Lock()
        self._keys = paramiko.HostKeys()
        if Path(self.path).is_file():
            self._keys.load(self.path)
        elif strict:
            raise FileNotFoundError(f"known_hosts file not found: {self.path}")

    def known_types(self, host: str, port: int) -> list[str]:
        with self._lock:
            entry = self._keys.lookup(known_hosts_name(host, port))
            return list(entry.keys()) if entry else []

    def check(self, host: str, port: int, key: paramiko.PKey) -> None:
        name = known_hosts_name(host, port)
        with self._lock:
            entry = self._keys.lookup(name)
            if not entry:
                if self.strict:
                    raise HostError(host, f"host key unknown: {name} is not in {self.path} "
                                    f"(add it, e.g. ssh-keyscan -p {port} {host} >> known_hosts, "
                                    "after checking its fingerprint; or set strict_host_keys: false)")
                self._keys.add(name, key.get_name(), key)  # in memory only, for this run
                return
            known = entry.get(key.get_name())
            if known is None or known != key:
                raise HostError(host, f"HOST KEY CHANGED for {name}: the {key.get_name()} key "
                                f"({key.fingerprint}) does not match {self.path}; refusing to connect "
                                "(possible man-in-the-middle; fix known_hosts if the host was reinstalled)")


def load_client_key(path: str) -> paramiko.PKey:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"ssh key not found: {p}")
    try:
        return paramiko.PKey.from_path(p)
    except paramiko.PasswordRequiredException:
        raise ValueError(f"ssh key {p} is passphrase-protected; this tool never prompts: "
                         "use an unencrypted deploy key") from None
    except (paramiko.SSHException, ValueError) as e:
        raise ValueError(f"cannot read ssh key {p}: {e}") from None


_RSA_ALIASES = ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"]


class Connection:
    """One authenticated transport to one host. Channels are opened on it as needed."""

    def __init__(self, host: str, transport: paramiko.Transport, timeout: float):
        self.host = host
        self.transport = transport
        self.timeout = timeout
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_lock = threading.RLock()
        self.dead = False  # set when the host stopped answering: nothing more is tried on this connection
        self._probe: tuple[float, threading.Event] | None = None

    @property
    def alive(self) -> bool:
        return not self.dead and self.transport.is_active()

    def silent_for(self) -> float:
        """Seconds the host has left an SSH keepalive unanswered (0 while it answers). Non-blocking: one request
        is in flight at a time, in a thread of its own (a dropped link never blocks the caller)."""
        if self.dead:
            return float("inf")
        now = time.monotonic()
        if self._probe is not None:
            started, answered = self._probe
            if not answered.is_set():
                return now - started
        answered = threading.Event()
        self._probe = (now, answered)

        def ask() -> None:
            try:
                self.transport.global_request("keepalive@openssh.com", wait=True)  # any reply will do
            except Exception:  # noqa: BLE001 - a closed transport answers nothing
                return
            answered.set()
        threading.Thread(target=ask, daemon=True, name=f"keepalive-{self.host}").start()
        return 0.0

    def open(self, command: str, *, combine_stderr: bool = False) -> paramiko.Channel:
        chan = self.transport.open_session(timeout=self.timeout)
        if combine_stderr:
            chan.set_combine_stderr(True)
        chan.exec_command(command)
        return chan

    def run(self, command: str, stdin: bytes | None = None, timeout: float | None = None
            ) -> tuple[int, bytes, bytes]:
        """Run and wait: (exit status, stdout, stderr). Exit status -1 = no status (connection lost)."""
        chan = self.open(command)
        chan.settimeout(timeout if timeout is not None else max(self.timeout, 30.0))
        try:
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out = _read_all(chan.recv)
            err = _read_all(chan.recv_stderr)
            return chan.recv_exit_status(), out, err
        except socket.timeout:
            raise HostError(self.host, f"remote command timed out: {command[:80]}") from None
        finally:
            chan.close()

    @contextlib.contextmanager
    def sftp(self) -> Iterator[paramiko.SFTPClient]:
        """`with conn.sftp() as sftp:` the connection's one SFTP session, held exclusively for the block.
        paramiko's SFTPClient is not safe for concurrent requests: a thread waiting for its response can read
        and drop another thread's, and that thread then waits forever (seen: a node's output pump reading
        exit.json while the submitter's main loop read agent.json from the same host)."""
        with self._sftp_lock:
            if self._sftp is None:
                self._sftp = paramiko.SFTPClient.from_transport(self.transport)
            yield self._sftp

    def close(self) -> None:
        try:
            if self._sftp is not None and self._sftp_lock.acquire(timeout=1.0):  # a blocked holder: just drop it
                try:
                    self._sftp.close()
                finally:
                    self._sftp_lock.release()
        finally:
            self.transport.close()


def _read_all(recv: Callable[[int], bytes]) -> bytes:
    chunks = []
    while True:
        data = recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


class Pool:
    """Connections to many hosts, made and used by a small thread pool (fan-out is CPU-bound)."""

    def __init__(self, options: SSHSpec, threads: int = POOL_THREADS):
        """`options`: the cluster's ssh block (port, user, key, known_hosts, strict_host_keys, connect_timeout)."""
        self.options = options
        self.host_keys = HostKeys(options.known_hosts, options.strict_host_keys)
        self.pkey = load_client_key(options.key)
        self.user = login(options)
        self.threads = threads
        self.conns: dict[str, Connection] = {}
        self._lock = threading.Lock()
        # set by a submit while nothing of its job runs yet: once the event is set, map() stops waiting within
        # CANCEL_POLL_S, closes every connection and raises SubmitCancelled (see check_cancel)
        self.cancel: threading.Event | None = None

    def check_cancel(self) -> None:
        """Raise SubmitCancelled, every connection closed, when the pool's cancel event is set."""
        if self.cancel is not None and self.cancel.is_set():
            self.close()
            raise SubmitCancelled("cancelled while the job was being started: nothing of it runs")

    # ------------------------------------------------------------------ connecting
    def connect(self, host: str) -> Connection:
        o = self.options
        try:
            sock = socket.create_connection((host, o.port), timeout=o.connect_timeout)
        except socket.gaierror as e:
            raise HostError(host, f"cannot resolve host name ({e.strerror})") from None
        except socket.timeout:
            raise HostError(host, f"unreachable: no answer on port {o.port} within {o.connect_timeout:g}s") from None
        except OSError as e:
            raise HostError(host, f"unreachable on port {o.port}: {e.strerror or e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = paramiko.Transport(sock)
        t.banner_timeout = o.connect_timeout
        t.auth_timeout = o.connect_timeout
        try:
            types = self.host_keys.known_types(host, o.port)
            if types:  # ask only for key types we can check (as OpenSSH does)
                want = [a for k in types for a in (_RSA_ALIASES if k == "ssh-rsa" else [k])]
                offer = [k for k in t.get_security_options().key_types if k in want]
                if offer:
                    t.get_security_options().key_types = offer
            try:
                t.start_client(timeout=o.connect_timeout)
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise HostError(host, f"SSH handshake failed on port {o.port}: {e or type(e).__name__}") from None
            self.host_keys.check(host, o.port, t.get_remote_server_key())
            try:
                t.auth_publickey(self.user, self.pkey)
            except paramiko.BadAuthenticationType as e:
                raise HostError(host, f"public key authentication not allowed for {self.user} "
                                f"(server allows: {', '.join(e.allowed_types) or 'nothing'})") from None
            except paramiko.AuthenticationException:
                raise HostError(host, f"authentication failed for user {self.user} with key "
                                f"{self.options.key} (key not authorized on the host?)") from None
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise HostError(host, f"authentication error: {e}") from None
        except BaseException:
            t.close()
            raise
        t.sock.settimeout(READER_WAKE_S)  # (authenticated: paramiko's own waits of the handshake are over)
        conn = Connection(host, t, o.connect_timeout)
        with self._lock:  # checked and added as one step: a cancel's close() comes before (seen here) or after it
            cancelled = self.cancel is not None and self.cancel.is_set()
            old = None if cancelled else self.conns.pop(host, None)
            if not cancelled:
                self.conns[host] = conn
        if cancelled:  # a connect that outlived a cancelled map
            conn.close()
            raise HostError(host, "cancelled")
        if old is not None:
            old.close()
        return conn

    def map(self, fn: Callable[[str], Any], hosts: Iterable[str], threads: int | None = None) -> dict[str, Any]:
        """fn(host) on every host, in up to `threads` (default: the pool's) daemon threads: {host: result or the
        Exception raised}. The calling thread only waits; with a cancel event (`self.cancel`) it polls it every
        CANCEL_POLL_S and raises SubmitCancelled as soon as it is set: a host that never answers (a connect or a read
        waiting out its timeout) neither delays the cancel nor keeps the process alive after it, and hosts not begun
        are not begun. A single host without a cancel event runs in the calling thread. The threads are daemons: a
        caller that stops waiting (an exception, the process ending) leaves what they were doing unfinished."""
        hosts = list(dict.fromkeys(hosts))  # (each host once: results are per host)
        self.check_cancel()
        if not hosts:
            return {}
        todo, results, lock, done = list(reversed(hosts)), {}, threading.Lock(), threading.Event()

        def work() -> None:
            while True:
                with lock:
                    if not todo or (self.cancel is not None and self.cancel.is_set()):
                        return  # cancelled: the hosts not begun are not begun
                    host = todo.pop()
                try:
                    result = fn(host)
                except BaseException as e:  # noqa: BLE001 - an Exception is the host's result; others re-raised below
                    result = e
                with lock:
                    results[host] = result
                    if len(results) == len(hosts):
                        done.set()

        if len(hosts) == 1 and self.cancel is None:
            work()
        else:
            for i in range(min(threads or self.threads, len(hosts))):
                threading.Thread(target=work, daemon=True, name=f"ssh-{i}").start()
            while not done.wait(CANCEL_POLL_S if self.cancel is not None else None):
                self.check_cancel()
        self.check_cancel()  # set as the last host finished: its result may already say "cancelled"
        fatal = next((r for r in results.values() if isinstance(r, BaseException) and not isinstance(r, Exception)),
                     None)
        if fatal is not None:
            raise fatal
        return {h: results[h] for h in hosts}

    def connect_all(self, hosts: Iterable[str]) -> dict[str, Connection | Exception]:
        return self.map(self.connect, hosts)

    def run_all(self, command: str | Callable[[str], str], hosts: Iterable[str] | None = None,
                stdin: bytes | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Run a command over the already-open connections: {host: (rc, out, err) or exception}."""
        hosts = list(self.conns) if hosts is None else list(hosts)
        cmd = command if callable(command) else (lambda h: command)
        return self.map(lambda h: self.conns[h].run(cmd(h), stdin=stdin, timeout=timeout), hosts)

    def close(self) -> None:
        with self._lock:
            conns, self.conns = list(self.conns.values()), {}
        for c in conns:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
