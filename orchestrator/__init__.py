"""orchestrate: multi-node LLM training jobs on local, SSH and SLURM clusters.

The public Python API (docs/api.md) is what `__all__` names: `submit`, `Job`, `sweep`, `Sweep`, `jobs`, `render`,
their typed results and errors. Importing this package is cheap on purpose: those names are loaded on first use
(orchestrator.client), and heavy libraries (torch, transformers, trl, deepspeed, paramiko, submitit) are imported
lazily by the modules that need them.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "submit", "Job", "sweep", "Sweep", "jobs", "render",
    "Status", "NodeStatus", "RankStatus", "Result", "Rendered",
    "ConfigError", "Problem", "JobFailed", "OrchestratorError",
]

_FROM = {"ConfigError": "orchestrator.errors", "Problem": "orchestrator.errors",
         "OrchestratorError": "orchestrator.errors"}

def __getattr__(name: str) -> object:
    """The public names, imported on first use (PEP 562): `import orchestrator` stays cheap."""
    if name not in __all__:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_FROM.get(name, "orchestrator.client")), name)
    globals()[name] = value
    return value

def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

