"""Recipe and cluster specs: YAML + flags + key=value overrides -> frozen, validated dataclasses.

The only omegaconf user. Merge order: schema defaults < file < CLI flags < dotlist overrides.
`load_*` read files; `parse_*` are pure. Every problem of one input is reported together in one
`ConfigError` (exit code 2) before anything is touched. Dotlist keys starting with `cluster.` go to
the cluster file (e.g. `cluster.slurm.time=00:30:00`); all others to the recipe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from orchestrator.errors import ConfigError, Problem
from orchestrator.core.health import HealthSpec
from orchestrator.core.hostlist import HostlistError, expand
from orchestrator.core.schema import (CLUSTER_SCHEMA, RECIPE_SCHEMA, check_env_map, is_secret_name, suggest,
                                 validate)

_DOT_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*$")


@dataclass(frozen=True)
class ModelSpec:
    name_or_path: str
    dtype: str = "auto"
    attn_implementation: str | None = None
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DataSpec:
    path: tuple[str, ...]
    config: str | None = None
    split: str = "train"
    eval_split: str | None = None
    max_samples: int | None = None


@dataclass(frozen=True)
class CheckpointSpec:
    resume: str = "auto"
    save_on_signal: bool = True


@dataclass(frozen=True)
class ParallelismSpec:
    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp: int | None = None
    cp: int | None = None
    sp: int | None = None


@dataclass(frozen=True)
class LaunchSpec:
    profile: str = "multi_gpu"
    nodes: int = 1
    procs_per_node: int = 1
    mixed_precision: str | None = None
    parallelism: ParallelismSpec = ParallelismSpec()
    env: dict[str, str] = field(default_factory=dict)
    secret_env: tuple[str, ...] = ()
    port: int | None = None


@dataclass(frozen=True)
class RecipeSpec:
    recipe: str
    model: ModelSpec
    tokenizer: str | None
    data: DataSpec
    trainer: dict[str, Any]
    checkpoint: CheckpointSpec
    launch: LaunchSpec
    health: HealthSpec = HealthSpec()
    source: str = "<recipe>"

    @property
    def name(self) -> str:
        return Path(self.source).stem if self.source.endswith((".yaml", ".yml")) else "recipe"

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe, as written to RUN_DIR/recipe.yaml (plain data, no secrets)."""
        from dataclasses import asdict
        d = {k: v for k, v in asdict(self).items() if k != "source"}
        d["data"]["path"] = list(self.data.path)
        d["launch"]["secret_env"] = list(self.launch.secret_env)
        return d


@dataclass(frozen=True)
class SSHSpec:
    hosts: tuple[str, ...]
    port: int = 22
    user: str | None = None
    key: str = "~/.ssh/id_ed25519"
    known_hosts: str = "~/.ssh/known_hosts"
    strict_host_keys: bool = True
    python: str = "python3"
    workdir: str = "~/orchestrate"
    shared_fs: bool = False
    connect_timeout: float = 10
    hostfile: str | None = None


@dataclass(frozen=True)
class SlurmSpec:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    gpus_per_node: int = 0
    max_gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    setup: tuple[str, ...] = ()
    python: str = "python3"
    workdir: str = "~/orchestrate"
    signal_lead_s: int = 120
    max_restarts: int = 3
    extra_sbatch: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterSpec:
    kind: str = "local"
    name: str = "local"
    accelerator: str = "auto"
    network_interface: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    ssh: SSHSpec | None = None
    slurm: SlurmSpec | None = None
    source: str = "<builtin local>"


# ----------------------------------------------------------------------------------------- loading

def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """Read one YAML file into a plain dict; syntax errors name file:line."""
    import yaml
    p = Path(path)
    if not p.is_file():
        raise ConfigError(Problem(str(path), f"{what} file not found"))
    text = p.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(Problem(f"{path}{line}", f"YAML syntax error: {problem}")) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(Problem(str(path), f"top level must be a mapping, got {type(data).__name__}"))
    return data


def parse_dotlist(items: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[Problem]]:
    """`a.b=1` overrides -> (recipe overrides, cluster overrides, problems). Values parse as YAML."""
    from omegaconf import OmegaConf
    recipe_items, cluster_items, problems = [], [], []
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not _DOT_KEY.match(key.strip()):
            problems.append(Problem(f"override {item!r}", "must look like key.path=value"))
            continue
        if key.startswith("cluster."):
            cluster_items.append(item[len("cluster."):])
        else:
            recipe_items.append(item)
    out = []
    for group in (recipe_items, cluster_items):
        try:
            out.append(OmegaConf.to_container(OmegaConf.from_dotlist(group), resolve=True) if group else {})
        except Exception as e:  # omegaconf raises several types for bad grammar
            problems.append(Problem("overrides", f"cannot parse: {str(e).splitlines()[0]}"))
            out.append({})
    return out[0], out[1], problems


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf
    cfgs = [OmegaConf.create(layer) for layer in layers if layer]
    if not cfgs:
        return {}
    merged = OmegaConf.merge(*cfgs)
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


def _resolve(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Resolve ${...} interpolations of one file; bad ones become a ConfigError."""
    try:
        return _merge(data)
    except Exception as e:
        raise ConfigError(Problem(source, f"interpolation failed: {str(e).splitlines()[0]}")) from None


# ----------------------------------------------------------------------------------------- pure parse

def parse_recipe(data: dict[str, Any], source: str = "<recipe>",
                 trainer_fields: Callable[[str], frozenset[str] | None] | None = None) -> RecipeSpec:
    """Validate a recipe dict; `trainer_fields(recipe)` (TRL config field names) checks the trainer block."""
    values, problems = validate(data, RECIPE_SCHEMA)
    launch = values.get("launch", {})
    env, env_problems = check_env_map(launch.get("env") or {}, "launch.env")
    problems.extend(env_problems)
    trainer = values.get("trainer") or {}
    fields = trainer_fields(values["recipe"]) if trainer_fields and values.get("recipe") in ("sft", "dpo", "cp") \
        else None
    if fields is not None:
        for key in trainer:
            if key not in fields:
                problems.append(Problem(f"trainer.{key}", f"unknown {values.get('recipe', '')} trainer option"
                                        + suggest(str(key), fields)))
    for key, value in trainer.items():
        if isinstance(key, str) and is_secret_name(key) and isinstance(value, str) and value:
            problems.append(Problem(f"trainer.{key}", "looks like a secret: pass it by launch.secret_env"))
    if problems:
        raise ConfigError(problems, source=source)
    m, d, c, p = values["model"], values["data"], values["checkpoint"], launch["parallelism"]
    return RecipeSpec(
        recipe=values["recipe"],
        model=ModelSpec(**m),
        tokenizer=values["tokenizer"],
        data=DataSpec(path=tuple([d["path"]] if isinstance(d["path"], str) else d["path"]), config=d["config"],
                      split=d["split"], eval_split=d["eval_split"], max_samples=d["max_samples"]),
        trainer=dict(trainer),
        checkpoint=CheckpointSpec(**c),
        health=HealthSpec(**values["health"]),
        launch=LaunchSpec(profile=launch["profile"], nodes=launch["nodes"], procs_per_node=launch["procs_per_node"],
                          mixed_precision=launch["mixed_precision"], parallelism=ParallelismSpec(**p), env=env,
                          secret_env=tuple(launch["secret_env"]), port=launch["port"]),
        source=source,
    )


def parse_cluster(data: dict[str, Any], source: str = "<cluster>") -> ClusterSpec:
    values, problems = validate(data, CLUSTER_SCHEMA)
    kind = values.get("kind", "local")
    env, env_problems = check_env_map(values.get("env") or {}, "env")
    problems.extend(env_problems)
    for other in ("ssh", "slurm"):
        if other in data and other != kind:
            problems.append(Problem(other, f"block given but kind is {kind!r}"))
    ssh = slurm = None
    if kind == "ssh" and not problems:
        s = values["ssh"]
        hosts: list[str] = []
        if s["hosts"] is None and s["hostfile"] is None:
            problems.append(Problem("ssh.hosts", "missing: give ssh.hosts (list or 'gpu[01-04]') or ssh.hostfile"))
        elif s["hosts"] is not None:
            try:
                raw = [s["hosts"]] if isinstance(s["hosts"], str) else list(s["hosts"])
                hosts = [h for expr in raw for h in expand(expr)]
            except HostlistError as e:
                problems.append(Problem("ssh.hosts", str(e)))
        dups = sorted({h for h in hosts if hosts.count(h) > 1})
        if dups:
            problems.append(Problem("ssh.hosts", f"duplicate hosts: {', '.join(dups)}"))
        ssh = SSHSpec(hosts=tuple(hosts), **{k: v for k, v in s.items() if k != "hosts"})
    if kind == "slurm":
        s = values["slurm"]
        slurm = SlurmSpec(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in s.items()})
    if problems:
        raise ConfigError(problems, source=source)
    name = values["name"] or (Path(source).stem if source.endswith((".yaml", ".yml")) else kind)
    return ClusterSpec(kind=kind, name=name, accelerator=values["accelerator"],
                       network_interface=values["network_interface"], env=env, ssh=ssh, slurm=slurm, source=source)


def with_hosts(cluster: ClusterSpec, hosts: list[str]) -> ClusterSpec:
    """A copy of an ssh cluster with its host list set (hostfile read by the caller)."""
    from dataclasses import replace
    assert cluster.ssh is not None
    return replace(cluster, ssh=replace(cluster.ssh, hosts=tuple(hosts)))


def parse_hostfile(text: str, source: str) -> list[str]:
    """One host per line; '#' comments; 'host slots=N' style extras ignored (pdsh/DeepSpeed hostfiles)."""
    hosts = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(line.split()[0])
    if not hosts:
        raise ConfigError(Problem(source, "hostfile lists no hosts"))
    return hosts


# ----------------------------------------------------------------------------------------- entry points

def load(recipe_path: str, cluster_path: str | None = None, flags: dict[str, Any] | None = None,
         overrides: list[str] | None = None,
         trainer_fields: Callable[[str], frozenset[str] | None] | None = None
         ) -> tuple[RecipeSpec, ClusterSpec]:
    """Read + merge + validate recipe and cluster. All problems of one input in one ConfigError."""
    rec_over, clu_over, dot_problems = parse_dotlist(list(overrides or []))
    if dot_problems:
        raise ConfigError(dot_problems, source="command line")
    recipe_file = _resolve(read_yaml(recipe_path, "recipe"), recipe_path)
    flag_layer: dict[str, Any] = {}
    for key, value in (flags or {}).items():
        if value is not None:
            flag_layer.setdefault("launch", {})[key] = value
    recipe_dict = _merge(recipe_file, flag_layer, rec_over)
    cluster_dict: dict[str, Any] = {}
    if cluster_path:
        cluster_dict = _resolve(read_yaml(cluster_path, "cluster"), cluster_path)
    cluster_dict = _merge(cluster_dict, clu_over) if clu_over else cluster_dict
    errors: list[ConfigError] = []
    recipe = cluster = None
    try:
        recipe = parse_recipe(recipe_dict, source=recipe_path, trainer_fields=trainer_fields)
    except ConfigError as e:
        errors.append(e)
    try:
        cluster = parse_cluster(cluster_dict, source=cluster_path or "<builtin local>")
        if cluster.kind == "ssh" and cluster.ssh and cluster.ssh.hostfile and not cluster.ssh.hosts:
            hf = Path(cluster.ssh.hostfile).expanduser()
            if not hf.is_file():
                raise ConfigError(Problem("ssh.hostfile", f"file not found: {hf}"), source=cluster_path)
            cluster = with_hosts(cluster, parse_hostfile(hf.read_text(), str(hf)))
    except ConfigError as e:
        errors.append(e)
    if errors:
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError([Problem(e.source or "", str(p)) for e in errors for p in e.problems])
    assert recipe is not None and cluster is not None
    return recipe, cluster


def cluster_to_dict(cluster: ClusterSpec) -> dict[str, Any]:
    from dataclasses import asdict
    return asdict(cluster)


def cluster_from_dict(d: dict[str, Any]) -> ClusterSpec:
    """Inverse of cluster_to_dict (the run dir's cluster.json: cancel/status from another process)."""
    d = dict(d)
    if d.get("ssh"):
        d["ssh"] = SSHSpec(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d["ssh"].items()})
    if d.get("slurm"):
        d["slurm"] = SlurmSpec(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d["slurm"].items()})
    return ClusterSpec(**d)
