"""Planning: the one place that reads the outside world for planning (internal; the public layer is
orchestrator.client, exported by `orchestrator`).

`prepare` loads + validates specs, resolves paths, gathers facts (profile file, free port, model head
counts, GPUs, container runtime, python) and calls the pure planner and renderer; nothing is written.
`replan` plans a running job again without a bad host; `write_files` writes rendered files to a directory.
Running a prepared job is orchestrator.running's; queries on recorded jobs are orchestrator.records'.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, Problem
from launchers import launcher_for
from orchestrator.node.rundir import RunDir
from orchestrator.core.jobplan import LaunchPlan, needed_packages
from orchestrator.core.plan import PlanFacts, apply_plan_defaults, make_plan
from orchestrator.core.render import render_files
from orchestrator.core.resume import KEYWORDS as RESUME_KEYWORDS
from orchestrator.core.schema import PROFILES
from orchestrator.core.spec import ClusterSpec, RecipeSpec, load
from orchestrator.trlfields import trainer_fields
from orchestrator import resources

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")


@dataclass(frozen=True)
class Prepared:
    recipe: RecipeSpec
    cluster: ClusterSpec
    plan: LaunchPlan
    files: dict[str, str]
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)  # prepare()'s arguments: how to re-plan it
    resumed_from: dict[str, Any] | None = None  # {path, job, step}: another job's checkpoint it continues, as asked


# ------------------------------------------------------------------------------------------- facts

def _home() -> Path:
    from orchestrator.store import home
    return home()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def detect_accelerator(cluster: ClusterSpec) -> str:
    """cpu | gpu. Local `auto`: gpu when this machine shows NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES
    honoured; ORCHESTRATE_NVIDIA_SMI names a stand-in nvidia-smi); SLURM: gpu when GPUs are requested; SSH: gpu."""
    if cluster.accelerator != "auto":
        return cluster.accelerator
    if cluster.kind == "local":
        from orchestrator.node import gpus
        if not gpus.has_driver() and gpus.visible() is None:
            return "cpu"  # the cheap look first: no device files, no driver, no override
        count = gpus.count_visible()
        return "cpu" if count == 0 else "gpu"  # None (nvidia-smi failed on a machine with the driver): gpu
    if cluster.kind == "slurm":
        return "gpu" if cluster.slurm and cluster.slurm.gpus_per_node > 0 else "cpu"
    return "gpu"


def gpu_facts(recipe, cluster: ClusterSpec, accelerator: str) -> tuple[dict[str, int] | None, tuple[int, ...]]:
    """(GPUs per host, GPUs of this machine bound to other live local jobs) for the planner (docs/gpus.md).
    Local: this machine's GPUs (CUDA_VISIBLE_DEVICES honoured). SSH: asked from the hosts (nvidia-smi through
    `python -m orchestrator.node.gpus`) only when the plan needs the count (procs_per_node auto, ssh.gpus_per_node
    not given); the pre-flight checks every host at submit anyway. SLURM: the allocation (slurm.gpus_per_node)."""
    if accelerator != "gpu":
        return None, ()
    if cluster.kind == "local":
        from orchestrator.node import gpus
        count = gpus.count_visible()
        return ({"localhost": count} if count is not None else None), busy_local_gpus()
    if (cluster.kind == "ssh" and cluster.ssh is not None and cluster.ssh.gpus_per_node is None
            and recipe.launch.procs_per_node == "auto" and recipe.launch.nodes <= len(cluster.ssh.hosts)):
        return ssh_gpu_counts(cluster, list(cluster.ssh.hosts[:recipe.launch.nodes])), ()
    return None, ()


def busy_local_gpus() -> tuple[int, ...]:
    """GPUs of this machine that live jobs' node agents lease (whoever submitted them: core.leases): a new job's
    emulated nodes use others."""
    from orchestrator.core.leases import LOCAL_HOST
    from orchestrator.node.lease import leased_gpus
    return leased_gpus(LOCAL_HOST)


def ssh_gpu_counts(cluster: ClusterSpec, hosts: list[str]) -> dict[str, int]:
    """{host: GPUs its node agent's python may use}, asked over SSH; ConfigError naming a host that cannot tell."""
    from launchers.ssh.transport import Pool, remote_command
    assert cluster.ssh is not None
    argv = [cluster.ssh.python, "-m", "orchestrator.node.gpus"]
    try:
        pool = Pool(cluster.ssh)
    except (OSError, ValueError) as e:  # no known_hosts / key file: nothing can be asked
        raise ConfigError(Problem("launch.procs_per_node", f"auto needs the hosts' GPU counts, which cannot be asked "
                                  f"({e}); give launch.procs_per_node or ssh.gpus_per_node"),
                          source=cluster.source) from None
    try:
        def ask(host: str) -> int:
            rc, out, err = pool.connect(host).run(remote_command(argv), timeout=60)
            line = next((ln for ln in out.decode(errors="replace").splitlines() if ln.startswith("{")), "")
            if rc != 0 or not line:
                tail = (err or out).decode(errors="replace").strip().splitlines()
                raise RuntimeError(f"exit {rc}" + (f": {tail[-1]}" if tail else ""))
            inv = json.loads(line)
            return len(inv["visible"]) if inv.get("visible") is not None else len(inv.get("gpus") or [])
        found = pool.map(ask, hosts)
    finally:
        pool.close()
    bad = {h: r for h, r in found.items() if isinstance(r, Exception)}
    if bad:
        raise ConfigError([Problem("launch.procs_per_node", f"auto needs the GPU count of {h}, which could not be "
                                                            f"asked ({type(e).__name__}: {e}); give "
                                                            "launch.procs_per_node or ssh.gpus_per_node")
                           for h, e in bad.items()], source=cluster.source)
    return {h: int(n) for h, n in found.items()}


def package_root() -> str:
    """Where this machine's node package lives: the directory holding `orchestrator` and `recipes` (a container mounts
    those two, never the rest of a site-packages)."""
    return str(resources.package_root())


def container_runtime(recipe, cluster: ClusterSpec) -> str | None:
    """What `container.runtime: auto` means on this cluster (None: not asked, or none found): local and SLURM look on
    this machine (on SLURM pyxis first, when srun knows --container-image); SSH asks every host and takes the first
    runtime of core.container.AUTO_ORDER that all of them have."""
    import shutil
    from orchestrator.core.container import AUTO_ORDER
    spec = getattr(recipe, "container", None)
    if spec is None or not spec.image or spec.runtime != "auto":
        return None
    order = AUTO_ORDER.get(cluster.kind, AUTO_ORDER["local"])
    if cluster.kind == "ssh" and cluster.ssh is not None:
        return ssh_container_runtime(cluster, list(cluster.ssh.hosts[:recipe.launch.nodes]), order)
    for runtime in order:
        if runtime == "pyxis":
            from launchers.slurm.launcher import srun_knows_containers
            if shutil.which("srun") and srun_knows_containers():
                return runtime
        elif shutil.which(runtime):
            return runtime
    return None


def ssh_container_runtime(cluster: ClusterSpec, hosts: list[str], order: tuple[str, ...]) -> str | None:
    """The first runtime of `order` that every host has (`command -v` over SSH); ConfigError naming a host that
    cannot be asked."""
    from launchers.ssh.transport import Pool, remote_command
    assert cluster.ssh is not None
    program = "for r in " + " ".join(order) + "; do command -v $r >/dev/null 2>&1 && echo $r; done; true"
    try:
        pool = Pool(cluster.ssh)
    except (OSError, ValueError) as e:
        raise ConfigError(Problem("container.runtime", f"auto needs to ask the hosts which runtime they have ({e}); "
                                                       "name it (podman, docker, apptainer, enroot)"),
                          source=cluster.source) from None
    try:
        found = pool.map(lambda h: pool.connect(h).run(remote_command(["sh", "-c", program]), timeout=60), hosts)
    finally:
        pool.close()
    bad = {h: r for h, r in found.items() if isinstance(r, Exception)}
    if bad:
        raise ConfigError([Problem("container.runtime", f"auto: cannot ask {h} which runtime it has "
                                                        f"({type(e).__name__}: {e}); name the runtime")
                           for h, e in bad.items()], source=cluster.source)
    have = [set(out.decode(errors="replace").split()) for _, out, _ in found.values()]
    return next((r for r in order if all(r in h for h in have)), None)


def passthrough_env(recipe) -> dict[str, str]:
    """The submit environment's variables whose names start with a launch.env_passthrough prefix (the planner drops
    secret-looking names and says so)."""
    prefixes = tuple(recipe.launch.env_passthrough)
    return {k: v for k, v in os.environ.items() if prefixes and k.startswith(prefixes)}


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..") or value.endswith(DATA_SUFFIXES)


def resolve_paths(recipe, cwd: Path):
    """Make local paths absolute (relative to where orchestrate runs); missing local files are errors.

    Own code (`run:`): the script must be a file; every arg value that looks like a local path (./x, ../x, /x, ~/x,
    a data file name, or an existing relative file or directory) and every `*_dir` option becomes absolute, so ranks
    started elsewhere find them. The output dir is the args' `--output_dir`, else outputs/<job file stem>, which is
    added to the args of a TRL subcommand only (your own script may not take the option)."""
    from orchestrator.core.spec import RunJobSpec, list_options, option_name
    problems: list[Problem] = []
    if isinstance(recipe, RunJobSpec):
        run = recipe.run

        def absolute(value: str) -> str:
            return str((cwd / Path(value).expanduser()).resolve())

        def is_local(value: str) -> bool:
            if not value or value.startswith("-"):
                return False
            try:
                return _looks_like_path(value) or (cwd / value).exists()
            except (OSError, ValueError):  # a word that is no path (too long, NUL)
                return False

        def resolve_value(name: str, value):
            if not isinstance(value, str) or "://" in value:  # a URL (s3://, hf://) is no local path
                return value
            return absolute(value) if is_local(value) or (name.endswith("_dir") and value) else value

        if run.script is not None:
            full = Path(absolute(run.script))
            if not full.is_file():
                problems.append(Problem("run.script", f"file not found: {full}" if not full.exists()
                                        else f"not a file: {full}"))
            run = replace(run, script=str(full))
        if isinstance(run.args, dict):
            args = {k: tuple(resolve_value(option_name(k), v) for v in value) if isinstance(value, tuple)
                    else resolve_value(option_name(k), value) for k, value in run.args.items()}
        else:
            words = list(run.args)
            names = {i: option_name(n) for n, _, i in list_options(tuple(words))}
            for i, word in enumerate(words):
                if word.startswith("--") and "=" in word:
                    key, _, value = word.partition("=")
                    words[i] = f"{key}={resolve_value(option_name(key), value)}"
                elif not word.startswith("-"):
                    words[i] = resolve_value(names.get(i, ""), word)
            args = tuple(words)
        run = replace(run, args=args)
        given = run.option("output_dir")
        output_dir = given if isinstance(given, str) and given else absolute(f"outputs/{recipe.name}")
        if given is None and run.kind == "trl":
            run = run.with_option("output_dir", output_dir)
        ckpt = recipe.checkpoint
        if ckpt.resume not in RESUME_KEYWORDS:
            ckpt = replace(ckpt, resume=absolute(ckpt.resume))
        if problems:
            raise ConfigError(problems, source=recipe.source)
        return replace(recipe, run=run, checkpoint=ckpt, output_dir=output_dir)
    data_paths = []
    for i, p in enumerate(recipe.data.path):
        p = resources.given_or_shipped(p, cwd)  # recipes/data/...: the shipped file unless the directory has one
        if _looks_like_path(p) or (cwd / p).exists():
            full = (cwd / Path(p).expanduser()).resolve()
            if not full.exists():
                problems.append(Problem(f"data.path[{i}]" if len(recipe.data.path) > 1 else "data.path",
                                        f"file not found: {full}"))
            data_paths.append(str(full))
        else:
            data_paths.append(p)  # a hub dataset name
    model = recipe.model
    name = model.name_or_path
    builtin = _builtin_models()
    if name not in builtin and (_looks_like_path(name) or (cwd / name).is_dir()):
        full = (cwd / Path(name).expanduser()).resolve()
        if not full.exists():
            problems.append(Problem("model.name_or_path", f"directory not found: {full}"))
        model = replace(model, name_or_path=str(full))
    tok = recipe.tokenizer
    if tok and tok not in builtin and (_looks_like_path(tok) or (cwd / tok).is_dir()):
        tok = str((cwd / Path(tok).expanduser()).resolve())
    trainer = dict(recipe.trainer)
    out = trainer.get("output_dir") or f"outputs/{recipe.name}"
    trainer["output_dir"] = str((cwd / Path(out).expanduser()).resolve())
    ckpt = recipe.checkpoint
    if ckpt.resume not in RESUME_KEYWORDS:
        ckpt = replace(ckpt, resume=str((cwd / Path(ckpt.resume).expanduser()).resolve()))
    if problems:
        raise ConfigError(problems, source=recipe.source)
    return replace(recipe, model=model, tokenizer=tok, trainer=trainer, checkpoint=ckpt,
                   data=replace(recipe.data, path=tuple(data_paths)))


def _check_notify_env(recipe) -> None:
    """notify.webhook_env must name a variable of the submit environment that holds an http(s) URL (never shown)."""
    from orchestrator.core.schema import check_value
    name = recipe.notify.webhook_env if getattr(recipe, "notify", None) is not None else None
    if not name or not recipe.notify.on:
        return
    value = os.environ.get(name, "")
    msg = f"{name} is not set in the submit environment" if not value else None
    bad = check_value("url", value) if value else None
    if msg or bad:
        raise ConfigError(Problem("notify.webhook_env", msg or f"${name}: {bad}"), source=recipe.source)


def _builtin_models() -> dict[str, dict]:
    from orchestrator.core.models import BUILTIN_MODELS
    return BUILTIN_MODELS


def model_facts(recipe) -> dict[str, Any] | None:
    """The model's config (head counts for the parallelism checks): a built-in tiny model's shapes, or a local model
    directory's config.json (own code: the directory its args name by --model_name_or_path / --model)."""
    from orchestrator.core.spec import RunJobSpec
    if isinstance(recipe, RunJobSpec):
        name = recipe.run.option("model_name_or_path") or recipe.run.option("model")
        if not isinstance(name, str) or not name:
            return None
    else:
        name = recipe.model.name_or_path
    builtin = _builtin_models()
    if name in builtin:
        return dict(builtin[name])
    cfg = Path(name) / "config.json"
    if cfg.is_file():
        try:
            return json.loads(cfg.read_text())
        except ValueError:
            return None
    return None


def load_profile(recipe: RecipeSpec, cwd: Path) -> tuple[str, dict[str, Any]]:
    import yaml
    profile = recipe.launch.profile
    if profile in PROFILES:
        path = resources.profile_path(profile)
        name = profile
    elif profile.endswith((".yaml", ".yml")) or "/" in profile:
        path = (cwd / Path(profile).expanduser()).resolve()
        name = str(path)
        if not path.is_file():
            raise ConfigError(Problem("launch.profile", f"accelerate config file not found: {path}"),
                              source=recipe.source)
    else:
        from orchestrator.core.schema import suggest
        raise ConfigError(Problem("launch.profile", f"unknown profile {profile!r}; one of {', '.join(PROFILES)} "
                                                    f"or a path to an accelerate YAML" + suggest(profile, PROFILES)),
                          source=recipe.source)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(Problem(f"{path}:{mark.line + 1 if mark else '?'}", "YAML syntax error in profile"),
                          source=recipe.source) from None
    return name, data if isinstance(data, dict) else {"__not_a_mapping__": data}


def new_job_id(recipe: RecipeSpec) -> str:
    return f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _run_dir_for(cluster: ClusterSpec, job_id: str) -> str:
    """Where the submitter writes the run dir: the SLURM work dir (every node sees it), else ORCHESTRATE_HOME/runs
    (SSH hosts without a shared filesystem get a copy under their own work dir: the SSH launcher's business)."""
    if cluster.kind == "slurm" and cluster.slurm:
        return str(Path(cluster.slurm.workdir).expanduser() / "runs" / job_id)
    return str(_home() / "runs" / job_id)


def _python_for(cluster: ClusterSpec) -> str:
    if cluster.kind == "ssh" and cluster.ssh:
        return cluster.ssh.python
    if cluster.kind == "slurm" and cluster.slurm:
        return cluster.slurm.python
    return sys.executable


# ------------------------------------------------------------------------------------------- entry points

def prepare(recipe_path: str, cluster_path: str | None = None, *, nodes: int | None = None,
            procs_per_node: int | None = None, profile: str | None = None, overrides: list[str] | None = None,
            cwd: Path | None = None, job_id: str | None = None, check_trainer: bool = True,
            run_dir: str | None = None, exclude: tuple[str, ...] = (), judge_checkpoints: bool = True) -> Prepared:
    """Everything `render` shows and `submit` runs, without writing anything. `run_dir` overrides where the
    run dir is (render: the output directory, so a rendered job.sbatch can be submitted by hand from it).
    `exclude`: hosts the job must not use (bad hosts taken out by the restart policy: SSH plans with the hosts left,
    SLURM submits with --exclude). `judge_checkpoints`: whether a new job may take up the checkpoints in its output
    dir (`check_resume`); False for a re-plan of a running job and for a sweep's base plan (its points get output
    dirs of their own, each judged)."""
    from orchestrator.core.spec import RunJobSpec, fields_key, without_hosts
    from orchestrator.trlfields import trainer_defaults, trl_commands
    cwd = Path(cwd or os.getcwd())
    inputs = dict(recipe_path=recipe_path, cluster_path=cluster_path, nodes=nodes, procs_per_node=procs_per_node,
                  profile=profile, overrides=list(overrides or []), cwd=cwd, check_trainer=check_trainer,
                  run_dir=run_dir, exclude=tuple(exclude))
    flags = {"nodes": nodes, "procs_per_node": procs_per_node, "profile": profile}
    recipe, cluster = load(recipe_path, cluster_path, flags=flags, overrides=overrides,
                           trainer_fields=trainer_fields if check_trainer else None, trl_commands=trl_commands)
    cluster = without_hosts(cluster, exclude)
    recipe = resolve_paths(recipe, cwd)
    _check_container_files(recipe, cluster)
    _check_notify_env(recipe)
    recipe, notes = apply_plan_defaults(recipe)
    profile_name, profile_cfg = load_profile(recipe, cwd)
    job_id = job_id or new_job_id(recipe)
    port = recipe.launch.port or (free_port() if cluster.kind == "local" else 29500)
    run_module = defaults = None
    if isinstance(recipe, RunJobSpec):
        output_dir = recipe.output_dir
        if recipe.run.trl is not None:
            run_module = ((trl_commands() or {}).get(recipe.run.trl) or {}).get("module")
        defaults = trainer_defaults(fields_key(recipe.run))
    else:
        output_dir = recipe.trainer["output_dir"]
    resumed_from = check_resume(recipe, cluster, output_dir, job_id) if judge_checkpoints else None
    host_recipe, stage_files, rank_cwd, package = _staging(recipe, cluster, cwd, output_dir)
    accelerator = detect_accelerator(cluster)
    inventory, busy = gpu_facts(recipe, cluster, accelerator)
    facts = PlanFacts(job_id=job_id, run_dir=run_dir or _run_dir_for(cluster, job_id), output_dir=output_dir,
                      python=_python_for(cluster), port=port, accelerator=accelerator,
                      profile_name=profile_name, profile_config=profile_cfg, model_facts=model_facts(recipe),
                      hosts=cluster.ssh.hosts if cluster.ssh else (), run_module=run_module,
                      trainer_defaults=defaults, gpu_inventory=inventory, gpu_busy=busy,
                      passthrough_env=passthrough_env(recipe), container_runtime=container_runtime(recipe, cluster),
                      cwd=rank_cwd if rank_cwd and not package else str(cwd), package_root=package_root())
    try:
        plan = make_plan(host_recipe, cluster, facts, notes=notes)
    except ConfigError:
        if not facts.gpu_busy:
            raise
        # too few GPUs without the ones other jobs lease: plan on them all; the job waits for its GPUs (QUEUED)
        plan = make_plan(host_recipe, cluster, replace(facts, gpu_busy=()), notes=notes)
    if plan.container is not None:
        plan = dataclasses.replace(plan, package_root=package_root())
        if not rank_cwd:  # the ranks start where they would without it, mounted
            rank_cwd = str(cwd)
    if rank_cwd or package:
        plan = dataclasses.replace(plan, rank_cwd=rank_cwd, node_package=package)
    files = render_files(plan, host_recipe.to_dict())
    files.update(stage_files)
    files.update(launcher_for(cluster).prepare(plan).files)  # e.g. the standalone job.sbatch (pure prepare)
    if resumed_from is not None:
        files[RunDir.RESUMED] = json.dumps(resumed_from, indent=2, sort_keys=True) + "\n"
    return Prepared(recipe=recipe, cluster=cluster, plan=plan, files=files, inputs=inputs, resumed_from=resumed_from)


def replan(prepared: Prepared, exclude: str) -> Prepared:
    """The same job (same id, run dir, inputs) planned again without host `exclude` (and those taken out before):
    on SSH the next spare takes its place (new machine ranks, main address, per-node configs, staging to it); on
    SLURM the next allocation excludes it."""
    inputs = dict(prepared.inputs)
    inputs["exclude"] = tuple(inputs.get("exclude") or ()) + (exclude,)
    return prepare(**inputs, job_id=prepared.plan.job_id, judge_checkpoints=False)


def output_dir_visible(cluster: ClusterSpec) -> bool:
    """The job's output dir, as the ranks see it, is this machine's path too: local, SLURM (a shared filesystem) and
    SSH hosts with shared_fs: true. SSH hosts without one keep their outputs in their own cache (docs/staging.md)."""
    return cluster.kind != "ssh" or bool(cluster.ssh and cluster.ssh.shared_fs)


def check_resume(recipe, cluster: ClusterSpec, output_dir: str, job_id: str) -> dict[str, Any] | None:
    """A NEW job must not silently continue another job's checkpoints (orchestrator.core.resume): the checkpoint its
    checkpoint.resume would pick up is read here (its orchestrate.json: the job that wrote it) and judged before
    anything starts. Refused: ConfigError (exit 2) naming the checkpoint, its job and step and the ways out.
    Returns {path, job, step} when the job continues another job's checkpoint because the user asked for it, else
    None. Where the output dir is not visible from here (SSH hosts without a shared filesystem) nothing is judged."""
    from orchestrator.core.resume import Checkpoint, decide
    from orchestrator.core.spec import RunJobSpec
    from orchestrator.node.hooks import orchestrate_checkpoint as oc
    mode = recipe.checkpoint.resume
    if mode == "never" or not output_dir_visible(cluster):
        return None
    key = "trainer.output_dir"
    if isinstance(recipe, RunJobSpec):
        given, key = recipe.run.options().get("output_dir", (None, ""))
        if not given:
            return None  # the script chooses its output dir itself: not known here
    if mode in ("auto", "latest"):
        path = oc.latest_complete(output_dir, say=False)  # (the one a rank would resume from)
    elif Path(mode).is_dir():
        path = mode
    else:
        raise ConfigError(Problem("checkpoint.resume", f"{mode} is not a checkpoint directory"), source=recipe.source)
    d = decide(mode, job_id, Checkpoint(**oc.describe(path)) if path else None, output_key=key)
    if d.action == "refuse":
        raise ConfigError(Problem("checkpoint.resume", d.message), source=recipe.source)
    return d.checkpoint.to_dict() if d.announce and d.checkpoint is not None else None


def spares_left(prepared: Prepared) -> int | None:
    """Hosts left to replace a bad one: SSH, the cluster's hosts beyond the nodes the job uses (those taken out
    already gone from the list); SLURM, the partition's nodes beyond the job's and the excluded ones (sinfo); None
    where hosts cannot be replaced (the local backend) or SLURM cannot tell."""
    c, nodes = prepared.cluster, prepared.plan.nodes
    if c.kind == "ssh" and c.ssh is not None:
        return len(c.ssh.hosts) - nodes
    if c.kind == "slurm" and c.slurm is not None:
        from launchers.slurm.launcher import partition_nodes
        known = partition_nodes(c.slurm.partition)
        return None if known is None else len(set(known) - set(c.slurm.exclude)) - nodes
    return None


def _check_container_files(recipe, cluster: ClusterSpec) -> None:
    """An image given as a file (.sqsh / .sif) must exist here when the nodes see this machine's files (local, and
    SLURM's shared filesystem); SSH hosts check their own in the pre-flight. Mounts' host paths on this machine:
    local only (a SLURM node checks its own at start)."""
    spec = getattr(recipe, "container", None)
    if spec is None or not spec.image or cluster.kind == "ssh":
        return
    problems = []
    if spec.image.startswith(("/", "./", "~")) or spec.image.endswith((".sqsh", ".squashfs", ".sif")):
        path = Path(spec.image).expanduser()
        if not path.is_file():
            problems.append(Problem("container.image", f"image file not found: {path}"))
    if cluster.kind == "local":
        from orchestrator.core.container import parse_mount
        for i, text in enumerate(spec.mounts):
            m = parse_mount(text)[0]
            if m is not None and not Path(m.host).expanduser().exists():
                problems.append(Problem(f"container.mounts[{i}]", f"host path {m.host} does not exist"))
    if problems:
        raise ConfigError(problems, source=recipe.source)


def _staging(recipe, cluster, cwd: Path, output_dir: str):
    """(the job as its hosts run it, {"stage.json": layout} or {}, the ranks' cwd, the node package's hash). SSH hosts
    without a shared filesystem get the node package and (ssh.stage) the job's local inputs, under
    ${RUN_DIR}/staged (docs/staging.md); with a shared filesystem the ranks start in the submitter's directory."""
    if cluster.kind != "ssh" or cluster.ssh is None:
        return recipe, {}, "", ""
    if cluster.ssh.shared_fs:
        return recipe, {}, str(cwd), ""
    from orchestrator.core.spec import RunJobSpec
    from launchers.ssh import stage as ssh_stage
    host_recipe, layout, rank_cwd = ssh_stage.plan_staging(recipe, cwd, output_dir, cluster.ssh)
    cache = ssh_stage.hash_cache()
    package = ssh_stage.package_tree(cache).sha
    cache.save()
    container = getattr(recipe, "container", None)
    # what the hosts' python must have: the stack, unless it is in the container image (checked there instead)
    needed = [] if container is not None and container.image else \
        list(needed_packages(recipe.run.kind if isinstance(recipe, RunJobSpec) else "recipe"))
    doc = {"sources": [dataclasses.asdict(x) for x in layout.sources], "output_local": layout.output_local,
           "output_key": layout.output_key, "fetch": layout.fetch, "stage": layout.stage,
           "inputs": list(layout.inputs), "needed": needed, "package": package}
    return host_recipe, {ssh_stage.STAGE_FILE: json.dumps(doc, indent=1, sort_keys=True) + "\n"}, rank_cwd, package


def write_files(files: dict[str, str], out_dir: Path) -> None:
    """Write rendered files owner-only (0700 dirs, 0600 files), atomically."""
    RunDir(out_dir).mkdir()
    RunDir(out_dir).write_files(files)
