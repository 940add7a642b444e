"""The architecture rules (pyproject [tool.importlinter], docs/how-it-works.md "Layout") hold, and they bite.

scripts/lint.sh runs `lint-imports` too; this makes a plain pytest run catch a forbidden import as well.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
N_CONTRACTS = 7


def _lint_imports() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    if exe.exists():
        return str(exe)
    found = shutil.which("lint-imports")
    if not found:
        if os.environ.get("CI") == "true":
            pytest.fail("import-linter is not installed in CI (the [test] extra installs it)")
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    return found


def _run(cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "COLUMNS": "400"}  # one line per contract: "<name> KEPT|BROKEN"
    proc = subprocess.run([_lint_imports(), "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def test_import_contracts_kept():
    rc, out = _run(ROOT)
    assert rc == 0, f"lint-imports broke a contract:\n{out}"
    assert f"{N_CONTRACTS} kept, 0 broken" in out, out   # a contract silently dropped is a rule no longer checked


@pytest.mark.parametrize("module, line, contract", [
    ("orchestrator/node/heartbeat.py", "import paramiko", "orchestrator.node runs on a bare node"),
    ("orchestrator/node/heartbeat.py", "from orchestrator.core import spec", "orchestrator.node runs on a bare node"),
    ("orchestrator/core/hostlist.py", "from orchestrator import store", "orchestrator.core is pure"),
    ("recipes/callbacks.py", "from launchers import base", "recipes import no launcher"),
    ("orchestrator/store.py", "from orchestrator.cli import views", "orchestrator layers"),
    ("orchestrator/errors.py", "from orchestrator import types", "orchestrator layers"),
    ("orchestrator/newmodule.py", "import os", "orchestrator layers"),   # exhaustive: every module has a layer
    ("launchers/local.py", "from orchestrator import supervise", "launchers report events"),
    ("launchers/ssh/job.py", "from orchestrator.supervise import judge", "launchers report events"),
    ("orchestrator/supervise.py", "from launchers import local", "web > cli > client > gc/sweep > records > running"),
    ("orchestrator/node/agent.py", "import launchers", "web > cli > client > gc/sweep > records > running"),
    ("orchestrator/events.py", "from orchestrator import supervise", "orchestrator layers"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, contract):
    """A copy of the tree with one forbidden (lazy, function-level) import added, or a module no layer names:
    lint-imports must fail on it, naming the contract."""
    for name in ("orchestrator", "launchers", "recipes"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.jsonl"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text((target.read_text() if target.exists() else "") + f"\n\ndef _injected():\n    {line}\n")
    rc, out = _run(tmp_path)
    assert rc != 0, out
    broken = [ln for ln in out.splitlines() if ln.endswith(" BROKEN") or " BROKEN (" in ln]
    assert any(ln.startswith(contract) for ln in broken), out
