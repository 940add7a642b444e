"""What `--help` tells a newcomer (issue #37): every subcommand, option and positional has help text; the positional
of submit/render is named `job` (a recipe or a `run:` job file); `render --help` says what it writes besides its
directory; `python -m orchestrator.node --help` shows its own name; docs/CONTRACT.md says what `accelerator: auto` is
on SLURM, as the code decides it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from orchestrator.api import detect_accelerator
from orchestrator.cli.main import build_parser
from orchestrator.core.spec import parse_cluster

REPO = Path(__file__).resolve().parents[2]


def _parsers(parser: argparse.ArgumentParser, name: str = "orchestrate"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions}
            assert set(action.choices) == helped, f"{name}: subcommands without help: {set(action.choices) - helped}"
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_option_and_positional_of_every_subcommand_has_help():
    missing = [f"{name}: {'/'.join(a.option_strings) or a.dest}" for name, p in _parsers(build_parser())
               for a in p._actions if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
    assert missing == []


def test_the_positional_of_submit_and_render_is_the_job():
    subs = dict(_parsers(build_parser()))
    for name in ("orchestrate submit", "orchestrate render"):
        p = subs[name]
        assert p.format_usage().rstrip().endswith("job [key=value ...]"), p.format_usage()
        assert "run:" in p.format_help() and "recipe" in p.format_help()


def test_render_help_says_what_it_writes_besides_its_directory():
    text = " ".join(dict(_parsers(build_parser()))["orchestrate render"].format_help().split())
    assert "touches nothing" not in text and "$ORCHESTRATE_HOME/cache" in text, text


def test_the_node_agent_help_shows_its_own_name():
    r = subprocess.run([sys.executable, "-m", "orchestrator.node", "--help"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m orchestrator.node ["), r.stdout[:200]


def test_contract_says_what_auto_accelerator_is_on_slurm():
    assert detect_accelerator(parse_cluster({"kind": "slurm", "slurm": {}})) == "cpu"
    assert detect_accelerator(parse_cluster({"kind": "slurm", "slurm": {"gpus_per_node": 4}})) == "gpu"
    assert detect_accelerator(parse_cluster({"kind": "ssh", "ssh": {"hosts": ["h"]}})) == "gpu"
    line = next(x for x in (REPO / "docs" / "CONTRACT.md").read_text().splitlines() if x.startswith("accelerator: "))
    assert "ssh: gpu" in line and "slurm: gpu when slurm.gpus_per_node > 0, else cpu" in line, line
