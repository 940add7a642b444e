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
bytes after its reply. Ops: hello, check, listen, put, build, list, get, exec (see `Server`).
"""

import hashlib
import json
import os
import shutil
import sys

CHUNK = 1 << 20
TREE_MARK = ".orchestrate-tree"


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
        _mkdirs(self.root)
        st = os.statvfs(self.root)
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
        """Open a TCP port for a relayed `put` (host-to-host fan-out): the first line a peer sends must be `token`."""
        import socket
        self.listener = socket.socket(socket.AF_INET6 if ":" in req.get("bind", "") else socket.AF_INET)
        self.listener.bind((req.get("bind", ""), 0))
        self.listener.listen(1)
        self.listener.settimeout(float(req.get("timeout", 30)))
        self.token = req["token"]
        return {"port": self.listener.getsockname()[1]}

    def _relay_in(self):
        """The peer that presents the token (a connection with another first line is dropped and the next awaited,
        until the listen timeout); `abort <token>`: the previous host failed, give up at once."""
        import socket
        import time
        deadline = time.monotonic() + self.listener.gettimeout()
        try:
            while True:
                self.listener.settimeout(max(0.1, deadline - time.monotonic()))
                conn, _ = self.listener.accept()
                conn.settimeout(10)
                rfile = conn.makefile("rb")
                try:
                    first = rfile.readline(200).strip()
                except (OSError, socket.timeout):
                    first = b""
                if first == self.token.encode():
                    conn.settimeout(None)
                    return conn, rfile
                rfile.close()  # (the file holds the socket open)
                conn.close()
                if first == b"abort " + self.token.encode():
                    raise ConnectionAbortedError("relay aborted: the host before this one failed")
        finally:
            self.listener.close()

    @staticmethod
    def _relay_out(fwd):
        import socket
        out = socket.create_connection((fwd["host"], int(fwd["port"])), timeout=float(fwd.get("timeout", 10)))
        out.settimeout(None)
        out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out.sendall(fwd["token"].encode() + b"\n")
        return out

    def op_put(self, req):
        """Receive the raw bytes of the listed blobs, in order, from stdin (or, `relay`, from the peer that connected
        to our `listen` port); each is hashed while written and kept only if its content has the announced sha256.
        `forward` {host, port, token}: pass every byte on to the next host as it arrives (one stream leaves the
        submitter; the hosts fan it out). A blob this host already holds is only passed on."""
        _mkdirs(self.blobs)
        if not req.get("relay") and getattr(self, "listener", None) is not None:
            self.listener.close()  # the stream comes over SSH after all
        conn, src = self._relay_in() if req.get("relay") else (None, self.rin)
        out = self._relay_out(req["forward"]) if req.get("forward") else None
        try:
            return self._receive(req["blobs"], src, out)
        finally:
            for s in (out, conn):
                if s is not None:
                    s.close()

    def _receive(self, blobs, src, out):
        bad, got = [], 0
        for sha, size in blobs:
            keep = self.blob_ok(sha, size) is None
            tmp = self.blob(sha) + ".part.%d" % os.getpid()
            h = hashlib.sha256()
            left = size
            with open(tmp if keep else os.devnull, "wb") as fh:
                while left:
                    data = src.read(min(CHUNK, left))
                    if not data:
                        raise EOFError("stream ended inside blob %s" % sha)
                    if out is not None:
                        out.sendall(data)
                    if keep:
                        h.update(data)
                        fh.write(data)
                    left -= len(data)
            if not keep:
                continue
            got += size
            if h.hexdigest() != sha:
                os.unlink(tmp)
                bad.append(sha)
                continue
            os.chmod(tmp, 0o400)
            try:
                os.unlink(self.blob(sha) + ".ok")
            except OSError:
                pass
            if os.path.exists(self.blob(sha)):
                os.chmod(self.blob(sha), 0o600)
            os.replace(tmp, self.blob(sha))
            ok = self.blob(sha) + ".ok"
            with open(ok + ".tmp", "w") as fh:
                fh.write(_stamp(os.stat(self.blob(sha))))
            os.replace(ok + ".tmp", ok)
        return {"bytes": got, "bad": bad}

    def op_build(self, req):
        """Make each tree (hard links to its blobs) unless it is complete and links the current blobs; then the
        job's links: {path relative to the workdir: tree sha or "outputs/<key>"}."""
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
