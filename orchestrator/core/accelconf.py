"""The text of a node's accelerate config file (what `accelerate launch --config_file` loads).

Shared by the planner's dry-run rendering (orchestrator.core.render) and the node agent, which writes the file at
launch time once it knows its rank and the main address: a small module, so the agent's start does not import
the planner.
"""

from __future__ import annotations

from typing import Any

HEADER = ("# Rendered by orchestrate for job {job}, node {rank} of {nodes}. "
          "Loaded by `accelerate launch --config_file`.\n")


def to_yaml(data: Any) -> str:
    import yaml
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml: ~10x faster for 1000s of nodes
    return yaml.dump(data, Dumper=dumper, sort_keys=True, default_flow_style=False, width=120, allow_unicode=True)


def accelerate_config_text(config: dict[str, Any], job: str, rank: int, nodes: int) -> str:
    return HEADER.format(job=job, rank=rank, nodes=nodes) + to_yaml(config)
