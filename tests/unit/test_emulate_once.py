"""ORCHESTRATE_EMULATE (orchestrator.node.emulate) is parsed once by a node agent: one value decides both the check
before anything starts and what the agent runs. A real agent (`python -m orchestrator.node` as every backend starts
it, here through its main() in a process of its own) runs emulated ranks of a real plan's run dir, with the parser
counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core.plan import PlanFacts, make_plan
from orchestrator.core.render import render_files
from orchestrator.core.spec import parse_cluster, parse_recipe
from orchestrator.node.emulate import Emulation

REPO = Path(__file__).resolve().parents[2]

COUNTED_AGENT = """
import json, sys
sys.path.insert(0, {repo!r})
import orchestrator.node.emulate as emulate
import orchestrator.node.agent as agent
calls = []
real = emulate.parse
def counted(spec):
    calls.append(spec)
    return real(spec)
emulate.parse = counted
if hasattr(agent, "parse_emulate"):  # (an agent that imported the parser under its own name counts too)
    agent.parse_emulate = counted
code = agent.main(sys.argv[1:])
print("PARSED " + json.dumps(calls), flush=True)
sys.exit(code)
"""


def _run_dir(tmp_path: Path) -> Path:
    recipe = parse_recipe({"recipe": "sft", "model": {"name_or_path": "tiny"}, "data": {"path": "/data/x.jsonl"},
                           "trainer": {"max_steps": 2, "output_dir": str(tmp_path / "out")},
                           "launch": {"nodes": 1, "procs_per_node": 3}}, source="emu.yaml")
    facts = PlanFacts(job_id="emu-1", run_dir=str(tmp_path / "run"), output_dir=str(tmp_path / "out"),
                      python=sys.executable, port=29500, accelerator="cpu", profile_name="multi_gpu",
                      profile_config={"distributed_type": "MULTI_GPU"})
    plan = make_plan(recipe, parse_cluster({}), facts)
    run = tmp_path / "run"
    for rel, text in render_files(plan, recipe.to_dict()).items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    return run


def _agent(run: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", COUNTED_AGENT.format(repo=str(REPO)), str(run), "--node-rank", "0",
                           *extra], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**(env or {}), "PATH": "/usr/bin:/bin", "HOME": str(run)})


def _parsed(out: subprocess.CompletedProcess) -> list[str]:
    return json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("PARSED "))[7:])


def test_the_agent_parses_the_spec_once_and_runs_what_it_checked(tmp_path):
    run = _run_dir(tmp_path)
    out = _agent(run, "--emulate", "rate=20,steps=3")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert _parsed(out) == ["rate=20,steps=3"]  # was twice: the check, then again for the argv
    for g in range(3):  # the emulated ranks ran: every rank's steps, then its end
        recs = [json.loads(ln) for ln in (run / "heartbeats" / f"rank{g}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs if r["event"] == "step"] == [1, 2, 3] and recs[-1]["event"] == "end"
    # from the environment the same (SLURM's agents inherit it); a bad spec is refused before anything starts
    out = _agent(run, env={"ORCHESTRATE_EMULATE": "rate=20,steps=3,speed=9"})
    assert out.returncode == 2 and _parsed(out) == ["rate=20,steps=3,speed=9"], out.stdout + out.stderr
    assert "ORCHESTRATE_EMULATE: 'speed=9' is not one of rate=, steps=, die=" in out.stdout + out.stderr


def test_an_emulation_is_one_parsed_value():
    assert Emulation.of(None) is None and Emulation.of("") is None
    e = Emulation.of("rate=2,die=9@5")
    assert e is not None and dict(e.options) == {"rate": "2", "die": "9@5"}
    argv = e.argv([8, 9], python="/py")
    assert argv[0] == "/py" and argv[1].endswith("orchestrator/node/emulate.py") and argv[2:] == ["rate=2,die=9@5",
                                                                                               "8,9"]
    with pytest.raises(ValueError, match="'steps' is not one of"):
        Emulation.of("rate=1,steps")
