"""orchestrator.srcfields: TRL / transformers config fields and TRL's CLI parsers read from source equal what importing
the packages gives (the installed versions, and a package of every annotation form), and a submit with a cold field
cache imports neither transformers, trl nor torch (issue #28 item 6)."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
import textwrap

import pytest
from helpers import OFFLINE_ENV, PYTHON, REPO

from orchestrator import srcfields, trlfields
from orchestrator.core.spec import BATCH_OPTIONS


def _dynamic(package: str, name: str):
    cls = getattr(importlib.import_module(package), name)
    return trlfields.field_kinds(cls), trlfields.field_defaults(cls)


@pytest.fixture(scope="module")
def static_commands():
    return srcfields.trl_commands(trlfields._trl_scripts_dir())


def _classes(commands) -> list[tuple[str, str]]:
    configs = sorted({e["config"] for e in commands.values() if e["config"]})
    return [("transformers", "TrainingArguments"), ("trl", "SFTConfig"), ("trl", "DPOConfig")] + \
        [("trl", c) for c in configs]


def test_trl_subcommands_from_source_equal_the_imported_parsers(static_commands):
    dynamic = trlfields.build_trl_commands(trlfields._trl_scripts_dir())
    assert static_commands.keys() == dynamic.keys()
    for name in dynamic:
        assert static_commands[name] == dynamic[name], name
    sft = static_commands["sft"]
    assert sft["config"] == "SFTConfig" and {"--learning_rate", "--learning-rate", "--help"} <= set(sft["options"])


def test_config_fields_from_source_equal_the_imported_classes(static_commands):
    for package, name in _classes(static_commands):
        kinds, defaults = srcfields.class_info(package, name)
        dyn_kinds, dyn_defaults = _dynamic(package, name)
        assert kinds == dyn_kinds, name
        # every default read from source is the imported one; one computed at import time (transformers' `optim`
        # depends on torch's version) is not read, and none of those is one the plan needs
        assert {k: (v, type(v)) for k, v in defaults.items()} == \
            {k: (dyn_defaults[k], type(dyn_defaults[k])) for k in defaults}, name
        unread = set(dyn_defaults) - set(defaults)
        assert len(unread) <= 2 and not unread & set(BATCH_OPTIONS), (name, unread)


ANNOTATED = '''
    from __future__ import annotations
    import enum
    import typing
    from dataclasses import dataclass, field
    from typing import Any, Dict, List, Literal, Optional, Union, Annotated

    class Colour(str, enum.Enum):
        RED = "red"

    class Level(enum.IntEnum):
        LOW = 1

    class Names(list):
        pass

    @dataclass
    class Base:
        a: int = 1
        b: Optional[float] = None
        c: "Dict[str, int]" = field(default_factory=dict)
        d: bool = field(default=True, metadata={"help": "x", "aliases": ["--dee"]})
        e: typing.Optional[str] = "s"

    class Plain(Base):  # not a dataclass itself: its annotations are no fields
        ignored: int = 3

    @dataclass
    class Child(Plain):
        a: float = 2.0      # redefined: keeps its place, new kind
        f: Union[int, str, None] = None
        g: List[int] = field(default_factory=list)
        h: Literal["x", "y"] = "x"
        i: Literal[1, "y"] = 1
        j: Colour = Colour.RED
        k: Level = Level.LOW
        m: Names = field(default_factory=Names)
        n: Annotated[int, "meta"] = -4
        o: int | None = 5
        p: Any = None
        q: tuple[int, ...] = (1,)
        r: bool | None = True
        s: dict[str, Any] | str | None = None
        t: Optional[Literal["a", "b"]] = None
        u: typing.ClassVar[int] = 0
        v: int = field(default=0, init=False)
        w: float = 1e-3
'''


def test_every_annotation_form_reads_as_the_imported_type(tmp_path, monkeypatch):
    pkg = tmp_path / "srcfields_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .configs import Child as Child\n")
    (pkg / "configs.py").write_text(textwrap.dedent(ANNOTATED))
    monkeypatch.syspath_prepend(str(tmp_path))
    kinds, defaults = srcfields.class_info("srcfields_probe", "Child")
    assert "srcfields_probe" not in sys.modules  # read, not imported
    dyn_kinds, dyn_defaults = _dynamic("srcfields_probe", "Child")
    assert kinds == dyn_kinds
    assert list(kinds) == [f.name for f in dataclasses.fields(importlib.import_module("srcfields_probe").Child)]
    assert defaults == dyn_defaults
    assert kinds["j"] == "str" and kinds["k"] == "any" and kinds["m"] == "list" and kinds["b"] == "opt_float"


def test_unreadable_source_is_said_not_guessed(tmp_path, monkeypatch):
    pkg = tmp_path / "srcfields_odd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import dataclasses\nBase = dataclasses.make_dataclass('Base', ['x'])\n"
                                     "@dataclasses.dataclass\nclass Odd(Base):\n    y: int = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(srcfields.Unreadable, match="base Base not found"):
        srcfields.class_info("srcfields_odd", "Odd")


@pytest.mark.parametrize("job,extra", [
    ("recipes/configs/sft_tiny.yaml", []),
    ("examples/own_code/trl_sft.yaml", []),
    ("examples/own_code/my_job.yaml", []),
])
def test_a_cold_submit_imports_no_training_stack(tmp_path, job, extra):
    """A fresh ORCHESTRATE_HOME (no field cache): the plan checks the trainer's fields (a bad value is still refused)
    and the CLI imports neither transformers, trl nor torch."""
    env = {**OFFLINE_ENV, "ORCHESTRATE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([PYTHON, "-X", "importtime", "-m", "orchestrator.cli", "submit", job, "--nodes", "2",
                          "--dry-run", *extra], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in ("transformers", "trl", "torch")}
    assert list((tmp_path / "home" / "cache").glob("*.kinds.json"))
    key = "trainer.learning_rate" if job.startswith("recipes") else "run.args.learning_rate"
    bad = subprocess.run([PYTHON, "-m", "orchestrator.cli", "submit", job, "--nodes", "2", "--dry-run",
                          f"{key}=fast"], capture_output=True, text=True, cwd=REPO,
                         env={**env, "ORCHESTRATE_HOME": str(tmp_path / "home2")}, timeout=120)
    assert bad.returncode == 2 and key in bad.stderr and "must be a number" in bad.stderr, bad.stderr


@pytest.mark.parametrize("package", ["trl", "transformers", "accelerate", "PyYAML", "typing-extensions",
                                     "no-such-package-here"])
def test_the_version_read_from_dist_info_is_importlib_metadatas(package):
    """The field cache is named by versions read from the `.dist-info` directories on sys.path (no importlib.metadata
    on a submit): the same as importlib.metadata says."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        want: str | None = version(package)
    except PackageNotFoundError:
        want = None
    trlfields._version.cache_clear()
    assert trlfields._version(package) == want
