"""A render's output directory (`orchestrate render --out DIR`, `orchestrator.render(...).write(DIR)`): what render
writes there, and the guard that never leaves two plans mixed in one directory (docs/operations.md "render").

| DIR holds                                                  | render                                             |
|------------------------------------------------------------|----------------------------------------------------|
| nothing (missing or empty)                                 | writes                                             |
| only an earlier render of the same job (same job name)     | replaces it: that render's files first removed     |
| another plan (a plan.json or render of another job)        | refused (exit 2) unless force                      |
| any file render does not write                             | refused (exit 2) unless force                      |

force removes render's own files only (those the earlier render listed in DIR/rendered.json, else the names render
writes: plan.json, recipe.yaml, job.sbatch, stage.json, resumed_from.json, nodes/<R>/*, the same under p<i>/) and
keeps every other file. Every render lists what it wrote in DIR/rendered.json (its job id and name, its files).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, Problem

MANIFEST = "rendered.json"
# what render writes, where no rendered.json lists it (a render of an older version, or a run dir)
OWN = re.compile(r"^sweep\.json$|^(p\d+/)?(plan\.json|recipe\.yaml|job\.sbatch|stage\.json|resumed_from\.json|"
                 r"nodes/\d+/(accelerate\.yaml|command\.txt))$")


def _listing(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() or p.is_symlink())


def _read(out: Path, name: str) -> dict[str, Any]:
    """A JSON file of the render (a run dir's shape), read through RunDir; {} when absent or not an object."""
    from orchestrator.node.rundir import RunDir
    data = RunDir(out).read_json(name)
    return data if isinstance(data, dict) else {}


def to_remove(out: Path, job_name: str, force: bool = False) -> list[str]:
    """The files of `out` to remove before a render of job `job_name` is written there (see the table above);
    ConfigError (key --out) when `out` holds another plan or other files and not `force`."""
    if not out.exists():
        return []
    if not out.is_dir():
        raise ConfigError(Problem("--out", f"{out} is not a directory"))
    files = _listing(out)
    if not files:
        return []
    manifest = _read(out, MANIFEST)
    listed = manifest.get("files") if isinstance(manifest.get("files"), list) else None
    own = (set(map(str, listed)) | {MANIFEST}) & set(files) if listed is not None else \
        {f for f in files if OWN.match(f) or f == MANIFEST}
    others = [f for f in files if f not in own]
    if force:
        return sorted(own)
    plan = manifest or _read(out, "plan.json")
    old_id, old_name = plan.get("job_id"), plan.get("job") or plan.get("recipe_name")
    if listed is not None and old_name == job_name and not others:
        return sorted(own)  # the same job rendered again: replaced, nothing of the earlier render left
    how = "render into an empty directory, or add --force (it removes only the files render writes)"
    if own:
        what = f"the plan of job {old_id}" if old_id else f"files of another plan ({sorted(own)[0]})"
        if old_name == job_name and others:
            what += f" and {len(others)} other file(s) ({others[0]})"
        raise ConfigError(Problem("--out", f"{out} holds {what}: {how}"))
    raise ConfigError(Problem("--out", f"{out} is not empty ({len(others)} file(s) render does not write, e.g. "
                                       f"{others[0]}): {how}; the other files are kept"))


def write(files: dict[str, str], out: str | os.PathLike[str], job_id: str, job_name: str,
          force: bool = False) -> Path:
    """Write a render's `files` (relative path -> text) to `out`, owner-only, after the guard (to_remove): the files
    of the render it replaces removed first, then the new ones and their list (MANIFEST). Returns the directory."""
    from orchestrator.node.rundir import RunDir
    path = Path(out).expanduser().resolve()
    for rel in to_remove(path, job_name, force):
        (path / rel).unlink(missing_ok=True)
        d = (path / rel).parent
        while d != path and not any(d.iterdir()):  # (the earlier render's nodes/<R>/ that this one has no more)
            d.rmdir()
            d = d.parent
    manifest = {"job_id": job_id, "job": job_name, "files": sorted(files)}
    RunDir(path).mkdir()
    RunDir(path).write_files(dict(files, **{MANIFEST: json.dumps(manifest, indent=1) + "\n"}))
    return path
