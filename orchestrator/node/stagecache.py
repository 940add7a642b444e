"""The per-host content-addressed cache that staging fills: a program for a host that has only Python.

Owns the host side of staging (the submitter side is launchers.ssh.stage). It runs before orchestrate
exists on the host: the submitter sends THIS FILE's source as `python -c SOURCE serve WORKDIR` over one SSH channel,
so it imports nothing but the standard library and nothing of orchestrate. Layout under WORKDIR (all 0700 / 0600,
owner-only; staged files are read-only, 0400 or 0500 when executable):

    cache/blobs/<sha256>          one file per distinct content
    cache/blobs/<sha256>.ok       its stamp "size mtime_ns inode", written when the content was verified
    cache/trees/<tree sha256>/    a tree of hard links to blobs (a code root, a data file, a model dir, the
                                  node package), complete when `.orchestrate-tree` exists
    outputs/<key>/                a job's output dir (kept across jobs, so a resubmitted job resumes)
    runs/<job>/staged/<label>     -> cache/trees/<tree sha256>  (symlinks made per job)
    runs/<job>/output             -> outputs/<key>

A cached blob counts as present only while its stamp matches the file (a write into it, even through a staged
tree's hard link, changes mtime: it is re-sent and every tree linking it is rebuilt). Protocol: JSON request lines
on stdin, one JSON reply line each on stdout; `put` is followed by the raw blob bytes, `get` is answered by raw
bytes after its reply. Ops: hello, check, listen, put, build, list, checkpoints, get, exec (see `Server`).

The relay (host-to-host fan-out of a `put`): each host opens a TCP port (`listen`) and the stream goes submitter ->
host 0 -> host 1 -> ... Every hop is mutual TLS pinned to a certificate and key the submitter made for this stage only
and sent to each host over its SSH session (`RelayTLS`); a peer then presents its hop's token. A port greets each peer
on its own thread within RELAY_GREET_S, so strangers are dropped without delaying the real peer (`Listener`); sends
never time out (a host may start reading late); every blob is still hashed on arrival.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys

CHUNK = 1 << 20
TREE_MARK = ".orchestrate-tree"
RELAY_GREET_S = 5.0  # a peer of a relay port must finish TLS and present its greeting within this, or it is dropped
RELAY_PENDING = 64  # greetings in progress at once on one relay port; one more drops the oldest
PUT, ABORT = b"put   ", b"abort "  # a relay greeting: one of these and the hop's token (32 hex digits), 38 bytes


def _stamp(st):
    return "%d %d %d" % (st.st_size, st.st_mtime_ns, st.st_ino)


def _mkdirs(path):
    os.makedirs(path, mode=0o700, exist_ok=True)


def _bad_rel(rel):
    """A manifest path that could leave its root: absolute, `..`, empty parts."""
    parts = rel.split("/")
    return not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in rel


def versions(names):
    """{name: installed version or None}, from the `Version:` line of each package's .dist-info/METADATA on sys.path
    (importlib.metadata costs ~30 ms of imports on every host and submit; this costs well under one)."""
    want = {n.lower().replace("-", "_"): n for n in names}
    out = dict.fromkeys(names)
    for d in sys.path:
        try:
            entries = os.listdir(d or ".")
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith(".dist-info"):
                continue
            key = entry[:-len(".dist-info")].rpartition("-")[0].lower().replace("-", "_").replace(".", "_")
            name = want.get(key)
            if name is None or out[name] is not None:
                continue
            try:
                with open(os.path.join(d or ".", entry, "METADATA"), encoding="utf-8", errors="replace") as fh:
                    for line in fh:
                        if line.startswith("Version:"):
                            out[name] = line.split(":", 1)[1].strip()
                            break
                        if not line.strip():
                            break
            except OSError:
                pass
    return out


def _load_chain(ctx, pem, keydir):
    """ssl loads a certificate and key only from a path: an anonymous memory file (/proc/self/fd/N, Linux) where there
    is one, else a 0600 file in a fresh 0700 directory under `keydir` (the host's owner-only cache), removed at once."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("orchestrate-relay", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.write(fd, pem.encode())
            ctx.load_cert_chain("/proc/self/fd/%d" % fd)
            return
        except OSError:
            pass
        finally:
            os.close(fd)
    import tempfile
    d = tempfile.mkdtemp(prefix="relay-", dir=keydir)
    try:
        path = os.path.join(d, "relay.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(pem)
        ctx.load_cert_chain(path)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def cut(sock):
    """Shut a connection down from another thread (its reader or writer wakes at once); the owner closes it."""
    import socket
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _filler(tls):
    """fill(view) -> how many bytes of the TLS stream were read into `view` (all of it but at the stream's end): TLS
    records go straight into the buffer (no Python layers between a record and the buffer)."""
    read = tls.read

    def fill(view):
        n, got = len(view), 0
        while got < n:
            k = read(n - got, view[got:])
            if not k:
                break
            got += k
        return got
    return fill


class RelayTLS:
    """The stage's relay credentials: one self-signed certificate and its key, made by the submitter for this stage
    only and given to each host over its SSH session. Every hop is mutual TLS pinned to that certificate: both ends
    present it and accept no other, so a peer without the key can neither feed a host nor read what it sends."""

    def __init__(self, cert, key, keydir=None):
        import ssl
        self.pin = ssl.PEM_cert_to_DER_cert(cert)
        self.server = self._context(ssl.PROTOCOL_TLS_SERVER, cert, key, keydir)
        self.client = self._context(ssl.PROTOCOL_TLS_CLIENT, cert, key, keydir)

    @staticmethod
    def _context(protocol, cert, key, keydir):
        import ssl
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # the pin names the peer, not a host name
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=cert)
        if protocol == ssl.PROTOCOL_TLS_SERVER:
            ctx.num_tickets = 0  # the sender never has anything to read: its close after the last byte is a clean end
        _load_chain(ctx, cert + key, keydir)
        return ctx

    def pinned(self, tls):
        if tls.getpeercert(binary_form=True) != self.pin:
            raise ConnectionRefusedError("the relay peer presented another certificate")
        return tls

    def connect(self, host, port, greeting, timeout, handshake=None):
        """A hop's sending end: TCP to host:port within `timeout`, TLS pinned to the stage's certificate (within
        `handshake`, default `timeout`), then `greeting`. Sends then wait as long as the peer takes: a host that
        starts reading late is no failure."""
        import socket
        raw = socket.create_connection((host, port), timeout=timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.settimeout(timeout if handshake is None else handshake)
        try:
            tls = self.client.wrap_socket(raw)
        except BaseException:
            raw.close()
            raise
        try:
            self.pinned(tls).sendall(greeting)
            tls.settimeout(None)
            return tls
        except BaseException:
            tls.close()
            raise


class Listener:
    """A relay port: each connecting peer is greeted on a thread of its own (TLS handshake, the pin, then the 38-byte
    greeting, all within `greet_s`), so strangers that send garbage, send nothing or hold no key are dropped while the
    port keeps accepting; the first peer presenting PUT + this hop's token is the stream (`peer_in`)."""

    def __init__(self, bind, tls, token, greet_s=RELAY_GREET_S):
        import socket
        import threading
        if len(token) != 32 or token.strip("0123456789abcdef"):
            raise ValueError("a relay token is 32 hex digits")
        self.tls, self.greet_s = tls, greet_s
        self.want, self.stop = PUT + token.encode(), ABORT + token.encode()
        self.sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        self.sock.bind((bind, 0))
        self.sock.listen(RELAY_PENDING)
        self.port = self.sock.getsockname()[1]
        self.cond = threading.Condition()
        self.pending = {}  # greetings in progress, oldest first
        self.peer = None
        self.aborted = self.closed = False
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import threading
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return  # closed
            raw.settimeout(self.greet_s)
            try:
                tls = self.tls.server.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            except OSError:
                raw.close()
                continue
            with self.cond:
                if self.closed:
                    tls.close()
                    return
                if len(self.pending) >= RELAY_PENDING:
                    oldest = next(iter(self.pending))
                    del self.pending[oldest]
                    cut(oldest)
                self.pending[tls] = None
            threading.Thread(target=self._greet, args=(tls,), daemon=True).start()

    def _greet(self, tls):
        import time
        deadline = time.monotonic() + self.greet_s
        head = b""
        try:
            tls.do_handshake()  # (bounded as a whole by the socket's timeout)
            self.tls.pinned(tls)
            while len(head) < len(self.want):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                tls.settimeout(left)
                data = tls.recv(len(self.want) - len(head))
                if not data:
                    break
                head += data
        except (OSError, ValueError):  # ssl.SSLError and timeouts are OSErrors
            head = b""
        with self.cond:
            self.pending.pop(tls, None)
            if head == self.want and self.peer is None and not self.closed:
                tls.settimeout(None)
                self.peer = tls
                self.cond.notify_all()
                return
            if head == self.stop:
                self.aborted = True
                self.cond.notify_all()
            else:
                self.refused += 1
        tls.close()

    def peer_in(self, timeout):
        """The connection of the peer that presented this hop's token, waited for up to
        `timeout`; an `abort` greeting (the host before this one failed) gives up at once. The port is closed after."""
        import time
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.peer is None and not self.aborted and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
            peer, aborted, refused = self.peer, self.aborted, self.refused
            if not aborted:
                self.peer = None  # (kept from close(), which closes the rest)
        self.close()
        if aborted:
            raise ConnectionAbortedError("relay aborted: the host before this one failed")
        if peer is None:
            raise TimeoutError("no relay peer within %gs (%d refused)" % (timeout, refused))
        return peer

    def close(self):
        import socket
        with self.cond:
            if self.closed:
                return
            self.closed = True
            pending, self.pending = list(self.pending), {}
            peer, self.peer = self.peer, None
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self.sock.close()
        for tls in pending:
            cut(tls)
        if peer is not None:
            peer.close()


class Server:
    def __init__(self, workdir, rin, wout):
        self.root = os.path.realpath(os.path.expanduser(workdir))
        self.blobs = os.path.join(self.root, "cache", "blobs")
        self.trees = os.path.join(self.root, "cache", "trees")
        self.rin, self.wout = rin, wout
        os.umask(0o077)

    # ------------------------------------------------------------------ helpers
    def reply(self, obj):
        self.wout.write((json.dumps(obj) + "\n").encode())
        self.wout.flush()

    def blob(self, sha):
        return os.path.join(self.blobs, sha)

    @contextlib.contextmanager
    def locked(self):
        """This host's cache changed by one stage at a time (cache/.lock): submitters staging the same files at once
        (queued jobs) would otherwise replace each other's blobs and trees under them."""
        _mkdirs(os.path.join(self.root, "cache"))
        fd = os.open(os.path.join(self.root, "cache", ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def blob_ok(self, sha, size):
        """The blob's inode when it is present, the right size and unchanged since verified; else None."""
        try:
            st = os.stat(self.blob(sha))
            with open(self.blob(sha) + ".ok") as fh:
                stamp = fh.read().strip()
        except OSError:
            return None
        return st.st_ino if st.st_size == size and stamp == _stamp(st) else None

    def tree_ok(self, th, entries):
        top = os.path.join(self.trees, th)
        if not os.path.exists(os.path.join(top, TREE_MARK)):
            return False
        for rel, sha, size, _mode in entries:
            ino = self.blob_ok(sha, size)
            try:
                if ino is None or os.lstat(os.path.join(top, rel)).st_ino != ino:
                    return False
            except OSError:
                return False
        return True

    # ------------------------------------------------------------------ ops
    def op_hello(self, req):
        """Facts the pre-flight needs: the real workdir, free disk, Python, the training stack's versions (read from
        the installed metadata, nothing imported), which of the given paths exist; with `blobs`, also `check`."""
        try:
            _mkdirs(self.root)
            st = os.statvfs(self.root)
        except OSError as e:  # one line naming the setting (the submitter adds the host), never a bare errno
            return {"error": "ssh.workdir %s cannot be created or used: %s" % (self.root, e.strerror or e)}
        paths = req.get("paths", [])
        out = {"workdir": self.root, "free": st.f_bavail * st.f_frsize, "python": sys.version.split()[0],
               "versions": versions(req.get("packages", [])), "home": os.path.expanduser("~"),
               "absent": [p for p in paths if not os.path.exists(os.path.expanduser(p))]}
        if "blobs" in req:
            out.update(self.op_check(req))
        return out

    def op_check(self, req):
        """Which blobs must be sent (absent, wrong size, or changed since verified: corrupted -> re-sent) and which of
        the given trees are not complete with the current blobs (`dirty`: `build` makes them)."""
        missing, seen = [], set()
        for sha, size in req["blobs"]:
            if sha not in seen and self.blob_ok(sha, size) is None:
                missing.append(sha)
            seen.add(sha)
        return {"missing": missing, "dirty": [th for th, entries in req.get("trees", {}).items()
                                              if not self.tree_ok(th, entries)]}

    def op_listen(self, req):
        """Open this host's relay port for a relayed `put` (host-to-host fan-out; see `Listener`): TLS only, pinned to
        the stage's one certificate and key (`tls`: {cert, key} PEM, arriving on this session's stdin, held in memory),
        demanded of both ends; the peer must then present PUT and this hop's `token`."""
        tls = req["tls"]
        _mkdirs(os.path.join(self.root, "cache"))
        self.relay_tls = RelayTLS(tls["cert"], tls["key"], os.path.join(self.root, "cache"))
        self.listener = Listener(req.get("bind", ""), self.relay_tls, req["token"],
                                 float(req.get("greet", RELAY_GREET_S)))
        self.listen_timeout = float(req.get("timeout", 30))
        return {"port": self.listener.port}

    def op_put(self, req):
        """Receive the raw bytes of the listed blobs, in order, from stdin (or, `relay`, from the peer that connected
        to our `listen` port); each is hashed while written and kept only if its content has the announced sha256.
        `forward` {host, port, token}: pass every byte on to the next host as it arrives (one stream leaves the
        submitter; the hosts fan it out). A blob this host already holds is only passed on."""
        _mkdirs(self.blobs)
        listener, self.listener = getattr(self, "listener", None), None
        if listener is not None and not req.get("relay"):
            listener.close()  # the stream comes over SSH after all
        conn = listener.peer_in(self.listen_timeout) if req.get("relay") else None
        out = None
        try:
            if req.get("forward"):
                fwd = req["forward"]
                out = self.relay_tls.connect(fwd["host"], int(fwd["port"]), PUT + fwd["token"].encode(),
                                             float(fwd.get("timeout", 10)))
            return self._receive(req["blobs"], self.rin.readinto if conn is None else _filler(conn), out)
        finally:
            for s in (out, conn):
                if s is not None:
                    s.close()

    def _receive(self, blobs, fill, out):
        """The blobs' bytes, in order, read in pieces of up to CHUNK that span blobs (`fill`): each piece is passed
        on first (`out`), then hashed and written blob by blob."""
        bad, got = [], 0
        buf = memoryview(bytearray(CHUNK))
        have = at = 0  # bytes in buf, of which consumed
        stream = sum(size for _sha, size in blobs)  # still to read
        for sha, size in blobs:
            path = self.blob(sha)
            keep = self.blob_ok(sha, size) is None
            tmp = path + ".part.%d" % os.getpid()
            h = hashlib.sha256()
            left = size
            fh = open(tmp, "wb") if keep else None
            try:
                while left:
                    if at == have:
                        have, at = fill(buf[:min(CHUNK, stream)]), 0
                        if not have:
                            raise EOFError("stream ended inside blob %s" % sha)
                        stream -= have
                        if out is not None:
                            out.sendall(buf[:have])
                    piece = buf[at:at + min(left, have - at)]
                    if fh is not None:
                        h.update(piece)
                        fh.write(piece)
                    at += len(piece)
                    left -= len(piece)
            finally:
                if fh is not None:
                    fh.close()
            if not keep:
                continue
            got += size
            if h.hexdigest() != sha:
                os.unlink(tmp)
                bad.append(sha)
                continue
            os.chmod(tmp, 0o400)
            with self.locked():
                if self.blob_ok(sha, size) is not None:  # put by another stage meanwhile: keep its file (trees link it)
                    os.unlink(tmp)
                    continue
                ok = path + ".ok"
                try:
                    os.unlink(ok)
                except OSError:
                    pass
                if os.path.exists(path):
                    os.chmod(path, 0o600)
                os.replace(tmp, path)
                with open(ok + ".tmp", "w") as fh:
                    fh.write(_stamp(os.stat(path)))
                os.replace(ok + ".tmp", ok)
        return {"bytes": got, "bad": bad}

    def op_build(self, req):
        """Make each tree (hard links to its blobs) unless it is complete and links the current blobs; then the
        job's links: {path relative to the workdir: tree sha or "outputs/<key>"}."""
        with self.locked():
            return self._build(req)

    def _build(self, req):
        built = []
        for th, entries in req.get("trees", {}).items():
            if self.tree_ok(th, entries):
                continue
            top = os.path.join(self.trees, th)
            tmp = top + ".build.%d" % os.getpid()
            shutil.rmtree(tmp, ignore_errors=True)
            for rel, sha, size, mode in entries:
                if _bad_rel(rel):
                    raise ValueError("refused manifest path %r" % rel)
                if self.blob_ok(sha, size) is None:
                    raise ValueError("blob %s of %s is missing" % (sha[:12], rel))
                dst = os.path.join(tmp, rel)
                _mkdirs(os.path.dirname(dst))
                if mode & 0o100:  # an executable: the content's one inode becomes owner-executable (no mtime change)
                    os.chmod(self.blob(sha), 0o500)
                os.link(self.blob(sha), dst)
            _mkdirs(tmp)
            with open(os.path.join(tmp, TREE_MARK), "w") as fh:
                fh.write(th)
            if os.path.exists(top):
                old = top + ".old.%d" % os.getpid()
                os.rename(top, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, top)
            built.append(th)
        for rel, target in sorted(req.get("links", {}).items()):
            if _bad_rel(rel) or _bad_rel(target):
                raise ValueError("refused link %r -> %r" % (rel, target))
            link = os.path.join(self.root, rel)
            dest = os.path.join(self.trees, target) if not target.startswith("outputs/") else \
                os.path.join(self.root, target)
            if target.startswith("outputs/"):
                _mkdirs(dest)
            _mkdirs(os.path.dirname(link))
            if os.path.islink(link) and os.readlink(link) == dest:
                continue
            tmp = link + ".tmp.%d" % os.getpid()
            os.symlink(dest, tmp)
            os.replace(tmp, link)
        for rel in req.get("dirs", []):
            if _bad_rel(rel):
                raise ValueError("refused dir %r" % rel)
            _mkdirs(os.path.join(self.root, rel))
        return {"built": built}

    def op_list(self, req):
        """The files under a directory (relative to the workdir, links followed once at the top): [rel, size,
        sha256]; `only` = "last_checkpoint" keeps the newest checkpoint-N directory."""
        top = os.path.realpath(os.path.join(self.root, req["dir"]))
        if not os.path.isdir(top):
            return {"files": [], "root": top}
        if req.get("only") == "last_checkpoint":
            steps = [(int(d.split("-", 1)[1]), d) for d in os.listdir(top)
                     if d.startswith("checkpoint-") and d.split("-", 1)[1].isdigit()]
            if not steps:
                return {"files": [], "root": top}
            sub = max(steps)[1]
        else:
            sub = ""
        out = []
        for dirpath, dirnames, filenames in os.walk(os.path.join(top, sub) if sub else top):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                if os.path.islink(full) or not os.path.isfile(full):
                    continue
                h = hashlib.sha256()
                with open(full, "rb") as fh:
                    for block in iter(lambda: fh.read(CHUNK), b""):
                        h.update(block)
                out.append([os.path.relpath(full, top), os.path.getsize(full), h.hexdigest()])
        return {"files": out, "root": top}

    def op_checkpoints(self, req):
        """The steps of the complete checkpoint-N directories under a directory (relative to the workdir), newest
        last. Complete: the save ended (orchestrate_checkpoint.complete, the rule a rank resumes by: the record or
        trainer_state.json there); a host whose newest one was cut short by a kill lacks it, and is given a copy."""
        top = os.path.realpath(os.path.join(self.root, req["dir"]))
        try:
            names = os.listdir(top)
        except OSError:
            names = []
        return {"steps": sorted(int(d.split("-", 1)[1]) for d in names
                                if d.startswith("checkpoint-") and d.split("-", 1)[1].isdigit()
                                and any(os.path.isfile(os.path.join(top, d, f))
                                        for f in ("orchestrate.json", "trainer_state.json")))}

    def op_get(self, req):
        """Send the listed files (relative to `dir`) as raw bytes after the reply, each exactly the listed size."""
        top = os.path.realpath(os.path.join(self.root, req["dir"]))
        for rel, _size in req["files"]:
            if _bad_rel(rel):
                raise ValueError("refused path %r" % rel)
        self.reply({"ok": True})
        for rel, size in req["files"]:
            left = size
            with open(os.path.join(top, rel), "rb") as fh:
                while left:
                    data = fh.read(min(CHUNK, left))
                    if not data:
                        data = b"\0" * min(CHUNK, left)  # shrank meanwhile: the submitter's hash check fails
                    self.wout.write(data)
                    left -= len(data)
        self.wout.flush()
        return None

    def op_exec(self, req):
        """Become the node agent on this same channel (one remote start per host and submit): answer, print the
        wrapper line the submitter reads the agent's wrapper pid from (`mark` + this pid), then exec `argv`."""
        argv = req["argv"]
        self.reply({"ok": True})
        sys.stderr.flush()
        os.write(1, ("%s%d\n" % (req["mark"], os.getpid())).encode())
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(1, ("cannot start %s: %s\n" % (argv[0], e.strerror)).encode())
            os._exit(127)

    def serve(self):
        while True:
            line = self.rin.readline()
            if not line:
                return 0
            req = json.loads(line)
            try:
                out = getattr(self, "op_" + req["op"])(req)
            except Exception as e:  # noqa: BLE001 - answered, the submitter names the host
                self.reply({"error": "%s: %s" % (type(e).__name__, e)})
                if req.get("op") in ("put", "get"):
                    return 1  # the byte stream is out of step: end the session
                continue
            if out is not None:
                self.reply(out)


def main(argv):
    if len(argv) != 2 or argv[0] != "serve":
        sys.stderr.write("usage: stagecache serve WORKDIR\n")
        return 2
    return Server(argv[1], sys.stdin.buffer, sys.stdout.buffer).serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
