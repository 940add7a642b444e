#!/usr/bin/env python3
"""docs/CONTRACT.md against the schema: which keys of a job file (recipe or own code) and a cluster file the
contract's YAML blocks document, and whether each shows the schema's default.

The schema is the spec dataclasses (orchestrator/core/spec.py, HealthSpec and StragglerSpec in core/health.py),
read through `orchestrator.core.schema.rules`, the validator's own view. The contract's YAML blocks that document it
are marked with an HTML comment right before the block:

    <!-- schema: recipe -->   a recipe job file (RecipeSpec)        <!-- schema: run -->  an own-code job file
    <!-- schema: cluster -->  a cluster file (ClusterSpec)

A block may show part of its file (the Containers block shows only `container:`). Each key it shows must be a key of
the schema at that place ("extra" otherwise), and a value shown for a key is its default (to_plain of the field's
default; any value for a required key; `null` or a mapping for an optional block such as `container:`). Every key of
every block reachable from the three files must be shown, with its default, in at least one marked block ("missing";
a block used in several places, such as `launch:`, is documented once).

    .venv/bin/python scripts/contract_keys.py      # prints missing / extra / wrong defaults; exit 1 if any
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from orchestrator.core.schema import rules, to_plain  # noqa: E402
from orchestrator.core.spec import ClusterSpec, RecipeSpec, RunJobSpec  # noqa: E402

ROOTS: dict[str, type] = {"recipe": RecipeSpec, "run": RunJobSpec, "cluster": ClusterSpec}
MARK = re.compile(r"<!--\s*schema:\s*(\w+)\s*-->")
# Defaults the loader computes rather than the dataclass: the doc shows this value (and says in words what it means).
COMPUTED = {
    ("ClusterSpec", "name"): None,  # spec.parse_cluster: unset or null -> the cluster file's stem
}
REQUIRED = object()


def schema_keys(cls: type, seen: set[type] | None = None) -> dict[tuple[str, str], Any]:
    """{(class name, key): default} for every public field of `cls` and of every block under it; REQUIRED for a
    field without a default, None for an optional block (`container: null`)."""
    seen = set() if seen is None else seen
    if cls in seen:
        return {}
    seen.add(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[tuple[str, str], Any] = {}
    for name, rule in rules(cls).items():
        if rule.internal:
            continue
        f = fields[name]
        if rule.block is not None:
            if rule.optional_block:
                out[(cls.__name__, name)] = None
            out.update(schema_keys(rule.block, seen))
            continue
        if f.default is not dataclasses.MISSING:
            default = to_plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = to_plain(f.default_factory())
        else:
            default = REQUIRED
        out[(cls.__name__, name)] = COMPUTED.get((cls.__name__, name), default)
    return out


def all_schema_keys() -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for cls in ROOTS.values():
        out.update(schema_keys(cls))
    return out


def doc_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line, root name, YAML text) of every fenced block right after a `<!-- schema: NAME -->` marker."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = MARK.search(line)
        if not m:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or not lines[j].lstrip().startswith("```"):
            raise ValueError(f"CONTRACT.md:{i + 1}: a schema marker must come right before a fenced block")
        k = j + 1
        while k < len(lines) and not lines[k].lstrip().startswith("```"):
            k += 1
        out.append((j + 2, m.group(1), "\n".join(lines[j + 1:k])))
    return out


def _same(shown: Any, default: Any) -> bool:
    if isinstance(default, float) or isinstance(shown, float):
        return isinstance(shown, (int, float)) and not isinstance(shown, bool) and float(shown) == float(default)
    return bool(shown == default and type(shown) is type(default)) or (shown == default == {} or shown == default == [])


def walk(cls: type, doc: Any, path: str, where: str, shown: dict, problems: list[str]) -> None:
    """Record in `shown` each (class, key) the mapping `doc` documents with its default; problems otherwise."""
    if not isinstance(doc, dict):
        problems.append(f"{where}: {path or '<top>'}: expected a mapping of keys, got {doc!r}")
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rs = rules(cls)
    for key, value in doc.items():
        if key is True and "on" in rules(cls):  # YAML 1.1 reads a bare `on:` as true, as schema.build knows
            key = "on"
        full = f"{path}.{key}" if path else str(key)
        rule = rs.get(str(key))
        if rule is None or rule.internal:
            problems.append(f"{where}: extra: {full} is documented but is no key of the schema ({cls.__name__})")
            continue
        if rule.block is not None:
            if value is None and rule.optional_block:
                shown[(cls.__name__, key)] = None
            elif isinstance(value, dict):
                if rule.optional_block:
                    shown.setdefault((cls.__name__, key), "block")
                walk(rule.block, value, full, where, shown, problems)
            else:
                problems.append(f"{where}: {full}: a block: show it as a mapping of its keys"
                                + (" or null" if rule.optional_block else "") + f", not {value!r}")
            continue
        default = schema_keys(cls)[(cls.__name__, key)]
        if default is REQUIRED or _same(value, default):
            shown[(cls.__name__, key)] = value
        else:
            problems.append(f"{where}: wrong default: {full}: the doc shows {value!r}, the schema's default is "
                            f"{default!r} ({cls.__name__}.{fields[key].name})")


def check(text: str) -> tuple[list[str], list[str]]:
    """(missing keys, other problems: extra keys, wrong defaults, unparsable blocks) of a CONTRACT.md text."""
    shown: dict[tuple[str, str], Any] = {}
    problems: list[str] = []
    for line, name, block in doc_blocks(text):
        where = f"docs/CONTRACT.md:{line} ({name})"
        if name not in ROOTS:
            problems.append(f"{where}: unknown schema marker {name!r} (one of {', '.join(ROOTS)})")
            continue
        try:
            doc = yaml.safe_load(block)
        except yaml.YAMLError as e:
            problems.append(f"{where}: not YAML: {e}")
            continue
        walk(ROOTS[name], doc, "", where, shown, problems)
    missing = [f"missing: {cls}.{key} (default {default!r})" if default is not REQUIRED else
               f"missing: {cls}.{key} (required)"
               for (cls, key), default in all_schema_keys().items() if (cls, key) not in shown]
    return missing, problems


SPAN = re.compile(r"`([^`]+)`")
DOTTED = re.compile(r"(?:cluster\.)?[a-z_]+(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FREE = ("trainer.", "run.args.")  # TRL's fields and a script's options: not orchestrate's schema
NOT_KEYS = {"cluster.x"}  # README's `cluster.x=y`: the form of an override, not a key
FILES = re.compile(r"\.(json|jsonl|yaml|yml|py|txt|log|png|md|sh|lock|sbatch)$")


def resolve(path: str) -> bool:
    """Whether a dotted key (`health.straggler.window`, `cluster.ssh.shared_fs`) is a key of a job or cluster file."""
    if path.startswith(FREE):
        return True
    roots = [ClusterSpec] if path.startswith("cluster.") else [RecipeSpec, RunJobSpec, ClusterSpec]
    parts = path.split(".")[1:] if path.startswith("cluster.") else path.split(".")
    for cls in roots:
        cur: type | None = cls
        for i, part in enumerate(parts):
            rule = rules(cur).get(part) if cur is not None else None
            if rule is None or rule.internal:
                break
            cur = rule.block
            if cur is None and i < len(parts) - 1:
                break
        else:
            return True
    return False


def prose_keys(text: str, where: str) -> list[str]:
    """Dotted keys named in code spans (`launch.secret_env`, `ssh.shared_fs: true`, `cluster.slurm.python=X`) whose
    first part is a block of a job or cluster file, and that are no key of the schema."""
    blocks = {name for cls in (*ROOTS.values(),) for name, r in rules(cls).items() if r.block is not None}
    blocks |= {"cluster", "trainer", "run"}
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        for span in SPAN.findall(line):
            word = re.split(r"[\s:=]", span.strip(), maxsplit=1)[0]
            m = DOTTED.fullmatch(word)
            if m and word.split(".")[0] in blocks and word not in NOT_KEYS and not FILES.search(word) \
                    and not resolve(word):
                bad.append(f"{where}:{n}: `{span}` names {word}, which is no key of a job or cluster file")
    return bad


def all_prose_problems() -> list[str]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        out += prose_keys(path.read_text(), str(path.relative_to(ROOT)))
    return out


def main() -> int:
    missing, problems = check((ROOT / "docs" / "CONTRACT.md").read_text())
    problems += all_prose_problems()
    for line in missing + problems:
        print(line)
    if not (missing or problems):
        print(f"docs/CONTRACT.md documents all {len(all_schema_keys())} schema keys with their defaults")
    return 1 if missing or problems else 0


if __name__ == "__main__":
    sys.exit(main())
