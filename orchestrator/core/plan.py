"""The pure planner: (JobSpec, ClusterSpec, PlanFacts) -> LaunchPlan, or a ConfigError listing
every problem (parallelism arithmetic, profile/backend rules, divisibility, host counts).

One path for every job: each node runs `python -m accelerate.commands.launch --config_file
${RUN_DIR}/nodes/R/accelerate.yaml ENTRY...`, where ENTRY is `-m recipes.run ${RUN_DIR}/recipe.yaml` for a built-in
recipe, `SCRIPT ARGS` / `-m MODULE ARGS` for your own code, and `-m trl.scripts.X ARGS` (the module of the installed
TRL that its `trl X` runs on every rank) for a TRL subcommand. The batch arithmetic reads the trainer block, or the
TrainingArguments fields a run's args carry.

No I/O, no environment reads: everything the planner needs from the outside world (the profile's
YAML content, the port, the python path, the model's head counts) arrives in `PlanFacts`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import shlex
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import ConfigError, Problem
from orchestrator.core.container import ContainerPlan, job_mounts, parse_mount, visible
from orchestrator.core.health import HealthSpec
from orchestrator.core.jobplan import LATE_IFNAME, LATE_MAIN_IP, RUN_DIR_VAR, LaunchPlan, NodePlan, job_port
from orchestrator.core.leases import node_gpus
from orchestrator.core.schema import is_secret_name
from orchestrator.core.spec import TRAINER_ALIASES, ClusterSpec, JobSpec, RecipeSpec, RunJobSpec, run_settings

# accelerate's ClusterConfig fields (accelerate/commands/config/config_args.py); a unit test keeps this in sync.
ACCELERATE_KEYS = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name",
    "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config", "ipex_config",
})
DISTRIBUTED_TYPES = frozenset({"NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                               "MULTI_MUSA", "MULTI_HPU", "DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA", "TPU"})
TRAINER_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
DEFAULT_MAX_LENGTH = {"sft": 1024, "dpo": 1024, "cp": 1024}
RECIPE_ENTRY = ("-m", "recipes.run", f"{RUN_DIR_VAR}/recipe.yaml")  # what a rank runs for a built-in recipe
# Hang forensics on GPU: NCCL's flight recorder, dumped next to the py-spy stacks on a collective timeout, or on demand
# by writing to RUN_DIR/stacks/nccl_pipe_rank_<G>.pipe (what a hang verdict can do before the teardown).
NCCL_FORENSICS = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{RUN_DIR_VAR}/stacks/nccl_trace_rank_",
                  "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{RUN_DIR_VAR}/stacks/nccl_pipe_rank_"}
PREFLIGHT_TIMEOUT_VAR = "ORCHESTRATE_PREFLIGHT_TIMEOUT"  # = orchestrator.node.preflight.TIMEOUT_VAR


@dataclass(frozen=True)
class PlanFacts:
    """Facts gathered by the caller (api) so that planning stays pure."""

    job_id: str
    run_dir: str
    output_dir: str
    python: str
    port: int
    accelerator: str  # cpu | gpu (resolved)
    profile_name: str
    profile_config: dict[str, Any]
    model_facts: dict[str, Any] | None = None  # num_attention_heads, num_key_value_heads
    hosts: tuple[str, ...] = ()  # ssh: the cluster's hosts; local: empty
    run_module: str | None = None  # a `trl:` job: the module of the installed TRL that runs the subcommand on a rank
    trainer_defaults: dict[str, Any] | None = None  # own code: defaults of the config its args fill (None: unknown)
    # GPUs a node may use, by host ("localhost": this machine, CUDA_VISIBLE_DEVICES honoured; ssh: each host's
    # nvidia-smi); None: not asked (SLURM: the allocation, slurm.gpus_per_node, is the fact)
    gpu_inventory: dict[str, int] | None = None
    gpu_busy: tuple[int, ...] = ()  # local: GPUs other live jobs on this machine are bound to
    passthrough_env: dict[str, str] | None = None  # the submitter's variables matching launch.env_passthrough
    # Containers (docs/containers.md): the runtime `container.runtime: auto` resolved to (None: none found, or not
    # asked), where the ranks start on the submit host (local, SLURM, a shared filesystem) and where the node package
    # (orchestrator) lives there: what the mounts must cover.
    container_runtime: str | None = None
    cwd: str = ""
    package_root: str = ""


def check_accelerate_config(cfg: Any, where: str) -> list[Problem]:
    """Structural check that a profile file is an accelerate config (keys + distributed_type)."""
    if not isinstance(cfg, dict):
        return [Problem(where, "not an accelerate config: top level must be a mapping")]
    problems = []
    unknown = sorted(str(k) for k in cfg if k not in ACCELERATE_KEYS)
    if unknown:
        from orchestrator.core.schema import suggest
        problems.append(Problem(where, "not an accelerate config: unknown keys "
                                + ", ".join(u + suggest(u, ACCELERATE_KEYS) for u in unknown)))
    dt = cfg.get("distributed_type")
    if dt is None:
        problems.append(Problem(where, "not an accelerate config: missing distributed_type"))
    elif str(dt) not in DISTRIBUTED_TYPES:
        problems.append(Problem(where, f"not an accelerate config: distributed_type {dt!r} is not one of "
                                + ", ".join(sorted(DISTRIBUTED_TYPES))))
    return problems


def parse_time_s(value: str) -> int | None:
    """SLURM time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS -> seconds."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not m:
        return None
    d, a, b, c = m.groups()
    if d is not None:
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return int(d) * 86400 + h * 3600 + mi * 60 + s
    if b is None:
        return int(a) * 60
    if c is None:
        return int(a) * 60 + int(b)
    return int(a) * 3600 + int(b) * 60 + int(c)


def _parallelism(recipe: JobSpec, world: int, problems: list[Problem]) -> dict[str, int]:
    p = recipe.launch.parallelism
    given = {k: getattr(p, k) for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    cp, sp = given["cp"] or 1, given["sp"] or 1
    if cp > 1 and sp > 1:
        problems.append(Problem("launch.parallelism", "cp and sp are exclusive: use cp (ring, FSDP2) or sp "
                                                      "(Ulysses, DeepSpeed), not both"))
    tp, rep = given["tp"] or 1, given["dp_replicate"] or 1
    inner = rep * tp * cp * sp
    shard = given["dp_shard"]
    if shard is None:
        if world % inner:
            problems.append(Problem("launch.parallelism", f"dp_replicate x tp x cp x sp = {inner} does not divide "
                                                          f"the {world} processes (nodes x procs_per_node)"))
            shard = 1
        else:
            shard = world // inner
    elif inner * shard != world:
        problems.append(Problem("launch.parallelism", f"dp_replicate x dp_shard x tp x (cp or sp) = {rep}x{shard}x"
                                f"{tp}x{cp * sp} = {inner * shard}, but nodes x procs_per_node = {world}"))
    return {"dp_replicate": rep, "dp_shard": shard, "tp": tp, "cp": cp, "sp": sp}


def sequence_multiple(cp: int, sp: int) -> tuple[int, str]:
    """What every sequence length must be a multiple of under context (cp*2) or sequence (sp) parallelism; 1: none."""
    if cp > 1:
        return cp * 2, f"cp*2 = {cp * 2} (ring attention)"
    if sp > 1:
        return sp, f"sp = {sp} (Ulysses)"
    return 1, ""


def apply_plan_defaults(recipe: JobSpec) -> tuple[JobSpec, tuple[str, ...]]:
    """The trainer settings the plan fills in when the recipe leaves them unset, and a note for each:
    under cp > 1 / sp > 1, `trainer.pad_to_multiple_of` = cp*2 / sp. Call it before planning so that the
    resolved recipe (RUN_DIR/recipe.yaml) carries what the ranks use; a value that is set is kept (and
    checked by the planner). Own code (`run:`) is left as written here (make_plan adds what a TRL subcommand
    needs: `_run_defaults`)."""
    if isinstance(recipe, RunJobSpec):
        return recipe, ()
    p = recipe.launch.parallelism
    multiple, why = sequence_multiple(p.cp or 1, p.sp or 1)
    if multiple > 1 and recipe.trainer.get("pad_to_multiple_of") is None:
        trainer = dict(recipe.trainer, pad_to_multiple_of=multiple)
        note = f"trainer.pad_to_multiple_of set to {multiple}: sequence lengths must be a multiple of {why}"
        return dataclasses.replace(recipe, trainer=trainer), (note,)
    return recipe, ()


def _settings(recipe: JobSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """(the trainer settings the plan reads, {setting: its key path}): the trainer block of a recipe, or the options
    of a run's args."""
    if isinstance(recipe, RecipeSpec):
        return dict(recipe.trainer), {k: f"trainer.{k}" for k in recipe.trainer}
    return run_settings(recipe.run), {k: where for k, (_, where) in recipe.run.options().items()}


def _rules(recipe: JobSpec, par: dict[str, int], dist: str, facts: PlanFacts, problems: list[Problem]) -> None:
    cp, sp, tp = par["cp"], par["sp"], par["tp"]
    t, where = _settings(recipe)
    fsdp_version = (facts.profile_config.get("fsdp_config") or {}).get("fsdp_version")
    if cp > 1:
        if dist != "FSDP" or str(fsdp_version) != "2":
            problems.append(Problem("launch.parallelism.cp", f"cp > 1 needs FSDP2 (profile fsdp2 or context_parallel), "
                                                             f"profile {facts.profile_name!r} is {dist}"))
        attn = t.get("attn_implementation") if isinstance(recipe, RunJobSpec) else recipe.model.attn_implementation
        if (attn is not None or isinstance(recipe, RecipeSpec)) and attn != "sdpa":
            problems.append(Problem(where.get("attn_implementation", "model.attn_implementation"),
                                    f"context parallelism (cp > 1) needs 'sdpa', got {attn!r}"))
    if sp > 1 and dist != "DEEPSPEED":
        problems.append(Problem("launch.parallelism.sp", f"sp > 1 (ALST/Ulysses) needs DeepSpeed (profile zero3 or "
                                                         f"alst_ulysses), profile {facts.profile_name!r} is {dist}"))
    if isinstance(recipe, RecipeSpec) and recipe.recipe == "cp" and cp == 1 and sp == 1:
        problems.append(Problem("launch.parallelism", "recipe 'cp' needs cp > 1 (ring attention) or sp > 1 (Ulysses)"))
    if facts.profile_name in ("context_parallel",) and cp == 1:
        problems.append(Problem("launch.parallelism.cp", "profile 'context_parallel' needs cp > 1"))
    if facts.profile_name in ("alst_ulysses",) and sp == 1:
        problems.append(Problem("launch.parallelism.sp", "profile 'alst_ulysses' needs sp > 1"))
    if tp > 1 and dist not in ("FSDP",):
        problems.append(Problem("launch.parallelism.tp", f"tp > 1 needs an FSDP2 profile, profile is {dist}"))
    divisor, why = sequence_multiple(cp, sp)
    if divisor > 1:  # pad_to_multiple_of unset was filled in by apply_plan_defaults; a set one must fit
        for key in ("max_length", "max_seq_length", "pad_to_multiple_of"):
            v = t.get(key)
            if v is not None and (not isinstance(v, int) or v % divisor):
                problems.append(Problem(where.get(key, f"trainer.{key}"), f"must be divisible by {why}, got {v!r}"))
    fsdp_ac = (facts.profile_config.get("fsdp_config") or {}).get("fsdp_activation_checkpointing")
    if dist == "FSDP" and fsdp_ac:
        for key in ("activation_checkpointing", TRAINER_ALIASES["activation_checkpointing"]):  # one switch, two names
            if t.get(key) is True:
                problems.append(Problem(where.get(key, f"trainer.{key}"), "the FSDP profile already checkpoints "
                                        "activations (fsdp_activation_checkpointing); turn one of them off"))
    heads = (facts.model_facts or {}).get("num_attention_heads")
    kv = (facts.model_facts or {}).get("num_key_value_heads")
    for size, name in ((sp, "sp"), (tp, "tp")):
        if size > 1 and isinstance(heads, int) and heads % size:
            problems.append(Problem(f"launch.parallelism.{name}", f"the model's {heads} attention heads are not "
                                                                  f"divisible by {name} = {size}"))
        if size > 1 and name == "tp" and isinstance(kv, int) and kv % size:
            problems.append(Problem("launch.parallelism.tp", f"the model's {kv} key/value heads are not divisible by "
                                                             f"tp = {size}"))


def _cluster_rules(recipe: JobSpec, cluster: ClusterSpec, facts: PlanFacts, ppn: int,
                   problems: list[Problem]) -> None:
    nodes = recipe.launch.nodes
    if cluster.kind == "ssh":
        hosts = facts.hosts
        if nodes > len(hosts):
            problems.append(Problem("launch.nodes", f"{nodes} nodes asked but cluster {cluster.name!r} lists only "
                                                    f"{len(hosts)} host(s)"))
    if cluster.kind == "slurm" and cluster.slurm is not None:
        problems.extend(slurm_problems(cluster.slurm, cluster.name, ppn, facts.accelerator))


# ----------------------------------------------------------------------------------------- containers

IMAGE_FILES = {".sqsh": ("pyxis", "enroot"), ".squashfs": ("pyxis", "enroot"), ".sif": ("apptainer",)}


def container_plan(recipe: JobSpec, cluster: ClusterSpec, facts: PlanFacts, cpu: bool, job_paths: list[tuple[str, str]],
                   problems: list[Problem]) -> ContainerPlan | None:
    """The job's container (its `container:` block, the cluster's merged under it by core.spec), resolved and checked:
    the runtime fits the backend, an image file fits the runtime, every path the job names is visible inside.
    `job_paths`: (key, absolute host path) of what the ranks read or write."""
    spec = recipe.container
    if spec is None or not spec.image:
        if spec is not None and (spec.mounts or spec.env or spec.workdir or spec.runtime != "auto"):
            problems.append(Problem("container.image", "missing: a container block needs an image (or set "
                                                       "`container: null` to run without one)"))
        return None
    runtime = spec.runtime if spec.runtime != "auto" else facts.container_runtime
    where = {"local": "this machine", "ssh": "the hosts", "slurm": "the SLURM login node"}.get(cluster.kind, "")
    if runtime is None:
        problems.append(Problem("container.runtime", f"auto: found no container runtime on {where} (podman, docker, "
                                                      "apptainer, enroot; pyxis on SLURM): install one or name it"))
        return None
    if runtime == "pyxis" and cluster.kind != "slurm":
        problems.append(Problem("container.runtime", f"pyxis runs containers only on SLURM (srun --container-image);"
                                                     f" on a {cluster.kind} cluster use podman, docker, apptainer or "
                                                     "enroot"))
    suffix = next((x for x in IMAGE_FILES if spec.image.endswith(x)), None)
    if suffix and runtime not in IMAGE_FILES[suffix]:
        problems.append(Problem("container.image", f"{spec.image}: a {suffix} file runs with "
                                                   f"{' or '.join(IMAGE_FILES[suffix])}, not {runtime}"))
    if runtime in ("podman", "docker") and spec.image.startswith(("/", "./", "~")):
        problems.append(Problem("container.image", f"{runtime} runs an image by name (a registry reference or one "
                                                   f"loaded on the hosts), not a file: {spec.image}"))
    if spec.workdir is not None and not spec.workdir.startswith("/"):
        problems.append(Problem("container.workdir", f"must be an absolute path inside the container, got "
                                                     f"{spec.workdir!r}"))
    for name, _ in spec.env.items():
        if name in ("PYTHONPATH",):
            problems.append(Problem(f"container.env.{name}", "set by orchestrate (the node package and its hooks "
                                                             "must stay importable in the container)"))
    mounts = tuple(m for m in (parse_mount(t)[0] for t in spec.mounts) if m is not None)
    if runtime == "pyxis":
        problems.extend(Problem(f"container.mounts[{i}]", f"pyxis: write the host path in full ({m.host}: srun does "
                                                          "not expand ~)") for i, m in enumerate(mounts)
                        if not m.host.startswith("/"))
    cp = ContainerPlan(runtime=runtime, image=spec.image, mounts=mounts, env=dict(spec.env),
                       workdir=spec.workdir or "", python=spec.python, options=tuple(spec.options),
                       gpus=not cpu and runtime != "pyxis")
    if cluster.kind != "ssh" or (cluster.ssh is not None and cluster.ssh.shared_fs):  # staged hosts: all in the run dir
        seen = job_mounts(cp, run_dir=facts.run_dir, package=facts.package_root, cwd=facts.cwd)
        for key, path in job_paths:
            if path.startswith("/") and not visible(seen, path):
                problems.append(Problem("container.mounts", f"{path} ({key}) is not visible in the container: mount "
                                                            f"it (container.mounts: [{path}:{path}:ro]) or move it "
                                                            f"under {facts.cwd or 'the submit directory'}"))
    return cp


# ----------------------------------------------------------------------------------------- GPUs (docs/gpus.md)

@dataclass(frozen=True)
class GpuLayout:
    """How a job's processes sit on its nodes' GPUs."""

    procs_per_node: int
    gpus_per_node: int | None  # what each node gives the job; None: CPU, or not known when planning
    visible: tuple[tuple[int, ...], ...] | None  # each node's CUDA_VISIBLE_DEVICES; None: left to the node
    subset: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()


def _ids(ids: list[int] | tuple[int, ...]) -> str:
    return ",".join(str(i) for i in ids)


def _idle(idle: str, why: str, fix: str) -> Problem:
    """Allocated (or present) GPUs left without a process: a plan error naming the numbers."""
    return Problem("launch.procs_per_node", f"{idle} would be idle ({why}): {fix}, or set launch.allow_idle_gpus: "
                                            "true")


def gpu_layout(recipe: JobSpec, cluster: ClusterSpec, facts: PlanFacts, problems: list[Problem]) -> GpuLayout:
    """Processes per node (`auto`: one per GPU a node gives the job; 1 on CPU), the GPUs each node uses and the
    problems: more processes than GPUs, GPUs left idle (unless launch.allow_idle_gpus), hosts with different GPU
    counts, `gpus:` indices a node does not have. Local emulated nodes split this machine's GPUs into disjoint sets;
    a `gpus:` subset (launch.gpus, else the cluster's gpus) is the GPUs each node uses."""
    launch = recipe.launch
    nodes, asked, allow = launch.nodes, launch.procs_per_node, launch.allow_idle_gpus
    auto = asked == "auto"
    subset = tuple(launch.gpus or cluster.gpus or ())
    where = "launch.gpus" if launch.gpus else "gpus"
    fixed = 1 if auto else int(asked)
    if facts.accelerator != "gpu":
        return GpuLayout(fixed, None, None, (), (f"{where} ignored on a CPU cluster",) if subset else ())
    notes: list[str] = []
    unknown = ("launch.procs_per_node: auto = 1 process per node: how many GPUs each node has is not known here "
               "(give launch.procs_per_node)")
    if cluster.kind == "local":
        total = (facts.gpu_inventory or {}).get("localhost") if facts.gpu_inventory is not None else None
        if subset and total is not None and any(g >= total for g in subset):
            problems.append(Problem(where, f"GPU(s) {_ids([g for g in subset if g >= total])} do not exist: this "
                                           f"machine has {total} GPU(s)"))
            return GpuLayout(fixed, None, None, subset)
        pool = list(subset) if subset else (list(range(total)) if total is not None else None)
        if pool is not None and facts.gpu_busy and set(pool) & set(facts.gpu_busy):
            busy = [g for g in pool if g in facts.gpu_busy]
            pool = [g for g in pool if g not in facts.gpu_busy]
            notes.append(f"GPU(s) {_ids(busy)} of this machine are bound to other running jobs: not used")
        if pool is None:  # not known: each emulated node still gets GPUs of its own
            if auto:
                notes.append(unknown)
            return GpuLayout(fixed, None, tuple(tuple(range(r * fixed, (r + 1) * fixed)) for r in range(nodes)),
                             subset, tuple(notes))
        ppn = (len(pool) // nodes or 1) if auto else fixed
        need = nodes * ppn
        usable = f"{len(pool)} usable GPU(s) ({_ids(pool) or 'none'})"
        if need > len(pool):
            problems.append(Problem("launch.procs_per_node", f"{nodes} emulated node(s) x {ppn} process(es) = {need}"
                                                             f" need a GPU each, but this machine has {usable}"))
            return GpuLayout(ppn, None, None, subset, tuple(notes))
        if need < len(pool) and not allow:
            problems.append(_idle(f"{len(pool) - need} of this machine's {usable}",
                                  f"{nodes} emulated node(s) x {ppn} process(es) use {need}",
                                  "use a node count that divides them, or pick GPUs with launch.gpus"))
        return GpuLayout(ppn, ppn, tuple(tuple(pool[r * ppn:(r + 1) * ppn]) for r in range(nodes)), subset,
                         tuple(notes))
    if cluster.kind == "ssh":
        hosts = facts.hosts[:nodes]
        declared = cluster.ssh.gpus_per_node if cluster.ssh is not None else None
        inv = facts.gpu_inventory or {}
        counts = {h: inv[h] for h in hosts if h in inv}
        per: int | None = declared
        if counts:
            per = min(counts.values())
            shown = ", ".join(f"{h} {n}" for h, n in counts.items())
            if subset:
                lacking = [h for h, n in counts.items() if any(g >= n for g in subset)]
                if lacking:
                    problems.append(Problem(where, f"GPU(s) {_ids(subset)} asked on every node, but "
                                                   f"{', '.join(lacking)} lack(s) some (GPUs per host: {shown})"))
            elif len(set(counts.values())) > 1:
                problems.append(Problem("ssh.hosts", f"the hosts have different GPU counts ({shown}): one process "
                                                     "per GPU needs the same number on every node; pick the same "
                                                     "GPUs on each with launch.gpus, or use hosts alike"))
            if declared is not None and any(n != declared for n in counts.values()):
                problems.append(Problem("ssh.gpus_per_node", f"{declared} declared, but the hosts have {shown}"))
        elif subset and per is not None and any(g >= per for g in subset):
            problems.append(Problem(where, f"GPU(s) {_ids([g for g in subset if g >= per])} do not exist: the "
                                           f"hosts have {per} GPU(s) (ssh.gpus_per_node)"))
        avail = len(subset) if subset else per
        if auto and avail is None:
            notes.append(unknown)
        ppn = (avail or 1) if auto else fixed
        if avail is not None and ppn > avail:
            problems.append(Problem("launch.procs_per_node", f"{ppn} processes per node, but each host gives the job "
                                                             f"{avail} GPU(s)" + (f" ({where} {_ids(subset)})"
                                                                                  if subset else "")))
        elif avail is not None and ppn < avail and not allow:
            problems.append(_idle(f"{avail - ppn} of the {avail} GPUs of each host",
                                  f"launch.procs_per_node = {ppn}" + (f", {where} {_ids(subset)}" if subset else "")
                                  + f"; {(avail - ppn) * nodes} idle GPUs on {nodes} node(s)",
                                  f"use launch.procs_per_node: auto ({avail} per node)"))
        return GpuLayout(ppn, avail, tuple(subset for _ in range(nodes)) if subset else None, subset, tuple(notes))
    # slurm: each node's allocation is slurm.gpus_per_node GPUs (SLURM sets CUDA_VISIBLE_DEVICES in the task)
    alloc = (cluster.slurm.gpus_per_node if cluster.slurm is not None else 0) or None
    if subset and alloc is not None and any(g >= alloc for g in subset):
        problems.append(Problem(where, f"GPU(s) {_ids([g for g in subset if g >= alloc])} are not in the allocation: "
                                       f"slurm.gpus_per_node = {alloc} (indices 0-{alloc - 1})"))
    avail = len(subset) if subset else alloc
    if auto and avail is None:
        notes.append("launch.procs_per_node: auto = 1 process per node: slurm.gpus_per_node is 0, the job asks "
                     "SLURM for no GPUs")
    ppn = (avail or 1) if auto else fixed
    if subset and ppn > len(subset):
        problems.append(Problem("launch.procs_per_node", f"{ppn} processes per node, but {where} gives each node "
                                                         f"{len(subset)} GPU(s) ({_ids(subset)})"))
    elif alloc is not None and ppn < alloc and not allow:
        problems.append(_idle(f"{alloc - ppn} of the {alloc} GPUs allocated per node",
                              f"slurm.gpus_per_node = {alloc}, launch.procs_per_node = {ppn}"
                              + (f", {where} {_ids(subset)}" if subset else "")
                              + f"; {(alloc - ppn) * nodes} idle GPUs on {nodes} node(s)",
                              f"use launch.procs_per_node: auto ({alloc} per node) or ask for fewer GPUs"
                              if not subset else "ask for fewer GPUs (slurm.gpus_per_node)"))
    return GpuLayout(ppn, alloc, tuple(subset for _ in range(nodes)) if subset else None, subset, tuple(notes))


def _passthrough(recipe: JobSpec, facts: PlanFacts, warnings: list[str]) -> dict[str, str]:
    """The submitter's variables named by launch.env_passthrough prefixes; secret-looking names never pass."""
    prefixes = recipe.launch.env_passthrough
    out: dict[str, str] = {}
    skipped = []
    for name, value in sorted((facts.passthrough_env or {}).items()):
        if not any(name.startswith(p) for p in prefixes):
            continue
        if is_secret_name(name):
            skipped.append(name)
            continue
        out[name] = value
    if skipped:
        warnings.append(f"launch.env_passthrough: {', '.join(skipped)} not passed (secret-looking: list them in "
                        "launch.secret_env)")
    return out


def slurm_problems(s, cluster_name: str, procs_per_node: int, accelerator: str) -> list[Problem]:
    """The checks of a `slurm:` block that need no cluster (also used by launchers.slurm.sbatch.check_slurm)."""
    problems: list[Problem] = []
    if s.max_gpus_per_node is not None and s.gpus_per_node > s.max_gpus_per_node:
        problems.append(Problem("slurm.gpus_per_node", f"{s.gpus_per_node} GPUs per node asked but cluster "
                                                       f"{cluster_name!r} nodes have {s.max_gpus_per_node}"))
    secs = parse_time_s(s.time)
    if secs is None:
        problems.append(Problem("slurm.time", f"not a SLURM time limit (HH:MM:SS, D-HH:MM, MM): {s.time!r}"))
    elif secs <= s.signal_lead_s:
        problems.append(Problem("slurm.time", f"time limit {s.time} ({secs} s) is not longer than the "
                                              f"preemption signal lead slurm.signal_lead_s = {s.signal_lead_s} s"))
    if accelerator == "gpu" and s.gpus_per_node and procs_per_node > s.gpus_per_node:
        problems.append(Problem("launch.procs_per_node", f"{procs_per_node} processes per node but "
                                                         f"slurm.gpus_per_node = {s.gpus_per_node}"))
    return problems


def _node_config(base: dict[str, Any], *, rank: int, nodes: int, world: int, main_host: str, port: int,
                 cpu: bool, mixed_precision: str, par: dict[str, int]) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    cfg.update(num_processes=world, num_machines=nodes, machine_rank=rank, main_process_ip=main_host,
               main_process_port=port, rdzv_backend="static", same_network=True, mixed_precision=mixed_precision)
    if cpu:
        # The torchrun path (MULTI_GPU, use_cpu false) exports RANK/WORLD_SIZE/LOCAL_RANK to every process;
        # MULTI_CPU with use_cpu true would start one process per node that silently trains alone.
        if cfg.get("distributed_type") in ("NO", "MULTI_CPU", "MULTI_GPU"):
            cfg["distributed_type"] = "MULTI_GPU"
        cfg["use_cpu"] = False
        cfg.pop("gpu_ids", None)
    if "parallelism_config" in cfg or par["cp"] > 1 or par["sp"] > 1 or par["tp"] > 1:
        pc = dict(cfg.get("parallelism_config") or {})
        pc.update(parallelism_config_dp_replicate_size=par["dp_replicate"],
                  parallelism_config_dp_shard_size=par["dp_shard"], parallelism_config_tp_size=par["tp"])
        if par["cp"] > 1:
            pc["parallelism_config_cp_size"] = par["cp"]
            pc.setdefault("parallelism_config_cp_backend", "torch")
        if par["sp"] > 1:
            pc["parallelism_config_sp_size"] = par["sp"]
            pc.setdefault("parallelism_config_sp_backend", "deepspeed")
        cfg["parallelism_config"] = pc
    return cfg


def node_command(python: str, rank: int, entry: tuple[str, ...] = RECIPE_ENTRY) -> tuple[str, ...]:
    """What node `rank` runs: accelerate launch with its config, then `entry` (what every rank runs: run_entry);
    run-dir paths are relative (RUN_DIR_VAR), bound by the node agent."""
    return (python, "-m", "accelerate.commands.launch", "--config_file",
            f"{RUN_DIR_VAR}/nodes/{rank}/accelerate.yaml", *entry)


def run_entry(recipe: JobSpec, facts: PlanFacts) -> tuple[str, ...]:
    """What every rank runs, after `accelerate launch --config_file ...`."""
    if isinstance(recipe, RecipeSpec):
        return RECIPE_ENTRY
    run = recipe.run
    if run.script is not None:
        return (run.script, *run.argv())
    if run.module is not None:
        return ("-m", run.module, *run.argv())
    return ("-m", facts.run_module or f"trl.scripts.{(run.trl or '').replace('-', '_')}", *run.argv())


def _run_defaults(recipe: RunJobSpec, par: dict[str, int], dist: str, world: int, facts: PlanFacts
                  ) -> tuple[RunJobSpec, tuple[str, ...]]:
    """What the plan adds to a TRL subcommand's args where they leave it unset and its config has the field (never to
    your own script's, whose options it cannot know), with a note: under cp > 1 / sp > 1 `--pad_to_multiple_of`
    cp*2 / sp; on a CPU cluster what the built-in recipes set there too (`--bf16 false` where the config does not
    default it off, `--use_cpu true`, or `--ddp_backend gloo` under DeepSpeed, which accelerate drops with use_cpu)."""
    run, notes = recipe.run, []
    fields = facts.trainer_defaults or {}
    multiple, why = sequence_multiple(par["cp"], par["sp"])
    is_trl = run.kind == "trl"
    added: list[str] = []

    def add(name: str, value: str) -> None:
        nonlocal run
        if run.option(name) is None and name in fields and name not in run.options():
            run = run.with_option(name, value)
            added.append(f"--{name} {value}")
    if multiple > 1 and run.option("pad_to_multiple_of") is None:
        if is_trl and "pad_to_multiple_of" in fields:
            add("pad_to_multiple_of", str(multiple))
            notes.append(f"run.args: --pad_to_multiple_of {multiple} added: sequence lengths must be a multiple of "
                         f"{why}")
        else:
            notes.append(f"sequence lengths must be a multiple of {why}: make your code pad to it")
    if is_trl and facts.accelerator == "cpu":
        before = len(added)
        if "bf16" in fields and fields["bf16"] is not False and "fp16" not in run.options():  # None: on unless fp16
            add("bf16", "false")
        if dist != "DEEPSPEED":
            add("use_cpu", "true")
        elif world > 1:
            add("ddp_backend", "gloo")
        if len(added) > before:
            notes.append(f"run.args: {' '.join(added[before:])} added (a CPU cluster)")
    return (dataclasses.replace(recipe, run=run) if run is not recipe.run else recipe), tuple(notes)


def _run_paths(entry: tuple[str, ...]) -> tuple[str, ...]:
    """The absolute local paths a run's command names (its script, path-like args), in order, once each."""
    out: list[str] = []
    for word in entry:
        value = word.partition("=")[2] if word.startswith("--") else word
        if value.startswith("/") and value not in out:
            out.append(value)
    return tuple(out)


def _batch(recipe: JobSpec, facts: PlanFacts) -> tuple[int | None, int | None, int | None, bool]:
    """(per-device batch, accumulation, max length, tokens exact) from the trainer block, or from what a run's args
    carry (a TRL subcommand: its config's defaults for the rest; your own code: TrainingArguments' defaults once it
    carries one of the batch fields, else unknown)."""
    bs_key, ga_key = "per_device_train_batch_size", "gradient_accumulation_steps"
    if isinstance(recipe, RecipeSpec):
        t = recipe.trainer
        max_len = t.get("max_length", DEFAULT_MAX_LENGTH.get(recipe.recipe))
        return (int(t.get(bs_key, TRAINER_DEFAULTS[bs_key])), int(t.get(ga_key, TRAINER_DEFAULTS[ga_key])),
                max_len if isinstance(max_len, int) else None, bool(t.get("packing")) and recipe.recipe != "dpo")
    t = run_settings(recipe.run)
    defaults = dict(TRAINER_DEFAULTS, **(facts.trainer_defaults or {}))
    bs = ga = None
    if recipe.run.kind == "trl" or bs_key in t or ga_key in t:
        bs, ga = t.get(bs_key, defaults.get(bs_key)), t.get(ga_key, defaults.get(ga_key))
    max_len = t.get("max_length", t.get("max_seq_length"))
    if max_len is None and recipe.run.kind == "trl":
        max_len = defaults.get("max_length", defaults.get("max_seq_length"))
    exact = t.get("packing") is True and recipe.run.trl == "sft"

    def whole(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None
    return whole(bs), whole(ga), whole(max_len), exact


def make_plan(recipe: JobSpec, cluster: ClusterSpec, facts: PlanFacts, notes: tuple[str, ...] = ()) -> LaunchPlan:
    """Plan the job or raise one ConfigError with every problem found. `notes`: what apply_plan_defaults said
    when the caller applied it first (they join the plan's warnings); unapplied defaults are applied here."""
    recipe, defaulted = apply_plan_defaults(recipe)
    problems: list[Problem] = []
    layout = gpu_layout(recipe, cluster, facts, problems)
    nodes, ppn = recipe.launch.nodes, layout.procs_per_node
    world = nodes * ppn
    problems.extend(check_accelerate_config(facts.profile_config, f"launch.profile ({facts.profile_name})"))
    dist = str(facts.profile_config.get("distributed_type", "MULTI_GPU")) if isinstance(facts.profile_config, dict) \
        else "MULTI_GPU"
    par = _parallelism(recipe, world, problems)
    if isinstance(recipe, RunJobSpec):
        recipe, run_notes = _run_defaults(recipe, par, dist, world, facts)
        defaulted = (*defaulted, *run_notes)
    _rules(recipe, par, dist, facts, problems)
    _cluster_rules(recipe, cluster, facts, ppn, problems)
    cpu = facts.accelerator == "cpu"
    warnings: list[str] = [*notes, *defaulted, *layout.notes]
    if cpu and dist == "FSDP":
        fsdp_v = str((facts.profile_config.get("fsdp_config") or {}).get("fsdp_version", "1"))
        if fsdp_v != "2":
            problems.append(Problem("launch.profile", f"{facts.profile_name!r} is FSDP1, which does not run on CPU "
                                                      "clusters; use fsdp2 (sharded on CPU by recipes/fsdp_cpu.py)"))
    if problems:
        raise ConfigError(problems, source=recipe.source)

    mp = recipe.launch.mixed_precision
    if mp is None:
        mp = "no" if cpu else str(facts.profile_config.get("mixed_precision", "no"))
        if isinstance(recipe, RunJobSpec):
            args = run_settings(recipe.run)
            dtype = args.get("dtype") or args.get("torch_dtype")
        else:
            dtype = recipe.model.dtype
        if not cpu and dtype == "float32":
            mp = "no"
    elif cpu and mp != "no":
        warnings.append(f"launch.mixed_precision={mp} ignored on CPU")
        mp = "no"

    if cluster.kind == "slurm":
        main_host = LATE_MAIN_IP
        hosts = [""] * nodes
    elif cluster.kind == "ssh":
        hosts = list(facts.hosts[:nodes])
        main_host = hosts[0]
    else:
        hosts = ["localhost"] * nodes
        main_host = "127.0.0.1"

    env = dict(cluster.env)
    passed = _passthrough(recipe, facts, warnings)
    env.update(passed)
    if isinstance(recipe, RunJobSpec):  # the ranks' health hooks (orchestrator/node/hooks) follow checkpoint:
        env.update(ORCHESTRATE_RESUME=recipe.checkpoint.resume,
                   ORCHESTRATE_SAVE_ON_SIGNAL="1" if recipe.checkpoint.save_on_signal else "0")
    env.update(recipe.launch.env)
    ifname = cluster.network_interface or ("lo" if cluster.kind == "local" else None)
    if ifname == "auto" and cluster.kind == "local":
        ifname = "lo"  # emulated nodes meet on loopback
    if ifname:  # auto: each node agent binds the interface that routes to the main node (orchestrator.node.netcheck)
        env.setdefault("GLOO_SOCKET_IFNAME", LATE_IFNAME if ifname == "auto" else ifname)
        if not cpu:
            env.setdefault("NCCL_SOCKET_IFNAME", LATE_IFNAME if ifname == "auto" else ifname)
    if not cpu:
        for k, v in NCCL_FORENSICS.items():
            env.setdefault(k, v)
    health = resolve_health(recipe.health, cluster)
    env[PREFLIGHT_TIMEOUT_VAR] = f"{float(health.preflight_timeout):g}"

    entry = run_entry(recipe, facts)
    container = container_plan(recipe, cluster, facts, cpu, _job_paths(recipe, facts, entry), problems)
    if problems:
        raise ConfigError(problems, source=recipe.source)
    if container is not None:
        env.update(container.env)
    python = container.python if container is not None and container.agent_side else facts.python
    node_plans = []
    bind_gpus = layout.visible is not None and "CUDA_VISIBLE_DEVICES" not in env  # the user's own setting wins
    node_envs = [dict(env, CUDA_VISIBLE_DEVICES=_ids(layout.visible[r])) if bind_gpus and layout.visible else env
                 for r in range(nodes)]
    port = facts.port
    if cluster.kind == "ssh" and recipe.launch.port is None and not cpu and node_gpus(node_envs[0]) is not None:
        port = job_port(facts.port, facts.job_id)  # the main host's other GPUs may run another job (core.leases)
    for r in range(nodes):
        cfg = _node_config(facts.profile_config, rank=r, nodes=nodes, world=world, main_host=main_host,
                           port=port, cpu=cpu, mixed_precision=mp, par=par)
        node_env = node_envs[r]
        node_plans.append(NodePlan(node_rank=r, host=hosts[r], ranks=tuple(range(r * ppn, (r + 1) * ppn)),
                                   accelerate_config=cfg, command=node_command(python, r, entry),
                                   env=dict(sorted(node_env.items()))))

    bs, ga, max_len, exact = _batch(recipe, facts)
    dp = world // (par["tp"] * par["cp"] * par["sp"])
    eff = bs * ga * dp if bs is not None and ga is not None else None
    if isinstance(recipe, RunJobSpec):
        label, run_kind, run_target, run_paths = recipe.run.kind, recipe.run.kind, recipe.run.target, _run_paths(entry)
    else:
        label, run_kind, run_target, run_paths = recipe.recipe, "recipe", "", ()
    return LaunchPlan(
        job_id=facts.job_id, recipe=label, recipe_name=recipe.name, cluster_kind=cluster.kind,
        cluster_name=cluster.name, accelerator=facts.accelerator, profile=facts.profile_name,
        distributed_type=str(node_plans[0].accelerate_config.get("distributed_type")), nodes=nodes,
        procs_per_node=ppn, world_size=world, parallelism=par, data_parallel_size=dp, per_device_batch=bs,
        grad_accum=ga, effective_batch=eff, max_length=max_len,
        tokens_per_step=eff * max_len if eff is not None and max_len is not None else None,
        tokens_per_step_exact=exact,
        main_host=main_host, port=port, run_dir=facts.run_dir, output_dir=facts.output_dir,
        python=facts.python, secret_env=recipe.launch.secret_env, node_plans=tuple(node_plans),
        warnings=tuple(warnings), health=health, run_kind=run_kind,
        run_target=run_target, run_paths=run_paths, gpus_per_node=layout.gpus_per_node, gpu_ids=layout.subset,
        allow_idle_gpus=recipe.launch.allow_idle_gpus and not cpu, network_interface=ifname,
        env_passthrough=tuple(passed), container=container,
        port_per_job=cluster.kind == "slurm" and recipe.launch.port is None,
        spare_hosts=tuple(facts.hosts[nodes:]) if cluster.kind == "ssh" else ())


def _job_paths(recipe: JobSpec, facts: PlanFacts, entry: tuple[str, ...]) -> list[tuple[str, str]]:
    """(key, absolute path) of what the ranks read or write on the node: the output dir, the data and model of a
    built-in recipe, the script and path-like args of own code."""
    out = [("output dir", facts.output_dir)]
    if isinstance(recipe, RecipeSpec):
        out += [("data.path", p) for p in recipe.data.path]
        out += [("model.name_or_path", recipe.model.name_or_path)]
        if recipe.tokenizer:
            out.append(("tokenizer", recipe.tokenizer))
    else:
        out += [("run", p) for p in _run_paths(entry)]
    return [(k, p) for k, p in out if isinstance(p, str) and p.startswith("/") and RUN_DIR_VAR not in p]


def resolve_health(health: HealthSpec, cluster: ClusterSpec) -> HealthSpec:
    """The plan's health settings: `max_restarts` None means 3 on SLURM (preemptions are routine), 0 elsewhere."""
    if health.max_restarts is not None:
        return health
    legacy = getattr(cluster.slurm, "max_restarts", None) if cluster.slurm is not None else None
    return dataclasses.replace(health, max_restarts=int(legacy) if legacy is not None else
                               (3 if cluster.kind == "slurm" else 0))


def command_line(argv: tuple[str, ...] | list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
