"""Pure rendering: LaunchPlan (+ resolved recipe) -> the files of a run dir, and the human summary.

`render_files` returns {relative path: text}; writing them is the caller's job. Deterministic:
sorted keys, no timestamps, so golden files compare byte for byte. Secret values never pass through
here: only their names, shown masked.
"""

from __future__ import annotations

from typing import Any

from orchestrator.core.accelconf import HEADER, accelerate_config_text, to_yaml as _yaml
from orchestrator.core.jobplan import LaunchPlan
from orchestrator.core.plan import command_line

def node_accelerate_yaml(plan: LaunchPlan, rank: int) -> str:
    node = plan.node(rank)
    return accelerate_config_text(node.accelerate_config, plan.job_id, rank, plan.nodes)


def node_command_text(plan: LaunchPlan, rank: int) -> str:
    node = plan.node(rank)
    lines = [f"# node {rank} ({node.host or 'host chosen by the scheduler'}), global ranks "
             f"{node.ranks[0]}..{node.ranks[-1]}", "# environment added for the ranks:"]
    for k, v in node.env.items():
        lines.append(f"{k}={command_line([v])}")
    for name in plan.secret_env:
        lines.append(f"{name}=***  # secret, passed from the submit environment, never written")
    lines.append("# command (run by `python -m orchestrator.node.agent RUN_DIR --node-rank "
                 f"{rank}`, in its own process group):")
    lines.append(command_line(node.command))
    return "\n".join(lines) + "\n"


def render_files(plan: LaunchPlan, recipe_dict: dict[str, Any]) -> dict[str, str]:
    files = {"plan.json": plan.to_json(), "recipe.yaml": _yaml(recipe_dict)}
    # Nodes differ only in machine_rank: dump once, substitute the rank line (same bytes as dumping each).
    template = _yaml(dict(plan.node_plans[0].accelerate_config, machine_rank="__MACHINE_RANK__"))
    same_shape = all(dict(n.accelerate_config, machine_rank=0) == dict(plan.node_plans[0].accelerate_config,
                                                                        machine_rank=0) for n in plan.node_plans)
    for node in plan.node_plans:
        r = node.node_rank
        if same_shape:
            body = template.replace("machine_rank: __MACHINE_RANK__\n", f"machine_rank: {r}\n")
            files[f"nodes/{r}/accelerate.yaml"] = HEADER.format(job=plan.job_id, rank=r, nodes=plan.nodes) + body
        else:
            files[f"nodes/{r}/accelerate.yaml"] = node_accelerate_yaml(plan, r)
        files[f"nodes/{node.node_rank}/command.txt"] = node_command_text(plan, node.node_rank)
    return files


def summary(plan: LaunchPlan, max_nodes_shown: int = 8) -> str:
    par = plan.parallelism
    extra = ", ".join(f"{k}={v}" for k, v in par.items() if v > 1 and k != "dp_shard")
    tok = "unknown"
    if plan.tokens_per_step is not None:
        tok = f"{plan.tokens_per_step:,}" + ("" if plan.tokens_per_step_exact else " (at most; exact with packing)")
    lines = [
        f"job        {plan.job_id}  ({plan.recipe} recipe '{plan.recipe_name}', {plan.cluster_kind} cluster "
        f"'{plan.cluster_name}', {plan.accelerator})",
        f"profile    {plan.profile} -> {plan.distributed_type}" + (f"  [{extra}]" if extra else ""),
        f"world      {plan.nodes} node(s) x {plan.procs_per_node} process(es) = {plan.world_size} "
        f"(data parallel {plan.data_parallel_size})",
        f"batch      {plan.per_device_batch} per device x {plan.grad_accum} accumulation x "
        f"{plan.data_parallel_size} = {plan.effective_batch} sequences per optimizer step",
        f"tokens     {tok} per step" + (f" (max_length {plan.max_length})" if plan.max_length else ""),
        f"rendezvous {plan.main_host}:{plan.port}",
        f"output     {plan.output_dir}",
    ]
    shown = plan.node_plans[:max_nodes_shown]
    for node in shown:
        lines.append(f"  node {node.node_rank:<4} host {node.host or '(scheduler)':<20} machine_rank "
                     f"{node.accelerate_config.get('machine_rank')}  ranks {node.ranks[0]}-{node.ranks[-1]}")
    if len(plan.node_plans) > len(shown):
        lines.append(f"  ... and {len(plan.node_plans) - len(shown)} more nodes")
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
