"""Entry point on every rank: `python -m recipes.run RECIPE_YAML`.

Loads the resolved recipe (plain YAML -> dict), dispatches to `recipes.<sft|dpo|cp>.main`, and from
rank 0 prints one line `ORCHESTRATE_RESULT {json}` (first/final loss, global step, output_dir, last
checkpoint, ...). Exit codes: 0 done; 128+signal when stopped by SIGTERM (143) / SIGUSR2 (140) after
saving a checkpoint (a preempted run is not a finished run); 2 for a recipe that cannot run as configured.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

RECIPES = ("sft", "dpo", "cp")
RESULT_PREFIX = "ORCHESTRATE_RESULT "


def load_recipe(path: str) -> dict:
    import yaml

    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise SystemExit(f"{path}: a recipe YAML must be a mapping")
    cfg.setdefault("trainer", {})
    cfg["trainer"] = dict(cfg["trainer"] or {})
    cfg["trainer"].setdefault("output_dir", os.path.abspath(os.path.join("outputs", Path(path).stem)))
    return cfg


def run(cfg: dict) -> dict:
    name = cfg.get("recipe")
    if name not in RECIPES:
        raise SystemExit(f"recipe: {name!r} is not one of {', '.join(RECIPES)}")
    return importlib.import_module(f"recipes.{name}").main(cfg)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m recipes.run RECIPE_YAML", file=sys.stderr)
        return 2
    from recipes import phases
    from recipes.common import RecipeError

    from orchestrator.node.proctools import process_start_time
    phases.mark("boot", proc_start=process_start_time())
    from orchestrator.node import preflight  # every node reaches every other, one all-reduce: before the model loads
    if preflight.run_from_env():
        return preflight.EXIT_CODE
    try:
        result = run(load_recipe(argv[0]))
    except RecipeError as e:
        print(f"orchestrate recipe error: {e}", file=sys.stderr, flush=True)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
    shutdown_distributed()
    sig = result.get("preempted_signal")
    return 128 + int(sig) if sig else 0  # preempted: saved and stopped, not finished


def shutdown_distributed() -> None:
    """Tear the process group down before the interpreter exits: a live gloo group at exit sometimes
    aborts the process ("terminate called without an active exception", SIGABRT) after a good run."""
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def leave(code: int) -> None:
    """Exit without interpreter finalization once the work is done and saved. Finalization sometimes aborts the
    process after a good run ("terminate called without an active exception", SIGABRT: a C++ thread of torch's
    distributed stack destroyed while joinable), which fails a finished job; and it restores default signal
    handlers, so a launcher's TERM arriving then ends a preempted rank with -15 instead of 143. atexit handlers
    (trackers such as wandb finishing their run) still run first."""
    import atexit

    hooks = sys.modules.get("orchestrate_hooks")  # orchestrate's start-up hooks, when on the path
    if hooks is not None:
        hooks.exiting(code)  # the exit record names the code (orchestrator.node.rankwatch)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
