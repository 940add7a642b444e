"""TRL's trainer config fields as {name: kind}, and TRL's CLI subcommands, read from the installed packages.

Fields: SFTConfig for the sft and cp recipes, DPOConfig for dpo; for own code (`run:`) the config class of a TRL
subcommand (`trl:grpo` -> GRPOConfig) or transformers' TrainingArguments (`script`, `module`). A kind is what the spec
checks a value against (orchestrator.core.spec.check_trainer / check_run): `int`, `float`, `bool`, `str`, `list`,
`dict`, or `any` (unions of several types, or types it cannot name), and `opt_<kind>` for a field that also accepts
None. Derived from the dataclass field types. The defaults of the same fields (JSON scalars only) come along: the
plan's batch arithmetic for a TRL subcommand whose args leave them unset.

Subcommands (`trl_commands`): every `trl/scripts/<name>.py` with a `make_parser` is a CLI subcommand `<name>` (`_` as
`-`), run on a rank as `python -m trl.scripts.<name>`; it trains when its parser holds a TrainingArguments subclass
(its config class), and the parser's option strings are what it accepts.

Both are read from the packages' source (orchestrator.srcfields, ~0.1 s), so no submit imports transformers or trl;
only source that reader does not follow is imported instead (seconds). Each result is cached per package version in
$ORCHESTRATE_HOME/cache/<package>-<version>-<what>.kinds.json (a TRL config's <version> names transformers' too: the
fields come from both; directory 0700, file 0600, written atomically); with the
cache present, planning reads one small file. Without trl installed: None (not checked; the spec
falls back to a fixed list of subcommand names).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import types
import typing
from pathlib import Path
from typing import Any

from orchestrator import srcfields
from orchestrator.core.trainerranges import config_class_name

CACHE_FORMAT = 1
KINDS = ("int", "float", "bool", "str", "list", "dict", "any")


def kind_of(tp: Any) -> str:
    """A field type -> its kind (see the module docstring)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return kind_of(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        kinds = {kind_of(a) for a in rest}
        kind = kinds.pop() if len(kinds) == 1 else "any"
        return "opt_" + kind if kind != "any" and len(rest) < len(args) else kind
    if origin is typing.Literal:
        kinds = {kind_of(type(v)) for v in typing.get_args(tp)}
        return kinds.pop() if len(kinds) == 1 else "any"
    base = origin or tp
    if not isinstance(base, type):
        return "any"
    if issubclass(base, enum.Enum):
        return "str" if issubclass(base, str) else "any"
    for cls, kind in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (dict, "dict"),
                      (list, "list"), (tuple, "list")):
        if issubclass(base, cls):
            return kind
    return "any"


def field_kinds(cls: type) -> dict[str, str]:
    """{field name: kind} of a dataclass (types that cannot be resolved are `any`)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError, AttributeError):  # a forward reference that does not resolve
        hints = {}
    return {f.name: kind_of(hints.get(f.name, f.type)) for f in dataclasses.fields(cls)}


def field_defaults(cls: type) -> dict[str, Any]:
    """{field name: default} of a dataclass, for defaults that are JSON scalars."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is None or
            (isinstance(f.default, (bool, int, float, str)) and not isinstance(f.default, enum.Enum))}


def cache_path(home: Path, trl_version: str, recipe: str) -> Path:
    return _path(home, "trl", _fields_version("trl", trl_version), config_class_name(recipe))


def _fields_version(package: str, package_version: str) -> str:
    """What a config class's fields depend on: TRL's configs inherit transformers' TrainingArguments, so their cache
    is named by both versions (a transformers upgrade that adds or drops a field must not meet a stale cache)."""
    if package == "transformers":
        return package_version
    return f"{package_version}+transformers-{_version('transformers') or 'none'}"


def _path(home: Path, package: str, package_version: str, what: str) -> Path:
    return home / "cache" / f"{package}-{package_version}-{what}.kinds.json"


def _read_payload(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == CACHE_FORMAT else None


def _read(path: Path) -> dict[str, str] | None:
    data = _read_payload(path)
    fields = data.get("fields") if data is not None else None
    if not isinstance(fields, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items()):
        return None
    if not isinstance(data.get("defaults"), dict):  # a cache written before the defaults came along
        return None
    return fields


def _write(path: Path, payload: dict[str, Any]) -> None:
    """Owner-only and atomic: a reader sees the old file, the new one or none."""
    home = path.parent.parent
    if not home.exists():
        home.mkdir(parents=True, mode=0o700)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@functools.lru_cache(maxsize=None)
def _version(package: str) -> str | None:
    """The installed version, read from its .dist-info on sys.path as the node side reads the stack's versions
    (orchestrator.node.stagecache.versions: no importlib.metadata, whose imports and parsing cost ~25 ms); only
    without one (an egg-info install, no such package) is importlib.metadata asked. Kept per process."""
    from orchestrator.node.stagecache import versions
    found = versions([package])[package]
    if found:
        return found
    from importlib.metadata import PackageNotFoundError, version as metadata_version
    try:
        return metadata_version(package)
    except PackageNotFoundError:
        return None


def _home() -> Path:
    from orchestrator.store import home
    return home()


def _save(path: Path, payload: dict[str, Any]) -> None:
    try:
        _write(path, payload)
    except OSError:
        pass


def _class_info(package: str, class_name: str) -> tuple[dict[str, str], dict[str, Any]] | None:
    """({field: kind}, {field: default}) of `package.class_name`, cached per package version."""
    package_version = _version(package)
    if package_version is None:
        return None
    path = _path(_home(), package, _fields_version(package, package_version), class_name)
    fields = _read(path)
    if fields is not None:
        return fields, dict((_read_payload(path) or {}).get("defaults") or {})
    try:
        fields, defaults = srcfields.class_info(package, class_name)
    except srcfields.Unreadable:
        try:  # source this reader does not follow: import it (seconds, once per version)
            import importlib
            cls = getattr(importlib.import_module(package), class_name)
            fields, defaults = field_kinds(cls), field_defaults(cls)
        except Exception:  # noqa: BLE001 - a broken install (or its torch) only costs the checks
            return None
    _save(path, {"format": CACHE_FORMAT, package: package_version, "class": class_name, "fields": fields,
                 "defaults": defaults})
    return fields, defaults


def _class_for(key: str) -> tuple[str, str] | None:
    """(package, class) whose fields `key` means: a recipe (sft, dpo, cp), `trl:<subcommand>`, `script`, `module`."""
    if key.startswith("trl:"):
        entry = (trl_commands() or {}).get(key[4:])
        config = entry.get("config") if entry else None
        return ("trl", config) if config else None
    if key in ("script", "module"):
        return "transformers", "TrainingArguments"
    return "trl", config_class_name(key)


def trainer_fields(recipe: str) -> dict[str, str] | None:
    """{field: kind} of the config `recipe` means (see `_class_for`), or None when not known (trl / transformers not
    installed or not importable, a subcommand without a config class)."""
    what = _class_for(recipe)
    info = _class_info(*what) if what else None
    return info[0] if info else None


def trainer_defaults(recipe: str) -> dict[str, Any] | None:
    """{field: default} of the same config (JSON scalar defaults only), or None when not known."""
    what = _class_for(recipe)
    info = _class_info(*what) if what else None
    return info[1] if info else None


def _trl_scripts_dir() -> Path | None:
    import importlib.util
    try:
        spec = importlib.util.find_spec("trl")  # finds the package without importing it
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) / "scripts" if locations else None


def _read_commands(path: Path) -> dict[str, dict[str, Any]] | None:
    data = _read_payload(path)
    commands = data.get("commands") if data is not None else None
    if not isinstance(commands, dict) or not commands:
        return None
    if not all(isinstance(v, dict) and isinstance(v.get("module"), str) for v in commands.values()):
        return None
    return commands


def build_trl_commands(scripts: Path) -> dict[str, dict[str, Any]]:
    """{subcommand: {module, config, training, options}} from TRL's scripts directory (imports each script)."""
    import importlib
    commands: dict[str, dict[str, Any]] = {}
    for name, module, text in srcfields.trl_scripts(scripts):
        entry: dict[str, Any] = {"module": module, "config": None, "training": False, "options": None}
        if "def make_parser" in text:
            try:
                from transformers import TrainingArguments
                parser = importlib.import_module(module).make_parser()
                types_ = [t for t in getattr(parser, "dataclass_types", ()) if isinstance(t, type)]
                config = next((t for t in types_ if issubclass(t, TrainingArguments)), None)
                options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
                entry.update(config=config.__name__ if config else None, training=config is not None,
                             options=sorted(options))
            except Exception:  # noqa: BLE001 - a script that does not import here (optional deps): names only
                entry["training"] = "Config" in text and "TrlParser" in text
        commands[name] = entry
    return commands


def trl_commands() -> dict[str, dict[str, Any]] | None:
    """The installed TRL's CLI subcommands (see the module docstring), cached per TRL version; None when TRL is not
    installed (the spec then knows the names of TRL_COMMANDS_FALLBACK only)."""
    trl_version = _version("trl")
    if trl_version is None:
        return None
    path = _path(_home(), "trl", trl_version, "cli")
    cached = _read_commands(path)
    if cached is not None:
        return cached
    scripts = _trl_scripts_dir()
    if scripts is None or not scripts.is_dir():
        return None
    try:
        commands = srcfields.trl_commands(scripts)
    except srcfields.Unreadable:
        try:
            commands = build_trl_commands(scripts)
        except OSError:
            return None
    except OSError:
        return None
    if not commands:
        return None
    _save(path, {"format": CACHE_FORMAT, "trl": trl_version, "commands": commands})
    return commands
