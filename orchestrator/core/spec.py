"""Recipe and cluster specs: YAML + flags + key=value overrides -> frozen, validated dataclasses.

A job file is a built-in recipe (`recipe: sft|dpo|cp` with model/data/trainer blocks: RecipeSpec) or your own code
(`run: {script|module|trl, args}`: RunJobSpec); both share checkpoint/launch/health.

The spec dataclasses below are the one source of the recipe and cluster fields, defaults and checks
(core/schema.py derives the validator from them). Beyond single fields this module checks what spans
several: the `trainer:` block against TRL's field kinds and the plan's ranges, the `run:` block (one entry point,
TRL subcommands, its args' TrainingArguments-like values), ssh hosts (given or from a hostfile), blocks that do not
match the cluster kind.

The only omegaconf user, and only where it is needed: dotlist overrides, `${...}` interpolations, merges that are
not of plain data (`_merged_plain` does the others: importing omegaconf was most of a submit's validation time).
Merge order: dataclass defaults < file < CLI flags < dotlist overrides. `read_yaml`/`load` read files; `parse_*` are
pure. Every problem of one input is reported together in one `ConfigError` (exit code 2) before anything is touched.
Dotlist keys starting with `cluster.` go to the cluster file (e.g. `cluster.slurm.time=00:30:00`); all others to the
recipe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Callable

from orchestrator.core.health import HealthSpec
from orchestrator.core.container import RUNTIMES
from orchestrator.core.schema import (Argv, Check, EnvMap, EnvName, GpuIds, Hosts, IfName, Internal, Mounts, NameList,
                                      Port, PosInt, Prefixes, Procs, RunArgs, StrOrList, Url, arg_text, build,
                                      check_value, duplicate_hosts, expand_host_entry, from_plain, is_secret_name,
                                      mask_url, one_of, rules, suggest, to_plain)
from orchestrator.core.trainerranges import always_checked, broken_rule, config_class_name, takes_fractions
from orchestrator.errors import ConfigError, Problem

_DOT_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*$")

# ----------------------------------------------------------------------------------------- the specs
# Each field is declared once: its type and default here are what the validator checks and fills in
# (core/schema.py derives the rules; a field without a default is required).


@dataclass(frozen=True)
class ModelSpec:
    name_or_path: str
    dtype: Annotated[str, one_of("auto", "float32", "bfloat16", "float16")] = "auto"
    attn_implementation: str | None = None
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DataSpec:
    path: StrOrList  # one path / hub name, or a list of them
    config: str | None = None
    split: str = "train"
    eval_split: str | None = None
    max_samples: PosInt | None = None


@dataclass(frozen=True)
class CheckpointSpec:
    resume: str = "auto"  # auto | latest | never | a checkpoint directory (orchestrator.core.resume)
    save_on_signal: bool = True


@dataclass(frozen=True)
class OutputsSpec:
    # SSH hosts without a shared filesystem: what comes back to the submitter's output dir after the job
    # (none: stays on the hosts, `status` says where; final: the whole output dir; last_checkpoint: its newest
    # checkpoint-N)
    fetch: Annotated[str, one_of("none", "final", "last_checkpoint")] = "none"


@dataclass(frozen=True)
class ParallelismSpec:
    dp_replicate: PosInt | None = None
    dp_shard: PosInt | None = None
    tp: PosInt | None = None
    cp: PosInt | None = None
    sp: PosInt | None = None


@dataclass(frozen=True)
class LaunchSpec:
    profile: str = "multi_gpu"  # a name of core.schema.PROFILES or a path to an accelerate YAML
    nodes: PosInt = 1
    procs_per_node: Procs = "auto"  # auto: one process per GPU of a node (1 on a CPU cluster)
    mixed_precision: Annotated[str | None, one_of(None, "no", "bf16", "fp16")] = None
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    env: EnvMap = field(default_factory=dict)
    secret_env: NameList = ()
    port: Port | None = None
    gpus: GpuIds | None = None  # the GPUs of each node to use (indices), e.g. [0, 1]; null: the cluster's / all
    allow_idle_gpus: bool = False  # true: GPUs a node has (or was allocated) may be left without a process
    env_passthrough: Prefixes = ()  # the submitter's variables with these prefixes go to every rank (NCCL_, FI_, ...)


# What a `notify:` block can subscribe to (docs/CONTRACT.md "Notifications"). A subscription also covers the
# narrower events listed here: `failed` every FAILED end (a hang's end is sent as `hung`), `restarted` every restart
# (a SLURM requeue is sent as `preempted`).
NOTIFY_EVENTS = ("started", "restarted", "preempted", "hung", "failed", "completed", "cancelled")
NOTIFY_COVERS = {"failed": ("hung",), "restarted": ("preempted",)}


@dataclass(frozen=True)
class NotifySpec:
    """`notify:` (in a job file, or a cluster file for every job on it: the job's keys win) - the submit host tells
    someone when a job ends or restarts: it runs `command` (a list of words, or a string split into words; no shell)
    with the event's JSON on stdin, and/or POSTs the same JSON to `webhook` (or to the URL held by the submit
    environment's variable `webhook_env`, so that it is in no file). Delivery never changes the job's state."""

    on: Annotated[tuple[str, ...], Check("choice_list", NOTIFY_EVENTS)] = ("failed", "completed")
    command: Argv | None = None
    webhook: Url | None = None
    webhook_env: EnvName | None = None
    timeout_s: float = 10

    def wants(self, event: str) -> bool:
        return any(event == s or event in NOTIFY_COVERS.get(s, ()) for s in self.on)


@dataclass(frozen=True)
class SweepSpec:
    """`sweep:` in a job file: `orchestrate submit JOB` runs the grid as `--sweep` options would (docs/CONTRACT.md
    "Sweeps"): `grid` maps dotted keys to their values (a list; the product of every key's, the last key varying
    fastest); `max_parallel` and `stop_if_worse` are `--max-parallel` / `--stop-if-worse`. Command-line `--sweep`
    options replace a key's values or add keys; the command-line flags win. Each point's job runs the file without
    its sweep."""

    grid: dict[str, Any] = field(default_factory=dict)
    max_parallel: PosInt | None = None
    stop_if_worse: float | None = None


def sweep_problems(spec: "SweepSpec | None") -> list[Problem]:
    """What a sweep block may not say: an empty grid, a key that is not a dotted key, a key of no value."""
    if spec is None:
        return []
    from orchestrator.core.sweep import KEY
    problems = []
    if not spec.grid:
        problems.append(Problem("sweep.grid", "give at least one KEY: [values] to sweep"))
    for key, values in spec.grid.items():
        if not KEY.match(str(key)):
            problems.append(Problem(f"sweep.grid.{key}", "must be a dotted key such as trainer.learning_rate"))
        elif isinstance(values, list) and not values:
            problems.append(Problem(f"sweep.grid.{key}", "an empty list of values"))
        elif isinstance(values, dict):
            problems.append(Problem(f"sweep.grid.{key}", "must be a list of values (a mapping is one value: "
                                                         "write it as a one-item list)"))
    if spec.stop_if_worse is not None and not spec.stop_if_worse > 1:
        problems.append(Problem("sweep.stop_if_worse", f"must be a number > 1, got {spec.stop_if_worse}"))
    return problems


ABSENT: Any = object()  # merge_block's `given` for a job file without the block's key


def merge_block(base: Any, job: Any, given: Any = ABSENT, together: tuple[str, ...] = ()) -> Any:
    """The block (`container:`, `notify:`) a job gets when its cluster file sets one for every job: the cluster's
    (`base`) with the keys the job's block gives put over it (`given`: the job's block as written; a mapping key such
    as `env` merges name by name). `together`: keys that are one choice (either given replaces all). A job's
    `block: null` turns the cluster's off; a job without the key gets the cluster's as it is."""
    if given is ABSENT:
        return base
    if base is None or job is None or not isinstance(given, dict):
        return job
    keys = {"on" if k is True else k for k in given}  # (YAML 1.1 reads a bare `on:` key as true)
    keys |= set(together) if set(together) & keys else set()
    values = {k: getattr(job, k) for k in keys if k in type(base).__dataclass_fields__}
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(getattr(base, k), dict):
            values[k] = {**getattr(base, k), **v}
    return replace(base, **values)


def notify_problems(spec: NotifySpec | None, where: str = "notify", merged: bool = False) -> list[Problem]:
    """What a notify block may not say: both webhook and webhook_env (in one file); once merged, subscriptions with
    nothing to deliver them."""
    if spec is None:
        return []
    if not merged and spec.webhook and spec.webhook_env:
        return [Problem(where, "give webhook or webhook_env, not both")]
    if merged and spec.on and not (spec.command or spec.webhook or spec.webhook_env):
        return [Problem(where, "nothing to deliver: give command, webhook or webhook_env (or on: [] for none)")]
    return []


def _masked(d: dict[str, Any]) -> dict[str, Any]:
    """A spec's plain data as it may be written to a file: no `notify` key when there is none, its webhook masked; no
    `sweep` (a run dir's job is one point, never the grid)."""
    d.pop("sweep", None)
    if d.get("notify") is None:
        d.pop("notify", None)
    elif d["notify"].get("webhook"):
        d["notify"]["webhook"] = mask_url(d["notify"]["webhook"])
    return d


@dataclass(frozen=True)
class ContainerSpec:
    """Run the ranks in a container image (docs/containers.md). Set in the job file, the cluster file, or both: the
    job's keys override the cluster's; `container: null` in the job runs it without the cluster's container."""

    image: str | None = None  # a registry reference, a local .sqsh/.sif path, or a name present on the hosts
    runtime: Annotated[str, one_of("auto", *RUNTIMES)] = "auto"  # auto: what the cluster has
    mounts: Mounts = ()  # HOST:CONTAINER[:ro|rw]; HOST absolute or ~/... (expanded on each node)
    env: EnvMap = field(default_factory=dict)  # extra non-secret env inside (secrets: launch.secret_env)
    workdir: str | None = None  # where the ranks start inside (default: their working directory, mounted)
    python: str = "python3"  # the image's interpreter
    options: tuple[str, ...] = ()  # extra flags for the runtime, verbatim (e.g. --shm-size=16g)


@dataclass(frozen=True)
class RecipeSpec:
    recipe: Annotated[str, one_of("sft", "dpo", "cp")]
    model: ModelSpec
    data: DataSpec
    tokenizer: str | None = None
    trainer: dict[str, Any] = field(default_factory=dict)  # TRL's config fields, checked by check_trainer
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    outputs: OutputsSpec = field(default_factory=OutputsSpec)
    launch: LaunchSpec = field(default_factory=LaunchSpec)
    health: HealthSpec = field(default_factory=HealthSpec)
    container: ContainerSpec | None = None
    notify: NotifySpec | None = None
    sweep: SweepSpec | None = None
    source: Internal = "<recipe>"

    @property
    def name(self) -> str:
        return Path(self.source).stem if self.source.endswith((".yaml", ".yml")) else "recipe"

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe, as written to RUN_DIR/recipe.yaml (plain data, no secrets)."""
        return _masked(to_plain(self, exclude=("source",) + (("container",) if self.container is None else ())))


@dataclass(frozen=True)
class RunSpec:
    """`run:` - your own training code, started on every rank under `accelerate launch` with the rendered config:
    exactly one of `script` (a file, resolved against the directory orchestrate runs from), `module` (`python -m`)
    or `trl` (a TRL CLI training subcommand: sft, dpo, grpo, ...). `args`: its command-line arguments, a list of
    words or a mapping option -> value (`--option value`; booleans as `true`/`false`, a list as several words)."""

    script: str | None = None
    module: Annotated[str | None, Check("module_name")] = None
    trl: str | None = None
    args: RunArgs = ()

    @property
    def kind(self) -> str:
        """script | module | trl"""
        return "script" if self.script is not None else "module" if self.module is not None else "trl"

    @property
    def target(self) -> str:
        return self.script or self.module or self.trl or ""

    def argv(self) -> tuple[str, ...]:
        """The arguments as the words of a command line."""
        if not isinstance(self.args, dict):
            return tuple(self.args)
        words: list[str] = []
        for key, value in self.args.items():
            words.append(key if key.startswith("-") else f"--{key}")
            words.extend(arg_text(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))
        return tuple(words)

    def options(self) -> dict[str, tuple[Any, str]]:
        """{option name (dashes in the name as underscores): (value, key path)}: `--name value`, `--name=value` and a
        bare `--flag` (value None) of a list, or the keys of a mapping. The last one given wins, as in argparse."""
        out: dict[str, tuple[Any, str]] = {}
        if isinstance(self.args, dict):
            for key, value in self.args.items():
                out[option_name(key)] = (value, f"run.args.{key}")
            return out
        for name, value, index in list_options(tuple(self.args)):
            out[option_name(name)] = (value, f"run.args[{index}]")
        return out

    def option(self, name: str) -> Any:
        """The value of one option (None: not given, or a bare flag)."""
        return self.options().get(name, (None, ""))[0]

    def with_option(self, name: str, value: str) -> "RunSpec":
        """A copy with `--name value` set (replaced where given, else appended)."""
        if isinstance(self.args, dict):
            keys = [k for k in self.args if option_name(k) == name]
            args = {k: v for k, v in self.args.items() if k not in keys[1:]}
            args[keys[0] if keys else name] = value
            return replace(self, args=args)
        return replace(self, args=set_list_option(tuple(self.args), name, value))


def _is_option_word(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not _NUMBER.fullmatch(word)


def option_name(key: str) -> str:
    return key.lstrip("-").replace("-", "_")


def list_options(words: tuple[str, ...]) -> list[tuple[str, str | None, int]]:
    """(name as written, value or None for a bare flag, index of the value word) of every `--option` in a list of
    command-line words; positional words and further words of a multi-word value are skipped."""
    out: list[tuple[str, str | None, int]] = []
    i = 0
    while i < len(words):
        word = words[i]
        if not (word.startswith("--") and len(word) > 2):
            i += 1
            continue
        name, eq, value = word[2:].partition("=")
        if eq:
            out.append((name, value, i))
            i += 1
        elif i + 1 < len(words) and not _is_option_word(words[i + 1]):
            out.append((name, words[i + 1], i + 1))
            i += 2
        else:
            out.append((name, None, i))
            i += 1
    return out


def set_list_option(words: tuple[str, ...], name: str, value: Any) -> tuple[str, ...]:
    """`--name value` set in a list of words: the value of the last `--name` replaced, else appended."""
    text = arg_text(value)
    found = [(n, v, i) for n, v, i in list_options(words) if option_name(n) == option_name(name)]
    out = list(words)
    if not found:
        return (*out, f"--{name}", text)
    n, v, i = found[-1]
    if out[i].startswith(f"--{n}="):
        out[i] = f"--{n}={text}"
    elif v is None:
        out.insert(i + 1, text)
    else:
        out[i] = text
    return tuple(out)


@dataclass(frozen=True)
class RunJobSpec:
    """A job of your own code (`run:`): no model/data/trainer blocks, your code gets what it needs from run.args."""

    run: RunSpec
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    outputs: OutputsSpec = field(default_factory=OutputsSpec)
    launch: LaunchSpec = field(default_factory=LaunchSpec)
    health: HealthSpec = field(default_factory=HealthSpec)
    container: ContainerSpec | None = None
    notify: NotifySpec | None = None
    sweep: SweepSpec | None = None
    source: Internal = "<recipe>"
    output_dir: Internal = ""  # set by the caller's path resolution: `--output_dir` of the args, or the default

    @property
    def name(self) -> str:
        return Path(self.source).stem if self.source.endswith((".yaml", ".yml")) else "recipe"

    def to_dict(self) -> dict[str, Any]:
        """The resolved job, as written to RUN_DIR/recipe.yaml (plain data, no secrets)."""
        d = _masked(to_plain(self, exclude=("source", "output_dir") + (("container",) if self.container is None
                                                                          else ())))
        d["run"] = {k: v for k, v in d["run"].items() if v is not None}
        return d


JobSpec = RecipeSpec | RunJobSpec


@dataclass(frozen=True)
class SSHSpec:
    hosts: Hosts = ()  # a list, or an expression like gpu[01-04]; or `hostfile`
    port: Port = 22
    user: str | None = None
    key: str = "~/.ssh/id_ed25519"
    known_hosts: str = "~/.ssh/known_hosts"
    strict_host_keys: bool = True
    python: str = "python3"
    workdir: str = "~/orchestrate"
    shared_fs: bool = False
    connect_timeout: float = 10
    hostfile: str | None = None
    gpus_per_node: int | None = None  # GPUs on each host (null: asked with nvidia-smi when procs_per_node is auto);
    #                                   the pre-flight checks it against every host
    stage: bool = True  # no shared_fs: copy the job's local code, data and model dirs to each host's cache (false:
    #                     they must exist at the same paths on every host; the node package is shipped either way)
    stage_exclude: tuple[str, ...] = ()  # glob patterns (a name or a relative path) never staged, besides the defaults
    allow_version_mismatch: bool = False  # run although python/torch/accelerate/transformers/trl/deepspeed differ
    min_free_gb: float = 1.0  # free disk each host must keep in its workdir after staging (for outputs)
    stage_relay: bool = True  # large stages to 3+ hosts: the hosts pass the bytes on to each other (they must reach
    #                           each other on an ephemeral TCP port; otherwise each host gets them from the submitter)


@dataclass(frozen=True)
class SlurmSpec:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    gpus_per_node: int = 0
    max_gpus_per_node: int | None = None
    cpus_per_task: PosInt | None = None
    mem: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    setup: tuple[str, ...] = ()
    python: str = "python3"
    workdir: str = "~/orchestrate"
    signal_lead_s: int = 120
    max_restarts: int = 3
    extra_sbatch: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()  # nodes never to use (sbatch --exclude); bad nodes the restart policy takes out join


@dataclass(frozen=True)
class ClusterSpec:
    kind: Annotated[str, one_of("local", "ssh", "slurm")] = "local"
    name: Annotated[str, Check("opt_str")] = "local"  # unset: the cluster file's name
    accelerator: Annotated[str, one_of("auto", "cpu", "gpu")] = "auto"
    network_interface: IfName | None = None  # a name (checked on every host) or auto (the one routing to the main node)
    gpus: GpuIds | None = None  # the GPUs of each node jobs on this cluster use (launch.gpus overrides)
    env: EnvMap = field(default_factory=dict)
    ssh: SSHSpec | None = None
    slurm: SlurmSpec | None = None
    container: ContainerSpec | None = None  # every job on this cluster runs in it (a job's own block overrides keys)
    notify: NotifySpec | None = None  # for every job on this cluster; a job's own notify: keys win (merge_block)
    source: Internal = "<builtin local>"


RECIPES: tuple[str, ...] = rules(RecipeSpec)["recipe"].choices or ()

# TRL field kinds (orchestrator.trlfields) -> value checks (core.schema.CHECKS); other kinds accept anything, null
# too (`any` is a union the kinds cannot name, such as TRL's `pad_to_multiple_of: int | "auto" | None`).
_TRL_CHECKS = {"int": "int", "float": "float", "bool": "bool", "str": "text", "list": "list", "dict": "mapping"}
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _trl_check(kind: str) -> str:
    opt = kind.startswith("opt_")
    base = kind[4:] if opt else kind
    return ("opt_" if opt else "") + _TRL_CHECKS[base] if base in _TRL_CHECKS else "opt_any"


# A built-in recipe's `trainer:` key -> the older TrainingArguments field that means the same; where the installed
# transformers lacks the key (activation_checkpointing came in 5.2x), the recipe passes it under the older name
# (recipes.common.build_config), so the shipped configs run on every transformers pyproject allows.
TRAINER_ALIASES = {"activation_checkpointing": "gradient_checkpointing",
                   "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}


def check_trainer(trainer: dict[str, Any], recipe: str, kinds: Mapping[str, str] | None
                  ) -> tuple[dict[str, Any], list[Problem]]:
    """The `trainer:` block against TRL's field kinds (`kinds`, None: not known), then each value that has the right
    type against the trainer's ranges (core.trainerranges.RANGES: what TrainingArguments / TRL / torch would refuse).

    A float field also takes an int, and a number written as a string (YAML 1.1 reads `1e-4` as one)
    becomes a float; an `opt_` kind takes null. Returns (the block, every problem)."""
    out: dict[str, Any] = {}
    problems: list[Problem] = []
    typed: list[str] = []  # keys whose value has the field's type: their ranges are checked below
    for key, value in trainer.items():
        where = f"trainer.{key}"
        field = TRAINER_ALIASES.get(key, key) if kinds is not None and key not in kinds else key
        if kinds is not None and field not in kinds:
            problems.append(Problem(where, f"unknown {recipe} trainer option" + suggest(str(key), kinds)))
            continue
        if isinstance(key, str) and is_secret_name(key) and isinstance(value, str) and value:
            problems.append(Problem(where, "looks like a secret: pass it by launch.secret_env"))
            continue
        trl = (kinds or {}).get(field, "any")
        numeric = trl in ("float", "opt_float") or (kinds is None and takes_fractions(key))
        if numeric and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)
        msg = check_value(_trl_check(trl), value)
        if msg:
            problems.append(Problem(where, msg))
        else:
            typed.append(key)
        out[key] = value
    config = config_class_name(recipe)
    for key in typed:
        rule = broken_rule(key, out[key], out, config)
        if rule is not None:
            problems.append(Problem(f"trainer.{key}", rule.problem(out[key])))
    for key, older in TRAINER_ALIASES.items():
        if key in trainer and older in trainer:
            problems.append(Problem(f"trainer.{older}", f"the same switch as trainer.{key}: give one of them"))
    return out, problems


# ----------------------------------------------------------------------------------------- own code (`run:`)

# TRL's CLI subcommands when TRL is not installed where orchestrate runs (orchestrator.trlfields.trl_commands reads
# the installed TRL's); the ones in TRL_NOT_TRAINING start no training.
TRL_COMMANDS_FALLBACK = ("sft", "dpo", "grpo", "kto", "reward", "rloo", "ppo", "nash_md", "xpo", "online_dpo", "gkd",
                         "orpo", "cpo", "bco", "prm", "env", "vllm-serve")
TRL_NOT_TRAINING = ("env", "vllm-serve")
# What a TRL training subcommand cannot run without, though its parser takes each as optional (its script fails on
# every rank once started): (what, options one of which gives it). A need holds for a subcommand whose parser has
# the first option (the installed TRL's table); a `--config` file may give them all (not read here).
TRL_NEEDS = (("a model", ("model_name_or_path",)), ("a dataset", ("dataset_name", "datasets")),
             ("a teacher model", ("teacher_model_name_or_path",)),
             ("a reward", ("reward_funcs", "reward_model_name_or_path")))
# Options of `accelerate launch` that TRL's own CLI would pass on to it: here launch: decides them.
ACCELERATE_LAUNCH_OPTIONS = frozenset({"accelerate_config", "config_file", "num_processes", "num_machines",
                                       "machine_rank", "main_process_ip", "main_process_port", "multi_gpu",
                                       "use_deepspeed", "use_fsdp", "mixed_precision"})
# Where the plan reads batch arithmetic from in run.args (TrainingArguments / TRL config fields).
BATCH_OPTIONS = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "max_seq_length")
_INT = re.compile(r"[-+]?\d+")
_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "y": True, "n": False, "t": True, "f": False,
               "1": True, "0": False}

TrlCommands = Callable[[], Mapping[str, Mapping[str, Any]] | None]  # -> {subcommand: {module, config, training,
#                                                                      options}} of the installed TRL, None: unknown


def trl_command_table(trl_commands: TrlCommands | None) -> dict[str, Mapping[str, Any]]:
    """The TRL subcommands: the installed TRL's when known, else TRL_COMMANDS_FALLBACK (names only)."""
    table = trl_commands() if trl_commands is not None else None
    if table:
        return dict(table)
    return {name: {"module": f"trl.scripts.{name.replace('-', '_')}", "config": None,
                   "training": name not in TRL_NOT_TRAINING, "options": None} for name in TRL_COMMANDS_FALLBACK}


def fields_key(run: RunSpec) -> str:
    """What `trainer_fields` is asked for the TrainingArguments-like options of a run: `trl:<subcommand>` (that
    subcommand's TRL config class) or `script` / `module` (transformers' TrainingArguments)."""
    return f"trl:{run.trl}" if run.kind == "trl" else run.kind


def coerce_arg(value: Any, kind: str) -> tuple[Any, str | None]:
    """One run.args value (a word of the command line, or a YAML scalar) read as a field of `kind` (a trlfields kind)
    would read it: (the value, or an error message)."""
    base = kind[4:] if kind.startswith("opt_") else kind
    if value is None:  # a bare `--flag`
        return (True, None) if base in ("bool", "any") else (None, "needs a value")
    if base == "bool":
        if isinstance(value, bool):
            return value, None
        word = str(value).strip().lower()
        return (_BOOL_WORDS[word], None) if word in _BOOL_WORDS else (value, f"must be true or false, got {value!r}")
    if base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if isinstance(value, str) and _INT.fullmatch(value.strip()):
            return int(value), None
        return value, f"must be an integer, got {value!r}"
    if base == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value, None
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value), None
        return value, f"must be a number, got {value!r}"
    if base == "str" and isinstance(value, (tuple, list)):
        return value, f"must be one word, got {len(value)}"
    return value, None


def guess_arg(value: Any) -> Any:
    """A run.args value as the plan reads it where no field kind is known: integers, numbers and true/false words."""
    if isinstance(value, str):
        word = value.strip()
        if _INT.fullmatch(word):
            return int(word)
        if _NUMBER.fullmatch(word):
            return float(word)
        if word.lower() in ("true", "false"):
            return word.lower() == "true"
    return value


def run_settings(run: RunSpec, kinds: Mapping[str, str] | None = None) -> dict[str, Any]:
    """{option: value} of run.args as the training code reads them (by `kinds` where known, else guessed)."""
    out: dict[str, Any] = {}
    for name, (value, _) in run.options().items():
        kind = (kinds or {}).get(name)
        out[name] = coerce_arg(value, kind)[0] if kind else (True if value is None else guess_arg(value))
    return out


def trl_missing(run: RunSpec, accepted: set[str]) -> list[Problem]:
    """The TRL_NEEDS of subcommand `run.trl` (whose parser takes `accepted`) that run.args leave out, each named by the
    option to give."""
    given = run.options()
    if "config" in given:
        return []
    out = []
    for what, names in TRL_NEEDS:
        if names[0] not in accepted or any(n in given for n in names):
            continue
        rest = [f"--{n}" for n in names[1:] if n in accepted]
        out.append(Problem(f"run.args.{names[0]}", f"missing: trl {run.trl} needs {what}"
                           + (f" (this or {' or '.join(rest)})" if rest else "")))
    return out


def check_run(run: RunSpec, kinds: Mapping[str, str] | None, trl_commands: TrlCommands | None) -> list[Problem]:
    """The `run:` block beyond single fields: one entry point, a known module name / TRL training subcommand, no
    accelerate launch options, and the options that are TrainingArguments / TRL config fields (`kinds`) checked
    like `trainer:` values. Other options pass (your code has its own), except for a TRL subcommand, whose parser
    is known: a typo is refused here, not on every rank once the job has started. The ranges (core.trainerranges)
    hold for the options that are fields of the run's config, and for the ones the plan reads wherever given."""
    problems: list[Problem] = []
    given = [k for k in ("script", "module", "trl") if getattr(run, k) is not None]
    if len(given) != 1:
        return [Problem("run", "give exactly one of script, module, trl" +
                        (f" (got {', '.join(given)})" if given else ""))]
    accepted: set[str] | None = None
    label = run.kind
    config: str | None = "TrainingArguments"  # the class whose ranges hold (core.trainerranges); None: not known
    if run.trl is not None:
        label, config = f"trl {run.trl}", None
        table = trl_command_table(trl_commands)
        entry = table.get(run.trl)
        training = sorted(n for n, e in table.items() if e.get("training"))
        if entry is None:
            problems.append(Problem("run.trl", f"unknown TRL subcommand {run.trl!r}" + suggest(run.trl, training)
                                    + f"; one of {', '.join(training)}"))
            return problems
        if not entry.get("training"):
            problems.append(Problem("run.trl", f"{run.trl!r} is not a training subcommand of TRL; one of "
                                               f"{', '.join(training)}"))
            return problems
        if entry.get("options"):
            accepted = {option_name(o) for o in entry["options"]} | {"config"}
            problems += trl_missing(run, accepted)
        config = entry.get("config")
    settings = run_settings(run, kinds)
    for name, (value, where) in run.options().items():
        if run.kind == "trl" and name in ACCELERATE_LAUNCH_OPTIONS:
            problems.append(Problem(where, f"--{name} is an `accelerate launch` option: orchestrate sets the launch "
                                           "from launch: (profile, nodes, procs_per_node, mixed_precision)"))
            continue
        if accepted is not None and name not in accepted and not (name.startswith("no_") and name[3:] in accepted):
            problems.append(Problem(where, f"not an option of {label}" + suggest(name, sorted(accepted))))
            continue
        if is_secret_name(name) and isinstance(value, str) and value:
            problems.append(Problem(where, "looks like a secret: pass it by launch.secret_env"))
            continue
        kind = (kinds or {}).get(name)
        if kind is None and not always_checked(name):
            continue
        coerced, msg = coerce_arg(value, kind or "any")
        rule = None if msg else broken_rule(name, guess_arg(coerced) if isinstance(coerced, str) else coerced,
                                            settings, config)
        if rule is not None:
            msg = rule.problem(guess_arg(value) if isinstance(value, str) else value)  # a word: the number written
        if msg:
            problems.append(Problem(where, msg))
    return problems


# ----------------------------------------------------------------------------------------- loading

def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """Read one YAML file into a plain dict; syntax errors name file:line. A relative `recipes/...` or
    `cluster_configs/...` path that is no file here is the file orchestrate ships (orchestrator.resources)."""
    import yaml
    from orchestrator.resources import shipped
    p = Path(path)
    if not p.is_file():
        p = shipped(path) or p
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
    out: list[dict[str, Any]] = []
    for group in (recipe_items, cluster_items):
        if not group:
            out.append({})
            continue
        try:
            from omegaconf import OmegaConf
            out.append(OmegaConf.to_container(OmegaConf.from_dotlist(group), resolve=True))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - omegaconf raises several types for bad grammar
            problems.append(Problem("overrides", f"cannot parse: {str(e).splitlines()[0]}"))
            out.append({})
    return out[0], out[1], problems


_PLAIN_LEAVES = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """Data omegaconf would hand back unchanged: YAML's plain scalars (no string holding an `${...}` interpolation or
    omegaconf's `???`), lists of them, mappings with string keys."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, str):
        return "${" not in value and value != "???"
    return isinstance(value, _PLAIN_LEAVES)


def _copy_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_plain(v) for k, v in value.items()}
    return [_copy_plain(v) for v in value] if isinstance(value, list) else value


def _merge_plain(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any] | None:
    """omegaconf's merge of two plain layers (a mapping over a mapping merges key by key, anything else replaces),
    or None where the two do not agree on a key's shape (a mapping against a list or a scalar): omegaconf decides
    (or refuses) those."""
    out = dict(base)
    for key, value in top.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            merged = _merge_plain(old, value)
            if merged is None:
                return None
            out[key] = merged
        elif key in out and (isinstance(old, dict) or isinstance(value, dict)):
            return None
        else:
            out[key] = value
    return out


def _merged_plain(layers: tuple[dict[str, Any], ...]) -> dict[str, Any] | None:
    """The layers merged as omegaconf would, when they are all plain (`_plain`) and agree on every key's shape (a
    fresh copy, sharing nothing with them); None otherwise."""
    if not all(_plain(layer) for layer in layers):
        return None
    merged: dict[str, Any] = {}
    for layer in layers:
        step = _merge_plain(merged, layer)
        if step is None:
            return None
        merged = step
    return _copy_plain(merged)


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """The layers merged, interpolations resolved, as plain data. Plain layers are merged without importing omegaconf
    (`_merged_plain`: the same result, tests/unit/test_schema.py compares them)."""
    plain = _merged_plain(layers)
    if plain is not None:
        return plain
    from omegaconf import OmegaConf
    cfgs = [OmegaConf.create(layer) for layer in layers if layer]
    if not cfgs:
        return {}
    return OmegaConf.to_container(OmegaConf.merge(*cfgs), resolve=True)  # type: ignore[return-value]


def _resolve(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Resolve ${...} interpolations of one file; bad ones become a ConfigError."""
    try:
        return _merge(data)
    except Exception as e:  # noqa: BLE001 - omegaconf raises several types for a bad interpolation
        raise ConfigError(Problem(source, f"interpolation failed: {str(e).splitlines()[0]}")) from None


# ----------------------------------------------------------------------------------------- pure parse

TrainerFields = Callable[[str], Mapping[str, str] | None]  # recipe -> TRL {field: kind}


_NOT_WITH_RUN = ("model", "data", "trainer", "tokenizer")


def parse_run_job(data: dict[str, Any], source: str = "<recipe>", trainer_fields: TrainerFields | None = None,
                  trl_commands: TrlCommands | None = None) -> RunJobSpec:
    """Validate a job of your own code (`run:`). `trainer_fields(fields_key(run))` -> the {field: kind} its
    TrainingArguments-like options are checked against; `trl_commands()` -> the installed TRL's subcommands."""
    problems: list[Problem] = []
    if "recipe" in data:
        problems.append(Problem("recipe", "give either recipe: (a built-in recipe) or run: (your own code), not both"))
    for key in _NOT_WITH_RUN:
        if key in data:
            problems.append(Problem(key, "not used with run: (your code gets what it needs from run.args)"))
    rest = {k: v for k, v in data.items() if k not in ("recipe", *_NOT_WITH_RUN)}
    spec, schema_problems = build(RunJobSpec, rest)
    problems.extend(schema_problems)
    run, run_problems = build(RunSpec, rest.get("run"), "run")  # the rest of run: is checked once its fields are
    if not run_problems:
        fields = trainer_fields(fields_key(run)) if trainer_fields is not None else None
        kinds = dict.fromkeys(fields, "any") if fields is not None and not isinstance(fields, Mapping) else fields
        problems.extend(check_run(run, kinds, trl_commands))
    problems.extend(notify_problems(spec.notify) if spec is not None else [])
    problems.extend(sweep_problems(spec.sweep) if spec is not None else [])
    if problems:
        raise ConfigError(problems, source=source)
    assert spec is not None
    return replace(spec, source=source)


def parse_job(data: dict[str, Any], source: str = "<recipe>", trainer_fields: TrainerFields | None = None,
              trl_commands: TrlCommands | None = None) -> JobSpec:
    """A job file: a built-in recipe (`recipe:`) or your own code (`run:`)."""
    if isinstance(data, dict) and "run" in data:
        return parse_run_job(data, source, trainer_fields, trl_commands)
    return parse_recipe(data, source, trainer_fields)


def parse_recipe(data: dict[str, Any], source: str = "<recipe>",
                 trainer_fields: TrainerFields | None = None) -> RecipeSpec:
    """Validate a recipe dict. `trainer_fields(recipe)` -> TRL's {field: kind} for that recipe
    (orchestrator.trlfields.trainer_fields; a set of names checks names only; None: unknown)."""
    spec, problems = build(RecipeSpec, data)
    raw = data if isinstance(data, dict) else {}
    kind = raw.get("recipe") if isinstance(raw.get("recipe"), str) and raw.get("recipe") in RECIPES else None
    trainer = raw.get("trainer")
    if isinstance(trainer, dict):
        fields = trainer_fields(kind) if trainer_fields is not None and kind else None
        if fields is not None and not isinstance(fields, Mapping):
            fields = dict.fromkeys(fields, "any")
        trainer, trainer_problems = check_trainer(trainer, kind or "", fields)
        problems.extend(trainer_problems)
    problems.extend(notify_problems(spec.notify) if spec is not None else [])
    problems.extend(sweep_problems(spec.sweep) if spec is not None else [])
    if problems:
        raise ConfigError(problems, source=source)
    return replace(spec, trainer=trainer or {}, source=source)


def parse_cluster(data: dict[str, Any], source: str = "<cluster>") -> ClusterSpec:
    spec, problems = build(ClusterSpec, data)
    raw = data if isinstance(data, dict) else {}
    kind = raw.get("kind", "local")
    for other in ("ssh", "slurm"):
        if other in raw and other != kind:
            problems.append(Problem(other, f"block given but kind is {kind!r}"))
    ssh_raw = raw["ssh"] if isinstance(raw.get("ssh"), dict) else {}
    if kind == "ssh" and ssh_raw.get("hosts") is None and ssh_raw.get("hostfile") is None:
        problems.append(Problem("ssh.hosts", "missing: give ssh.hosts (list or 'gpu[01-04]') or ssh.hostfile"))
    if spec is not None and spec.ssh is not None:
        problems.extend(duplicate_hosts(spec.ssh.hosts, "ssh.hosts"))
    problems.extend(notify_problems(spec.notify) if spec is not None else [])
    if problems:
        raise ConfigError(problems, source=source)
    name = raw.get("name") or (Path(source).stem if source.endswith((".yaml", ".yml")) else kind)
    return replace(spec, name=name, source=source, ssh=spec.ssh if kind == "ssh" else None,
                   slurm=(spec.slurm or SlurmSpec()) if kind == "slurm" else None)


def without_hosts(cluster: ClusterSpec, hosts: tuple[str, ...] | list[str]) -> ClusterSpec:
    """The cluster with `hosts` taken out: an SSH cluster's list (order kept: the next host is the spare that moves
    in), a SLURM cluster's `slurm.exclude`."""
    if not hosts:
        return cluster
    if cluster.ssh is not None:
        return replace(cluster, ssh=replace(cluster.ssh, hosts=tuple(h for h in cluster.ssh.hosts if h not in hosts)))
    if cluster.slurm is not None:
        return replace(cluster, slurm=replace(cluster.slurm, exclude=tuple(dict.fromkeys((*cluster.slurm.exclude,
                                                                                         *hosts)))))
    return cluster


def with_hosts(cluster: ClusterSpec, hosts: list[str]) -> ClusterSpec:
    """A copy of an ssh cluster with its host list set (hostfile read by the caller)."""
    assert cluster.ssh is not None
    return replace(cluster, ssh=replace(cluster.ssh, hosts=tuple(hosts)))


def parse_hostfile(text: str, source: str) -> list[str]:
    """One host (or host expression) per line; '#' comments; 'host slots=N' style extras ignored (pdsh/DeepSpeed
    hostfiles). Every host is checked like ssh.hosts; a bad one is named by file:line."""
    hosts: list[str] = []
    problems: list[Problem] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            got, bad = expand_host_entry(line.split()[0], f"{source}:{n}")
            hosts.extend(got)
            problems.extend(bad)
    if not hosts and not problems:
        problems.append(Problem(source, "hostfile lists no hosts"))
    problems.extend(duplicate_hosts(hosts, source))
    if problems:
        raise ConfigError(problems)
    return hosts


# ----------------------------------------------------------------------------------------- entry points

def _list_args_overrides(recipe_file: dict[str, Any], rec_over: dict[str, Any]) -> None:
    """`run.args.NAME=value` on a list of args: set `--NAME value` in the list (in place; the merge cannot mix a
    list with a mapping). `run.args.3=x` replaces the 4th word."""
    run = recipe_file.get("run")
    over = (rec_over.get("run") or {}) if isinstance(rec_over.get("run"), dict) else {}
    if not (isinstance(run, dict) and isinstance(run.get("args"), list) and isinstance(over.get("args"), dict)):
        return
    if not all(isinstance(w, (str, int, float, bool)) for w in run["args"]):
        return  # the bad word is reported by the schema
    words = [arg_text(w) for w in run["args"]]
    for key, value in over.pop("args").items():
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(Problem(f"run.args.{key}", "an override of a list of args must be a string, number or "
                                                         "boolean"), source="command line")
        if str(key).isdigit():
            if int(key) >= len(words):
                raise ConfigError(Problem(f"run.args.{key}", f"run.args has {len(words)} words"), source="command line")
            words[int(key)] = arg_text(value)
        else:
            words = list(set_list_option(tuple(words), str(key), value))
    run["args"] = words


def load(recipe_path: str, cluster_path: str | None = None, flags: dict[str, Any] | None = None,
         overrides: list[str] | None = None, trainer_fields: TrainerFields | None = None,
         trl_commands: TrlCommands | None = None) -> tuple[JobSpec, ClusterSpec]:
    """Read + merge + validate the job (a built-in recipe or `run:` own code) and cluster. All problems of one input
    in one ConfigError."""
    rec_over, clu_over, dot_problems = parse_dotlist(list(overrides or []))
    if dot_problems:
        raise ConfigError(dot_problems, source="command line")
    recipe_file = _resolve(read_yaml(recipe_path, "recipe"), recipe_path)
    _list_args_overrides(recipe_file, rec_over)
    flag_layer: dict[str, Any] = {}
    for key, value in (flags or {}).items():
        if value is not None:
            flag_layer.setdefault("launch", {})[key] = value
    try:
        recipe_dict = _merge(recipe_file, flag_layer, rec_over)
    except Exception as e:  # noqa: BLE001 - omegaconf raises several types when an override does not fit the file
        raise ConfigError(Problem("overrides", f"do not fit {recipe_path}: {str(e).splitlines()[0]}"),
                          source="command line") from None
    cluster_dict: dict[str, Any] = {}
    if cluster_path:
        cluster_dict = _resolve(read_yaml(cluster_path, "cluster"), cluster_path)
    cluster_dict = _merge(cluster_dict, clu_over) if clu_over else cluster_dict
    errors: list[ConfigError] = []
    recipe: JobSpec | None = None
    cluster: ClusterSpec | None = None
    try:
        recipe = parse_job(recipe_dict, source=recipe_path, trainer_fields=trainer_fields, trl_commands=trl_commands)
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
    if recipe is not None and cluster is not None:  # the job's container / notify keys over the cluster's
        notify = merge_block(cluster.notify, recipe.notify, recipe_dict.get("notify", ABSENT),
                             together=("webhook", "webhook_env"))
        bad = notify_problems(notify, merged=True)
        if bad:
            errors.append(ConfigError(bad, source=recipe_path))
        recipe = replace(recipe, notify=notify, container=merge_block(cluster.container, recipe.container,
                                                                       recipe_dict.get("container", ABSENT)))
    if errors:
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError([Problem(e.source or "", str(p)) for e in errors for p in e.problems])
    assert recipe is not None and cluster is not None
    return recipe, cluster


def cluster_to_dict(cluster: ClusterSpec) -> dict[str, Any]:
    """The cluster as RUN_DIR/cluster.json holds it (a notify webhook masked)."""
    return _masked(to_plain(cluster))


def cluster_from_dict(d: dict[str, Any]) -> ClusterSpec:
    """Inverse of cluster_to_dict (the run dir's cluster.json: cancel/status from another process)."""
    return from_plain(ClusterSpec, d)
