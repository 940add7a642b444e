"""Submits a prepared run dir over SSH in its own process (so tests can SIGKILL / SIGINT the submitter).

usage: python tests/ssh/submit_driver.py CLUSTER_JSON LOCAL_RUN_DIR
Prints `SUBMITTED {handle data}` once every agent runs, the nodes' lines, then `RESULT {...}`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.core.jobplan import LaunchPlan
from orchestrator.core.spec import parse_cluster
from launchers.ssh.launcher import SSHLauncher
from orchestrator.node.rundir import RunDir
from orchestrator.supervise import Supervisor


def main() -> int:
    cluster = parse_cluster(json.loads(sys.argv[1]), source="<driver>")
    local = Path(sys.argv[2])
    launcher = SSHLauncher(cluster, grace_s=1.0)
    plan = LaunchPlan.from_json((local / "plan.json").read_text())
    job = launcher.submit(launcher.prepare(plan), RunDir(local))
    print("SUBMITTED " + json.dumps(job.handle.data), flush=True)
    result = Supervisor(plan, on_line=lambda r, line: print(f"[node{r}] {line}", flush=True)).run(job)
    print("RESULT " + json.dumps({"state": result.state, "returncode": result.returncode,
                                  "root_cause": result.root_cause}), flush=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
