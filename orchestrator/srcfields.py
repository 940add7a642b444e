"""Dataclass fields and TRL's CLI parsers read from the installed packages' SOURCE, without importing them.

Planning checks `trainer:` / `run.args` values against TrainingArguments and the TRL configs (orchestrator.trlfields).
Importing transformers or trl costs 1.5-2.5 CPU-s (torch comes along), once per package version; this module
derives the same answers from the packages' Python files with `ast`, in ~0.1 s, so no submit imports them:

- `class_info(package, name)`: ({field: kind}, {field: JSON-scalar default}) of a dataclass, its bases followed
  through the modules that define them (imports, package `__init__` re-exports, lazy `_import_structure` tables);
- `trl_commands(scripts_dir)`: {subcommand: {module, config, training, options}} from each `trl/scripts/<name>.py`'s
  `make_parser` (the dataclass types it hands TrlParser, and the option strings HfArgumentParser makes of them).

A kind is trlfields' (`int`, `float`, `bool`, `str`, `list`, `dict`, `any`, `opt_<kind>`), computed from the
annotation as `trlfields.kind_of` computes it from the resolved type. The result must equal what importing gives:
tests/unit/test_srcfields.py compares the two for every config class and subcommand of the installed versions.
Anything this reader does not understand raises `Unreadable`; the caller then imports (the slow path, still right).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BUILTIN_KINDS = {"bool": "bool", "int": "int", "float": "float", "str": "str", "dict": "dict", "list": "list",
                  "tuple": "list", "bytes": "any", "complex": "any", "object": "any", "type": "any"}
_TYPING_ALIASES = {"Dict": "dict", "List": "list", "Tuple": "list", "Mapping": "any", "Sequence": "any",
                   "Iterable": "any", "Callable": "any", "Any": "any", "Set": "any", "FrozenSet": "any"}
_ENUM_BASES = {"Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"}
_NONE = "none"  # the kind of NoneType while an annotation is read (never returned)


class Unreadable(Exception):
    """The source holds something this reader does not follow (the caller imports instead)."""


@functools.lru_cache(maxsize=None)
def _package_dir(top: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: found without importing anything
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def module_file(module: str) -> Path | None:
    """The .py file of `module` (a package's `__init__.py`), found without importing its parents."""
    top, *rest = module.split(".")
    base = _package_dir(top)
    if base is None:
        return None
    path = base.joinpath(*rest)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


@functools.lru_cache(maxsize=256)
def _tree(module: str) -> ast.Module:
    path = module_file(module)
    if path is None:
        raise Unreadable(f"no source for {module}")
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError) as e:
        raise Unreadable(f"{module}: {e}") from e


def _package_of(module: str) -> str:
    path = module_file(module)
    return module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module).split(".")
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


class ClassRef:
    """A class found in source: its module and its `ast.ClassDef`."""

    def __init__(self, module: str, node: ast.ClassDef):
        self.module, self.node = module, node

    @property
    def key(self) -> tuple[str, str]:
        return self.module, self.node.name


def _imported(module: str, name: str) -> list[tuple[str, str]]:
    """Where `name`, as `module` sees it, is imported from: [(module, name there)] (any import in the file, also
    under `if TYPE_CHECKING`, and a lazy `_import_structure = {"sub": ["Name"]}` table)."""
    return _import_index(module).get(name, [])


@functools.lru_cache(maxsize=256)
def _import_index(module: str) -> dict[str, list[tuple[str, str]]]:
    """{name: [(module, name there)]} of every import in `module`'s file (one walk per file)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                out.setdefault(alias.asname or alias.name, []).append((_absolute(module, node), alias.name))
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
              and any(isinstance(t, ast.Name) and t.id == "_import_structure" for t in node.targets)):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(value, ast.List):
                    for e in value.elts:
                        if isinstance(e, ast.Constant) and isinstance(e.value, str):
                            out.setdefault(e.value, []).append((f"{_package_of(module)}.{key.value}", e.value))
    return out


def find_class(module: str, name: str, _depth: int = 0) -> ClassRef | None:
    """The class `name` as `module` sees it (defined there or imported), or None when it is not a class in source."""
    if _depth > 12:
        raise Unreadable(f"{module}.{name}: imports too deep")
    tree = _tree(module)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ClassRef(module, node)
    for source, real in _imported(module, name):
        if module_file(source) is None:
            continue  # a package outside this reader (typing, torch's C types, ...)
        found = find_class(source, real, _depth + 1)
        if found is not None:
            return found
    return None


_OUTSIDE = ("typing", "typing_extensions", "collections", "enum", "builtins", "abc")
_TYPING_FORMS = {"Optional", "Union", "Annotated", "Literal"}


def _resolve_expr(module: str, expr: ast.expr) -> ClassRef | str | None:
    """A base-class / annotation name: a ClassRef in source, a builtin / typing / enum name (str), or None (a class
    outside the packages read here, such as torch.dtype: no builtin base as far as kinds go)."""
    if isinstance(expr, ast.Name):
        found = find_class(module, expr.id)
        if found is not None:
            return found
        for source, real in _imported(module, expr.id):
            if source.split(".")[0] in _OUTSIDE:
                return real
        known = expr.id in _BUILTIN_KINDS or expr.id in _ENUM_BASES or expr.id in _TYPING_ALIASES
        return expr.id if known or expr.id in _TYPING_FORMS else None
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and expr.value.id in _OUTSIDE:
            return expr.attr
        return None
    return None


@functools.lru_cache(maxsize=None)
def _builtin_bases(module: str, name: str) -> frozenset[str]:
    """Every builtin / Enum base a class reaches through its bases ("str", "Enum", ...)."""
    ref = find_class(module, name)
    if ref is None:
        return frozenset()
    out: set[str] = set()
    for base in ref.node.bases:
        got = _resolve_expr(module, base)
        if isinstance(got, ClassRef):
            out |= _builtin_bases(*got.key)
        elif isinstance(got, str):
            out.add(got)
    return frozenset(out)


def _class_kind(ref: ClassRef) -> str:
    bases = _builtin_bases(*ref.key)
    if bases & _ENUM_BASES:
        return "str" if "str" in bases else "any"
    for b in ("bool", "int", "float", "str", "dict", "list", "tuple"):
        if b in bases:
            return _BUILTIN_KINDS[b]
    return "any"


def _literal_kind(value: ast.expr) -> str:
    if isinstance(value, ast.Constant):
        v = value.value
        if v is None:
            return "any"  # kind_of(NoneType)
        return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(v), "any")
    if isinstance(value, ast.UnaryOp) and isinstance(value.operand, ast.Constant):
        return _literal_kind(value.operand)
    return "any"


def _union(kinds: list[str]) -> str:
    rest = [k for k in kinds if k != _NONE]
    distinct = set(rest)
    kind = distinct.pop() if len(distinct) == 1 else "any"
    return "opt_" + kind if kind != "any" and len(rest) < len(kinds) else kind


def _subscript_parts(node: ast.Subscript) -> list[ast.expr]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


def annotation_kind(module: str, node: ast.expr | None) -> str:
    """The kind of an annotation expression, as trlfields.kind_of gives for the type it evaluates to."""
    if node is None:
        return "any"
    if isinstance(node, ast.Constant):
        if node.value is None:
            return _NONE
        if isinstance(node.value, str):  # a forward reference
            try:
                return annotation_kind(module, ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return "any"
        raise Unreadable(f"annotation {ast.dump(node)}")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union(_flatten_union(module, node))
    if isinstance(node, ast.Subscript):
        head = _resolve_expr(module, node.value)
        name = head if isinstance(head, str) else None
        if name == "Optional":
            return _union([annotation_kind(module, _subscript_parts(node)[0]), _NONE])
        if name == "Union":
            return _union([annotation_kind(module, p) for p in _subscript_parts(node)])
        if name == "Annotated":
            return annotation_kind(module, _subscript_parts(node)[0])
        if name == "Literal":
            kinds = {_literal_kind(p) for p in _subscript_parts(node)}
            return kinds.pop() if len(kinds) == 1 else "any"
        if name is not None:
            return _BUILTIN_KINDS.get(name) or _TYPING_ALIASES.get(name) or "any"
        return _class_kind(head) if isinstance(head, ClassRef) else "any"
    got = _resolve_expr(module, node)
    if isinstance(got, ClassRef):
        return _class_kind(got)
    if isinstance(got, str):
        return _BUILTIN_KINDS.get(got) or _TYPING_ALIASES.get(got) or "any"
    return "any"


def _or_parts(node: ast.expr) -> list[ast.expr]:
    """The members of an `A | B | C` annotation (a single member otherwise)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _or_parts(node.left) + _or_parts(node.right)
    return [node]


def _flatten_union(module: str, node: ast.expr) -> list[str]:
    return [annotation_kind(module, p) for p in _or_parts(node)]


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or \
                (isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


_MISSING = object()


def _call_kwarg(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_field_call(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and (
        (isinstance(value.func, ast.Name) and value.func.id in ("field", "HfArg"))
        or (isinstance(value.func, ast.Attribute) and value.func.attr == "field"))


class Field:
    """One dataclass field as read from source."""

    def __init__(self, name: str, kind: str, default: Any, init: bool, aliases: list[str], bool_type: bool):
        self.name, self.kind, self.default, self.init, self.aliases = name, kind, default, init, aliases
        self.bool_type = bool_type  # `bool` or `bool | None` exactly (HfArgumentParser's --no_<name>)


def _literal(expr: ast.expr | None) -> Any:
    if expr is None:
        return _MISSING
    try:
        return ast.literal_eval(expr)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING


def _is_bool_type(module: str, node: ast.expr | None) -> bool:
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return False
    parts = _flatten_parts(node)
    names = [p.id if isinstance(p, ast.Name) else ("None" if isinstance(p, ast.Constant) and p.value is None else "?")
             for p in parts]
    return names == ["bool"] or sorted(names) == ["None", "bool"]


def _flatten_parts(node: ast.expr) -> list[ast.expr]:
    """`_or_parts`, with `Optional[X]` as X and None."""
    out: list[ast.expr] = []
    for p in _or_parts(node):
        if isinstance(p, ast.Subscript) and isinstance(p.value, ast.Name) and p.value.id == "Optional":
            out += [*_flatten_parts(p.slice), ast.Constant(None)]
        else:
            out.append(p)
    return out


@functools.lru_cache(maxsize=None)
def _fields(module: str, name: str) -> tuple[Field, ...]:
    """The dataclass fields of a class in source, in dataclasses' order (bases first, a redefinition in place)."""
    ref = find_class(module, name)
    if ref is None:
        raise Unreadable(f"class {module}.{name} not found in source")
    order: dict[str, Field] = {}
    for base in reversed(ref.node.bases):
        got = _resolve_expr(module, base)
        if isinstance(got, ClassRef):
            for f in _fields(*got.key):
                order[f.name] = f
        elif got is None and not (isinstance(base, ast.Name) and base.id in ("Generic", "Protocol")):
            raise Unreadable(f"{module}.{name}: base {ast.unparse(base)} not found in source")
    if _is_dataclass(ref.node):
        for stmt in ref.node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            ann = stmt.annotation
            head = ann.value if isinstance(ann, ast.Subscript) else ann
            if isinstance(head, (ast.Name, ast.Attribute)) and \
                    (head.id if isinstance(head, ast.Name) else head.attr) in ("ClassVar", "InitVar"):
                continue
            default, init, aliases = _MISSING, True, []
            if _is_field_call(stmt.value):
                call = stmt.value
                assert isinstance(call, ast.Call)
                default = _literal(_call_kwarg(call, "default"))
                init_expr = _call_kwarg(call, "init")
                init = True if init_expr is None else bool(_literal(init_expr))
                meta = _literal(_call_kwarg(call, "metadata"))
                if isinstance(meta, dict) and meta.get("aliases") is not None:
                    aliases = [meta["aliases"]] if isinstance(meta["aliases"], str) else list(meta["aliases"])
                elif meta is _MISSING and _call_kwarg(call, "metadata") is not None:
                    meta_node = _call_kwarg(call, "metadata")
                    if isinstance(meta_node, ast.Dict) and any(
                            isinstance(k, ast.Constant) and k.value == "aliases" for k in meta_node.keys):
                        raise Unreadable(f"{module}.{name}.{stmt.target.id}: aliases not a literal")
                hf_aliases = _call_kwarg(call, "aliases")
                if hf_aliases is not None:
                    al = _literal(hf_aliases)
                    aliases = [al] if isinstance(al, str) else list(al) if isinstance(al, (list, tuple)) else []
            elif stmt.value is not None:
                default = _literal(stmt.value)
                if default is _MISSING:
                    default = _Unknown
            order[stmt.target.id] = Field(stmt.target.id, annotation_kind(module, ann), default, init, aliases,
                                          _is_bool_type(module, ann))
    return tuple(order.values())


class _UnknownDefault:
    """A default this reader cannot evaluate (not a JSON scalar as far as the caller knows)."""


_Unknown = _UnknownDefault()


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def class_info(package: str, name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """({field: kind}, {field: default} for JSON-scalar defaults) of `package.name` (as `from package import name`
    finds it), read from source. Raises Unreadable."""
    ref = find_class(package, name)
    if ref is None:
        raise Unreadable(f"{package}.{name} not found in source")
    fields = _fields(*ref.key)
    return ({f.name: f.kind for f in fields},
            {f.name: f.default for f in fields if f.default is not _MISSING and f.default is not _Unknown
             and _scalar(f.default)})


def _reaches(ref: ClassRef, target: tuple[str, str], depth: int = 0) -> bool:
    if ref.key == target:
        return True
    if depth > 12:
        return False
    for base in ref.node.bases:
        got = _resolve_expr(ref.module, base)
        if isinstance(got, ClassRef) and _reaches(got, target, depth + 1):
            return True
    return False


def _options(ref: ClassRef) -> set[str]:
    """The option strings HfArgumentParser makes of a dataclass (init fields; `--no_<name>` for a bool default
    True)."""
    out: set[str] = set()
    for f in _fields(*ref.key):
        if not f.init:
            continue
        out.add(f"--{f.name}")
        if "_" in f.name:
            out.add(f"--{f.name.replace('_', '-')}")
        out.update(a for a in f.aliases if a.startswith("--"))
        if f.default is True and f.bool_type:
            out.update({f"--no_{f.name}", f"--no-{f.name.replace('_', '-')}"})
    return out


def _parser_types(module: str, fn: ast.FunctionDef) -> list[ast.expr]:
    """The dataclass types `make_parser` hands the parser: a tuple assigned to `dataclass_types`, or the first
    argument of `TrlParser(...)`."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "dataclass_types"
                                                for t in node.targets):
            if isinstance(node.value, (ast.Tuple, ast.List)):
                return list(node.value.elts)
            raise Unreadable(f"{module}: dataclass_types is not a literal tuple")
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "TrlParser" and node.args:
            arg = node.args[0]
            return list(arg.elts) if isinstance(arg, (ast.Tuple, ast.List)) else [arg]
    raise Unreadable(f"{module}: make_parser's dataclass types not found")


def _local_class(module: str, fn: ast.FunctionDef, expr: ast.expr) -> ClassRef:
    """A name used inside `fn`: imported there (`from trl import X` inside the function), else the module's."""
    if not isinstance(expr, ast.Name):
        raise Unreadable(f"{module}: {ast.unparse(expr)} is not a plain name")
    for node in ast.walk(fn):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == expr.id:
                    found = find_class(_absolute(module, node), alias.name)
                    if found is None:
                        raise Unreadable(f"{module}: {expr.id} not found in source")
                    return found
    found = find_class(module, expr.id)
    if found is None:
        raise Unreadable(f"{module}: {expr.id} not found in source")
    return found


def trl_scripts(scripts: Path) -> Iterator[tuple[str, str, str]]:
    """(subcommand, module, source text) of each script in TRL's scripts directory (helpers left out)."""
    for path in sorted(scripts.glob("*.py")):
        if path.name.startswith("_"):
            continue
        text = path.read_text(errors="replace")
        if "def make_parser" in text or "__main__" in text:
            yield path.stem.replace("_", "-"), f"trl.scripts.{path.stem}", text


def trl_commands(scripts: Path) -> dict[str, dict[str, Any]]:
    """{subcommand: {module, config, training, options}} of TRL's scripts directory (see trlfields), from source."""
    training_args = find_class("transformers", "TrainingArguments")
    if training_args is None:
        raise Unreadable("transformers.TrainingArguments not found in source")
    commands: dict[str, dict[str, Any]] = {}
    for name, module, text in trl_scripts(scripts):
        entry: dict[str, Any] = {"module": module, "config": None, "training": False, "options": None}
        if "def make_parser" in text:
            fn = next((n for n in _tree(module).body if isinstance(n, ast.FunctionDef) and n.name == "make_parser"),
                      None)
            if fn is None:
                raise Unreadable(f"{module}: make_parser is not a top-level function")
            refs = [_local_class(module, fn, e) for e in _parser_types(module, fn)]
            config = next((r for r in refs if _reaches(r, training_args.key)), None)
            options = {"--help"}
            for r in refs:
                options |= _options(r)
            entry.update(config=config.node.name if config else None, training=config is not None,
                         options=sorted(options))
        commands[name] = entry
    return commands
