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

from orchestrator.errors import ConfigError, Problem
from orchestrator.core.jobplan import LaunchPlan
from orchestrator.core.plan import PlanFacts, make_plan
from orchestrator.core.render import render_files
from orchestrator.core.schema import PROFILES
from orchestrator.core.spec import ClusterSpec, RecipeSpec, load

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILE_DIR = REPO_ROOT / "cluster_configs" / "profiles"
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")


@dataclass(frozen=True)
class Prepared:
    recipe: RecipeSpec
    cluster: ClusterSpec
    plan: LaunchPlan
    files: dict[str, str]


# ------------------------------------------------------------------------------------------- facts

def trainer_fields(recipe: str) -> frozenset[str] | None:
    """Field names of TRL's config for this recipe, cached per TRL version (importing trl costs ~3 s)."""
    try:
        from importlib.metadata import version
        trl_version = version("trl")
    except Exception:
        return None
    cls_name = "DPOConfig" if recipe == "dpo" else "SFTConfig"
    cache = _home() / "cache" / f"trl-{trl_version}-{cls_name}.json"
    try:
        return frozenset(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    try:
        import trl
        fields = sorted(f.name for f in dataclasses.fields(getattr(trl, cls_name)))
    except Exception:
        return None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(fields))
    except OSError:
        pass
    return frozenset(fields)


def _home() -> Path:
    from orchestrator.store import home
    return home()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def detect_accelerator(cluster: ClusterSpec) -> str:
    if cluster.accelerator != "auto":
        return cluster.accelerator
    if cluster.kind == "local":
        return "gpu" if Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists() else "cpu"
    if cluster.kind == "slurm":
        return "gpu" if cluster.slurm and cluster.slurm.gpus_per_node > 0 else "cpu"
    return "gpu"


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or value.endswith(DATA_SUFFIXES)


def resolve_paths(recipe: RecipeSpec, cwd: Path) -> RecipeSpec:
    """Make local paths absolute (relative to where orchestrate runs); missing local files are errors."""
    problems: list[Problem] = []
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
    if ckpt.resume not in ("auto", "never"):
        ckpt = replace(ckpt, resume=str((cwd / Path(ckpt.resume).expanduser()).resolve()))
    if problems:
        raise ConfigError(problems, source=recipe.source)
    return replace(recipe, model=model, tokenizer=tok, trainer=trainer, checkpoint=ckpt,
                   data=replace(recipe.data, path=tuple(data_paths)))


def _builtin_models() -> dict[str, dict]:
    from orchestrator.core.models import BUILTIN_MODELS
    return BUILTIN_MODELS


def model_facts(recipe: RecipeSpec) -> dict[str, Any] | None:
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
    if cluster.kind == "ssh" and cluster.ssh and not cluster.ssh.shared_fs:
        return f"{cluster.ssh.workdir.rstrip('/')}/runs/{job_id}"
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
            run_dir: str | None = None) -> Prepared:
    """Everything `render` shows and `submit` runs, without writing anything. `run_dir` overrides where the
    run dir is (render: the output directory, so a rendered job.sbatch can be submitted by hand from it)."""
    cwd = Path(cwd or os.getcwd())
    flags = {"nodes": nodes, "procs_per_node": procs_per_node, "profile": profile}
    recipe, cluster = load(recipe_path, cluster_path, flags=flags, overrides=overrides,
                           trainer_fields=trainer_fields if check_trainer else None)
    recipe = resolve_paths(recipe, cwd)
    profile_name, profile_cfg = load_profile(recipe, cwd)
    job_id = job_id or new_job_id(recipe)
    port = recipe.launch.port or (free_port() if cluster.kind == "local" else 29500)
    facts = PlanFacts(job_id=job_id, run_dir=run_dir or _run_dir_for(cluster, job_id), output_dir=recipe.trainer["output_dir"],
                      python=_python_for(cluster), port=port, accelerator=detect_accelerator(cluster),
                      profile_name=profile_name, profile_config=profile_cfg, model_facts=model_facts(recipe),
                      hosts=cluster.ssh.hosts if cluster.ssh else ())
    plan = make_plan(recipe, cluster, facts)
    files = render_files(plan, recipe.to_dict())
    if cluster.kind == "slurm":  # the standalone job.sbatch is part of what render shows (pure prepare)
        files.update(make_launcher(cluster).prepare(plan).files)
    return Prepared(recipe=recipe, cluster=cluster, plan=plan, files=files)


def write_files(files: dict[str, str], out_dir: Path) -> list[Path]:
    """Write rendered files owner-only (0700 dirs, 0600 files)."""
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(out_dir, 0o700)
    written = []
    for rel, text in sorted(files.items()):
        path = out_dir / rel
        for parent in reversed(path.relative_to(out_dir).parents[:-1]):
            d = out_dir / parent
            if not d.is_dir():
                d.mkdir(mode=0o700)
                os.chmod(d, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)
        written.append(path)
    return written


def submit(prepared: Prepared, *, on_line: Callable[[int, str], None] | None = None,
           on_event: Callable[[str, dict], None] | None = None):
    """Write the run dir, record the job, launch it and supervise it to the end. Returns JobResult."""
    from orchestrator.store import JobStore, digest
    plan = prepared.plan
    run_dir = Path(plan.run_dir) if prepared.cluster.kind != "ssh" or (prepared.cluster.ssh and
                                                                        prepared.cluster.ssh.shared_fs) \
        else _home() / "runs" / plan.job_id
    from orchestrator.core.spec import cluster_to_dict
    write_files(dict(prepared.files, **{"cluster.json": json.dumps(cluster_to_dict(prepared.cluster), indent=2,
                                                                   sort_keys=True) + "\n"}), run_dir)
    store = JobStore()
    store.create(job_id=plan.job_id, recipe=prepared.recipe.source, recipe_digest=digest(prepared.files["recipe.yaml"]),
                 cluster=prepared.cluster.name, backend=prepared.cluster.kind, nodes=plan.nodes,
                 world_size=plan.world_size, run_dir=str(run_dir))
    max_restarts = int(plan.health.max_restarts)
    restarts, stalled_attempts, best_step = 0, 0, -1
    while True:
        result = _run_once(prepared, store, run_dir, restarts, on_line, on_event)
        progressed = result.max_step is not None and result.max_step > best_step
        best_step = max(best_step, result.max_step if result.max_step is not None else -1)
        if result.state in ("COMPLETED", "CANCELLED") or restarts >= max_restarts:
            break
        if restarts > 0:  # only restarts count toward a crash loop
            stalled_attempts = 0 if progressed else stalled_attempts + 1
        if stalled_attempts >= 2:
            result = dataclasses.replace(result, root_cause=result.root_cause + f" (crash loop: {stalled_attempts} "
                                         "restarts in a row made no progress; not restarting)")
            break
        restarts += 1
        store.update(plan.job_id, "RESTARTING", detail=f"restart {restarts}/{max_restarts}: {result.root_cause}"[:2000],
                     restarts=restarts)
        if on_event:
            on_event("restart", {"job_id": plan.job_id, "restart": restarts, "max_restarts": max_restarts,
                                 "reason": result.root_cause, "step": best_step})
    store.update(plan.job_id, result.state, detail=result.root_cause or None, exit_code=result.returncode,
                 root_cause=result.root_cause or None, restarts=restarts)
    return dataclasses.replace(result, restarts=restarts)


def make_launcher(cluster: ClusterSpec, local_run_dir: Path | None = None):
    from orchestrator.launchers import get_launcher
    if cluster.kind == "ssh":
        from orchestrator.launchers.ssh.launcher import SSHLauncher
        return SSHLauncher(cluster, local_run_dir=str(local_run_dir) if local_run_dir else None)
    return get_launcher(cluster.kind, cluster)


def _run_once(prepared: Prepared, store, run_dir: Path, attempt: int, on_line, on_event):
    plan = prepared.plan
    launcher = make_launcher(prepared.cluster, run_dir)
    submission = launcher.prepare(plan)
    if on_event and attempt == 0:
        on_event("submitting", {"job_id": plan.job_id, "run_dir": str(run_dir)})
    try:
        handle = launcher.submit(submission, on_line=on_line) if prepared.cluster.kind == "local" \
            else launcher.submit(submission)
    except Exception as e:
        store.update(plan.job_id, "FAILED", detail=str(e)[:500], root_cause=str(e)[:500])
        raise
    store.update(plan.job_id, "RUNNING", handle=handle.uri)
    try:
        write_files({"handle.json": json.dumps({"uri": handle.uri, "data": handle.data}, default=str, indent=2,
                                               sort_keys=True) + "\n"}, run_dir)
    except (OSError, TypeError):
        pass
    if on_event:
        on_event("running", {"job_id": plan.job_id, "handle": handle.uri, "attempt": attempt})
    try:
        return launcher.wait(handle, on_line=on_line)
    except KeyboardInterrupt:  # launchers that do not handle Ctrl-C themselves: cancel through the backend
        from orchestrator.types import JobResult
        launcher.cancel(handle)
        return JobResult("CANCELLED", 130, "cancelled by the user (Ctrl-C)")

