"""Staging for SSH hosts that share no filesystem with the submitter: the submitter's side.

Owns: which local paths a job needs on its hosts and where they appear there (`plan_staging`, pure but for stat and
`git ls-files`: the job is rewritten to `${RUN_DIR}/staged/<label>/...` and `${RUN_DIR}/output`), the file lists of
those roots with their excludes and refusals (`list_root`), their content hashes (`Tree`, hashed once per file
version: `HashCache` under ORCHESTRATE_HOME/cache), the node package every host runs (`package_tree`: orchestrator
and the built-in recipes, shipped by content hash, so no host needs orchestrate installed and none can run another
version), the session with each host (`Stager`: facts and pre-flight, then only the missing blobs, then the trees
and the job's links) and bringing outputs back (`fetch_outputs`). The host side is orchestrator.node.stagecache.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.core.jobplan import RUN_DIR_VAR
from orchestrator.core.resume import KEYWORDS as RESUME_KEYWORDS  # auto latest never: no path to stage
from orchestrator.errors import ConfigError, PreflightError, Problem, SubmitCancelled

logger = logging.getLogger("orchestrate.ssh")

# Never staged: version-control internals, caches, virtualenvs. Added to ssh.stage_exclude.
DEFAULT_EXCLUDES = (".git", ".hg", ".svn", "__pycache__", "*.pyc", ".venv", "venv", ".mypy_cache", ".pytest_cache",
                    ".ruff_cache", "node_modules", ".ipynb_checkpoints", ".DS_Store")
# Never staged, whatever the excludes say: files that usually hold secrets.
SECRET_FILES = (".env", ".env.*", "*.pem", "*.key", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".netrc",
                ".git-credentials", ".pypirc", "*.p12", "*.pfx", "credentials", "credentials.json")
PACKAGES = ("orchestrator", "recipes")  # the node package: what the agent and the built-in recipes import
STACK = ("torch", "accelerate", "transformers", "trl", "deepspeed")  # versions compared across hosts
CHUNK = 1 << 20
GIB = 1 << 30
STAGE_FILE = "stage.json"  # the layout in the run dir (written by prepare, read by submit)
RELAY_MIN_HOSTS, RELAY_MIN_BYTES = 3, 8 << 20  # below these, sending to each host straight from here is as fast


# ----------------------------------------------------------------------------------------- what goes where

@dataclass(frozen=True)
class Source:
    """One local root staged to every host: a directory (its listed files) or a single file."""

    label: str  # appears on the host as ${RUN_DIR}/staged/<label>
    path: str  # the local directory, or the file
    kind: str  # package | code | data | model | file
    files: tuple[str, ...] = ()  # relative paths under `path` (a directory); () for a file

    def root(self) -> Path:
        p = Path(self.path)
        return p if p.is_dir() else p.parent

    def rels(self) -> tuple[str, ...]:
        return self.files if Path(self.path).is_dir() else (Path(self.path).name,)


@dataclass(frozen=True)
class Layout:
    """How a job is staged (shown by render, done by submit)."""

    sources: tuple[Source, ...]
    output_local: str  # the submitter's output dir (fetched back into)
    output_key: str  # outputs/<key> on each host, stable for one local output dir (so a resubmit resumes)
    fetch: str  # none | final | last_checkpoint
    stage: bool  # False: only the node package; the job's paths must already exist on every host
    inputs: tuple[str, ...] = ()  # local input paths (checked on every host when stage is off)

    def lines(self) -> list[str]:
        out = []
        for s in self.sources:
            n = len(s.rels())
            out.append(f"  {s.label:<10} {s.kind:<8} {s.path}" + (f"  ({n} files)" if Path(s.path).is_dir() else ""))
        out.append(f"  {'output':<10} {'':<8} {RUN_DIR_VAR}/output -> WORKDIR/{self.output_key}"
                   f"  (fetch: {self.fetch})")
        return out


def output_key(local: str) -> str:
    return "outputs/" + hashlib.sha256(local.encode()).hexdigest()[:12] + "-" + (Path(local).name or "out")


def _staged(label: str, rel: str = "") -> str:
    return f"{RUN_DIR_VAR}/staged/{label}" + (f"/{rel}" if rel and rel != "." else "")


def git_root(path: Path) -> Path | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def _excluded(rel: str, patterns: tuple[str, ...]) -> bool:
    parts = rel.split("/")
    return any(fnmatch.fnmatch(p, pat) for p in parts for pat in patterns) or any(
        fnmatch.fnmatch(rel, pat) for pat in patterns)


def list_root(root: Path, excludes: tuple[str, ...] = (), use_git: bool = True) -> tuple[str, ...]:
    """The files of a code/data/model root, relative and sorted: the git-tracked (and untracked, not ignored) files
    when `root` is a git work tree's top, else every file under it; minus the default, the given and the secret
    excludes. A symlink that leaves the root, or a path that would, is a ConfigError naming it."""
    pats = DEFAULT_EXCLUDES + tuple(excludes) + SECRET_FILES
    rels: list[str] = []
    if use_git and (root / ".git").exists():
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, timeout=120)
        if out.returncode == 0:
            rels = [r for r in out.stdout.decode(errors="surrogateescape").split("\0") if r]
    if not rels:
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            dirnames[:] = sorted(d for d in dirnames
                                 if not _excluded(d if rel_dir == "." else f"{rel_dir}/{d}", pats)
                                 or os.path.islink(os.path.join(dirpath, d)))
            rels += [n if rel_dir == "." else f"{rel_dir}/{n}" for n in filenames]
            rels += [d if rel_dir == "." else f"{rel_dir}/{d}" for d in dirnames
                     if os.path.islink(os.path.join(dirpath, d))]
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    real_root = root.resolve()
    keep: list[str] = []
    problems: list[Problem] = []
    for rel in sorted(set(rels)):
        if _excluded(rel, pats):
            continue
        if rel.startswith("/") or ".." in rel.split("/"):
            problems.append(Problem(str(root / rel), "refused: a path that leaves the staged root"))
            continue
        full = root / rel
        if full.is_symlink():
            target = full.resolve()
            if not target.is_relative_to(real_root):
                problems.append(Problem(str(full), f"refused: a symlink leaving {root} (to {target}); exclude it "
                                                   "with ssh.stage_exclude or copy the file in"))
                continue
            if target.is_dir():
                continue  # a link to a directory inside the root: its files are listed under their own path
        if full.is_file():
            keep.append(rel)
    if problems:
        raise ConfigError(problems)
    return tuple(keep)


def plan_staging(recipe, cwd: Path, output_local: str, ssh) -> tuple[Any, Layout, str]:
    """(the job as the hosts run it, the layout, the ranks' working directory on the hosts). Local inputs of the
    job (data files, a local model or tokenizer dir, a resume checkpoint, your code's root and the other local paths
    its args name) become `${RUN_DIR}/staged/<label>/...`; the output dir becomes `${RUN_DIR}/output` (a link to
    WORKDIR/outputs/<key> on the host). Nothing is read but file lists."""
    from orchestrator.core.spec import RecipeSpec, RunJobSpec

    stage = bool(getattr(ssh, "stage", True))
    excludes = tuple(getattr(ssh, "stage_exclude", ()) or ())
    fetch = getattr(getattr(recipe, "outputs", None), "fetch", "none")
    sources: list[Source] = []
    inputs: list[str] = []
    out_local = str(output_local)
    out_remote = f"{RUN_DIR_VAR}/output"

    def add(label: str, path: str, kind: str) -> str:
        """Stage `path` (a file or dir) as `label`; the path it has on the hosts."""
        inputs.append(path)
        p = Path(path)
        files = list_root(p, excludes, use_git=False) if p.is_dir() else ()
        sources.append(Source(label, path, kind, files))
        return _staged(label) if p.is_dir() else _staged(label, p.name)

    def under(path: str, root: str) -> str | None:
        try:
            rel = Path(path).relative_to(root)
        except ValueError:
            return None
        return rel.as_posix()

    def out_path(value: str) -> str | None:
        rel = under(value, out_local)
        return None if rel is None else (out_remote if rel == "." else f"{out_remote}/{rel}")

    rank_cwd = RUN_DIR_VAR
    if isinstance(recipe, RecipeSpec):
        if not stage:
            new = recipe
            inputs += [p for p in recipe.data.path if p.startswith("/")]
            for p in (recipe.model.name_or_path, recipe.tokenizer or ""):
                if p.startswith("/"):
                    inputs.append(p)
        else:
            paths = []
            for i, p in enumerate(recipe.data.path):
                paths.append(add(f"data{i}", p, "data") if p.startswith("/") and Path(p).exists() else p)
            model = recipe.model
            if model.name_or_path.startswith("/") and Path(model.name_or_path).is_dir():
                model = replace(model, name_or_path=add("model", model.name_or_path, "model"))
            tok = recipe.tokenizer
            if tok and tok.startswith("/") and Path(tok).is_dir():
                tok = add("tokenizer", tok, "model")
            ckpt = recipe.checkpoint
            if ckpt.resume not in RESUME_KEYWORDS and out_path(ckpt.resume) is None:
                ckpt = replace(ckpt, resume=add("resume", ckpt.resume, "model"))
            elif ckpt.resume not in RESUME_KEYWORDS:
                ckpt = replace(ckpt, resume=out_path(ckpt.resume))
            new = replace(recipe, data=replace(recipe.data, path=tuple(paths)), model=model, tokenizer=tok,
                          checkpoint=ckpt)
        # every node keeps whole checkpoints (HF Trainer saves on the main node only by default), so any node
        # can resume from its own disk and a fetch finds a complete checkpoint
        trainer = dict(new.trainer, output_dir=out_remote)
        trainer.setdefault("save_on_each_node", True)
        new = replace(new, trainer=trainer, launch=_each_node(new.launch))
        return new, Layout(tuple(sources), out_local, output_key(out_local), fetch, stage, tuple(inputs)), rank_cwd

    assert isinstance(recipe, RunJobSpec)
    run = recipe.run
    code_root: Path | None = None
    code_files: frozenset[str] = frozenset()
    if run.script is not None or run.module is not None:
        base = Path(run.script).parent if run.script is not None else cwd
        code_root = git_root(base) or base
        if stage:
            files = list_root(code_root, excludes, use_git=True)
            code_files = frozenset(files)
            sources.append(Source("code", str(code_root), "code", files))
            inputs.append(str(code_root))
        rel_cwd = under(str(cwd.resolve()), str(code_root))
        if rel_cwd is not None and stage:
            rank_cwd = _staged("code", rel_cwd)
    counter = [0]

    def map_value(value: Any) -> Any:
        if not isinstance(value, str) or not value.startswith("/"):
            return value
        o = out_path(value)
        if o is not None:
            return o
        if not stage:
            if Path(value).exists() or not (value.endswith("_dir") or Path(value).parent.exists()):
                inputs.append(value)
            return value
        if code_root is not None:
            rel = under(value, str(code_root))
            if rel is not None and (rel in code_files or (Path(value).is_dir() and any(
                    f.startswith(rel + "/") for f in code_files)) or rel == "."):
                return _staged("code", rel)
        if Path(value).exists():
            counter[0] += 1
            return add(f"input{counter[0]}", value, "file" if Path(value).is_file() else "data")
        return value

    if isinstance(run.args, dict):
        args: Any = {k: tuple(map_value(x) for x in v) if isinstance(v, tuple) else map_value(v)
                     for k, v in run.args.items()}
    else:
        words = list(run.args)
        for i, w in enumerate(words):
            if w.startswith("--") and "=" in w:
                k, _, v = w.partition("=")
                words[i] = f"{k}={map_value(v)}"
            else:
                words[i] = map_value(w)
        args = tuple(words)
    script = run.script
    if script is not None and stage and code_root is not None:
        script = _staged("code", under(script, str(code_root)) or Path(script).name)
    new_run = replace(run, script=script, args=args)
    launch = _each_node(recipe.launch)
    ckpt = recipe.checkpoint
    if ckpt.resume not in RESUME_KEYWORDS:
        ckpt = replace(ckpt, resume=out_path(ckpt.resume) or (add("resume", ckpt.resume, "model") if stage
                                                               else ckpt.resume))
    new = replace(recipe, run=new_run, checkpoint=ckpt, launch=launch)
    return new, Layout(tuple(sources), out_local, output_key(out_local), fetch, stage, tuple(inputs)), rank_cwd


def _each_node(launch):
    """Every node keeps whole checkpoints (a Trainer saves on the main node only by default), so any node can resume
    from its own disk and a fetch finds a complete checkpoint: the zero-code hooks set the Trainer's
    save_on_each_node (docs/staging.md)."""
    return replace(launch, env={**launch.env, "ORCHESTRATE_SAVE_ON_EACH_NODE": "1"})


# ----------------------------------------------------------------------------------------- content hashes

class HashCache:
    """sha256 of local files, remembered by (path, size, mtime_ns, inode): an unchanged file is not read again.
    Each entry also keeps the day it was last used; saving forgets entries unused for KEEP_DAYS and, past
    MAX_ENTRIES, the least recently used (files deleted or moved away must not grow the file forever)."""

    KEEP_DAYS = 30
    MAX_ENTRIES = 1_000_000

    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict[str, list] = {}
        self.dirty = False
        self._lock = threading.Lock()
        self.cancel: threading.Event | None = None  # set: hashing stops with SubmitCancelled (a submit's Ctrl-C)
        if path is not None:
            try:
                loaded = json.loads(path.read_text())
            except (OSError, ValueError):
                loaded = {}
            self.data = {k: v for k, v in loaded.items() if _entry_ok(v)} if isinstance(loaded, dict) else {}

    def sha(self, full: Path) -> tuple[str, int, int]:
        """(sha256, size, mode) of a file (links followed)."""
        st = full.stat()
        key = str(full)
        today = self._today()
        hit = self.data.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns and hit[2] == st.st_ino:
            if hit[4:] != [today]:  # refreshed once a day: an unchanged tree does not rewrite the file every submit
                with self._lock:
                    self.data[key] = hit[:4] + [today]
                    self.dirty = True
            return hit[3], st.st_size, st.st_mode
        h = hashlib.sha256()
        with open(full, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                if self.cancel is not None and self.cancel.is_set():
                    raise SubmitCancelled("cancelled while hashing the files to stage: nothing of the job runs")
                h.update(block)
        digest = h.hexdigest()
        with self._lock:
            self.data[key] = [st.st_size, st.st_mtime_ns, st.st_ino, digest, today]
            self.dirty = True
        return digest, st.st_size, st.st_mode

    @staticmethod
    def _today() -> int:
        return int(time.time() // 86400)

    def _pruned(self) -> dict[str, list]:
        """The entries to keep: used within KEEP_DAYS (an entry of an older orchestrate, without a day, counts as
        used today), the most recently used MAX_ENTRIES of them."""
        today = self._today()
        days = {k: (v[4] if len(v) > 4 and isinstance(v[4], int) and v[4] <= today else today)
                for k, v in self.data.items()}
        keep = [k for k, d in days.items() if d >= today - self.KEEP_DAYS]
        if len(keep) > self.MAX_ENTRIES:
            keep = sorted(keep, key=days.__getitem__, reverse=True)[:self.MAX_ENTRIES]
        return {k: self.data[k][:4] + [days[k]] for k in keep}

    def save(self) -> None:
        if not self.dirty or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with self._lock:
                self.data = self._pruned()
            with os.fdopen(fd, "w") as fh:
                json.dump(self.data, fh)
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError:
            pass  # a cache: the next submit hashes again


def _entry_ok(v: Any) -> bool:
    """[size, mtime_ns, inode, sha256(, day)]: anything else in the file (hand-edited, corrupt) is dropped."""
    return isinstance(v, list) and len(v) >= 4 and all(isinstance(x, int) for x in v[:3]) and isinstance(v[3], str)


def hash_cache() -> HashCache:
    from orchestrator.store import home
    return HashCache(home() / "cache" / "hashes.json")


@dataclass(frozen=True)
class Tree:
    label: str
    entries: tuple[tuple[str, str, int, int], ...]  # (rel, sha256, size, mode 0o400|0o500)
    sha: str
    local: dict[str, Path] = field(default_factory=dict, compare=False, hash=False)  # sha -> a local file with it

    @property
    def size(self) -> int:
        return sum(e[2] for e in self.entries)


def make_tree(label: str, root: Path, rels: tuple[str, ...], cache: HashCache) -> Tree:
    entries, local = [], {}
    for rel in rels:
        full = root / rel
        sha, size, mode = cache.sha(full)
        entries.append((rel, sha, size, 0o500 if mode & 0o100 else 0o400))
        local.setdefault(sha, full)
    entries.sort()
    th = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    return Tree(label, tuple(entries), th, local)


def package_tree(cache: HashCache) -> Tree:
    """The node package: the orchestrator and recipes packages as installed here (no caches, no compiled files)."""
    from orchestrator.resources import package_root
    top = package_root()
    rels: list[str] = []
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(top / pkg):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel_dir = os.path.relpath(dirpath, top)
            rels += [f"{rel_dir}/{n}" for n in sorted(filenames) if not n.endswith((".pyc", ".pyo"))]
    return make_tree("package", top, tuple(rels), cache)


def source_trees(layout: Layout, cache: HashCache) -> list[Tree]:
    return [make_tree(s.label, s.root(), s.rels(), cache) for s in layout.sources]


def agent_prefix(workdir: str, package_sha: str) -> tuple[str, ...]:
    """What goes before the agent's python on a host that gets the node package: its PYTHONPATH."""
    return ("env", f"PYTHONPATH={workdir.rstrip('/')}/cache/trees/{package_sha}")


def relay_credentials() -> tuple[str, str]:
    """(certificate, private key) PEM for one stage's relay: a fresh ECDSA P-256 key and a self-signed certificate,
    made here with `cryptography` (paramiko's own dependency; the hosts need only Python's ssl), held in memory and
    given to each host over its SSH session only. The validity dates guard nothing (the key lives for one stage),
    so they are wide: a host whose clock is off still takes part."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    pub = key.public_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "orchestrate staging relay")])
    utc = datetime.timezone.utc
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(pub)
            .serial_number(x509.random_serial_number())
            .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=utc))
            .not_valid_after(datetime.datetime(2100, 1, 1, tzinfo=utc))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(pub), critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM).decode(),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()).decode())


# ----------------------------------------------------------------------------------------- the host sessions

def _server_source() -> str:
    from orchestrator.node import stagecache
    return Path(stagecache.__file__).read_text()


class Session:
    """One host's stagecache server over one SSH channel."""

    def __init__(self, conn: Any, python: str, workdir: str):
        from launchers.ssh.transport import remote_command
        self.host = conn.host
        self.chan = conn.open(remote_command([python, "-c", _server_source(), "serve", workdir]))
        self.chan.settimeout(None)
        self.buf = b""
        self.python = python

    def _fill(self) -> bool:
        data = self.chan.recv(CHUNK)
        self.buf += data
        return bool(data)

    def readline(self) -> bytes:
        while b"\n" not in self.buf:
            if not self._fill():
                line, self.buf = self.buf, b""
                return line
        line, _, self.buf = self.buf.partition(b"\n")
        return line + b"\n"

    def exec(self, argv: tuple[str, ...], mark: str) -> tuple[Any, bytes]:
        """Turn this session into the node agent (stagecache's `exec`): (the channel, what it already printed)."""
        self.ask({"op": "exec", "argv": list(argv), "mark": mark})
        self.chan.set_combine_stderr(True)
        rest, self.buf = self.buf, b""
        return self.chan, rest

    def ask(self, req: dict[str, Any], payload=None) -> dict[str, Any]:
        self.chan.sendall((json.dumps(req) + "\n").encode())
        if payload is not None:
            try:
                payload(self.chan)
            except OSError as e:  # the host stopped reading: its own answer says why (a full disk, ...)
                self.chan.settimeout(5)
                try:
                    line = self.readline()
                except OSError:
                    line = b""
                why = json.loads(line).get("error") if line.startswith(b"{") else None
                raise RuntimeError(why or f"sending failed: {e}") from None
        line = self.readline()
        if not line:
            err = self.chan.makefile_stderr("rb").read().decode(errors="replace").strip().splitlines()  # it ended
            rc = self.chan.recv_exit_status()
            why = err[-1] if err else f"exit {rc}"
            if rc == 127:
                why = f"remote python {self.python!r} not found"
            raise RuntimeError(f"staging session ended: {why}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise RuntimeError("staging session ended inside a file")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def close(self) -> None:
        try:
            self.chan.shutdown_write()
            self.chan.recv_exit_status()
            self.chan.close()
        except Exception:  # noqa: BLE001 - already gone
            pass


@dataclass
class HostStage:
    workdir: str = ""  # the real workdir on the host
    free: int = 0
    versions: dict[str, str | None] = field(default_factory=dict)
    python: str = ""
    absent: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    dirty: list[str] = field(default_factory=list)  # trees to (re)build
    sent_bytes: int = 0
    sent_files: int = 0
    built: int = 0


class Stager:
    """Stage a job to its hosts: `hello` (facts + pre-flight on every host, nothing written but the workdir), then
    `push` (only the blobs a host lacks, then the trees and the job's links)."""

    def __init__(self, pool: Any, ssh: Any, trees: list[Tree], links: dict[str, str], needed: tuple[str, ...]):
        self.pool, self.ssh, self.trees, self.links, self.needed = pool, ssh, trees, links, needed
        self.sessions: dict[str, Session] = {}
        self.hosts: dict[str, HostStage] = {}
        self.local: dict[str, Path] = {}
        for t in trees:
            self.local.update(t.local)
        self.blobs = sorted({(e[1], e[2]) for t in trees for e in t.entries})
        self.tree_entries = {t.sha: [list(e) for e in t.entries] for t in trees}

    def workdir(self, host: str) -> str:
        return str(self.ssh.workdir).replace("{host}", host)

    def hello(self, hosts: list[str], paths: tuple[str, ...] = ()) -> None:
        """Open a session on every host and ask its facts and which blobs it lacks; PreflightError names every host
        with a problem (unreachable, no python, a missing package, a version differing across hosts, a path absent
        with staging off, too little disk)."""
        from launchers.ssh.transport import HostError

        def one(host: str) -> HostStage:
            conn = self.pool.conns.get(host)
            if conn is None or not conn.alive:
                conn = self.pool.connect(host)
            s = self.sessions[host] = Session(conn, str(self.ssh.python), self.workdir(host))
            facts = s.ask({"op": "hello", "packages": list(STACK), "paths": list(paths), "blobs": self.blobs,
                           "trees": self.tree_entries})
            return HostStage(workdir=facts["workdir"], free=int(facts["free"]), versions=facts["versions"],
                             python=facts["python"], absent=list(facts["absent"]), missing=facts["missing"],
                             dirty=facts["dirty"])

        results = self.pool.map(one, hosts)
        problems: list[Problem] = []
        for host, res in results.items():
            if isinstance(res, HostError):
                problems.append(Problem(host, res.cause))
            elif isinstance(res, Exception):
                problems.append(Problem(host, str(res) or type(res).__name__))
            else:
                self.hosts[host] = res
        if not problems:
            problems = self.problems(paths)
        if problems:
            self.close()
            raise PreflightError(problems)

    def problems(self, paths: tuple[str, ...]) -> list[Problem]:
        problems: list[Problem] = []
        sizes = dict(self.blobs)
        reserve = float(getattr(self.ssh, "min_free_gb", 1.0)) * GIB
        for host, hs in self.hosts.items():
            for p in hs.absent:
                problems.append(Problem(host, f"{p}: not found on the host (ssh.stage is false: every path the job "
                                              "needs must exist on every host)"))
            for name in self.needed:
                if hs.versions.get(name) is None:
                    problems.append(Problem(host, f"python {self.ssh.python} has no {name} (the job needs it)"))
            need = sum(sizes[s] for s in hs.missing) + reserve
            if hs.free < need:
                problems.append(Problem(host, f"{hs.workdir}: {hs.free / GIB:.2f} GiB free, staging needs "
                                              f"{sum(sizes[s] for s in hs.missing) / GIB:.2f} GiB plus "
                                              f"ssh.min_free_gb = {reserve / GIB:g} GiB for outputs"))
        if not getattr(self.ssh, "allow_version_mismatch", False) and len(self.hosts) > 1:
            first = next(iter(self.hosts))
            for name in ("python",) + STACK:
                want = self.hosts[first].python if name == "python" else self.hosts[first].versions.get(name)
                for host, hs in list(self.hosts.items())[1:]:
                    have = hs.python if name == "python" else hs.versions.get(name)
                    if have != want:
                        problems.append(Problem(host, f"{name} {have or 'not installed'} differs from {first}'s "
                                                      f"{want or 'not installed'} (set ssh.allow_version_mismatch: "
                                                      "true to run anyway)"))
        return problems

    def _payload(self, batch: list[list], progress):
        """A `put`'s bytes: the listed blobs read from the local files, in order; small files travel together, a
        CHUNK at a time (fewer sends, and full TLS records on the relay)."""
        def send(chan) -> None:
            small = bytearray()
            for sha, size in batch:
                with open(self.local[sha], "rb") as fh:
                    left = size
                    while left:
                        data: bytes | bytearray = fh.read(min(CHUNK, left))
                        if not data:
                            raise RuntimeError(f"{self.local[sha]} changed while staging")
                        left -= len(data)
                        if small or len(data) < CHUNK:
                            small += data
                            if len(small) < CHUNK:
                                continue
                            data, small = small, bytearray()
                        chan.sendall(data)
                        progress(len(data))
            if small:
                chan.sendall(small)
                progress(len(small))
        return send

    def _send_relay(self, sock, batch: list[list], progress) -> None:
        try:
            self._payload(batch, progress)(sock)
        except OSError:
            pass  # the host names what it missed
        finally:
            sock.close()

    def push(self, on_progress=None) -> dict[str, HostStage]:
        """Send each host the blobs it lacks (hashed again there), then build the trees and the job's links. With
        RELAY_MIN_HOSTS or more hosts lacking RELAY_MIN_BYTES or more, the bytes leave the submitter once: they go
        to the first host, which passes them on to the next as they arrive, and so on (a pipeline over the hosts'
        own network, each hop checked by sha256); where that chain breaks, the hosts still lacking something get
        it straight from the submitter."""
        sizes = dict(self.blobs)
        lacking = [h for h, hs in self.hosts.items() if hs.missing]
        union = sorted({sha for h in lacking for sha in self.hosts[h].missing})
        with_blobs = set(union)  # a tree holding one of these is built again where it is sent (a no-op if complete)
        relay = (bool(getattr(self.ssh, "stage_relay", True)) and len(lacking) >= RELAY_MIN_HOSTS
                 and sum(sizes[x] for x in union) >= RELAY_MIN_BYTES)
        total = sum(sizes[x] for x in union) if relay else sum(sizes[x] for h in lacking
                                                                 for x in self.hosts[h].missing)
        done, last, lock = [0], [time.time()], threading.Lock()

        def progress(n: int) -> None:
            with lock:
                done[0] += n
                if on_progress and time.time() - last[0] > 2:
                    last[0] = time.time()
                    on_progress(done[0], total)

        def record(host: str, out: dict[str, Any], files: int) -> None:
            if out["bad"]:
                raise RuntimeError(f"{len(out['bad'])} file(s) arrived with another content than hashed here (changed "
                                   f"while staging, or corrupted on the way); first {out['bad'][0][:12]}")
            hs = self.hosts[host]
            hs.sent_bytes, hs.sent_files = hs.sent_bytes + int(out["bytes"]), hs.sent_files + files

        if relay:
            self.relayed = self._relay(lacking, [[x, sizes[x]] for x in union], progress, record)
            # a host whose hop went through holds every blob (each verified there); whatever the chain did not
            # deliver elsewhere comes straight from the submitter
            broken = [h for h in lacking if self.relayed.get(h) != "ok"]
            for h in set(lacking) - set(broken):
                self.hosts[h].missing = []
            asked = self.pool.map(lambda h: self.sessions[h].ask({"op": "check", "blobs": self.blobs}), broken)
            for h, out in asked.items():
                if isinstance(out, Exception):
                    raise out
                self.hosts[h].missing = out["missing"]

        def one(host: str) -> HostStage:
            s, hs = self.sessions[host], self.hosts[host]
            if hs.missing:
                batch = [[sha, sizes[sha]] for sha in hs.missing]
                record(host, s.ask({"op": "put", "blobs": batch}, self._payload(batch, progress)), len(batch))
            # a tree is (re)built where it was not complete or one of its blobs was (re)sent
            trees = {t.sha: self.tree_entries[t.sha] for t in self.trees
                     if t.sha in hs.dirty or any(e[1] in with_blobs for e in t.entries)}
            hs.built = len(s.ask({"op": "build", "trees": trees, "links": self.links})["built"])
            return hs

        results = self.pool.map(one, list(self.hosts))
        errs = [Problem(h, f"staging failed: {r}") for h, r in results.items() if isinstance(r, Exception)]
        if errs:
            self.close()
            raise PreflightError(errs)
        return self.hosts

    def _relay(self, hosts: list[str], batch: list[list], progress, record) -> dict[str, str]:
        """One stream through the hosts in order: the submitter -> hosts[0] -> hosts[1] -> ... Returns {host: "ok"
        or why its hop failed}; a failed hop leaves the rest to the direct sends. Every hop is mutual TLS pinned to
        a certificate made for this stage (`relay_credentials`, sent to each host in its `listen` over SSH), then
        the hop's own token (docs/staging.md)."""
        import secrets
        from orchestrator.node.stagecache import ABORT, PUT, RELAY_GREET_S, RelayTLS, cut
        cert, key = relay_credentials()
        tls = RelayTLS(cert, key)
        tokens = {h: secrets.token_hex(16) for h in hosts}
        asked = self.pool.map(lambda h: self.sessions[h].ask({"op": "listen", "token": tokens[h], "timeout": 30,
                                                              "tls": {"cert": cert, "key": key}}), hosts)
        failed = {h: f"no relay port: {r}" for h, r in asked.items() if isinstance(r, Exception)}
        if failed:  # (a host's python without ssl, say): every host gets the files straight from here
            logger.warning("staging relay not used: %s", "; ".join(f"{h}: {w}" for h, w in failed.items()))
            return {h: failed.get(h, "relay not used (another host has no relay port)") for h in hosts}
        ports = {h: int(out["port"]) for h, out in asked.items()}
        first: Any = None
        try:  # the first hop over the hosts' network too, when this machine reaches it (as the ranks' traffic does)
            first = tls.connect(hosts[0], ports[hosts[0]], PUT + tokens[hosts[0]].encode(), timeout=2,
                                handshake=RELAY_GREET_S)
        except OSError:
            first = None  # over SSH then

        def hop(i: int) -> str:
            h = hosts[i]
            req: dict[str, Any] = {"op": "put", "blobs": batch}
            if i + 1 < len(hosts):
                req["forward"] = {"host": hosts[i + 1], "port": ports[hosts[i + 1]], "token": tokens[hosts[i + 1]]}
            if i == 0 and first is None:
                out = self.sessions[h].ask(req, self._payload(batch, progress))
            elif i == 0:
                sender = threading.Thread(target=self._send_relay, args=(first, batch, progress), daemon=True)
                sender.start()
                try:
                    out = self.sessions[h].ask(dict(req, relay=True))
                except BaseException:
                    cut(first)  # (the sender never times out: it ends with the stream)
                    raise
                finally:
                    sender.join()
            else:
                out = self.sessions[h].ask(dict(req, relay=True))
            record(h, out, len(batch))
            return "ok"

        def safe(i: int) -> str:
            try:
                return hop(i)
            except Exception as e:  # noqa: BLE001 - reported per host
                if i + 1 < len(hosts):  # the next host may still wait for this one: release it at once
                    nxt = hosts[i + 1]
                    try:
                        tls.connect(nxt, ports[nxt], ABORT + tokens[nxt].encode(), timeout=2).close()
                    except OSError:
                        pass
                return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

        try:  # every hop at once (a pipeline); a submit's cancel closes every connection, ending each hop's stream
            at = {h: i for i, h in enumerate(hosts)}  # (hosts are distinct: the spec refuses duplicates)
            out = self.pool.map(lambda h: safe(at[h]), hosts, threads=len(hosts))
        except SubmitCancelled:
            if first is not None:  # and the first hop's direct stream: its sender stops, host 0 sees the end
                cut(first)
            raise
        broken = {h: why for h, why in out.items() if why != "ok"}
        if broken:
            logger.warning("staging relay: %s; those hosts get the files from here",
                           "; ".join(f"{h}: {w}" for h, w in broken.items()))
            for h in broken:  # a session whose stream broke mid-put is out of step: open a fresh one
                self.sessions[h].close()
                self.sessions[h] = Session(self.pool.conns[h], str(self.ssh.python), self.workdir(h))
        return out

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()


# ----------------------------------------------------------------------------------------- results back

def fetch_outputs(pool: Any, ssh: Any, nodes: list[tuple[str, str]], key: str, local: Path, only: str) -> dict:
    """Bring WORKDIR/<key> (or its newest checkpoint-N, only="last_checkpoint") back from every node's host into
    `local` (each file verified by its sha256; node 0 first, a file already fetched from another node is kept).
    Returns {"files", "bytes", "hosts": {host: "host:path"}, "errors": {host: cause}}."""
    local.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"files": 0, "bytes": 0, "hosts": {}, "errors": {}}
    seen: set[str] = set()
    for host, workdir in nodes:
        try:
            conn = pool.conns.get(host)
            if conn is None or not conn.alive:
                conn = pool.connect(host)
            s = Session(conn, str(ssh.python), workdir)
            try:
                listing = s.ask({"op": "list", "dir": key, "only": only})
                summary["hosts"][host] = f"{host}:{listing['root']}"
                files = [f for f in listing["files"] if f[0] not in seen]
                if not files:
                    continue
                s.ask({"op": "get", "dir": key, "files": [[f[0], f[1]] for f in files]})  # paths: under the output dir
                for rel, size, sha in files:
                    dst = local / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    h = hashlib.sha256()
                    tmp = dst.with_name(dst.name + ".part")
                    with open(tmp, "wb") as fh:
                        left = size
                        while left:
                            data = s.read_exact(min(CHUNK, left))
                            h.update(data)
                            fh.write(data)
                            left -= len(data)
                    if h.hexdigest() != sha:
                        tmp.unlink()
                        raise RuntimeError(f"{rel} changed while it was fetched")
                    os.replace(tmp, dst)
                    seen.add(rel)
                    summary["files"] += 1
                    summary["bytes"] += size
            finally:
                s.close()
        except Exception as e:  # noqa: BLE001 - reported per host
            summary["errors"][host] = str(e) or type(e).__name__
    return summary


def seed_checkpoints(pool: Any, ssh: Any, steps: dict[str, list[int]], workdirs: dict[str, str], key: str,
                     scratch: Path) -> dict[str, str]:
    """Every host of a job without a shared filesystem keeps its own checkpoints (save_on_each_node), and each must
    hold the newest one to resume: a host that lacks the newest checkpoint another has (a spare that took a bad host's
    place) gets a copy, fetched from a host that has it (every file checked by its sha256) and put into its output
    dir (`key`, under its workdir) over SFTP. `steps`: each host's checkpoint steps (the `checkpoints` op).
    Returns {host: "checkpoint-N from H"} for the hosts seeded."""
    newest = max((max(v) for v in steps.values() if v), default=None)
    lacking = [h for h, v in steps.items() if newest is not None and newest not in v]
    if newest is None or not lacking:
        return {}
    src = next(h for h, v in steps.items() if newest in v)
    got = fetch_outputs(pool, ssh, [(src, workdirs[src])], key, scratch, "last_checkpoint")
    if got["errors"] or not got["files"]:
        raise RuntimeError(f"cannot fetch checkpoint-{newest} from {src}: {got['errors'] or 'no files'}")
    name = f"checkpoint-{newest}"
    files = sorted(p for p in (scratch / name).rglob("*") if p.is_file())

    def put(host: str) -> None:
        with pool.conns[host].sftp() as sftp:
            base = f"{workdirs[host].rstrip('/')}/{key}"
            made: set[str] = set()
            for f in files:
                rel = f.relative_to(scratch).as_posix()
                parts = f"{base}/{rel}".split("/")[:-1]
                for i in range(len(base.split("/")), len(parts) + 1):
                    d = "/".join(parts[:i])
                    if d and d not in made:
                        try:
                            sftp.mkdir(d, 0o700)
                        except OSError:  # (there already)
                            pass
                        made.add(d)
                tmp = f"{base}/{rel}.part"
                sftp.put(str(f), tmp)
                sftp.chmod(tmp, 0o600)
                sftp.posix_rename(tmp, f"{base}/{rel}")
    failed = {h: e for h, e in pool.map(put, lacking).items() if isinstance(e, Exception)}
    if failed:
        raise RuntimeError("cannot put " + name + " on " + ", ".join(f"{h} ({e})" for h, e in failed.items()))
    return {h: f"{name} from {src}" for h in lacking}
