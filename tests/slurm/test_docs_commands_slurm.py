"""Docs that run, on the SLURM testbed: the commands the docs show with the annotation `doc-test: slurm`
(cluster_configs/slurm_local.yaml's own submit) run VERBATIM against the testbed cluster (scripts/slurm_cluster.sh,
the `slurm_cluster` fixture), as tests/local_backend/test_docs_commands_run.py runs the others (tests/doccommands.py:
the environment, the variables). Marked `slurm`: skipped without the testbed, failed under CI=true without it."""

from __future__ import annotations

import pytest
from doccommands import Shown, collect, doc_env, run_shown

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

SLURM_SHOWN = [s for s in collect()[0] if s.action == "slurm"]


@pytest.mark.parametrize("shown", SLURM_SHOWN, ids=[f"{s.where} {s.text}"[:90] for s in SLURM_SHOWN])
def test_shown_slurm_command_runs_verbatim(shown: Shown, slurm_cluster, tmp_path, job_guard):
    home = job_guard.home(tmp_path / "home")
    rc, out, variables, took = run_shown([shown], doc_env(home), tmp_path, timeout=540)[shown]
    assert rc == shown.exit_code, (f"{shown.where}: `{shown.text}` exited {rc} on the SLURM testbed ({took:.1f} s): "
                                   f"fix the doc\n{out[-3000:]}")
    assert "COMPLETED" in out, out[-3000:]
