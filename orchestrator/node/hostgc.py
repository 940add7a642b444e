"""`orchestrate gc` on an SSH host: a program for a host that has only Python.

The submitter sends THIS FILE's source as `python -c SOURCE WORKDIR` over SSH (as it does stagecache.py's, so it runs
on a host that lacks orchestrate, and whatever node package the host holds may be removed), with one JSON request on
stdin, `{"remove": [job id, ...], "dry_run": bool, "outputs": bool}`, and reads one JSON reply line from stdout.
Standard library only; nothing of orchestrate. The workdir's layout is stagecache.py's:

    runs/<job>/staged/<label> -> cache/trees/<tree>      runs/<job>/plan.json: "node_package" (a tree)
    runs/<job>/output -> outputs/<key>                   cache/trees/<tree>/...: hard links to cache/blobs/<sha256>

What is freed (each item listed with its bytes; `dry_run` lists exactly the same and removes nothing):

- `runs/<job>` of each job asked for, unless one of its node agents still runs here (then refused, with why);
- the trees those jobs name that no other run dir here names (another submitter's job, a job still running, one not
  asked for: all keep what they name), and the blobs that only those trees link (a blob any other tree links stays);
  nothing of the cache while a staging session serves this workdir (a submit may be about to link what is there);
- with `outputs`, `outputs/<key>` of those jobs when no other run dir links it.

Reply: {"workdir", "items": [{"job", "what": "run dir"|"outputs"|"cache", "path", "bytes", ...}], "refused":
{job: why}, "missing": [jobs with no run dir here], "note"}; an item that could not be removed carries "error".
One gc at a time per workdir (a lock file); a second one is refused.
"""

import json
import os
import re
import shutil
import stat
import sys

JOB_ID = re.compile(r"^[A-Za-z0-9_.+-]+$")
SHA = re.compile(r"^[0-9a-f]{64}$")
LOCK = ".gc.lock"


def _real(path):
    return os.path.realpath(os.path.expanduser(path))


def _listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _files(path):
    """lstat of every regular file under `path` (links not followed)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield st


def du(path):
    """Bytes of the regular files under `path` (links not followed, each inode once)."""
    sizes = {(st.st_dev, st.st_ino): st.st_size for st in _files(path)}
    return sum(sizes.values())


def inodes(path):
    """The inodes of the regular files of a tree."""
    return {st.st_ino for st in _files(path)}


def _cmdline(pid):
    try:
        with open("/proc/%s/stat" % pid) as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return None
        with open("/proc/%s/cmdline" % pid, "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except (OSError, IndexError):
        return None


class Workdir:
    def __init__(self, workdir):
        self.root = _real(workdir)
        self.runs = os.path.join(self.root, "runs")
        self.trees = os.path.join(self.root, "cache", "trees")
        self.blobs = os.path.join(self.root, "cache", "blobs")

    def jobs(self):
        return [j for j in _listdir(self.runs) if os.path.isdir(os.path.join(self.runs, j))
                and not os.path.islink(os.path.join(self.runs, j))]

    def refs(self, job):
        """(trees, output link target relative to the workdir or None) that run dir names."""
        run = os.path.join(self.runs, job)
        trees = set()
        staged = os.path.join(run, "staged")
        for name in _listdir(staged):
            p = os.path.join(staged, name)
            if os.path.islink(p):
                target = os.readlink(p)
                if _real(os.path.dirname(target)) == _real(self.trees):
                    trees.add(os.path.basename(target))
        try:
            with open(os.path.join(run, "plan.json")) as fh:
                pkg = json.load(fh).get("node_package")
            if isinstance(pkg, str) and SHA.match(pkg):
                trees.add(pkg)
        except (OSError, ValueError, AttributeError):
            pass
        out = None
        link = os.path.join(run, "output")
        if os.path.islink(link):
            target = _real(link)
            outputs = os.path.join(self.root, "outputs") + os.sep
            if target.startswith(outputs):
                out = os.path.relpath(target, self.root)
        return trees, out

    def agent_running(self, job):
        """The pid of a node agent of this job that still runs here (its command line names the run dir), or None."""
        run = os.path.join(self.runs, job)
        for rank in _listdir(os.path.join(run, "nodes")):
            try:
                with open(os.path.join(run, "nodes", rank, "agent.json")) as fh:
                    pid = int(json.load(fh).get("agent_pid") or 0)
            except (OSError, ValueError, TypeError, AttributeError):
                continue
            argv = _cmdline(pid) if pid > 1 else None
            if argv and any(a == run or _real(a) == _real(run) for a in argv if a.startswith("/")):
                return pid
        return None

    def staging_sessions(self):
        """Pids of stagecache servers (`python -c SOURCE serve WORKDIR`) of this user serving this workdir now."""
        out = []
        for name in _listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                if os.stat("/proc/" + name).st_uid != os.getuid():
                    continue
            except OSError:
                continue
            argv = _cmdline(name)
            if argv and len(argv) >= 5 and argv[1] == "-c" and argv[-2] == "serve" and _real(argv[-1]) == self.root:
                out.append(int(name))
        return out

    def blob_index(self):
        """{inode: (sha, size)} of the cache's blobs."""
        out = {}
        for name in _listdir(self.blobs):
            if SHA.match(name):
                try:
                    st = os.lstat(os.path.join(self.blobs, name))
                except OSError:
                    continue
                out[st.st_ino] = (name, st.st_size)
        return out


def plan(wd, remove, outputs):
    """What gc frees in `wd` for the jobs `remove`: (items, refused, missing, note)."""
    present = set(wd.jobs())
    refused, missing, gone = {}, [], []
    for job in dict.fromkeys(remove):
        if not JOB_ID.match(job) or job in (".", ".."):
            refused[job] = "not a job id"
        elif job not in present:
            missing.append(job)
        else:
            pid = wd.agent_running(job)
            if pid is not None:
                refused[job] = "its node agent (pid %d) still runs on this host" % pid
            else:
                gone.append(job)
    refs = {job: wd.refs(job) for job in present}
    kept_trees, kept_outputs = set(), set()
    for job in present - set(gone):
        kept_trees |= refs[job][0]
        if refs[job][1]:
            kept_outputs.add(refs[job][1])
    items = [{"job": job, "what": "run dir", "path": os.path.join(wd.runs, job),
              "bytes": du(os.path.join(wd.runs, job))} for job in gone]
    if outputs:
        for job in gone:
            key = refs[job][1]
            if key and key not in kept_outputs and os.path.isdir(os.path.join(wd.root, key)):
                kept_outputs.add(key)  # (listed once, with the first job that names it)
                items.append({"job": job, "what": "outputs", "path": os.path.join(wd.root, key),
                              "bytes": du(os.path.join(wd.root, key))})
    trees = set()
    for job in gone:
        trees |= refs[job][0]
    trees = sorted(t for t in trees - kept_trees if os.path.isdir(os.path.join(wd.trees, t)))
    note = ""
    sessions = wd.staging_sessions() if trees else []
    if sessions:
        note = ("the cache was left alone: a submit is staging to this workdir right now (pid %s); run gc again later"
                % ", ".join(map(str, sessions)))
        trees = []
    if trees:
        mine = set()
        for t in trees:
            mine |= inodes(os.path.join(wd.trees, t))
        others = set()
        for t in _listdir(wd.trees):  # every other tree, complete or not, referenced or not
            if t not in trees:
                others |= inodes(os.path.join(wd.trees, t))
        index = wd.blob_index()
        blobs = sorted(index[ino] for ino in mine - others if ino in index)
        items.append({"job": "", "what": "cache", "path": os.path.join(wd.root, "cache"),
                      "bytes": sum(size for _, size in blobs), "trees": trees, "blobs": [sha for sha, _ in blobs]})
    return items, refused, missing, note


def remove_item(wd, item):
    """Remove what one item lists; trees go first (renamed away at once), then their blobs (stamp, then content)."""
    if item["what"] != "cache":
        shutil.rmtree(item["path"])
        return
    for t in item["trees"]:
        top = os.path.join(wd.trees, t)
        away = "%s.gc.%d" % (top, os.getpid())
        os.rename(top, away)
        shutil.rmtree(away)
    for sha in item["blobs"]:
        for path in (os.path.join(wd.blobs, sha + ".ok"), os.path.join(wd.blobs, sha)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def run(workdir, req):
    import fcntl
    wd = Workdir(workdir)
    if not os.path.isdir(wd.root):
        return {"workdir": wd.root, "items": [], "refused": {}, "missing": list(req.get("remove", [])), "note": ""}
    lock = os.open(os.path.join(wd.root, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RuntimeError("another gc is running in %s" % wd.root) from None
        items, refused, missing, note = plan(wd, list(req.get("remove", [])), bool(req.get("outputs")))
        if not req.get("dry_run"):
            for item in items:
                try:
                    remove_item(wd, item)
                except OSError as e:
                    item["error"] = "%s: %s" % (getattr(e, "filename", None) or item["path"], e.strerror or e)
        return {"workdir": wd.root, "items": items, "refused": refused, "missing": missing, "note": note}
    finally:
        os.close(lock)


def main(argv):
    if len(argv) != 1:
        sys.stderr.write("usage: hostgc WORKDIR < REQUEST_JSON\n")
        return 2
    os.umask(0o077)
    try:
        out = run(argv[0], json.loads(sys.stdin.readline() or "{}"))
    except Exception as e:  # noqa: BLE001 - answered; the submitter names the host
        sys.stdout.write(json.dumps({"error": "%s: %s" % (type(e).__name__, e)}) + "\n")
        return 1
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
