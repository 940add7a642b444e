"""Where the files orchestrate ships are: found through the installed packages (importlib.resources), never relative
to a source checkout, so a plain `pip install` works from any directory.

What ships (package data of the wheel, the same folders as the checkout's):
- `cluster_configs/`: the cluster files (`local.yaml`, the examples) and `profiles/<name>.yaml`, the accelerate
  profiles under TRL's names (core.schema.PROFILES);
- `recipes/`: the built-in recipes, their `configs/*.yaml` and `data/*.jsonl`;
- `orchestrator/` (the node package with its zero-code hooks) and `recipes/`: what a node runs, a container mounts
  and SSH staging ships, all under `package_root()`.

A relative path a user gives under `recipes/` or `cluster_configs/` (`recipes/configs/sft_tiny.yaml`, the data path
inside it) is the file in the working directory when there is one, else the one shipped (`given_or_shipped`).
Standard library only: the node agent imports this too.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = ("recipes", "cluster_configs")  # top-level folders whose files a user may name by their checkout path


def _package_dir(name: str) -> Path:
    from importlib.resources import files  # (~20 ms: only where asked, not in every node agent's start)
    return Path(str(files(name))).resolve()


def package_root() -> Path:
    """The directory holding the `orchestrator` and `recipes` packages (site-packages, or an editable checkout)."""
    return _package_dir("orchestrator").parent


def profile_path(name: str) -> Path:
    """The accelerate profile shipped under `name` (one of core.schema.PROFILES)."""
    return _package_dir("cluster_configs") / "profiles" / f"{name}.yaml"


def shipped(path: str | Path) -> Path | None:
    """The shipped file a relative path `recipes/...` or `cluster_configs/...` names, or None."""
    parts = Path(path).parts
    if len(parts) < 2 or parts[0] not in SHIPPED or ".." in parts:
        return None
    found = _package_dir(parts[0]).joinpath(*parts[1:])
    return found if found.is_file() else None


def given_or_shipped(path: str, cwd: Path) -> str:
    """`path` as given when it is absolute or exists under `cwd`; else the shipped file it names (absolute); else
    `path` as given (whoever reads it reports it missing)."""
    if Path(path).expanduser().is_absolute() or (cwd / path).exists():
        return path
    found = shipped(path)
    return str(found) if found is not None else path
