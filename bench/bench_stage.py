#!/usr/bin/env python3
"""Staging to hosts that share no filesystem (not CI): orchestrate's stager vs rsync / pdcp, same data, same hosts.

    python bench/bench_stage.py [--hosts 8] [--rounds 5] [--size-mib 256] [--ref REV] [--out PATH] [--keep]

Data: --small-files files of --small-kib KiB (default 2000 x 16 KiB) plus --large-files files sharing the rest of
--size-mib (default 7 x ~32 MiB), random bytes (nothing compresses), generated once under /var/tmp (deleted at the
end unless --keep). Hosts: scripts/sshd_hosts.py private hosts (each sshd in its own mount namespace with its own
tmpfs work area /var/tmp/orchestrate-host), default 8 on 127.0.13.60.. port 2229, up at the start and always down
at the end (also on Ctrl-C / SIGTERM).

Measured, interleaved per round (the order rotates each round, so drift hits every side alike):
- ours: a cold stage (every host's WORKDIR wiped before), timed from Pool creation through hello(), push() and
  close() (connecting included, as the anchors connect too), with the local HashCache warm (a second submit);
  the warm re-hash (make_tree) and the cold local hashing time are reported separately;
- rsync_serial: `rsync -a -e 'ssh ...'` to one host after the other (as SkyPilot does), into a wiped dir;
- rsync_parallel: the same to all hosts at once (a stronger anchor);
- pdcp: `pdcp -R ssh -l root -r` to all hosts (PDSH_SSH_ARGS_APPEND carries the ssh options).
- ours_direct (when the engine has ssh.stage_relay; --no-direct skips it): ours with the relay off, every host
  fed by the submitter over SSH;
- ours_ref (only with --ref REV): ours as of git revision REV (its launchers/ssh/stage.py, its hosts running its
  orchestrator/node/stagecache.py), so that a change's cost is paired round by round in the same run.
With the relay on (default, 3+ hosts, 8+ MiB) the bytes leave the submitter once and the hosts pass them on over
mutual TLS (docs/staging.md); the hops that worked are recorded per run.
ssh options everywhere: -p PORT -i KEY -o UserKnownHostsFile=... -o StrictHostKeyChecking=yes -o BatchMode=yes
-o KexAlgorithms=curve25519-sha256. Every result is checked on every host afterwards (file count and bytes, read
in the host's own mount namespace), so a failed copy never counts as fast. Per round: the ratio ours/anchor;
reported: median and range of those paired ratios, each side's median; goal: ours <= 0.75 x the best anchor.
Then, on the staged hosts:
- nothing changed: bytes moved must be 0 (asserted); wall time of hello + push + close, (a) over connections
  already open and (b) from a fresh Pool (connect included). This is the staging session's absolute time; in a
  submit that session then becomes the host's node agent (the one remote start a submit needs anyway), so what
  staging ADDS to a submit (the issue's goal: <= 0.3 s) is measured by bench/bench_stage_submit.py;
- one small file changed: bytes moved to each host must equal that file's size (asserted); wall time.

Needs root (sshd, nsenter), rsync and pdsh (pdcp). Holds /tmp/orchestrate-testbed.lock while hosts are up (unless
--no-lock: the caller holds it, e.g. `flock /tmp/orchestrate-testbed.lock python bench/bench_stage.py --no-lock`);
stops starting new rounds when --lock-budget-min would be exceeded. Results: --out (default
bench/results/stage.json) and a table on stdout.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

import sshd_hosts  # noqa: E402
from private_hosts import host_run  # noqa: E402

from orchestrator.core.spec import parse_cluster  # noqa: E402
from launchers.ssh import stage as st  # noqa: E402
from launchers.ssh.transport import Pool  # noqa: E402

LOCK = "/tmp/orchestrate-testbed.lock"
WORKDIR = f"{sshd_hosts.HOST_WORK_AREA}/work"  # the stager's workdir on a private host
ANCHOR_DIR = f"{sshd_hosts.HOST_WORK_AREA}/anchor"  # where the anchors copy to (same tmpfs)
LINK = "runs/bench/staged/data"
ANCHORS = ("rsync_serial", "rsync_parallel", "pdcp")
OURS = ("ours", "ours_direct", "ours_ref")  # ours_direct: ssh.stage_relay false; ours_ref: --ref REV
SIDES = OURS + ANCHORS


class Stop(Exception):
    """SIGTERM: unwind through the finally blocks (hosts down, lock released)."""


def now() -> float:
    return time.perf_counter()


# ----------------------------------------------------------------------------------------- data

def make_data(root: Path, small: int, small_kib: int, large: int, size_mib: int) -> dict:
    """Random files: `small` x small_kib KiB in 100-file dirs, `large` files sharing what is left of size_mib."""
    root.mkdir(parents=True, exist_ok=False)
    small_bytes = small * small_kib * 1024
    rest = size_mib * (1 << 20) - small_bytes
    if large and rest <= 0:
        raise SystemExit(f"--size-mib {size_mib} leaves nothing for {large} large files")
    sizes = [rest // large + (1 if i < rest % large else 0) for i in range(large)] if large else []
    for i in range(small):
        d = root / "small" / f"d{i // 100:03d}"
        if i % 100 == 0:
            d.mkdir(parents=True)
        (d / f"f{i:05d}.bin").write_bytes(os.urandom(small_kib * 1024))
    if sizes:
        (root / "large").mkdir()
    for i, n in enumerate(sizes):
        with open(root / "large" / f"shard{i:02d}.bin", "wb") as fh:
            left = n
            while left:
                k = min(left, 8 << 20)
                fh.write(os.urandom(k))
                left -= k
    return {"files": small + len(sizes), "bytes": small_bytes + sum(sizes), "small_files": small,
            "small_bytes": small_kib * 1024, "large_files": len(sizes), "large_bytes": sizes}


# ----------------------------------------------------------------------------------------- hosts

def on_hosts(tb, hosts: list[str], script: str, check: bool = True) -> dict[str, str]:
    """`sh -c script` as root in each host's mount namespace, all hosts at once: {host: stdout}."""
    def one(h: str) -> str:
        r = host_run(tb, h, ["sh", "-c", script], timeout=120)
        if check and r.returncode != 0:
            raise RuntimeError(f"{h}: `{script}` failed: {r.stderr.decode(errors='replace')[-300:]}")
        return r.stdout.decode()
    with ThreadPoolExecutor(len(hosts)) as ex:
        return dict(zip(hosts, ex.map(one, hosts), strict=True))


def wipe(tb, hosts: list[str]) -> None:
    """Every host back to empty: no staged cache, no anchor copy (an empty anchor dir, made outside any timing)."""
    own = "" if tb.user == "root" else f" && chown {shlex.quote(tb.user)} {WORKDIR} {ANCHOR_DIR}"
    on_hosts(tb, hosts, f"rm -rf {WORKDIR} {ANCHOR_DIR} && mkdir -m 0755 {WORKDIR} {ANCHOR_DIR}{own}")


def counted(tb, hosts: list[str], top: str, extra: str = "") -> dict[str, tuple[int, int]]:
    """{host: (regular files, their bytes)} under `top` on each host."""
    out = on_hosts(tb, hosts, f"find {shlex.quote(top)} -type f {extra} -printf '%s\\n'", check=False)
    return {h: (len(s.split()), sum(int(x) for x in s.split())) for h, s in out.items()}


def verify(tb, hosts: list[str], top: str, want: dict, what: str, extra: str = "") -> None:
    got = counted(tb, hosts, top, extra)
    bad = {h: c for h, c in got.items() if c != (want["files"], want["bytes"])}
    if bad:
        raise RuntimeError(f"{what}: wrong result on {len(bad)} host(s), want ({want['files']} files, "
                           f"{want['bytes']} bytes) under {top}; got {bad}")


# ----------------------------------------------------------------------------------------- the sides

def rsync_argv(tb, src: Path, host: str, flags: list[str]) -> list[str]:
    e = " ".join(shlex.quote(w) for w in ["ssh", *tb.ssh_options()])
    return ["rsync", *flags, "-e", e, f"{src}/", f"{tb.user}@{host}:{ANCHOR_DIR}/data/"]


def run_rsync_serial(tb, src: Path, hosts: list[str], flags: list[str]) -> float:
    t0 = now()
    for h in hosts:
        p = subprocess.run(rsync_argv(tb, src, h, flags), stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"rsync to {h} failed ({p.returncode}): {p.stderr[-300:]}")
    return now() - t0


def run_rsync_parallel(tb, src: Path, hosts: list[str], flags: list[str]) -> float:
    t0 = now()
    procs = {h: subprocess.Popen(rsync_argv(tb, src, h, flags), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for h in hosts}
    outs = {h: p.communicate() for h, p in procs.items()}
    dt = now() - t0
    bad = {h: outs[h][1][-200:] for h, p in procs.items() if p.returncode != 0}
    if bad:
        raise RuntimeError(f"parallel rsync failed on {sorted(bad)}: {bad}")
    return dt


def run_pdcp(tb, src: Path, hosts: list[str]) -> float:
    env = dict(os.environ, PDSH_SSH_ARGS_APPEND=" ".join(tb.ssh_options()))
    argv = ["pdcp", "-R", "ssh", "-f", str(max(32, len(hosts))), "-l", tb.user, "-w", ",".join(hosts), "-r",
            str(src), f"{ANCHOR_DIR}/"]
    t0 = now()
    p = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    dt = now() - t0
    if p.returncode != 0:
        raise RuntimeError(f"pdcp failed ({p.returncode}): {p.stderr[-400:]}")
    return dt


def ref_stager(rev: str):
    """launchers/ssh/stage.py as of git revision `rev`, loaded as the module `stage_ref`, whose sessions run that
    revision's orchestrator/node/stagecache.py on the hosts (the side ours_ref)."""
    import types

    def show(path: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout
    mod = types.ModuleType("stage_ref")
    mod.__file__ = f"{rev}:launchers/ssh/stage.py"
    sys.modules["stage_ref"] = mod  # (dataclasses look their module up)
    exec(compile(show("launchers/ssh/stage.py"), mod.__file__, "exec"), mod.__dict__)
    cache_source = show("orchestrator/node/stagecache.py")
    mod._server_source = lambda: cache_source
    return mod


def stage_once(cluster, src: Path, rels: tuple[str, ...], cache, hosts: list[str], pool=None, engine=st) -> dict:
    """One stage of the data tree: warm re-hash, then [Pool,] Stager, hello, push, close. `pool`: connections
    already open (not timed, not closed here); None: a fresh Pool, connected inside hello and closed after.
    `engine`: the stage module (ref_stager's for ours_ref)."""
    st = engine
    t0 = now()
    tree = st.make_tree("data", src, rels, cache)
    t1 = now()
    own = pool is None
    p = Pool(cluster.ssh) if own else pool
    t2 = now()
    s = st.Stager(p, cluster.ssh, [tree], {LINK: tree.sha}, ())
    s.hello(hosts)
    t3 = now()
    facts = s.push()
    t4 = now()
    s.close()
    t5 = now()
    if own:
        p.close()
    t6 = now()
    return {"rehash_s": t1 - t0, "pool_s": t2 - t1, "hello_s": t3 - t2, "push_s": t4 - t3, "close_s": t6 - t4,
            "stage_s": t6 - t1, "stage_from_stager_s": t5 - t2, "with_rehash_s": t6 - t0, "tree": tree,
            "sent": {h: f.sent_bytes for h, f in facts.items()},
            "sent_files": {h: f.sent_files for h, f in facts.items()},
            "built": {h: f.built for h, f in facts.items()},
            "relay": dict(getattr(s, "relayed", None) or {})}


def ours_cold(tb, cluster, src, rels, cache, hosts, want, engine=st) -> dict:
    r = stage_once(cluster, src, rels, cache, hosts, engine=engine)
    tree = r.pop("tree")
    relay = r.pop("relay")
    r["relay_hops_ok"] = sum(v == "ok" for v in relay.values())
    if relay and r["relay_hops_ok"] != len(relay):
        print(f"  relay hops broken (direct sends filled in): {relay}", flush=True)
    bad = {h: b for h, b in r["sent"].items() if b != want["bytes"]}
    if bad:
        raise RuntimeError(f"ours: a cold host got other than {want['bytes']} bytes: {bad}")
    verify(tb, hosts, f"{WORKDIR}/cache/trees/{tree.sha}", want, "ours", "! -name .orchestrate-tree")
    links = on_hosts(tb, hosts, f"readlink {WORKDIR}/{LINK}")
    bad = {h: v.strip() for h, v in links.items() if not v.strip().endswith(tree.sha)}
    if bad:
        raise RuntimeError(f"ours: the job link is wrong on {bad}")
    return r


def rnd(x, n=3):
    return round(x, n) if isinstance(x, float) else x


# ----------------------------------------------------------------------------------------- the lock

def take_lock(path: str, wait_s: float):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    t0 = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, time.monotonic() - t0
        except BlockingIOError:
            if time.monotonic() - t0 > wait_s:
                os.close(fd)
                raise SystemExit(f"bench_stage: {path} still held by another test run after {wait_s:.0f} s") from None
            if not told:
                print(f"waiting for {path} (another test run holds it) ...", flush=True)
                told = True
            time.sleep(0.5)


# ----------------------------------------------------------------------------------------- main

def summary(vals: list[float]) -> dict:
    return {"median": rnd(statistics.median(vals)), "min": rnd(min(vals)), "max": rnd(max(vals)), "n": len(vals)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size-mib", type=int, default=256, help="total size of the data set (MiB)")
    ap.add_argument("--small-files", type=int, default=2000)
    ap.add_argument("--small-kib", type=int, default=16)
    ap.add_argument("--large-files", type=int, default=7, help="large files sharing the rest of --size-mib")
    ap.add_argument("--base-ip", default="127.0.13.60")
    ap.add_argument("--port", type=int, default=2229)
    ap.add_argument("--user", default="root", help="login user on the hosts for every side (root's shell start-up "
                                                   "here runs pyenv init: ~0.12 s of CPU per remote command)")
    ap.add_argument("--python", default=None, help="the hosts' python for the stager (default: the private hosts' "
                                                   "/opt/hostenv/bin/python; a non-root --user needs e.g. "
                                                   "/usr/bin/python3: the venv's interpreter lies under /root)")
    ap.add_argument("--rsync-flags", default="-a", help="rsync's flags (SkyPilot adds -Pvz; -z only burns CPU on "
                                                         "incompressible data, so the default anchor is stronger)")
    ap.add_argument("--data", default=None, help="where to generate the data set (default /var/tmp/bench-stage-PID)")
    ap.add_argument("--no-direct", action="store_true", help="skip the ours_direct side (ssh.stage_relay: false)")
    ap.add_argument("--ref", default=None, metavar="REV",
                    help="add the side ours_ref: the stager as of git revision REV, paired with ours in every round")
    ap.add_argument("--keep", action="store_true", help="keep the data set")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "stage.json"))
    ap.add_argument("--no-lock", action="store_true", help=f"the caller already holds {LOCK}")
    ap.add_argument("--lock-wait-min", type=float, default=30.0, help="give up waiting for the lock after this")
    ap.add_argument("--lock-budget-min", type=float, default=14.0,
                    help="start no new round when the lock would be held longer than this")
    args = ap.parse_args()
    why = sshd_hosts.prerequisites(private=True)
    for tool in ("rsync", "pdcp", "pdsh", "ssh"):
        if why is None and shutil.which(tool) is None:
            why = f"{tool} not found"
    if why:
        print(f"bench_stage: {why}", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise Stop(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    data_root = Path(args.data or f"/var/tmp/bench-stage-{os.getpid()}")
    src = data_root / "data"
    tmp = Path(tempfile.mkdtemp(prefix="bench-stage-", dir="/var/tmp"))
    rsync_flags = shlex.split(args.rsync_flags)
    result: dict = {"machine": {"cores": os.cpu_count(), "loadavg_start": list(os.getloadavg())},
                    "hosts": args.hosts, "rounds": args.rounds, "user": args.user, "python": args.python,
                    "rsync_flags": rsync_flags, "port": args.port, "base_ip": args.base_ip}
    lock_fd = None
    runs: dict[str, list[dict]] = {k: [] for k in SIDES}
    noop_open: list[dict] = []
    noop_fresh: list[dict] = []
    exec_true: list[float] = []
    change: list[dict] = []
    tb = None
    try:
        t0 = now()
        info = make_data(src, args.small_files, args.small_kib, args.large_files, args.size_mib)
        want = {"files": info["files"], "bytes": info["bytes"]}
        result["data"] = dict(info, path=str(src), mib=round(info["bytes"] / (1 << 20), 2),
                              generate_s=rnd(now() - t0))
        print(f"data: {info['files']} files, {info['bytes'] / (1 << 20):.1f} MiB under {src} "
              f"({info['small_files']} x {args.small_kib} KiB + {info['large_files']} large)", flush=True)
        rels = st.list_root(src, use_git=False)
        assert len(rels) == info["files"], (len(rels), info["files"])
        cold = []
        cache = None
        for _ in range(3):  # files in the page cache, no hashes cached: what a first submit pays locally
            cache = st.HashCache(None)
            t = now()
            tree = st.make_tree("data", src, rels, cache)
            cold.append(now() - t)
        warm = []
        for _ in range(3):
            t = now()
            st.make_tree("data", src, rels, cache)
            warm.append(now() - t)
        result["local_hash_cold_s"] = summary(cold)
        result["local_hash_warm_s"] = summary(warm)
        print(f"local hashing of {info['bytes'] / (1 << 20):.0f} MiB: cold {statistics.median(cold):.3f} s, warm "
              f"(HashCache hit) {statistics.median(warm):.3f} s", flush=True)

        if not args.no_lock:
            lock_fd, waited = take_lock(LOCK, args.lock_wait_min * 60)
            result["lock_waited_s"] = rnd(waited, 1)
        t_lock = now()
        tb = sshd_hosts.up(args.hosts, tmp / "sshd", base_ip=args.base_ip, port=args.port, private=True,
                           user=args.user, hide=[str(tmp)])
        hosts = list(tb.hosts)
        block = tb.ssh_block(**({"python": args.python} if args.python else {}))
        cluster = parse_cluster({"kind": "ssh", "accelerator": "cpu", "ssh": block}, source="<bench>")
        relay_knob = "stage_relay" in getattr(cluster.ssh, "__dataclass_fields__", {})
        cluster_direct = parse_cluster({"kind": "ssh", "accelerator": "cpu", "ssh": dict(block, stage_relay=False)},
                                       source="<bench>") if relay_knob else None
        sides = SIDES if relay_knob and not args.no_direct else ("ours",) + ANCHORS
        ref = ref_stager(args.ref) if args.ref else None
        sides = tuple(k for k in sides if k != "ours_ref" or ref is not None)
        result["sides"] = list(sides)
        result["hosts_up_s"] = rnd(now() - t_lock)
        print(f"{len(hosts)} private hosts up in {result['hosts_up_s']} s: {hosts[0]}..{hosts[-1]} port {tb.port}",
              flush=True)

        # warm-up, not counted: a tiny copy by every side (ssh client, rsync, pdcp, paramiko, remote python)
        tiny = tmp / "tiny"
        (tiny / "d").mkdir(parents=True)
        (tiny / "d" / "x").write_bytes(b"x" * 100)
        wipe(tb, hosts)
        run_rsync_parallel(tb, tiny, hosts, rsync_flags)
        run_pdcp(tb, tiny, hosts)
        stage_once(cluster, tiny, ("d/x",), st.HashCache(None), hosts)
        wipe(tb, hosts)

        def side(name: str) -> dict:
            wipe(tb, hosts)
            if name in OURS:
                r = ours_cold(tb, cluster_direct if name == "ours_direct" else cluster, src, rels, cache, hosts, want,
                              engine=ref if name == "ours_ref" else st)
                r["s"] = r["stage_s"]
            else:
                if name == "rsync_serial":
                    dt = run_rsync_serial(tb, src, hosts, rsync_flags)
                elif name == "rsync_parallel":
                    dt = run_rsync_parallel(tb, src, hosts, rsync_flags)
                else:
                    dt = run_pdcp(tb, src, hosts)
                verify(tb, hosts, f"{ANCHOR_DIR}/data", want, name)
                r = {"s": dt}
            wipe(tb, hosts)  # the hosts' tmpfs is memory: one copy at a time
            return r

        round_s = []
        for i in range(args.rounds):
            spent = now() - t_lock
            est = max(round_s) if round_s else 0.0
            if i and spent + 1.2 * est + 60 > args.lock_budget_min * 60:
                print(f"stopping after {i} rounds: the lock has been held {spent:.0f} s (budget "
                      f"{args.lock_budget_min} min)", flush=True)
                break
            tr = now()
            order = sides[i % len(sides):] + sides[:i % len(sides)]
            for name in order:
                runs[name].append({k: rnd(v) for k, v in side(name).items() if not isinstance(v, dict)})
            round_s.append(now() - tr)
            o = runs["ours"][-1]
            print(f"round {i}: " + ", ".join(f"{k} {runs[k][-1]['s']:.2f}s" for k in sides)
                  + f"  (ours: hello {o['hello_s']:.2f} push {o['push_s']:.2f} close {o['close_s']:.2f}, relay hops ok "
                  f"{o['relay_hops_ok']}; order {','.join(order)})", flush=True)

        # nothing changed / one file changed: the hosts hold the data set (one cold stage, not counted)
        wipe(tb, hosts)
        ours_cold(tb, cluster, src, rels, cache, hosts, want)
        pool = Pool(cluster.ssh)
        try:
            bad = {h: r for h, r in pool.connect_all(hosts).items() if isinstance(r, Exception)}
            if bad:
                raise RuntimeError(f"connect: {bad}")
            n = max(1, len(runs["ours"]))
            for _ in range(n):
                t = now()  # the floor of any extra remote step: one `true` per host over the open connections
                res = pool.run_all("true", hosts)
                exec_true.append(now() - t)
                assert all(not isinstance(x, Exception) and x[0] == 0 for x in res.values()), res
                for box, p in ((noop_open, pool), (noop_fresh, None)):
                    r = stage_once(cluster, src, rels, cache, hosts, pool=p)
                    r.pop("tree")
                    r.pop("relay")
                    moved = sum(r["sent"].values())
                    assert moved == 0, f"nothing changed, yet {moved} bytes were sent: {r['sent']}"
                    box.append({k: rnd(v) for k, v in r.items() if not isinstance(v, dict)}
                               | {"sent_bytes": moved, "built": sum(r["built"].values())})
            smalls = [r for r in rels if r.startswith("small/")]
            for j in range(n):
                rel = smalls[(j * 397) % len(smalls)]
                f = src / rel
                size = f.stat().st_size
                f.write_bytes(os.urandom(size))
                r = stage_once(cluster, src, rels, cache, hosts, pool=pool)
                tree = r.pop("tree")
                r.pop("relay")
                bad = {h: (b, r["sent_files"][h]) for h, b in r["sent"].items() if b != size or r["sent_files"][h] != 1}
                assert not bad, f"one file of {size} bytes changed, yet hosts got (bytes, files) {bad}"
                got = on_hosts(tb, hosts, f"sha256sum {WORKDIR}/{LINK}/{rel}")
                want_sha = next(e[1] for e in tree.entries if e[0] == rel)
                assert all(v.split()[0] == want_sha for v in got.values()), got
                change.append({k: rnd(v) for k, v in r.items() if not isinstance(v, dict)}
                              | {"file": rel, "file_bytes": size, "sent_bytes_per_host": size,
                                 "built": sum(r["built"].values())})
        finally:
            pool.close()
        result["lock_held_s"] = rnd(now() - t_lock, 1)
    except (KeyboardInterrupt, Stop) as e:
        print(f"bench_stage: interrupted ({e or 'Ctrl-C'}); hosts going down", file=sys.stderr)
        return 130
    finally:
        if tb is not None or (tmp / "sshd" / sshd_hosts.STATE).exists():
            sshd_hosts.down(tmp / "sshd")
            if tb is not None and sshd_hosts.leftovers(tb):
                print(f"bench_stage: host processes left: {sshd_hosts.leftovers(tb)}", file=sys.stderr)
        if lock_fd is not None:
            os.close(lock_fd)
        shutil.rmtree(tmp, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(data_root, ignore_errors=True)

    result["machine"]["loadavg_end"] = list(os.getloadavg())
    done = len(runs["ours"])
    result["rounds_done"] = done
    sides = [k for k in SIDES if runs[k]]
    med = {k: statistics.median(r["s"] for r in runs[k]) for k in sides}
    result["cold_stage_s"] = {k: summary([r["s"] for r in runs[k]]) for k in sides}
    result["ours_phases_median_s"] = {k: rnd(statistics.median(r[k] for r in runs["ours"]))
                                      for k in ("rehash_s", "pool_s", "hello_s", "push_s", "close_s",
                                                "stage_from_stager_s", "with_rehash_s")}
    ratios: dict = {}
    for ours in (k for k in OURS if k in sides):
        for a in ANCHORS + tuple(k for k in ("ours_direct", "ours_ref") if ours == "ours" and k in sides):
            pr = sorted(o["s"] / x["s"] for o, x in zip(runs[ours], runs[a], strict=True))
            ratios.setdefault(ours, {})[a] = {"paired_median": rnd(statistics.median(pr)), "paired_min": rnd(pr[0]),
                                              "paired_max": rnd(pr[-1]), "ratio_of_medians": rnd(med[ours] / med[a])}
    result["relay_hops_ok"] = [r.get("relay_hops_ok") for r in runs["ours"]]
    best = min(ANCHORS, key=lambda a: med[a])
    result["ratios_ours_over"] = ratios
    ratios = ratios["ours"]
    # stricter: each round's own faster one of rsync_parallel and pdcp
    per_round = sorted(o["s"] / min(x["s"], y["s"])
                       for o, x, y in zip(runs["ours"], runs["rsync_parallel"], runs["pdcp"], strict=True))
    result["goal_cold"] = {"best_anchor": best, "paired_median": ratios[best]["paired_median"],
                           "goal": "<= 0.75", "met": ratios[best]["paired_median"] <= 0.75,
                           "vs_each_rounds_best_of_rsync_parallel_pdcp": {
                               "paired_median": rnd(statistics.median(per_round)), "paired_min": rnd(per_round[0]),
                               "paired_max": rnd(per_round[-1])}}
    mib = want["bytes"] / (1 << 20) * len(hosts)
    result["throughput_mib_s"] = {k: rnd(mib / med[k], 1) for k in sides}
    noop_total = [r["with_rehash_s"] for r in noop_open]
    result["noop"] = {"open_connections": {"stage_s": summary([r["stage_s"] for r in noop_open]),
                                           "with_rehash_s": summary(noop_total),
                                           "hello_s": summary([r["hello_s"] for r in noop_open]),
                                           "push_s": summary([r["push_s"] for r in noop_open]),
                                           "close_s": summary([r["close_s"] for r in noop_open])},
                      "fresh_pool": {"stage_s": summary([r["stage_s"] for r in noop_fresh]),
                                     "with_rehash_s": summary([r["with_rehash_s"] for r in noop_fresh])},
                      "sent_bytes": [r["sent_bytes"] for r in noop_open + noop_fresh],
                      "exec_true_open_s": summary(exec_true),
                      "note": "absolute session time; what staging adds to a submit: bench/bench_stage_submit.py",
                      "runs_open": noop_open, "runs_fresh": noop_fresh}
    result["one_file_changed"] = {"stage_s": summary([r["stage_s"] for r in change]),
                                  "with_rehash_s": summary([r["with_rehash_s"] for r in change]), "runs": change}
    result["runs"] = runs

    print()
    print(f"cold stage of {want['files']} files, {want['bytes'] / (1 << 20):.0f} MiB to {len(hosts)} private hosts, "
          f"{done} rounds interleaved (median [min-max] s; aggregate MiB/s):")
    for k in sides:
        c = result["cold_stage_s"][k]
        print(f"  {k:<15} {c['median']:7.2f}  [{c['min']:.2f}-{c['max']:.2f}]  {result['throughput_mib_s'][k]:7.1f}")
    for ours, rs in result["ratios_ours_over"].items():
        print(f"  {ours} / other, paired per round: " + "; ".join(
            f"{a} {r['paired_median']:.3f} [{r['paired_min']:.3f}-{r['paired_max']:.3f}]" for a, r in rs.items()))
    print(f"  relay hops ok per ours run: {result['relay_hops_ok']}")
    g = result["goal_cold"]
    print(f"  goal ours <= 0.75 x best anchor ({best}): {g['paired_median']:.3f} -> {'MET' if g['met'] else 'NOT met'}")
    pr = g["vs_each_rounds_best_of_rsync_parallel_pdcp"]
    print(f"  ours / each round's faster of rsync_parallel and pdcp: {pr['paired_median']:.3f} "
          f"[{pr['paired_min']:.3f}-{pr['paired_max']:.3f}]")
    ph = result["ours_phases_median_s"]
    print(f"  ours phases (median s): re-hash (warm) {ph['rehash_s']}, pool {ph['pool_s']}, hello {ph['hello_s']}, "
          f"push {ph['push_s']}, close {ph['close_s']}")
    c, w = result["local_hash_cold_s"], result["local_hash_warm_s"]
    print(f"  local hashing: cold {c['median']:.3f} s [{c['min']:.3f}-{c['max']:.3f}], warm {w['median']:.3f} s")
    no = result["noop"]
    oc, wr = no["open_connections"], no["open_connections"]["with_rehash_s"]
    print(f"nothing changed ({len(noop_open)}+{len(noop_fresh)} runs, 0 bytes moved each): open connections "
          f"{oc['stage_s']['median']:.3f} s (+ re-hash: {wr['median']:.3f} s [{wr['min']:.3f}-{wr['max']:.3f}]); "
          f"fresh pool {no['fresh_pool']['stage_s']['median']:.3f} s (absolute; what it adds to a submit: "
          "bench/bench_stage_submit.py)")
    et = no["exec_true_open_s"]
    print(f"  for scale: `true` on every host over the same open connections {et['median']:.3f} s "
          f"[{et['min']:.3f}-{et['max']:.3f}] (remote shell start-up as {args.user})")
    ch = result["one_file_changed"]
    print(f"one small file changed ({len(change)} runs, {change[0]['file_bytes'] if change else 0} bytes moved per "
          f"host): {ch['stage_s']['median']:.3f} s [{ch['stage_s']['min']:.3f}-{ch['stage_s']['max']:.3f}] "
          f"(+ re-hash {ch['with_rehash_s']['median']:.3f} s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
