#!/usr/bin/env python3
"""SSH fan-out benchmark (not CI): `true` on N loopback sshd hosts, ours (paramiko pool) vs pdsh tuned.

    python bench/bench_ssh.py [--hosts 64 256] [--repeat 5] [--user orchbench] [--base-ip 127.1.0.2]

Per N: median of `repeat` runs of connect+exec+close of `true` on every host, ours vs
`pdsh -R ssh` with `-o KexAlgorithms=curve25519-sha256` (PDSH_SSH_ARGS_APPEND), their ratio (goal <= 0.75
at 256), and exec over already-open connections (goal <= 1 s for 256). Hosts run as a non-root user
(root's shell start-up costs ~130 ms here). Needs root (to start sshd) and pdsh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import sshd_hosts  # noqa: E402
from orchestrator.core.spec import SSHSpec  # noqa: E402
from launchers.ssh.transport import Pool  # noqa: E402


def ours(tb, hosts) -> float:
    t0 = time.perf_counter()
    pool = Pool(SSHSpec(port=tb.port, user=tb.user, key=tb.key, known_hosts=tb.known_hosts, connect_timeout=30))
    bad = [h for h, c in pool.connect_all(hosts).items() if isinstance(c, Exception)]
    res = pool.run_all("true", hosts)
    pool.close()
    dt = time.perf_counter() - t0
    fails = bad + [h for h, r in res.items() if isinstance(r, Exception) or r[0] != 0]
    if fails:
        raise RuntimeError(f"ours failed on {fails[:3]}")
    return dt


def exec_open(tb, hosts) -> float:
    pool = Pool(SSHSpec(port=tb.port, user=tb.user, key=tb.key, known_hosts=tb.known_hosts, connect_timeout=30))
    pool.connect_all(hosts)
    t0 = time.perf_counter()
    res = pool.run_all("true", hosts)
    dt = time.perf_counter() - t0
    pool.close()
    assert all(not isinstance(r, Exception) and r[0] == 0 for r in res.values())
    return dt


def pdsh(tb, hosts) -> float:
    env = dict(os.environ, PDSH_SSH_ARGS_APPEND=" ".join(tb.ssh_options()))
    t0 = time.perf_counter()
    p = subprocess.run(["pdsh", "-R", "ssh", "-f", "256", "-l", tb.user, "-w", ",".join(hosts), "true"], env=env,
                       capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"pdsh failed: {p.stderr[-300:]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--user", default="orchbench")
    ap.add_argument("--base-ip", default="127.1.0.2")
    ap.add_argument("--port", type=int, default=2222)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench-ssh-"))
    tb = sshd_hosts.up(max(a.hosts), d, base_ip=a.base_ip, port=a.port, user=a.user, timeout=60)
    try:
        print(f"{'hosts':>5} {'ours s':>8} {'pdsh s':>8} {'ratio':>6} {'exec-open s':>11}")
        for n in a.hosts:
            hosts = tb.hosts[:n]
            o = statistics.median(ours(tb, hosts) for _ in range(a.repeat))
            p = statistics.median(pdsh(tb, hosts) for _ in range(a.repeat))
            e = statistics.median(exec_open(tb, hosts) for _ in range(a.repeat))
            print(f"{n:>5} {o:>8.2f} {p:>8.2f} {o / p:>6.2f} {e:>11.2f}", flush=True)
    finally:
        sshd_hosts.down(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
