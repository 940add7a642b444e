"""The validator derived from the spec dataclasses, and the value checks it shares with the trainer rules.

One source: every field of a recipe or cluster file is declared once, as a field of a frozen dataclass
(core/spec.py; HealthSpec in core/health.py) with its type and default. A field's check follows from its
annotation: `bool`; `str` (non-empty); `int` (>= 0); `float` (a number > 0); `tuple[str, ...]` (a list of
strings); `dict` (a mapping); `X | None` (also null); a nested spec dataclass is a sub-block. Where that is not
enough the annotation says more with `Annotated[..., Check(kind, choices)]` (the aliases below: `PosInt`,
`Port`, `EnvMap`, `NameList`, `StrOrList`, `Hosts`, `RunArgs`, `Internal`, and `one_of(...)`). A field without a
default is required.

`build(cls, data)` walks a plain dict against a dataclass: unknown keys (with did-you-mean), missing required
keys, bad values and choices, each with its key path (`launch.parallelism.cp`), every problem collected; it
returns the instance when there is none. `to_plain`/`from_plain` are the JSON/YAML round trip of the same
dataclasses. Also here: secret names (`is_secret_name`, the one definition), the one URL masking rule (`mask_url`),
environment maps, host names.
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
import shlex
import types
import typing
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Union
from urllib.parse import urlsplit

from orchestrator.core.container import parse_mount
from orchestrator.core.gpuhealth import DIAGS, POLICIES
from orchestrator.core.health import STRAGGLER_ACTIONS
from orchestrator.core.hostlist import HostlistError, expand
from orchestrator.errors import Problem

SECRET_NAME = re.compile(r"(^HF_TOKEN$|^WANDB_API_KEY$|_TOKEN$|_KEY$|_SECRET$|PASSWORD)", re.IGNORECASE)
PROFILES = ("multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2", "context_parallel", "alst_ulysses")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
ENV_PREFIX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IFNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}$")  # Linux: at most 15 characters, no '/' or blanks


def is_secret_name(name: str) -> bool:
    """HF_TOKEN, WANDB_API_KEY and anything named *_TOKEN / *_KEY / *_SECRET / *PASSWORD*."""
    return bool(SECRET_NAME.search(name))


def mask_url(url: str) -> str:
    """`url` as it may be written anywhere (files, logs, the store, output): what can carry a secret becomes ***:
    user:password@, the whole path (Slack / Discord / Teams hooks carry their token there), the query (`?token=`) and
    the fragment. The scheme, host and port stay, so a line still says where it went. The one masking rule."""
    try:
        p = urlsplit(url)
        port = p.port
    except (ValueError, TypeError, AttributeError):
        return "***"
    if not p.scheme or not p.hostname:
        return "***"
    host = f"[{p.hostname}]" if ":" in p.hostname else p.hostname
    out = f"{p.scheme}://" + ("***@" if "@" in p.netloc else "") + host + (f":{port}" if port is not None else "")
    if p.path not in ("", "/"):
        out += "/***"
    return out + ("?***" if p.query else "") + ("#***" if p.fragment else "")


def _url_problem(x: Any) -> str | None:
    if not isinstance(x, str):
        return f"must be an http:// or https:// URL, got {type(x).__name__}"
    try:
        p = urlsplit(x)
        p.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return f"not a valid URL: {mask_url(x)}"
    if p.scheme not in ("http", "https") or not p.hostname or any(c.isspace() or ord(c) < 32 for c in x):
        return f"must be an http:// or https:// URL, got {mask_url(x)}"
    return None


def suggest(key: str, known: Iterable[Any]) -> str:
    import difflib  # (only a problem needs a suggestion)
    close = difflib.get_close_matches(key, [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ----------------------------------------------------------------------------------------- checks of one value

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str_or_list(x: Any) -> bool:
    return (isinstance(x, str) and x != "") or (isinstance(x, list) and bool(x) and
                                                all(isinstance(i, str) and i for i in x))


def _gpu_ids(x: Any) -> str | None:
    if not isinstance(x, list) or not x or not all(_is_int(i) and i >= 0 for i in x):
        return f"must be a non-empty list of GPU indices (integers >= 0), got {x!r}"
    dups = sorted({i for i in x if x.count(i) > 1})
    return f"lists GPU {', '.join(map(str, dups))} more than once" if dups else None


# kind -> (value -> error message or None). `opt_<kind>` also accepts null.
CHECKS: dict[str, Callable[[Any], str | None]] = {
    "any": lambda x: None,
    "str": lambda x: None if isinstance(x, str) and x != "" else "must be a non-empty string",
    "text": lambda x: None if isinstance(x, str) else f"must be a string, got {x!r}",
    "bool": lambda x: None if isinstance(x, bool) else f"must be true or false, got {x!r}",
    "int": lambda x: None if _is_int(x) else f"must be an integer, got {x!r}",
    "float": lambda x: None if _is_number(x) else f"must be a number, got {x!r}",
    "pos_int": lambda x: None if _is_int(x) and x >= 1 else f"must be an integer >= 1, got {x!r}",
    "nonneg_int": lambda x: None if _is_int(x) and x >= 0 else f"must be an integer >= 0, got {x!r}",
    "pos_number": lambda x: None if _is_number(x) and x > 0 else f"must be a number > 0, got {x!r}",
    "port": lambda x: None if _is_int(x) and 1 <= x <= 65535 else f"must be a port number 1-65535, got {x!r}",
    "str_or_list": lambda x: None if _str_or_list(x) else "must be a string or a non-empty list of strings",
    "hosts": lambda x: None if _str_or_list(x) else "must be a host, a host expression or a non-empty list of hosts",
    "str_list": lambda x: None if isinstance(x, list) and all(isinstance(i, str) for i in x)
    else "must be a list of strings",
    "name_list": lambda x: None if isinstance(x, list) and all(isinstance(i, str) and ENV_NAME.match(i) for i in x)
    else "must be a list of environment variable names",
    "list": lambda x: None if isinstance(x, list) else f"must be a list, got {type(x).__name__}",
    "mapping": lambda x: None if isinstance(x, dict) else f"must be a mapping, got {type(x).__name__}",
    "env_map": lambda x: None if isinstance(x, dict) else "must be a mapping NAME: value",
    "module_name": lambda x: None if isinstance(x, str) and _MODULE.fullmatch(x)
    else f"not a Python module name: {x!r}",
    "run_args": lambda x: None if isinstance(x, (list, dict)) else
    f"must be a list of arguments or a mapping option: value, got {type(x).__name__}",
    "nonneg_number": lambda x: None if _is_number(x) and x >= 0 else f"must be a number >= 0, got {x!r}",
    "procs": lambda x: None if x == "auto" or (_is_int(x) and x >= 1)
    else f"must be an integer >= 1, got {x!r} (or auto: one process per GPU)",
    "gpu_ids": lambda x: _gpu_ids(x),
    "prefix_list": lambda x: None if isinstance(x, list) and all(isinstance(i, str) and ENV_PREFIX.match(i) for i in x)
    else "must be a list of environment variable name prefixes (NCCL_, FI_, ...)",
    "ifname": lambda x: None if isinstance(x, str) and IFNAME.match(x)
    else f"must be a network interface name (eth0, ib0, ...) or auto, got {x!r}",
    "mounts": lambda x: None if isinstance(x, list) else f"must be a list of HOST:CONTAINER[:ro|rw], got {x!r}",
    "gpu_check": lambda x: None if x in POLICIES else f"must be one of {', '.join(POLICIES)}, got {x!r}"
    + suggest(str(x), POLICIES),
    "straggler_factor": lambda x: None if _is_number(x) and x > 1 else f"must be a number > 1, got {x!r}",
    "straggler_action": lambda x: None if x in STRAGGLER_ACTIONS else
    f"must be one of {', '.join(STRAGGLER_ACTIONS)}, got {x!r}" + suggest(str(x), STRAGGLER_ACTIONS),
    "gpu_diag": lambda x: None if x in DIAGS else f"must be one of {', '.join(DIAGS)}, got {x!r}"
    + suggest(str(x), DIAGS),
    "url": _url_problem,
    "env_name": lambda x: None if isinstance(x, str) and ENV_NAME.match(x)
    else f"must be an environment variable name, got {x!r}",
    "argv": lambda x: None if _str_or_list(x) else "must be a command: a list of words, or one string of words",
    "choice_list": lambda x: None if isinstance(x, str) or (isinstance(x, list) and all(isinstance(i, str) for i in x))
    else "must be a list of names",
}


def check_value(kind: str, value: Any, choices: tuple | None = None) -> str | None:
    """An error message, or None when `value` is acceptable for `kind` (and among `choices` when given)."""
    opt = kind.startswith("opt_")
    base = kind[4:] if opt else kind
    if value is None:
        msg = None if opt else "must not be null"
    else:
        msg = CHECKS.get(base, CHECKS["any"])(value)
    if msg is None and choices is not None and base == "choice_list":
        bad = [i for i in ([value] if isinstance(value, str) else value) if i not in choices]
        if bad:
            msg = (f"unknown {bad[0]!r}; each must be one of {', '.join(map(str, choices))}" +
                   suggest(bad[0], choices))
    elif msg is None and choices is not None and value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        msg = f"must be one of {shown}, got {value!r}" + suggest(str(value), [c for c in choices if c])
    return msg


# ----------------------------------------------------------------------------------------- converters

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


def is_host(name: str) -> bool:
    """A host name of RFC 1123 labels (trailing dot allowed), an IPv4 or an IPv6 address."""
    if not isinstance(name, str) or not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if len(name) > 253 or re.fullmatch(r"[0-9.]+", name):  # digits and dots only: an IPv4 address or nothing
        return False
    labels = (name[:-1] if name.endswith(".") else name).split(".")
    return all(_HOST_LABEL.match(label) for label in labels)


def expand_host_entry(entry: str, where: str) -> tuple[list[str], list[Problem]]:
    """One `ssh.hosts` entry or hostfile line -> hosts (a `gpu[01-04]` expression expands); bad ones named."""
    try:
        hosts = expand(entry)
    except HostlistError as e:
        return [], [Problem(where, str(e))]
    bad = [h for h in hosts if not is_host(h)]
    if bad:
        shown = ", ".join(repr(h) for h in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        what = "is not a valid host name or IP address" if len(bad) == 1 else "are not valid host names or IP addresses"
        return [], [Problem(where, f"{shown} {what}" + (f" (from {entry!r})" if hosts != [entry] else ""))]
    return hosts, []


def expand_hosts(value: str | list[str], path: str) -> tuple[tuple[str, ...], list[Problem]]:
    """`ssh.hosts` (an expression or a list of them) -> the hosts; errors name the entry (`ssh.hosts[1]`)."""
    entries = [(value, path)] if isinstance(value, str) else [(v, f"{path}[{i}]") for i, v in enumerate(value)]
    hosts: list[str] = []
    problems: list[Problem] = []
    for entry, where in entries:
        got, bad = expand_host_entry(entry, where)
        hosts.extend(got)
        problems.extend(bad)
    return tuple(hosts), problems


def duplicate_hosts(hosts: Iterable[str], where: str) -> list[Problem]:
    dups = sorted(h for h, n in Counter(hosts).items() if n > 1)
    return [Problem(where, f"duplicate hosts: {', '.join(dups)}")] if dups else []


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (str, int, float, bool))


def arg_text(x: Any) -> str:
    """One scalar as a command-line word: booleans as HfArgumentParser reads them (`true` / `false`)."""
    return ("true" if x else "false") if isinstance(x, bool) else str(x)


def check_run_args(value: list | dict, path: str) -> tuple[tuple[str, ...] | dict[str, Any], list[Problem]]:
    """`run.args`: a list of words (scalars; kept as strings, in order) or a mapping option -> scalar (or a list of
    scalars: several words after the option). Nested blocks and nulls are named by their place (`run.args[2]`,
    `run.args.learning_rate`)."""
    problems: list[Problem] = []
    if isinstance(value, list):
        for i, x in enumerate(value):
            if not _is_scalar(x):
                problems.append(Problem(f"{path}[{i}]", "must be a string, number or boolean"))
        return tuple(arg_text(x) for x in value if _is_scalar(x)), problems
    out: dict[str, Any] = {}
    for key, x in value.items():
        where = f"{path}.{key}"
        if not isinstance(key, str) or not key.strip("-"):
            problems.append(Problem(where, "an option name must be a non-empty string"))
        elif isinstance(x, list) and x and all(_is_scalar(i) for i in x):
            out[key] = tuple(x)
        elif not _is_scalar(x):
            problems.append(Problem(where, "must be a string, number or boolean (or a list of them)"))
        else:
            out[key] = x
    return out, problems


def check_mounts(value: list, path: str) -> tuple[tuple[str, ...], list[Problem]]:
    """Container mounts `HOST:CONTAINER[:ro|rw]` (core.container.parse_mount), each bad one named (`...mounts[1]`)."""
    problems = [Problem(f"{path}[{i}]", why) for i, item in enumerate(value) for why in [parse_mount(item)[1]] if why]
    return tuple(str(x) for x in value), problems
def to_argv(value: str | list[str], path: str) -> tuple[tuple[str, ...], list[Problem]]:
    """A command: a list of words as given, or one string split into words the way a shell splits them (quotes
    honoured; no shell runs it: no pipes, variables or globs)."""
    if isinstance(value, list):
        return tuple(value), []
    try:
        words = tuple(shlex.split(value))
    except ValueError as e:
        return (), [Problem(path, f"cannot split into words: {e}")]
    return words, [] if words else [Problem(path, "empty command")]


# kinds whose value is transformed once checked: (value, key path) -> (value, problems)
CONVERT: dict[str, Callable[[Any, str], tuple[Any, list[Problem]]]] = {
    "env_map": check_env_map,
    "mounts": check_mounts,
    "hosts": expand_hosts,
    "run_args": check_run_args,
    "argv": to_argv,
}


# ----------------------------------------------------------------------------------------- declaring fields

@dataclass(frozen=True)
class Check:
    """What an `Annotated[...]` field adds to its type: a check kind (CHECKS) and/or allowed values."""

    kind: str | None = None
    choices: tuple | None = None


def one_of(*choices: Any) -> Check:
    return Check(choices=tuple(choices))


PosInt = Annotated[int, Check("pos_int")]
Port = Annotated[int, Check("port")]
EnvMap = Annotated[dict[str, str], Check("env_map")]
NameList = Annotated[tuple[str, ...], Check("name_list")]
StrOrList = Annotated[tuple[str, ...], Check("str_or_list")]
Hosts = Annotated[tuple[str, ...], Check("hosts")]
RunArgs = Annotated[Any, Check("run_args")]  # a list of words or a mapping option -> value (check_run_args)
Procs = Annotated[Union[int, str], Check("procs")]  # an integer >= 1, or "auto" (one process per GPU)
GpuIds = Annotated[tuple[int, ...], Check("gpu_ids")]  # GPU indices of a node, e.g. [0, 1]
Prefixes = Annotated[tuple[str, ...], Check("prefix_list")]  # env name prefixes, e.g. [NCCL_, FI_]
IfName = Annotated[str, Check("ifname")]  # a network interface name, or "auto"
Mounts = Annotated[tuple[str, ...], Check("mounts")]  # container mounts HOST:CONTAINER[:ro|rw]
Url = Annotated[str, Check("url")]  # an http:// or https:// URL (shown only through mask_url)
EnvName = Annotated[str, Check("env_name")]  # the name of an environment variable
Argv = Annotated[tuple[str, ...], Check("argv")]  # a command: a list of words, or a string split into words
Internal = Annotated[str, Check("internal")]  # set by the program (e.g. the source file), never read from input

_BY_TYPE = {bool: "bool", int: "nonneg_int", float: "pos_number", str: "str", tuple: "str_list", list: "str_list",
            dict: "mapping"}


@dataclass(frozen=True)
class Rule:
    """One field as the validator sees it."""

    name: str
    kind: str = "any"
    choices: tuple | None = None
    required: bool = False
    block: type | None = None  # a nested spec dataclass
    optional_block: bool = False  # `SSHSpec | None`: built only when the key is given
    as_tuple: bool = False
    internal: bool = False


def _unwrap(tp: Any) -> tuple[Any, Check | None, bool]:
    """(bare type, Check, optional) of an annotation such as `Annotated[int | None, Check(...)]`."""
    check, optional = None, False
    for _ in range(2):  # Annotated[X | None] or Annotated[X] | None
        if typing.get_origin(tp) is Annotated:
            tp, *meta = typing.get_args(tp)
            # a Check, or a bare kind name (modules that cannot import this one: core.health's fields)
            check = next((m if isinstance(m, Check) else Check(m) for m in meta if isinstance(m, (Check, str))), check)
        if typing.get_origin(tp) in (Union, types.UnionType):
            args = typing.get_args(tp)
            rest = [a for a in args if a is not type(None)]
            optional = optional or len(rest) < len(args)
            tp = rest[0] if len(rest) == 1 else Any
    return tp, check, optional


@functools.cache
def rules(cls: type) -> dict[str, Rule]:
    """The fields of a spec dataclass as validation rules (computed once per class)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out: dict[str, Rule] = {}
    for f in dataclasses.fields(cls):
        tp, check, optional = _unwrap(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out[f.name] = Rule(f.name, block=tp, optional_block=optional)
            continue
        origin = typing.get_origin(tp) or tp
        kind = (check.kind if check and check.kind else None) or _BY_TYPE.get(origin, "any")
        if optional and not kind.startswith("opt_"):
            kind = "opt_" + kind
        out[f.name] = Rule(f.name, kind=kind, choices=check.choices if check else None, required=required,
                           as_tuple=origin is tuple, internal=kind == "internal")
    return out


# ----------------------------------------------------------------------------------------- the validator

def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _leaf(rule: Rule, value: Any, path: str) -> tuple[Any, list[Problem]]:
    base = rule.kind[4:] if rule.kind.startswith("opt_") else rule.kind
    if value is None and base in ("mapping", "env_map"):  # `env:` with nothing under it
        value = {}
    if value is None and base == "run_args":  # `args:` with nothing under it
        value = []
    msg = check_value(rule.kind, value, rule.choices)
    if msg:
        return value, [Problem(path, msg)]
    if value is not None and base in CONVERT:
        return CONVERT[base](value, path)
    if rule.as_tuple and isinstance(value, (str, list)):
        return (value,) if isinstance(value, str) else tuple(value), []
    if isinstance(value, dict):
        return dict(value), []
    return value, []


def build(cls: type, data: Any, path: str = "") -> tuple[Any, list[Problem]]:
    """Check `data` against the dataclass `cls`; return (instance or None when there are problems, problems)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return None, [Problem(path or "<top level>", f"must be a mapping, got {type(data).__name__}")]
    fields = rules(cls)
    if True in data and "on" in fields and "on" not in data:  # YAML 1.1 (PyYAML) reads a bare `on:` key as true
        data = {("on" if k is True else k): v for k, v in data.items()}
    public = [name for name, r in fields.items() if not r.internal]
    problems = [Problem(_join(path, key), "unknown key" + suggest(str(key), public))
                for key in data if key not in public]
    values: dict[str, Any] = {}
    for name in public:
        rule, full = fields[name], _join(path, name)
        if rule.block is not None:
            if rule.optional_block and data.get(name) is None:
                continue
            values[name], sub = build(rule.block, data.get(name), full)
            problems.extend(sub)
        elif name in data:
            values[name], sub = _leaf(rule, data[name], full)
            problems.extend(sub)
        elif rule.required:
            problems.append(Problem(full, "missing required key"))
    if problems:
        return None, problems
    return cls(**values), []


# ----------------------------------------------------------------------------------------- plain data round trip

def to_plain(obj: Any, exclude: tuple[str, ...] = ()) -> Any:
    """A spec dataclass as plain data (tuples become lists), for YAML/JSON; top-level `exclude` left out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in exclude}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def from_plain(cls: type, data: dict[str, Any]) -> Any:
    """Inverse of `to_plain` for data this program wrote (no checks): nested blocks and tuples restored."""
    values: dict[str, Any] = {}
    fields = rules(cls)
    for name, value in data.items():
        rule = fields.get(name)
        if rule is None:
            continue
        if rule.block is not None and isinstance(value, dict):
            value = from_plain(rule.block, value)
        elif rule.as_tuple and isinstance(value, list):
            value = tuple(value)
        values[name] = value
    return cls(**values)
