"""Pure rendering: LaunchPlan (+ resolved recipe) -> the files of a run dir, and the human summary.

`render_files` returns {relative path: text}; writing them is the caller's job. Deterministic:
sorted keys, no timestamps, so golden files compare byte for byte. Secret values never pass through
here: only their names, shown masked.
"""

from __future__ import annotations

from typing import Any

from orchestrator.core.accelconf import HEADER, accelerate_config_text, to_yaml as _yaml
from orchestrator.core.container import PACKAGE_VAR, container_argv_shown
from orchestrator.core.jobplan import AGENT_ENV, LATE_IFNAME, RUN_DIR_VAR, LaunchPlan
from orchestrator.core.plan import command_line

def node_accelerate_yaml(plan: LaunchPlan, rank: int) -> str:
    node = plan.node(rank)
    return accelerate_config_text(node.accelerate_config, plan.job_id, rank, plan.nodes)


def node_command_text(plan: LaunchPlan, rank: int) -> str:
    node = plan.node(rank)
    lines = [f"# node {rank} ({node.host or 'host chosen by the scheduler'}), global ranks "
             f"{node.ranks[0]}..{node.ranks[-1]}", "# environment added for the ranks:"]
    passed = set(plan.env_passthrough)
    for k, v in node.env.items():
        shown = plan.run_dir + v[len(RUN_DIR_VAR):] if v.startswith(RUN_DIR_VAR) else v
        lines.append(f"{k}={command_line([shown])}" + _env_note(plan, k, v, k in passed))
    for name in plan.secret_env:
        lines.append(f"{name}=***  # secret, passed from the submit environment, never written")
    lines.append(f"# command (run by the node agent, `python -m orchestrator.node RUN_DIR --node-rank {rank}`, in its "
                 f"own process group; {RUN_DIR_VAR} is where the run dir is on the node, here {plan.run_dir}):")
    lines.append(command_line([plan.run_dir + a[len(RUN_DIR_VAR):] if a.startswith(RUN_DIR_VAR) else a
                               for a in node.command]))
    cp = plan.container
    if cp is not None:
        def bind(a: str) -> str:
            return plan.run_dir + a[len(RUN_DIR_VAR):] if a.startswith(RUN_DIR_VAR) else a
        if cp.agent_side:
            names = sorted(set(node.env) | set(AGENT_ENV) | set(plan.secret_env))
            argv = container_argv_shown(cp, [bind(a) for a in node.command], job_id=plan.job_id, node_rank=rank,
                                        run_dir=plan.run_dir, cwd=bind(plan.rank_cwd), env_names=names)
            lines.append(f"# ... which runs in the container ({cp.runtime}, image {cp.image}): the node agent stays "
                         f"outside and runs exactly this ({PACKAGE_VAR}: where the node package is on the node):")
            lines.append(command_line(argv))
        else:
            lines.append(f"# ... in the container ({cp.runtime}, image {cp.image}): the task step's srun carries the "
                         "--container-* flags (job.sbatch), the node agent runs inside")
    return "\n".join(lines) + "\n"


def _env_note(plan: LaunchPlan, name: str, value: str, passed: bool) -> str:
    """A comment after an env line whose value the node binds or that came from the submit environment."""
    if value == LATE_IFNAME:
        return "  # bound on the node: the interface that routes to the main node (network_interface: auto)"
    if name == "CUDA_VISIBLE_DEVICES" and plan.cluster_kind == "slurm":
        return "  # indices into the GPUs SLURM allocates to the node (mapped through its CUDA_VISIBLE_DEVICES)"
    if passed:
        return "  # from the submit environment (launch.env_passthrough)"
    return ""


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


def bound_command(plan: LaunchPlan, rank: int) -> str:
    """Node `rank`'s command as one shell line, with the run dir's placeholder bound to `plan.run_dir`."""
    return command_line([plan.run_dir + a[len(RUN_DIR_VAR):] if a.startswith(RUN_DIR_VAR) else a
                         for a in plan.node(rank).command])


def _passes_output_dir(plan: LaunchPlan) -> bool:
    return any(w == "--output_dir" or w.startswith("--output_dir=") for w in plan.node(0).command)


def summary(plan: LaunchPlan, max_nodes_shown: int = 8) -> str:
    par = plan.parallelism
    extra = ", ".join(f"{k}={v}" for k, v in par.items() if v > 1 and k != "dp_shard")
    tok = "unknown"
    if plan.tokens_per_step is not None:
        tok = f"{plan.tokens_per_step:,}" + ("" if plan.tokens_per_step_exact else " (at most)" if plan.run_kind in
                                             ("script", "module") else " (at most; exact with packing)")
    own = plan.run_kind != "recipe"
    what = (f"own code: {plan.run_kind} {plan.run_target}, job '{plan.recipe_name}'" if own
            else f"{plan.recipe} recipe '{plan.recipe_name}'")
    if plan.effective_batch is not None:
        batch = (f"{plan.per_device_batch} per device x {plan.grad_accum} accumulation x {plan.data_parallel_size} = "
                 f"{plan.effective_batch} sequences per optimizer step")
    else:
        batch = ("set by your code (run.args carry no per_device_train_batch_size / gradient_accumulation_steps; "
                 f"data parallel {plan.data_parallel_size})")
    lines = [
        f"job        {plan.job_id}  ({what}, {plan.cluster_kind} cluster '{plan.cluster_name}', {plan.accelerator})",
        f"profile    {plan.profile} -> {plan.distributed_type}" + (f"  [{extra}]" if extra else ""),
        f"world      {plan.nodes} node(s) x {plan.procs_per_node} process(es) = {plan.world_size} "
        f"(data parallel {plan.data_parallel_size})",
        f"batch      {batch}",
        f"tokens     {tok} per step" + (f" (max_length {plan.max_length})" if plan.max_length else ""),
        f"rendezvous {plan.main_host}:{plan.port}" + _network(plan),
        f"output     {plan.output_dir}" + ("  (your code is not told: run.args carry no --output_dir)"
                                          if own and not _passes_output_dir(plan) else ""),
    ]
    if plan.cluster_kind == "ssh":
        lines.append(f"hosts      {', '.join(n.host for n in plan.node_plans)} run the job; "
                     + (f"spares (wait, take a failed host's place): {', '.join(plan.spare_hosts)}"
                        if plan.spare_hosts else "no spare hosts"))
    gpus = _gpus(plan)
    if gpus:
        lines.append(f"gpus       {gpus}")
    cp = plan.container
    if cp is not None:
        where = ("the task step runs in it (the node agent too)" if not cp.agent_side else
                 "each node agent starts the launcher in it")
        lines.append(f"container  {cp.runtime}, image {cp.image}: {where}; node package read-only at "
                     f"/opt/orchestrate" + (f"; mounts {', '.join(m.text() for m in cp.mounts)}" if cp.mounts else ""))
    if plan.env_passthrough:
        lines.append("env        from the submit environment (launch.env_passthrough): "
                     + ", ".join(plan.env_passthrough))
    if own:
        lines.append(f"command    {bound_command(plan, 0)}" +
                     (f"  (node R: nodes/R/accelerate.yaml, R = 0..{plan.nodes - 1})" if plan.nodes > 1 else ""))
    shown = plan.node_plans[:max_nodes_shown]
    for node in shown:
        cvd = node.env.get("CUDA_VISIBLE_DEVICES") if plan.accelerator == "gpu" else None
        lines.append(f"  node {node.node_rank:<4} host {node.host or '(scheduler)':<20} machine_rank "
                     f"{node.accelerate_config.get('machine_rank')}  ranks {node.ranks[0]}-{node.ranks[-1]}"
                     + (f"  CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else ""))
    if len(plan.node_plans) > len(shown):
        lines.append(f"  ... and {len(plan.node_plans) - len(shown)} more nodes")
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _network(plan: LaunchPlan) -> str:
    """The rendezvous line's tail: the interface and the pre-flight."""
    ifname = plan.network_interface
    where = ("  interface auto (each node: the one that routes to the main node)" if ifname == "auto" else
             f"  interface {ifname} (checked on every node)" if ifname else "")
    t = plan.health.preflight_timeout
    return where + (f"  pre-flight {float(t):g} s" if t and plan.world_size > 1 else "  no pre-flight" if not t else "")


def _gpus(plan: LaunchPlan) -> str:
    """What each node's GPUs do, for a GPU plan ("" on CPU)."""
    if plan.accelerator != "gpu":
        return ""
    per = plan.gpus_per_node
    have = {"slurm": "allocated per node (slurm.gpus_per_node)", "ssh": "per host",
            "local": "per emulated node"}.get(plan.cluster_kind, "per node")
    text = (f"{per} {have}" if per is not None else "per node not known when planning (checked by the pre-flight)"
            if plan.cluster_kind == "ssh" else "per node not known")
    text += f", {plan.procs_per_node} process(es) per node"
    if plan.gpu_ids:
        text += f", GPUs {','.join(str(g) for g in plan.gpu_ids)} of each node"
    if plan.allow_idle_gpus:
        text += ", idle GPUs allowed"
    return text
