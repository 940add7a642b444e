"""The application layer: the one place that reads the outside world for planning and then acts.

`prepare` loads + validates specs, resolves paths, gathers facts (profile file, free port, model head
counts, python) and calls the pure planner and renderer; nothing is written. `render` writes the
files to a directory. `submit` writes the run dir, records the job, hands the plan to a launcher and
supervises it to the end.
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
from typing import Any, Callable

from orchestrator.errors import ConfigError, LeasesBusy, OrchestratorError, PreflightError, Problem, SubmitCancelled
from launchers import launcher_for
from orchestrator.node.rundir import AttemptRecord, RunDir, write_error
from orchestrator.supervise import RestartPolicy, Supervisor, spares_matter
from orchestrator.types import JobHandle, JobResult, JobState, JobStatus, NodeExit, exit_signal, exit_text, is_terminal
from orchestrator.core.jobplan import LaunchPlan, needed_packages
from orchestrator.core.plan import PlanFacts, apply_plan_defaults, make_plan
from orchestrator.core.render import render_files
from orchestrator.core.resume import KEYWORDS as RESUME_KEYWORDS
from orchestrator.core.schema import PROFILES
from orchestrator.core.spec import ClusterSpec, RecipeSpec, load
from orchestrator.trlfields import trainer_fields

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILE_DIR = REPO_ROOT / "cluster_configs" / "profiles"
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
    return str(REPO_ROOT)


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
        path = PROFILE_DIR / f"{profile}.yaml"
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


def _record_new(prepared: Prepared, store, state: str = "PENDING") -> RunDir:
    """The job's run dir written (with its cluster.json) and its record created."""
    from orchestrator.core.spec import cluster_to_dict
    from orchestrator.store import StoreError, digest
    plan = prepared.plan
    rd = RunDir(plan.run_dir)
    fresh = not rd.root.exists()
    try:
        write_files(dict(prepared.files, **{RunDir.CLUSTER: json.dumps(cluster_to_dict(prepared.cluster), indent=2,
                                                                       sort_keys=True) + "\n"}), rd.root)
        store.create(job_id=plan.job_id, recipe=prepared.recipe.source,
                     recipe_digest=digest(prepared.files["recipe.yaml"]), cluster=prepared.cluster.name,
                     backend=prepared.cluster.kind, nodes=plan.nodes, world_size=plan.world_size, run_dir=str(rd.root),
                     state=state)
    except (OSError, StoreError) as e:  # (a full disk, a read-only home): refused, and no half-written run dir left
        if fresh:
            import shutil
            shutil.rmtree(rd.root, ignore_errors=True)
        raise PreflightError(Problem("", f"job {plan.job_id} not submitted: {_why_not_written(e)}")) from None
    return rd


def _why_not_written(e: Exception) -> str:
    from orchestrator.store import StoreError
    return e.one_line() if isinstance(e, StoreError) else f"cannot write the run dir: {write_error(e)}"


def submit(prepared: Prepared, *, on_line: Callable[[int, str], None] | None = None,
           on_beat: Callable[[dict], None] | None = None, on_event: Callable[[str, dict], None] | None = None,
           supervisor: Supervisor | None = None, wait: bool = True, adopt: JobHandle | None = None) -> JobResult:
    """Write the run dir, record the job, run it under the one Supervisor, restart by the one RestartPolicy, record
    the end. `supervisor` lets the caller keep a handle to cancel it (signal handlers). Hosts or GPUs leased by another
    job (LeasesBusy): the job waits QUEUED and tries again (`wait_for_leases`); `wait=False`: LeasesBusy is raised at
    once (the job recorded CANCELLED, nothing started). `adopt`: the first attempt was submitted already (a SLURM
    sweep's array task, `submit_array`: its run dir and record exist): it is watched, not submitted; a restart is a
    submission of its own. A run dir or record that cannot be written (a full disk): PreflightError, nothing left."""
    from orchestrator.store import JobStore, StoreError
    plan = prepared.plan
    try:
        store = JobStore()
    except StoreError as e:
        raise PreflightError(Problem("", f"job {plan.job_id} not submitted: {_why_not_written(e)}")) from None
    known = store.get(plan.job_id) if adopt is not None else None
    rd = RunDir(plan.run_dir) if known is not None and known.id == plan.job_id else _record_new(prepared, store)
    sup = supervisor or Supervisor(plan)
    sup.on_line, sup.on_beat = on_line or sup.on_line, on_beat or sup.on_beat
    notifier = _notifier(prepared, rd, sup, on_event)

    def emit(kind: str, data: dict) -> None:
        if notifier is not None and kind == "running" and data.get("attempt") == 0:
            notifier.started(data.get("handle", ""))
        if on_event:
            on_event(kind, data)

    policy = RestartPolicy(plan.health.max_restarts)
    launcher = launcher_for(prepared.cluster)
    attempt = 0
    try:
        while True:
            if sup.cancel.is_set():  # cancelled between attempts (or before the first started)
                result = JobResult(JobState.CANCELLED, 130, sup.cancel_reason)
                break
            stamp = store.wake_stamp()  # a job of this store that ends during this try wakes the wait after it
            try:
                result = _run_once(prepared, launcher, sup, store, rd, attempt, emit,
                                   adopt=adopt if attempt == 0 else None)
                if lost_lease_race(result):  # an agent found its host/GPU taken after the look: wait again
                    raise LeasesBusy([], result.root_cause.split("LeaseBusy: ", 1)[-1].splitlines()[0])
            except LeasesBusy as e:
                if not wait:
                    if e.kept is not None:  # (SSH: the hosts' waiting agents end now)
                        e.kept.close()
                    why = f"not started: {e} (--no-wait)"
                    store.update(plan.job_id, JobState.CANCELLED, detail=why[:500], root_cause=why[:500],
                                 exit_code=e.exit_code, final=True)
                    raise
                wait_for_leases(prepared, sup, store, rd, e, emit, stamp)
                continue
            except PreflightError as e:  # hosts that cannot run the job: spares take their place before the start
                spares = spares_left(prepared) if e.bad_hosts else None
                if spares is None or spares < len(e.bad_hosts) or len(e.bad_hosts) < len({p.where for p in e.problems}):
                    if e.bad_hosts:
                        if spares is not None and len(e.bad_hosts) == len({p.where for p in e.problems}) and \
                                spares_matter(e.bad_hosts):
                            gone = ", ".join(sorted(e.bad_hosts))
                            e = PreflightError(e.problems + [Problem("ssh.hosts", f"no spare host left to replace "
                                                                                  f"{gone}")], source=e.source)
                        store.update(plan.job_id, JobState.FAILED, detail=str(e)[:500], root_cause=str(e)[:500],
                                     exit_code=e.exit_code)  # (the very line and code the submit prints and exits)
                        raise e from None
                    raise
                for host, why in e.bad_hosts.items():
                    rd.append_attempt(AttemptRecord(t=time.time(), attempt=attempt, decision="replace",
                                                    reason=f"pre-flight: {why} -> replaced by a spare before the start",
                                                    host=host, kind="preflight", exclude=host))
                    prepared = replan(prepared, host)
                plan = _replanned(prepared, rd, sup, emit, sorted(e.bad_hosts))
                launcher = launcher_for(prepared.cluster)  # (SLURM: the next allocation's --exclude is the cluster's)
                continue
            if result.state in (JobState.COMPLETED, JobState.CANCELLED, JobState.RUNNING) or sup.cancel.is_set():
                break  # RUNNING: detached, the backend runs it on (status / ls ask it and record its end)
            d = policy.record(rd, attempt, result.root_cause, counted=attempt, culprit_host=result.culprit_host,
                              culprit_kind=result.culprit_kind, spares=spares_left(prepared))
            why = d.why
            if not d.restart:
                if plan.health.max_restarts or "no spare host" in why:
                    result = dataclasses.replace(result, root_cause=f"{result.root_cause} ({why})")
                break
            attempt += 1
            if d.exclude:
                prepared = replan(prepared, d.exclude)
                plan = _replanned(prepared, rd, sup, emit, [d.exclude])
                launcher = launcher_for(prepared.cluster)
            store.update(plan.job_id, JobState.RESTARTING, detail=f"{why}: {result.root_cause}"[:2000],
                         restarts=restart_count(rd))
            if notifier is not None:
                notifier.attempts()
            if on_event:
                on_event("restart", {"job_id": plan.job_id, "restart": attempt,
                                     "max_restarts": plan.health.max_restarts, "reason": result.root_cause,
                                     "step": rd.furthest_step()})
    except LeasesBusy:  # --no-wait: recorded CANCELLED above, nothing started; the caller says it (exit 75)
        if notifier is not None:
            notifier.close()
        raise
    except BaseException as e:  # the supervisor itself failed: the job is not left RUNNING in the store
        why = f"the supervisor failed: {type(e).__name__}: {str(e)[:300]}"
        try:
            store.update(plan.job_id, JobState.FAILED, detail=why, root_cause=why, exit_code=1, final=True)
        except Exception:  # noqa: BLE001 - reconcile (ls/status) records it later
            pass
        if notifier is not None:
            notifier.finished(JobResult(JobState.FAILED, 1, why, restarts=restart_count(rd)))
            notifier.close()
        raise
    restarts = restart_count(rd)
    if result.state == JobState.RUNNING:  # detached: no end to record yet
        store.update(plan.job_id, JobState.RUNNING, detail=result.root_cause or None, restarts=restarts)
    else:
        record_end(store, rd, plan.job_id, result, restarts, on_event)
    result = dataclasses.replace(result, restarts=restarts)
    if notifier is not None:  # after the store has the end: a hook that asks `orchestrate status` sees it
        if result.state != JobState.RUNNING:
            notifier.finished(result)
        notifier.close()
    return result


def submit_array(prepared: list[Prepared], *, parallel: int, name: str, folder: str, script: str,
                 cancel=None) -> tuple[str, list[JobHandle]]:
    """A sweep's points on SLURM as ONE array job (launchers.slurm SlurmLauncher.submit_array): every point's run dir
    written and its job recorded (PENDING) first, then one sbatch; each record gets its array task's handle. Nothing
    watches them here: each point's supervisor is `submit(..., adopt=handle)`. A cancel during the check, or a failed
    sbatch: every point recorded CANCELLED / FAILED with why, and the error raised."""
    from orchestrator.store import JobStore
    store = JobStore()
    rds = [_record_new(p, store) for p in prepared]
    launcher = launcher_for(prepared[0].cluster)
    subs = [launcher.prepare(replace(p.plan, submitter=submitter())) for p in prepared]
    try:
        array, handles = launcher.submit_array(subs, rds, parallel=parallel, name=name, folder=Path(folder),
                                               script=script, cancel=cancel)
    except BaseException as e:
        state, code = (JobState.CANCELLED, 130) if isinstance(e, (SubmitCancelled, KeyboardInterrupt)) else \
            (JobState.FAILED, 1)
        why = f"the sweep's array job was not submitted: {e}"[:500]
        for p in prepared:
            store.update(p.plan.job_id, state, detail=why, root_cause=why, exit_code=code, final=True)
        raise
    for p, rd, h in zip(prepared, rds, handles, strict=True):
        rd.write_json(RunDir.HANDLE, {"uri": h.uri, "data": h.data})
        store.update(p.plan.job_id, handle=h.uri)
    return array, handles


def array_tasks(cluster: ClusterSpec, array: str) -> dict[int, str] | None:
    """{task: SLURM state} of a SLURM array's tasks still listed by the controller (None: it cannot tell)."""
    return launcher_for(cluster).array_tasks(array)


def cluster_of(run_dir: str) -> ClusterSpec:
    """The cluster a job ran on, from its run dir (cluster.json)."""
    from orchestrator.core.spec import cluster_from_dict
    data = RunDir(run_dir).read_json(RunDir.CLUSTER)
    if not isinstance(data, dict):
        raise OrchestratorError(f"run dir {run_dir} has no readable {RunDir.CLUSTER}")
    return cluster_from_dict(data)


def cancel_array(cluster: ClusterSpec, array: str) -> None:
    """scancel a sweep's whole array job: its running tasks and those not started yet."""
    launcher_for(cluster).cancel(JobHandle(f"slurm://{array}"))


QUEUE_POLL_S = 3.0  # a QUEUED job looks again this often (docs/CONTRACT.md "Leases")
QUEUE_OWN_POLL_S = 30.0  # ... when its holders are live jobs of its own store (their end wakes it; a safety net)
END_RETRY_S = 60.0  # a full job store: the supervising process keeps trying to record the end this long


def outcome_record(result: JobResult, by: str) -> dict[str, Any]:
    """RUN_DIR/outcome.json of an ended attempt (RunDir docstring): the state, the exit code (128 + N: signal N, named
    in "signal"), the cause and each node's end as judged."""
    return {"state": str(result.state), "exit_code": result.returncode,
            "signal": exit_signal(result.returncode) if result.state == JobState.FAILED else None,
            "root_cause": result.root_cause, "by": by, "t": time.time(), "nodes": [n.to_dict() for n in result.nodes],
            "teardown_at": result.teardown_at}


def record_end(store, rd: RunDir, job: str, result: JobResult, restarts: int, on_event=None) -> None:
    """Record how the job ended: RUN_DIR/outcome.json (each node's end), then the store. A full disk never turns the
    end into something else: the store is retried for END_RETRY_S (said once; once it takes the end, an outcome.json
    that could not be written is written then), and when it still cannot take it the StoreFullError says the real
    end; `status` records it later from outcome.json (or the agents' exit records)."""
    from orchestrator.store import StoreFullError
    unwritten = rd.write_outcome(outcome_record(result, "supervisor"))
    fields = dict(detail=result.root_cause or None, exit_code=result.returncode, root_cause=result.root_cause or None,
                  restarts=restarts)
    try:
        store.update(job, result.state, **fields)
        return
    except StoreFullError as e:
        said = (f"ended {result.state} (exit {result.returncode}) but the job store cannot record it: "
                f"{e.one_line()}; trying again for {END_RETRY_S:.0f} s")
        if on_event:  # (a note is shown as "job JOB: LINE")
            on_event("note", {"job_id": job, "line": said})
        else:
            print(f"orchestrate: job {job} {said}", file=sys.stderr, flush=True)
    try:
        store.update(job, result.state, retry_s=END_RETRY_S, **fields)
        if unwritten is not None:  # there is space again: each node's end, which `status` shows, is kept too
            rd.write_outcome(outcome_record(result, "supervisor"))
    except StoreFullError as e:
        later = ("`orchestrate status` records it from the run dir once there is space" if unwritten is None else
                 f"its outcome could not be written either ({unwritten})")
        raise StoreFullError(f"job {job} ended {result.state} (exit {result.returncode}) but the job store could not "
                             f"record it: {e.one_line()}; {later}", e.path) from None


def submitter() -> str:
    """user@host of this process (a lease file names who holds it)."""
    import getpass
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def lost_lease_race(result: JobResult) -> bool:
    """An attempt that ended before anything started because a node agent found its lease taken (exit 75,
    `LeaseBusy:`): the job goes back to waiting, it has not failed."""
    from orchestrator.core.leases import EXIT_BUSY
    return (result.state == JobState.FAILED and result.returncode == EXIT_BUSY
            and "LeaseBusy: " in (result.root_cause or ""))


def queue_positions(records: list | None = None) -> dict[str, int]:
    """{job id: its place in this store's queue} for every QUEUED job whose submitter is alive: 1 + the queued jobs
    submitted before it that want an overlapping lease (core.leases.queue_position, FIFO by submit time)."""
    from orchestrator.core.leases import job_locks, queue_position
    from orchestrator.detach import live_supervisor
    from orchestrator.store import JobStore
    recs = JobStore().list(None) if records is None else records
    queued = []
    for rec in recs:
        if rec.state != JobState.QUEUED or (rec.id not in _WAITING and live_supervisor(rec.id) is None):
            continue
        try:
            plan = RunDir(rec.run_dir).read_plan()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        queued.append((rec.id, rec.created, job_locks(plan)))
    return {q[0]: queue_position(q[0], queued) for q in queued}


def queue_poll_s(store, busy: LeasesBusy) -> float:
    """How long a QUEUED job waits for its store to move before it looks again: QUEUE_POLL_S, or QUEUE_OWN_POLL_S when
    every lease it found busy is held by a job of its own store whose supervisor lives: that job's end moves the
    store's wake-up, and a try every few seconds meanwhile (staging, a probe on every host) only takes CPU from it."""
    from orchestrator.detach import live_supervisor
    jobs = {(b.get("holder") or {}).get("job") for b in busy.busy}
    if jobs and all(j and store.get(j) is not None and live_supervisor(j) is not None for j in jobs):
        return QUEUE_OWN_POLL_S
    return QUEUE_POLL_S


_WAITING: set[str] = set()  # jobs this process is waiting for (live_supervisor does not name this process)
_TOLD: dict[str, tuple[str, int]] = {}  # what was said last of each waiting job (said again only when it changes)


def wait_for_leases(prepared: Prepared, sup: Supervisor, store, rd: RunDir, busy: LeasesBusy, emit,
                    stamp: int | None = None) -> None:
    """The job is QUEUED: recorded with what it waits for (RUN_DIR/queue.json) and its place in this store's queue,
    told to the caller ("queued": {"job_id", "line", "position"}); once no job queued before it in this store wants
    an overlapping host/GPU (FIFO), returns as soon as a job of this store ends (store.wait_moved: within ~0.05 s;
    `stamp`: the store's wake_stamp() before the try that found the hosts leased, so an end during that try counts)
    or after queue_poll_s (QUEUE_POLL_S for a holder of another store, another user's), or at once when cancelled.
    The caller tries again."""
    job = prepared.plan.job_id
    line = str(busy)
    _WAITING.add(job)
    try:
        old = rd.read_json(RunDir.QUEUE)
        since = old.get("since") if isinstance(old, dict) and old.get("waiting_for") else None
        rd.write_json(RunDir.QUEUE, {"waiting_for": line, "since": since or time.time(), "t": time.time()})
        store.update(job, JobState.QUEUED, detail=line[:500])
        told = _TOLD.get(job)
        poll = queue_poll_s(store, busy)
        while True:
            position = queue_positions().get(job, 1)
            if (line, position) != told:
                emit("queued", {"job_id": job, "line": line, "position": position})
                told = _TOLD[job] = (line, position)
            # a job of this store ended or started: look again at once; another store's (user's) holder: every
            # QUEUE_POLL_S
            store.wait_moved(poll, sup.cancel.wait, since=stamp)
            stamp = None
            if sup.cancel.is_set() or position == 1:
                return
    finally:
        _WAITING.discard(job)


def _replanned(prepared: Prepared, rd: RunDir, sup: Supervisor, emit, excluded: list[str]) -> LaunchPlan:
    """The run dir and the supervisor take the re-planned job (the hosts taken out gone, spares in); the caller is
    told ("replanned": the new node -> host map, for its output prefixes)."""
    from orchestrator.core.spec import cluster_to_dict
    write_files(dict(prepared.files, **{RunDir.CLUSTER: json.dumps(cluster_to_dict(prepared.cluster), indent=2,
                                                                   sort_keys=True) + "\n"}), rd.root)
    sup.plan = prepared.plan
    emit("replanned", {"job_id": prepared.plan.job_id, "excluded": excluded,
                       "hosts": {n.node_rank: n.host for n in prepared.plan.node_plans}})
    return prepared.plan


def _notifier(prepared: Prepared, rd: RunDir, sup: Supervisor, on_event):
    """The job's Notifier (orchestrator.notify), fed the heartbeats and watching restarts.jsonl; None without a
    notify: block. Failures to deliver are told through on_event("notify", {"job_id", "line"}) (else stderr)."""
    spec = getattr(prepared.recipe, "notify", None)
    if spec is None or not spec.on:
        return None
    from orchestrator.notify import Notifier, job_facts

    def say(line: str) -> None:
        if on_event:
            on_event("notify", {"job_id": prepared.plan.job_id, "line": line})
        else:
            print(f"orchestrate: job {prepared.plan.job_id}: {line}", file=sys.stderr, flush=True)

    notifier = Notifier(spec, job_facts(prepared, str(rd.root)), rd, say=say)
    beat = sup.on_beat

    def on_beat(rec: dict) -> None:
        notifier.beat(rec)
        if beat is not None:
            beat(rec)
    sup.on_beat = on_beat
    notifier.watch()
    return notifier


def restart_count(rd: RunDir) -> int:
    """Every restart, whoever decided it (RunDir.restarts)."""
    return rd.restarts()


def _run_once(prepared: Prepared, launcher, sup: Supervisor, store, rd: RunDir, attempt: int, on_event,
              adopt: JobHandle | None = None) -> JobResult:
    plan = prepared.plan
    if adopt is not None:  # submitted already (a SLURM sweep's array task): its records are this attempt's own
        if sup.cancel.is_set():
            launcher.cancel(adopt, rd)
            return JobResult(JobState.CANCELLED, 130, sup.cancel_reason)
        return _watch(launcher.adopt(adopt, rd), plan, sup, store, rd, attempt, on_event)
    for r in range(plan.nodes):  # an earlier attempt's records must not speak for this one
        for path in (rd.exit_file(r), rd.agent_file(r)):
            path.unlink(missing_ok=True)
    rd.path(RunDir.OUTCOME).unlink(missing_ok=True)
    submission = launcher.prepare(replace(plan, submitter=submitter()))  # (the lease files name who submitted it)
    if on_event and attempt == 0 and not rd.path(RunDir.QUEUE).exists():  # (said once, not on each look again)
        on_event("submitting", {"job_id": plan.job_id, "run_dir": str(rd.root)})
    try:
        running = launcher.submit(submission, rd, cancel=sup.cancel)
    except SubmitCancelled as e:  # Ctrl-C / cancel while the backend was still starting it: nothing runs
        return JobResult(JobState.CANCELLED, 130, sup.cancel_reason or str(e))
    except LeasesBusy:  # nothing started: the caller waits (QUEUED) or, with --no-wait, records it
        raise
    except Exception as e:
        if not getattr(e, "bad_hosts", None):  # (hosts a spare may replace: the caller decides, and records)
            store.update(plan.job_id, JobState.FAILED, detail=str(e)[:500], root_cause=str(e)[:500],
                         exit_code=getattr(e, "exit_code", None))
        raise
    return _watch(running, plan, sup, store, rd, attempt, on_event)


def _watch(running, plan: LaunchPlan, sup: Supervisor, store, rd: RunDir, attempt: int, on_event) -> JobResult:
    """The submitted attempt recorded (RUNNING, its handle) and supervised to its end."""
    store.update(plan.job_id, JobState.RUNNING, handle=running.handle.uri)
    try:
        rd.write_json(RunDir.HANDLE, {"uri": running.handle.uri, "data": running.handle.data})
    except (OSError, TypeError):
        pass
    if on_event:
        on_event("running", {"job_id": plan.job_id, "handle": running.handle.uri, "attempt": attempt})
    sup.attempt = attempt
    return sup.run(running)


# ------------------------------------------------------------------------------------------- any process

def _record(job: str):
    from orchestrator.store import JobStore
    rec = JobStore().get(job)
    if rec is None:
        raise ConfigError(f"job {job!r} not found (see `orchestrate ls`)")
    return rec


def _backend(rec) -> tuple[Any, JobHandle, RunDir]:
    """The launcher, handle and run dir of a recorded job, rebuilt from its run dir (cluster.json, handle.json)."""
    from orchestrator.core.spec import cluster_from_dict
    rd = RunDir(rec.run_dir)
    cluster_data, handle_data = rd.read_json(RunDir.CLUSTER), rd.read_json(RunDir.HANDLE)
    if not isinstance(cluster_data, dict):
        raise OrchestratorError(f"job {rec.id}: run dir {rd.root} has no readable {RunDir.CLUSTER}")
    h = handle_data if isinstance(handle_data, dict) else {"uri": rec.handle or "", "data": {}}
    handle = JobHandle(h.get("uri") or rec.handle or "", dict(h.get("data") or {}, run_dir=str(rd.root)))
    return launcher_for(cluster_from_dict(cluster_data)), handle, rd


def reconcile(rec):
    """The store never lies: a job recorded as not ended whose supervisor is gone is asked to its backend; when the
    backend says it ended (or nothing of it runs any more), the end is recorded. Returns (record, JobStatus|None)."""
    from orchestrator.detach import live_supervisor
    from orchestrator.store import JobStore
    if is_terminal(rec.state) or live_supervisor(rec.id) is not None:
        return rec, None
    if rec.state == JobState.QUEUED and rec.id not in _WAITING:  # its waiting submitter is gone: nothing ever started
        why = "the submitter waiting for leased hosts is gone; nothing was started"
        JobStore().update(rec.id, JobState.CANCELLED, detail=why, root_cause=why, exit_code=130, final=True)
        return JobStore().get(rec.id), None
    rd = RunDir(rec.run_dir)
    done = rd.outcome()  # the supervisor judged the end but could not record it in the store (a full disk)
    if done.get("state") in ("COMPLETED", "FAILED", "CANCELLED"):
        JobStore().update(rec.id, done["state"], detail=done.get("root_cause") or None,
                          root_cause=done.get("root_cause") or None, exit_code=done.get("exit_code"),
                          restarts=restart_count(rd), final=True)
        return JobStore().get(rec.id), None
    try:
        launcher, handle, rd = _backend(rec)
        st = launcher.status(handle, rd)
    except Exception as e:  # noqa: BLE001 - status must still show what the store knows
        if rec.state == JobState.PENDING and time.time() - rec.created < 120:
            return rec, None  # being submitted right now
        return rec, JobStatus(JobState(rec.state) if rec.state in JobState.__members__ else JobState.RUNNING, (),
                              f"backend unknown ({type(e).__name__}: {str(e)[:120]})")
    if st.state == JobState.RUNNING and not st.nodes and time.time() - rec.updated > 120:
        st = JobStatus(JobState.FAILED, (), "no node of the job ever started")
    if st.state.terminal:
        why = st.reason
        if st.state == JobState.FAILED and rec.backend != "slurm":
            why = "the supervising process is gone and no node of the job is running"
            bad = next((n for n in st.nodes if n.end == "failed"), None) or \
                next((n for n in st.nodes if n.returncode not in (0, None) or n.state == "lost"), None)
            if bad is not None:
                how = bad.end or bad.state
                why += (f"; node {bad.node_rank} ({bad.host}) {how}" + (f" (exit {exit_text(bad.returncode)})"
                        if bad.returncode is not None else "") + (f": {bad.reason}" if bad.reason else ""))
        code = 0 if st.state == JobState.COMPLETED else 1
        JobStore().update(rec.id, st.state, detail=why or None, root_cause=why or None,
                          restarts=restart_count(RunDir(rec.run_dir)), exit_code=code, final=True)
        rec = JobStore().get(rec.id)
        # what the hosts said of each node, kept: a later `status` (the record now ended) shows the same table
        nodes = [NodeExit(n.node_rank, n.host, n.returncode, end=n.end or ("lost" if n.state == "lost" else ""),
                          note=n.reason) for n in st.nodes]
        rd.write_outcome(outcome_record(JobResult(st.state, code, why or "", tuple(nodes)), "status"))
    return rec, st


def status(job: str):
    """(record, backend status or None): the store's record, reconciled with the backend when nobody supervises it."""
    return reconcile(_record(job))


RECONCILE_THREADS = 8


def jobs(limit: int | None = 20) -> list:
    """The latest `limit` records (None: all), each reconciled. The backends of the jobs nobody supervises are asked at
    once (up to RECONCILE_THREADS at a time): hosts that do not answer cost one connect timeout, not one each."""
    from concurrent.futures import ThreadPoolExecutor
    from orchestrator.store import JobStore
    recs = JobStore().list(limit)
    asked = [r for r in recs if not is_terminal(r.state)]
    if len(asked) <= 1:
        return [reconcile(r)[0] for r in recs]
    with ThreadPoolExecutor(min(RECONCILE_THREADS, len(asked)), thread_name_prefix="reconcile") as ex:
        fresh = dict(zip((r.id for r in asked), ex.map(lambda r: reconcile(r)[0], asked), strict=True))
    return [fresh.get(r.id, r) for r in recs]


def logs(job: str, node: int | None = None):
    rec = _record(job)
    launcher, handle, rd = _backend(rec)
    return launcher.logs(handle, rd, node)


def cancel(job: str, wait_s: float = 90.0, by: str = "cancelled by the user (orchestrate cancel)") -> str:
    """Cancel a job from any process: its supervisor is asked (a cancel request in the run dir + SIGTERM: it tears
    every node down and records CANCELLED); with no supervisor left, the backend is asked directly. Returns the
    final state; raises OrchestratorError when the job did not end within `wait_s`."""
    import signal as _signal
    from orchestrator.detach import live_supervisor
    from orchestrator.store import JobStore
    rec, _ = reconcile(_record(job))
    if is_terminal(rec.state):
        return rec.state
    rd = RunDir(rec.run_dir)
    sup = live_supervisor(rec.id)
    if sup is not None:
        rd.request_cancel(by)
        try:
            os.kill(sup, _signal.SIGTERM)
        except ProcessLookupError:
            sup = None
    if sup is not None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            state = JobStore().get(rec.id).state
            if is_terminal(state):
                return state
            time.sleep(0.2)
        raise OrchestratorError(f"job {rec.id}: its supervisor (pid {sup}) did not end the job within {wait_s:.0f} s; "
                                f"it is still {JobStore().get(rec.id).state}")
    launcher, handle, rd = _backend(rec)
    launcher.cancel(handle, rd)
    JobStore().update(rec.id, JobState.CANCELLED, detail=by, root_cause=by, exit_code=130, final=True)
    return JobStore().get(rec.id).state
