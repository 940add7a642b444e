"""The recipe and cluster schemas as data, and the validator that walks a plain dict against them.

Pure: no I/O. Every problem is collected (key path + message + did-you-mean), never just the first.
`spec.py` turns validated dicts into frozen dataclasses.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Callable

from orchestrator.errors import Problem

SECRET_NAME = re.compile(r"(^HF_TOKEN$|^WANDB_API_KEY$|_TOKEN$|_KEY$|_SECRET$|PASSWORD)", re.IGNORECASE)
PROFILES = ("multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2", "context_parallel", "alst_ulysses")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


@dataclass(frozen=True)
class F:
    """A leaf field: `kind` names a checker below; `choices` limits values; `required` must be present."""

    kind: str
    default: Any = None
    choices: tuple | None = None
    required: bool = False


# Nested dicts are sub-blocks; F are leaves; the string "FREE" is a free-form mapping checked elsewhere.
RECIPE_SCHEMA: dict[str, Any] = {
    "recipe": F("str", required=True, choices=("sft", "dpo", "cp")),
    "model": {
        "name_or_path": F("str", required=True),
        "dtype": F("str", "auto", choices=("auto", "float32", "bfloat16", "float16")),
        "attn_implementation": F("opt_str", None),
        "trust_remote_code": F("bool", False),
    },
    "tokenizer": F("opt_str", None),
    "data": {
        "path": F("str_or_list", required=True),
        "config": F("opt_str", None),
        "split": F("str", "train"),
        "eval_split": F("opt_str", None),
        "max_samples": F("opt_pos_int", None),
    },
    "trainer": "FREE",
    "checkpoint": {
        "resume": F("str", "auto"),
        "save_on_signal": F("bool", True),
    },
    "health": {
        "stall_timeout": F("pos_number", 300),
        "startup_timeout": F("pos_number", 1800),
        "save_timeout": F("pos_number", 1800),
        "max_restarts": F("nonneg_int", 0),
        "poll_interval": F("pos_number", 1.0),
        "stack_dumps": F("bool", True),
    },
    "launch": {
        "profile": F("str", "multi_gpu"),
        "nodes": F("pos_int", 1),
        "procs_per_node": F("pos_int", 1),
        "mixed_precision": F("opt_str", None, choices=(None, "no", "bf16", "fp16")),
        "parallelism": {
            "dp_replicate": F("opt_pos_int", None),
            "dp_shard": F("opt_pos_int", None),
            "tp": F("opt_pos_int", None),
            "cp": F("opt_pos_int", None),
            "sp": F("opt_pos_int", None),
        },
        "env": F("env_map", {}),
        "secret_env": F("name_list", []),
        "port": F("opt_port", None),
    },
}

CLUSTER_SCHEMA: dict[str, Any] = {
    "kind": F("str", "local", choices=("local", "ssh", "slurm")),
    "name": F("opt_str", None),
    "accelerator": F("str", "auto", choices=("auto", "cpu", "gpu")),
    "network_interface": F("opt_str", None),
    "env": F("env_map", {}),
    "ssh": {
        "hosts": F("opt_str_or_list", None),
        "hostfile": F("opt_str", None),
        "port": F("port", 22),
        "user": F("opt_str", None),
        "key": F("str", "~/.ssh/id_ed25519"),
        "known_hosts": F("str", "~/.ssh/known_hosts"),
        "strict_host_keys": F("bool", True),
        "python": F("str", "python3"),
        "workdir": F("str", "~/orchestrate"),
        "shared_fs": F("bool", False),
        "connect_timeout": F("pos_number", 10),
    },
    "slurm": {
        "partition": F("opt_str", None),
        "account": F("opt_str", None),
        "qos": F("opt_str", None),
        "time": F("str", "01:00:00"),
        "gpus_per_node": F("nonneg_int", 0),
        "max_gpus_per_node": F("opt_nonneg_int", None),
        "cpus_per_task": F("opt_pos_int", None),
        "mem": F("opt_str", None),
        "constraint": F("opt_str", None),
        "exclusive": F("bool", False),
        "setup": F("str_list", []),
        "python": F("str", "python3"),
        "workdir": F("str", "~/orchestrate"),
        "signal_lead_s": F("nonneg_int", 120),
        "max_restarts": F("nonneg_int", 3),
        "extra_sbatch": F("str_list", []),
    },
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(kind: str, v: Any) -> str | None:
    """Return an error message, or None when `v` is acceptable for `kind`."""
    opt = kind.startswith("opt_")
    base = kind[4:] if opt else kind
    if v is None:
        return None if opt else "must not be null"
    checks: dict[str, Callable[[Any], str | None]] = {
        "str": lambda x: None if isinstance(x, str) and x != "" else "must be a non-empty string",
        "bool": lambda x: None if isinstance(x, bool) else f"must be true or false, got {x!r}",
        "pos_int": lambda x: None if _is_int(x) and x >= 1 else f"must be an integer >= 1, got {x!r}",
        "nonneg_int": lambda x: None if _is_int(x) and x >= 0 else f"must be an integer >= 0, got {x!r}",
        "pos_number": lambda x: None if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
        else f"must be a number > 0, got {x!r}",
        "port": lambda x: None if _is_int(x) and 1 <= x <= 65535 else f"must be a port number 1-65535, got {x!r}",
        "str_or_list": lambda x: None if (isinstance(x, str) and x) or (
            isinstance(x, list) and x and all(isinstance(i, str) and i for i in x))
        else "must be a string or a non-empty list of strings",
        "str_list": lambda x: None if isinstance(x, list) and all(isinstance(i, str) for i in x)
        else "must be a list of strings",
        "name_list": lambda x: None if isinstance(x, list) and all(isinstance(i, str) and ENV_NAME.match(i) for i in x)
        else "must be a list of environment variable names",
        "env_map": lambda x: None if isinstance(x, dict) else "must be a mapping NAME: value",
    }
    return checks[base](v)


def suggest(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def validate(data: Any, schema: dict[str, Any], path: str = "") -> tuple[dict[str, Any], list[Problem]]:
    """Check `data` against `schema`; return (dict with defaults filled in, problems)."""
    problems: list[Problem] = []
    where = path or "<top level>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return {}, [Problem(where, f"must be a mapping, got {type(data).__name__}")]
    out: dict[str, Any] = {}
    for key in data:
        if key not in schema:
            full = f"{path}.{key}" if path else str(key)
            problems.append(Problem(full, "unknown key" + suggest(str(key), schema)))
    for key, spec in schema.items():
        full = f"{path}.{key}" if path else key
        present = key in data
        value = data.get(key)
        if spec == "FREE":
            if value is None:
                out[key] = {}
            elif not isinstance(value, dict):
                problems.append(Problem(full, f"must be a mapping, got {type(value).__name__}"))
            else:
                out[key] = dict(value)
            continue
        if isinstance(spec, dict):
            sub, subprobs = validate(value, spec, full)
            out[key] = sub
            problems.extend(subprobs)
            continue
        if not present:
            if spec.required:
                problems.append(Problem(full, "missing required key"))
                continue
            out[key] = _copy(spec.default)
            continue
        msg = _check(spec.kind, value)
        if msg is None and spec.choices is not None and value not in spec.choices:
            shown = ", ".join("null" if c is None else str(c) for c in spec.choices)
            msg = f"must be one of {shown}, got {value!r}" + (suggest(str(value), [c for c in spec.choices if c]))
        if msg:
            problems.append(Problem(full, msg))
        out[key] = value
    return out, problems


def _copy(v: Any) -> Any:
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, list):
        return list(v)
    return v


def check_env_map(env: dict[str, Any], path: str) -> tuple[dict[str, str], list[Problem]]:
    """Env values become strings; secret-looking names with literal values are refused."""
    out: dict[str, str] = {}
    problems: list[Problem] = []
    for name, value in (env or {}).items():
        key = f"{path}.{name}"
        if not isinstance(name, str) or not ENV_NAME.match(name):
            problems.append(Problem(key, "not a valid environment variable name"))
            continue
        if is_secret_name(name):
            problems.append(Problem(key, "looks like a secret: never write it in a file; export it and list "
                                         f"'{name}' in launch.secret_env"))
            continue
        if isinstance(value, (dict, list)) or value is None:
            problems.append(Problem(key, "must be a string, number or boolean"))
            continue
        out[name] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return out, problems
