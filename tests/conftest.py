"""Suite-wide settings: offline Hugging Face, a private ORCHESTRATE_HOME per session, markers' skip rules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
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


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ORCHESTRATE_SKIP_GPU_TESTS_OK", "1") != "1":
        return
    import shutil
    has_gpus = shutil.which("nvidia-smi") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpus:
            item.add_marker(pytest.mark.skip(reason="needs >= 2 CUDA GPUs (none on this machine)"))


PYTHON = sys.executable
