"""orchestrate's start-up hook for a user's ranks (see orchestrator/node/hooks/__init__.py).

Python imports `sitecustomize` from sys.path at start-up. This one:
1. in a rank of an orchestrate launch only (ORCHESTRATE_HEARTBEAT_DIR and RANK or LOCAL_RANK set, not turned off
   with ORCHESTRATE_HOOKS=0, and not a child process of a hooked rank such as a spawned DataLoader worker),
   points its fd 1 and 2 at the rank's output pipe, if the node agent made one (orchestrator.node.ranklines: the
   agent tags each of its lines with the rank), then installs `orchestrate_hooks` (standard library only; torch /
   transformers are touched only when the user's code imports them);
2. always chains to the next sitecustomize.py on sys.path, so that a user's (or the distribution's) own is not
   shadowed; `import sitecustomize` afterwards returns that one.
Nothing here may break the user's process: errors of our own are reported on stderr and skipped.
"""

import os
import sys


def _active() -> bool:
    env = os.environ
    if not env.get("ORCHESTRATE_HEARTBEAT_DIR"):
        return False
    if env.get("ORCHESTRATE_HOOKS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if "RANK" not in env and "LOCAL_RANK" not in env:
        return False  # the launcher (accelerate launch / torchrun) itself, or a plain python
    owner = env.get("ORCHESTRATE_HOOKS_PID")
    if owner and owner != str(os.getpid()):
        return False  # a child of a hooked rank (spawned workers, subprocesses) inherits RANK: not a rank itself
    env["ORCHESTRATE_HOOKS_PID"] = str(os.getpid())
    return True


def _rank_output() -> None:
    """Send this rank's stdout and stderr (fd 1 and 2, so C-level writes and child processes too) to the named pipe
    the node agent reads for it: RUN_DIR/nodes/<node>/output/rank<RANK> (RunDir.rank_pipes). No pipe, or nobody
    reading it (ENXIO): the output stays where it was, untagged."""
    import stat

    env = os.environ
    run_dir, node, rank = env.get("ORCHESTRATE_RUN_DIR"), env.get("ORCHESTRATE_NODE_RANK"), env.get("RANK", "")
    if not run_dir or not node or not rank.isdigit():
        return
    path = os.path.join(run_dir, "nodes", node, "output", f"rank{int(rank)}")
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.set_blocking(fd, True)  # (the flag belongs to the pipe's open file, which fd 1 and 2 will share)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def _chain() -> None:
    """Run the next sitecustomize on sys.path (after this file's directory) and let it take the name."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    me = os.path.realpath(__file__)
    here = os.path.dirname(me)
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.realpath(spec.origin or "") == me:
        return
    sys.modules["orchestrate_sitecustomize"] = sys.modules.get(__name__)
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _preflight_wanted() -> bool:
    """The plan asks for the rank pre-flight (ORCHESTRATE_PREFLIGHT_TIMEOUT > 0) and there is more than one rank;
    checked before anything of orchestrator is imported (start-up stays standard-library only otherwise)."""
    try:
        return float(os.environ.get("ORCHESTRATE_PREFLIGHT_TIMEOUT", "0") or 0) > 0 and \
            int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    except ValueError:
        return False


if _active():
    try:
        _rank_output()
    except Exception as _e:  # noqa: BLE001 - never fail the user's process
        print(f"orchestrate: per-rank output not tagged: {type(_e).__name__}: {_e}", file=sys.stderr, flush=True)
    try:
        import orchestrate_hooks

        orchestrate_hooks.install()
        if _preflight_wanted():  # every rank joins a short all-reduce before the user's code: a broken network
            try:                 # fails in seconds (orchestrator.node.preflight; once per process)
                from orchestrator.node import preflight
            except ImportError:
                preflight = None
            if preflight is not None:
                preflight.exit_on_failure()
    except Exception as _e:  # noqa: BLE001 - never fail the user's process
        print(f"orchestrate: start-up hooks not installed: {type(_e).__name__}: {_e}", file=sys.stderr, flush=True)

_chain()
