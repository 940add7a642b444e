"""docs/CONTRACT.md cannot drift from the schema: every key of a job file (recipe or own code) and of a cluster file,
walked from the spec dataclasses the validator itself reads (orchestrator.core.schema.rules), appears in the
contract's marked YAML blocks with its default, and every key those blocks show is a key of the schema. Dotted keys
named in the prose of README.md and docs/*.md (`health.straggler.window`, `ssh.shared_fs: true`) must exist too.
The logic is scripts/contract_keys.py, which prints what is missing or extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("contract_keys", ROOT / "scripts" / "contract_keys.py")
assert _spec and _spec.loader
ck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ck)

CONTRACT = (ROOT / "docs" / "CONTRACT.md").read_text()


def test_contract_documents_every_schema_key_with_its_default():
    missing, problems = ck.check(CONTRACT)
    assert not missing, ("keys of the schema that docs/CONTRACT.md does not show (add them, with their default, to "
                         "a block marked <!-- schema: ... -->):\n" + "\n".join(missing))
    assert not problems, "docs/CONTRACT.md disagrees with the schema:\n" + "\n".join(problems)


def test_prose_names_only_keys_that_exist():
    bad = ck.all_prose_problems()
    assert not bad, "docs name keys the schema does not have:\n" + "\n".join(bad)


def test_walk_covers_every_file_kind():
    """The walk reaches the blocks added since the contract was first written (a broken walk would pass any doc)."""
    keys = {f"{c}.{k}" for c, k in ck.all_schema_keys()}
    for key in ("LaunchSpec.procs_per_node", "RunSpec.script", "RunSpec.trl", "SSHSpec.stage", "SSHSpec.hostfile",
                "ContainerSpec.image", "StragglerSpec.window", "NotifySpec.webhook_env", "CheckpointSpec.resume",
                "SlurmSpec.exclude", "OutputsSpec.fetch", "HealthSpec.preflight_timeout", "ClusterSpec.gpus"):
        assert key in keys, key
    assert ck.all_schema_keys()[("LaunchSpec", "procs_per_node")] == "auto"
    assert len(ck.doc_blocks(CONTRACT)) >= 5


def test_check_finds_missing_extra_and_wrong_defaults():
    doc = "<!-- schema: recipe -->\n```yaml\nlaunch:\n  procs_per_node: 1\n  nodez: 2\n```\n"
    missing, problems = ck.check(doc)
    assert "missing: HealthSpec.stall_timeout (default 300)" in missing
    assert any("wrong default: launch.procs_per_node" in p and "'auto'" in p for p in problems), problems
    assert any("extra: launch.nodez" in p for p in problems), problems
    doc = "<!-- schema: cluster -->\n```yaml\nssh: {port: 22, stage_relay: true}\ncontainer: null\n```\n"
    missing, problems = ck.check(doc)
    assert not problems and "missing: SSHSpec.port (default 22)" not in missing
    assert ck.prose_keys("set `health.straggler.windw: 5` or `ssh.shared_fs: true`", "x") == [
        "x:1: `health.straggler.windw: 5` names health.straggler.windw, which is no key of a job or cluster file"]
    assert ck.prose_keys("`trainer.warmup_steps=-5`, `run.args.lr=1`, `cluster.slurm.python=X`, `plan.json`", "x") == []


def test_script_prints_and_exits_zero():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "contract_keys.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "documents all" in p.stdout
