"""Suite-wide settings: offline Hugging Face, a private ORCHESTRATE_HOME per session, markers' skip rules, and
`job_guard`: every test that starts a job takes it, so whatever the job left is killed when the test ends
(helpers.JobGuard), whether it passed, failed or timed out."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "tests") not in sys.path:  # `from helpers import ...` from every suite
    sys.path.insert(0, str(REPO / "tests"))
for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(k, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ORCHESTRATE_CACHE", str(Path.home() / ".cache" / "orchestrate"))


@pytest.fixture(autouse=True, scope="session")
def _orchestrate_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("orchestrate_home")
    old = os.environ.get("ORCHESTRATE_HOME")
    os.environ["ORCHESTRATE_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("ORCHESTRATE_HOME", None)
    else:
        os.environ["ORCHESTRATE_HOME"] = old


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny Llama's local directory (built once, offline)."""
    from recipes.tiny import resolve_model_path
    return resolve_model_path("tiny-llama")


@pytest.fixture
def job_guard(request, _orchestrate_home):
    """A helpers.JobGuard for this test, already watching $ORCHESTRATE_HOME (new jobs there are this test's).
    Register more with guard.home(path) / run_dir(path) / token(t) / proc(p) / spawn(argv). At the end it kills
    what is left: children, supervisors, `python -m orchestrator.node RUN_DIR --kill` per run dir, tokens."""
    from helpers import JobGuard
    guard = JobGuard()
    guard.home(os.environ.get("ORCHESTRATE_HOME", _orchestrate_home))
    yield guard
    found = guard.teardown()
    if found:
        rep = getattr(request.node, "rep_call", None)
        msg = "job_guard killed what the test's jobs left: " + "; ".join(found)
        print(msg, file=sys.stderr)
        if rep is not None and rep.passed:  # a passing test that leaks processes is worth a warning
            import warnings
            warnings.warn(pytest.PytestWarning(msg), stacklevel=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ORCHESTRATE_SKIP_GPU_TESTS_OK", "1") != "1":
        return
    import shutil
    has_gpus = shutil.which("nvidia-smi") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpus:
            item.add_marker(pytest.mark.skip(reason="needs >= 2 CUDA GPUs (none on this machine)"))


PYTHON = sys.executable
