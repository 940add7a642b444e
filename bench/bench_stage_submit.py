#!/usr/bin/env python3
"""What staging adds to a submit when nothing changed (issue #13; not CI): the SSH launcher's submit (connect,
pre-flight, staging, copy, go: until every agent was told to start) of the tiny SFT on N nodes, `shared_fs: true`
(nothing staged or shipped: the hosts see the submitter's files) vs `shared_fs: false` with a warm cache (the node
package and the data already on the hosts: a resubmit), interleaved, same hosts, same run. Each job is stopped right
after its start.

    python bench/bench_stage_submit.py [--repeat 7] [--hosts 2]

Reports each side's median, the paired differences (staged - shared) median and range, and the bytes the staged
submits moved (must be 0). Goal: <= 0.3 s above a submit without staging. Results: bench/results/stage_submit.json.
Needs root and openssh-server (scripts/install_ssh_deps.sh); loopback hosts from 127.0.17.2, port 2230.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--hosts", type=int, default=2, help="nodes (one per host)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "stage_submit.json"))
    args = ap.parse_args()
    import sshd_hosts
    import yaml

    from orchestrator import api
    from launchers.ssh.launcher import SSHLauncher
    from orchestrator.node.rundir import RunDir
    tmp = Path(tempfile.mkdtemp(prefix="bench-stage-submit-", dir="/var/tmp"))
    os.environ["ORCHESTRATE_HOME"] = str(tmp / "home")
    tb = sshd_hosts.up(args.hosts, tmp / "sshd", base_ip="127.0.17.2", port=2230)
    clusters = {}
    for mode, shared in (("shared", True), ("staged", False)):
        block = tb.ssh_block(shared_fs=shared, workdir=str(tmp / mode / "{host}"))
        clusters[mode] = tmp / f"{mode}.yaml"
        clusters[mode].write_text(yaml.safe_dump({"kind": "ssh", "name": mode, "accelerator": "cpu",
                                                  "network_interface": "lo", "ssh": block}))

    def submit(mode: str) -> tuple[float, dict]:
        prep = api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(clusters[mode]), nodes=args.hosts, cwd=REPO,
                           overrides=[f"trainer.output_dir={tmp / 'out' / mode}"])
        rd = RunDir(prep.plan.run_dir)
        api.write_files(prep.files, rd.root)
        launcher = SSHLauncher(prep.cluster)
        sub = launcher.prepare(prep.plan)
        t0 = time.perf_counter()
        job = launcher.submit(sub, rd)
        took = time.perf_counter() - t0
        job.stop("benchmark", 1.0)
        for n in job.node_list:
            n.done.wait(30)
        job.close()
        staged = rd.read_json("staged.json") if mode == "staged" else {}
        return took, staged if isinstance(staged, dict) else {}

    rows: list[dict] = []
    try:
        submit("staged")  # the cold stage: the package and the data reach the hosts once
        for i in range(args.repeat):
            order = ("shared", "staged") if i % 2 == 0 else ("staged", "shared")
            row: dict = {}
            for mode in order:
                row[mode], info = submit(mode)
                if mode == "staged":
                    row["sent_bytes"] = info.get("sent_bytes")
                    row["stage_s"] = info.get("seconds")
            rows.append(row)
            print(f"round {i}: shared {row['shared']:.3f} s, staged {row['staged']:.3f} s "
                  f"(staging {row['stage_s']:.3f} s, {row['sent_bytes']} bytes sent)", flush=True)
    finally:
        sshd_hosts.down(tmp / "sshd")
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    diffs = [r["staged"] - r["shared"] for r in rows]
    res = {"rounds": rows, "shared_median_s": statistics.median(r["shared"] for r in rows),
           "staged_median_s": statistics.median(r["staged"] for r in rows),
           "paired_diff_median_s": statistics.median(diffs), "paired_diff_range_s": [min(diffs), max(diffs)],
           "bytes_moved": sorted({r["sent_bytes"] for r in rows}), "goal_s": 0.3,
           "met": statistics.median(diffs) <= 0.3 and all(r["sent_bytes"] == 0 for r in rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
