"""What `sitecustomize` installs in a user's rank: heartbeats, save-on-signal and resume without code changes.

`install()` (standard library only, cheap: no torch, no transformers):
- writes the "boot" start-up mark (with "proc_start", like recipes.run) to the rank's heartbeat file;
- sets the trackers' defaults (orchestrate_tracking: one W&B / TensorBoard / MLflow run per job across its
  attempts);
- puts a meta-path finder first on sys.meta_path that runs a hook right after a module of interest is executed:
  * `torch.optim.optimizer` -> `register_optimizer_step_post_hook`: one "step" record per optimizer step of this
    process (steps of the FIRST optimizer that steps; several optimizers count once per step), buffered
    (orchestrate_heartbeat.FLUSH_S) and self-timed (`stats()`). Silent while a Trainer heartbeat callback trains
    or once the script calls `orchestrate_heartbeat.beat` (their records win: no double counting).
  * `transformers.trainer` -> `Trainer.__init__` adds PreemptionCallback + HeartbeatCallback (orchestrate_trainer,
    the recipes' own) to every Trainer; `Trainer.train`:
      - skips all of it when the Trainer already carries orchestrate's callbacks (a built-in recipe);
      - ORCHESTRATE_RESUME=auto or latest and no resume_from_checkpoint given -> the latest checkpoint-* in
        args.output_dir (none: a fresh start); ORCHESTRATE_RESUME=<dir> -> that checkpoint, or, on a restart, the
        job's own latest one (orchestrate_checkpoint.resume_from). Unset: nothing is changed. The plan sets it from
        checkpoint.resume on every attempt; that a NEW job does not continue another job's checkpoints is checked
        by the submitter before anything starts (orchestrator.core.resume);
      - installs the SIGTERM/SIGUSR2 handlers for the run (ORCHESTRATE_SAVE_ON_SIGNAL=0: none): a signal -> at the
        next step boundary every rank saves a checkpoint and stops, the heartbeat says "preempted", and when
        train() returns the rank leaves with 128+signal (process group torn down, atexit handlers run) instead of
        going on with the rest of the script (final save, evaluation, upload) of an unfinished run.
  * `mlflow` -> rank 0's top-level `mlflow.start_run()` resumes the job's run (orchestrate_tracking.on_mlflow).
A plain loop gets no signal handler: SIGTERM/SIGUSR2 keep their default action (the process ends), since nothing
could save its state.
- sizes torch's flight recorder and starts the rank's hang responder (orchestrate_hangs: asked by the node
  agent on a hang, it writes the rank's recorder entries and thread stacks, even while the main thread is blocked);
- registers `_at_exit` at start-up, before the user's code, so it runs after every atexit handler the script and its
  libraries register:
  * writes the rank's exit record, ORCHESTRATE_HEARTBEAT_DIR/rank<G>.exit: {"pid", "code"}, where code is 1 after an
    uncaught exception (sys.last_value, whoever's excepthook printed it), else what the main thread last asked for
    through sys.exit / exit / quit (argparse and click call sys.exit) or a preempted / recipe exit named
    (`exiting`), else null: not known (the script ran to its end, raised SystemExit itself, or was interrupted by
    Ctrl-C, which Python turns into death by SIGINT). The node agent reads it only when torchrun reaped the rank
    before the agent could read its exit status (orchestrator.node.rankwatch); the agent removes its ranks' records
    before each launch and the pid ties one to its process;
  * where torch (so torch.distributed) was imported, lets the process group's worker threads drop what they hold
    before the interpreter finalizes (`_settle_at_exit`: without it a rank that ended well can die of SIGABRT).
"""

from __future__ import annotations

import os
import sys
import time

try:
    import orchestrate_heartbeat as hb
    import orchestrate_tracking as tracking
    import orchestrate_world
except ImportError:
    from orchestrator.node.hooks import orchestrate_heartbeat as hb
    from orchestrator.node.hooks import orchestrate_tracking as tracking
    from orchestrator.node.hooks import orchestrate_world

_installed = False
_OFF = ("0", "false", "no", "off")


class _OptimizerSteps:
    first = None  # weak reference to the optimizer whose steps are counted
    steps = 0
    calls = 0
    overhead_s = 0.0


def stats() -> dict:
    """Self-measured cost of the optimizer-step hook and of its writer."""
    w = hb._hook
    return {"optimizer_steps": _OptimizerSteps.steps, "hook_calls": _OptimizerSteps.calls,
            "hook_overhead_s": _OptimizerSteps.overhead_s, "records": w.records if w else 0,
            "writes": w.writes if w else 0}


def _warn(msg: str) -> None:
    print(f"orchestrate: {msg}", file=sys.stderr, flush=True)


def _ref(obj):
    import weakref

    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


# ------------------------------------------------------------------------------------------- optimizer hook

def _optimizer_stepped(optimizer, args, kwargs) -> None:
    t0 = time.perf_counter()
    s = _OptimizerSteps
    s.calls += 1
    first = s.first() if s.first is not None else None
    if first is None:
        s.first = _ref(optimizer)  # the first optimizer to step (or the next one, if it was discarded)
    elif first is not optimizer:
        s.overhead_s += time.perf_counter() - t0
        return
    s.steps += 1
    if s.steps == 1:
        _time_forward()
        if why := orchestrate_world.trains_alone():  # a rank that is not part of the world stops here, naming why
            raise TrainsAlone(f"this rank trains alone: {why}")
    _Forward.depth = 0  # (a forward that raised never ran its post-hook)
    if _Forward.pending:
        _read_events()  # the forwards whose GPU work is done count for this step's record
    if not hb._claims:  # no Trainer callback / beat() writes the step records
        (hb._hook or hb.hook_writer()).write("step", s.steps, lazy=True)
    s.overhead_s += time.perf_counter() - t0


# ------------------------------------------------------------------------------------- straggler evidence

class _Forward:
    """The rank's own compute, timed cheaply: seconds inside its model's outermost forward (global module hooks,
    installed at the first optimizer step). On a GPU the kernels run after the forward returns, so the time is the GPU's
    own: a pair of CUDA timing events around the forward on the current stream, read once the end event has completed
    (never waited for: at a later forward or optimizer step), which also counts the GPU idling while this rank's CPU
    was slow to launch. On CPU: wall seconds. Wrappers that synchronize ranks before calling the model (DDP broadcasts
    buffers, FSDP / DeepSpeed gather parameters) are not the outermost module: their inner model is, so the time
    excludes waiting for the other ranks where the wrapper's own forward holds the collective (DDP, ZeRO-1/2; under
    FSDP / ZeRO-3 the model's layers gather parameters inside, and the evidence is blurred by that wait)."""
    depth = 0
    t0 = 0.0
    wrappers: dict = {}  # type -> is a wrapper (cached per class)
    cuda = None  # torch.cuda when this rank computes on a GPU (decided at the first timed forward), else False
    start = None  # the current forward's start event (GPU)
    pending: list = []  # (start, end) events of forwards not read yet


def _cuda_timing(module):
    """torch.cuda if `module`'s parameters live on a GPU, else False (checked once per process)."""
    try:
        import torch

        p = next(module.parameters(), None)
        return torch.cuda if p is not None and p.is_cuda else False
    except Exception:  # noqa: BLE001
        return False


def _read_events() -> None:
    f = _Forward
    while f.pending and f.pending[0][1].query():
        start, end = f.pending.pop(0)
        hb.add_compute(start.elapsed_time(end) / 1000.0)
    del f.pending[:-64]  # (never more than a few: each is read at the next step at the latest)


_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine", "DataParallel",
             "PipelineEngine")


def _is_wrapper(module) -> bool:
    tp = type(module)
    known = _Forward.wrappers.get(tp)
    if known is None:
        known = _Forward.wrappers[tp] = tp.__name__ in _WRAPPERS
    return known


def _forward_pre(module, args) -> None:
    f = _Forward
    if f.depth == 0:
        if _is_wrapper(module):
            return
        if f.cuda is None:
            f.cuda = _cuda_timing(module)
        if f.cuda:
            if f.pending:
                _read_events()
            f.start = f.cuda.Event(enable_timing=True)
            f.start.record()
        else:
            f.t0 = time.perf_counter()
    f.depth += 1


def _forward_post(module, args, out) -> None:
    f = _Forward
    if f.depth == 0:
        return  # a wrapper's end (never counted)
    f.depth -= 1
    if f.depth == 0:
        if f.cuda and f.start is not None:
            end = f.cuda.Event(enable_timing=True)
            end.record()
            f.pending.append((f.start, end))
            f.start = None
        elif not f.cuda:
            hb.add_compute(time.perf_counter() - f.t0)


def _time_forward() -> None:
    if os.environ.get("ORCHESTRATE_STRAGGLER_EVIDENCE", "1").strip().lower() in _OFF:
        return
    try:
        from torch.nn.modules import module as nn_module

        nn_module.register_module_forward_pre_hook(_forward_pre)
        nn_module.register_module_forward_hook(_forward_post)
    except Exception as e:  # noqa: BLE001 - never break the user's run
        _warn(f"no straggler evidence in this rank: {type(e).__name__}: {e}")


def _on_torch_optimizer(module) -> None:
    module.register_optimizer_step_post_hook(_optimizer_stepped)


# --------------------------------------------------------------------------------------------- Trainer hook

def _on_transformers_trainer(module) -> None:
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or getattr(trainer_cls, "_orchestrate_patched", False):
        return
    import functools

    init, train = trainer_cls.__init__, trainer_cls.train

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        tracking.tensorboard_dir(self)
        if "_orchestrate_hooks" not in self.__dict__:
            try:
                _attach(self)
            except TrainsAlone:
                raise
            except Exception as e:  # noqa: BLE001 - the user's Trainer works without our callbacks
                self._orchestrate_hooks = None
                _warn(f"Trainer heartbeats not added: {type(e).__name__}: {e}")

    @functools.wraps(train)
    def train_(self, *args, **kwargs):
        return _train(train, self, args, kwargs)

    trainer_cls.__init__ = __init__
    trainer_cls.train = train_
    trainer_cls._orchestrate_patched = True


class TrainsAlone(RuntimeError):
    """A Trainer of a multi-process job that is not distributed: every rank would train alone on the whole data."""


def _check_distributed(trainer) -> None:
    """torchrun started WORLD_SIZE > 1 ranks, but the Trainer's TrainingArguments are not distributed (on a CPU
    cluster: use_cpu not set, so transformers' device setup stays non-distributed): each rank would train alone, in
    silence but for a warning. Fail the rank instead, saying how to fix it."""
    try:
        world = int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return
    args = getattr(trainer, "args", None)
    if world <= 1 or args is None or os.environ.get("ORCHESTRATE_ALLOW_UNDISTRIBUTED") == "1":
        return
    got = getattr(args, "world_size", world)
    if isinstance(got, int) and got == 1:
        cpu = os.environ.get("ORCHESTRATE_ACCELERATOR") == "cpu" and not getattr(args, "use_cpu", False)
        raise TrainsAlone("this rank's Trainer is not distributed (TrainingArguments.world_size 1, WORLD_SIZE "
                          f"{world}): every rank would train alone on all the data" +
                          (" - on a CPU cluster pass use_cpu=True (run.args: use_cpu: true)" if cpu else ""))


def _attach(trainer) -> None:
    _check_distributed(trainer)
    try:
        import orchestrate_trainer as ot
    except ImportError:  # imported through the package (tests), not from the hooks directory
        from orchestrator.node.hooks import orchestrate_trainer as ot

    if os.environ.get("ORCHESTRATE_SAVE_ON_EACH_NODE") == "1" and hasattr(trainer.args, "save_on_each_node"):
        # hosts without a shared filesystem (docs/staging.md): every node keeps whole checkpoints, so each can resume
        trainer.args.save_on_each_node = True
        _weights_on_each_node()
    save_on_signal = os.environ.get("ORCHESTRATE_SAVE_ON_SIGNAL", "1").strip().lower() not in _OFF
    preempt = ot.PreemptionCallback() if save_on_signal else None
    heartbeat = ot.HeartbeatCallback(preempt=preempt)
    if preempt is not None:
        trainer.add_callback(preempt)  # before the heartbeat callback: it sees the save that preempt asks for
    trainer.add_callback(heartbeat)
    trainer._orchestrate_hooks = (preempt, heartbeat)


def _weights_on_each_node() -> None:
    """transformers 5 writes model weights on global rank 0 only, whatever `save_on_each_node` says (its
    `PreTrainedModel.should_save_on_this_rank`): let the Trainer's own choice (`args.should_save`, passed as
    is_main_process) decide again, so each node's local main process writes the weights of its checkpoints."""
    try:
        from transformers import modeling_utils
    except ImportError:
        return
    cls = getattr(modeling_utils, "PreTrainedModel", None)
    if cls is not None and hasattr(cls, "should_save_on_this_rank") and not getattr(cls, "_orchestrate_each", False):
        cls.should_save_on_this_rank = lambda self, is_main_process: is_main_process
        cls._orchestrate_each = True


def _owned_elsewhere(trainer, ours) -> bool:
    """The Trainer carries orchestrate callbacks it did not get from us (the built-in recipes add their own)."""
    handler = getattr(trainer, "callback_handler", None)
    return any(getattr(cb, "orchestrate_role", None) and all(cb is not o for o in ours)
               for cb in getattr(handler, "callbacks", ()))


def _resume_arg(trainer, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    mode = os.environ.get("ORCHESTRATE_RESUME", "").strip()
    if not mode or mode.lower() in ("never", *_OFF):
        return args, kwargs
    given = args[0] if args else kwargs.get("resume_from_checkpoint")
    if given is not None:
        return args, kwargs  # the user's own choice (a path, True, or False = "do not resume") stands
    try:
        import orchestrate_checkpoint as oc
    except ImportError:
        from orchestrator.node.hooks import orchestrate_checkpoint as oc
    job = os.environ.get("ORCHESTRATE_JOB_ID", "").strip()
    try:
        ckpt = oc.resume_from(mode, getattr(trainer.args, "output_dir", "") or "", job)
    except FileNotFoundError:
        raise FileNotFoundError(f"ORCHESTRATE_RESUME={mode!r}: not a checkpoint directory") from None
    if ckpt is None:
        return args, kwargs
    if hb.env_rank() == 0:
        _warn(f"resuming from {ckpt} (ORCHESTRATE_RESUME={mode}){oc.whose(ckpt, job)}")
    if args:
        return (ckpt,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "resume_from_checkpoint": ckpt}


def _train(train, trainer, args: tuple, kwargs: dict):
    tracking.tensorboard_dir(trainer)  # (again: a TensorBoardCallback added after __init__)
    hooks = trainer.__dict__.get("_orchestrate_hooks")
    if not hooks:
        return train(trainer, *args, **kwargs)
    preempt, heartbeat = hooks
    if _owned_elsewhere(trainer, hooks):  # a built-in recipe: its callbacks, resume and exit code rule
        for cb in hooks:
            if cb is not None:
                trainer.remove_callback(cb)
        trainer._orchestrate_hooks = None
        return train(trainer, *args, **kwargs)
    args, kwargs = _resume_arg(trainer, args, kwargs)
    if preempt is not None:
        preempt.install()
    try:
        out = train(trainer, *args, **kwargs)
    except BaseException:
        if preempt is not None:
            preempt.uninstall()
        raise
    if preempt is not None and preempt.stopped_by:
        _leave_preempted(int(preempt.stopped_by))  # keeps the handler: a launcher's TERM now counts as the same request
    if preempt is not None:
        preempt.uninstall()
    return out


def _leave_preempted(signum: int) -> None:
    """Saved and stopped on a signal: tear the process group down (every rank agreed to stop at this step, so all
    arrive), run atexit handlers (trackers finish their run) and exit 128+signal without interpreter finalization
    (which sometimes aborts after a live gloo group; see recipes/run.py `leave`)."""
    import atexit

    hb.flush_all()
    try:
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                try:
                    dist.barrier()
                finally:
                    dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the checkpoint is saved: exit with the signal's code regardless
        _warn(f"process group teardown after preemption: {type(e).__name__}: {e}")
    _warn(f"rank {hb.env_rank()}: checkpoint saved after signal {signum}; exiting {128 + signum}")
    exiting(128 + signum)
    _flush_stdio()
    try:
        atexit._run_exitfuncs()
    finally:
        _flush_stdio()
        os._exit(128 + signum)


SETTLE_S = (0.01, 0.25)  # at least, at most


def _runnable_threads() -> int:
    """Threads of this process other than the calling one that are running or waiting for a CPU (state R)."""
    import threading

    me = str(threading.get_native_id())
    n = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] == b"R":
                    n += 1
        except (OSError, IndexError):
            continue
    return n


class _Exit:
    code: int | None = None  # what the main thread asked for (sys.exit / exit / quit, or `exiting`)
    pid = 0  # the hooked rank (a forked child that exits through Python writes no record in its name)


def exiting(code: int) -> None:
    """Name the code this rank is about to leave with through os._exit (after running the atexit handlers)."""
    _Exit.code = code


def _exit_code(status) -> int:
    """The process exit code Python gives SystemExit(status)."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    return 1  # any other object is printed to stderr and exits 1


def _asked(status) -> None:
    import threading

    if threading.current_thread() is threading.main_thread():  # elsewhere SystemExit ends only that thread
        _Exit.code = _exit_code(status)


def _watch_exit() -> None:
    """Remember the code the script asks for: wrap sys.exit and the exit / quit builtins."""
    import builtins

    _Exit.pid = os.getpid()
    real_exit = sys.exit

    def exit(status=None):  # stands in for sys.exit
        _asked(status)
        real_exit(status)

    exit.__doc__, exit.__module__, exit.__qualname__ = real_exit.__doc__, "sys", "exit"
    sys.exit = exit
    for name in ("exit", "quit"):
        quitter = getattr(builtins, name, None)
        if quitter is not None and callable(quitter):
            setattr(builtins, name, _quitter(quitter))


def _quitter(quitter):
    try:
        class Quitter(type(quitter)):
            def __call__(self, code=None):
                _asked(code)
                return quitter(code)

        q = Quitter.__new__(Quitter)
        q.__dict__.update(getattr(quitter, "__dict__", {}))
        return q
    except TypeError:
        return quitter


def _final_code() -> int | None:
    last = getattr(sys, "last_value", None)  # set by the interpreter for the exception that ended the script
    if last is not None and not isinstance(last, SystemExit):
        return None if isinstance(last, KeyboardInterrupt) else 1
    return _Exit.code


def _write_exit_record() -> None:
    hb_dir = os.environ.get("ORCHESTRATE_HEARTBEAT_DIR")
    if not hb_dir or os.getpid() != _Exit.pid:
        return
    path = os.path.join(hb_dir, f"rank{hb.env_rank()}.exit")
    code = _final_code()
    try:
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.write(fd, ('{"pid": %d, "code": %s}\n' % (os.getpid(), "null" if code is None else code)).encode())
        finally:
            os.close(fd)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # at exit: the record is a hint for the agent, never a failure of the rank


def _at_exit() -> None:
    _write_exit_record()
    _settle_at_exit()


def _settle_at_exit() -> None:
    """Give torch.distributed's worker threads the GIL once more before the interpreter finalizes.

    A gloo worker thread that finishes a collective (a DDP all-reduce, the last barrier) drops its reference to the
    work object; when that is the last one, the destructor frees Python objects the work captured and so takes the
    GIL. When the script ends before the worker got it (the main thread keeps the GIL up to the switch interval, and
    on a loaded machine the worker may not even have run yet), the worker asks for it after finalization has begun:
    Python ends the thread with pthread_exit, whose unwinding through a C++ destructor calls std::terminate
    ("terminate called without an active exception", SIGABRT), and torchrun reports a rank that finished its work as
    failed (pytorch/pytorch#190489; a 2-rank DDP script ending with a barrier aborted in 1 of 20 runs here, 4 of 8
    with a long switch interval). Sleeping here, after every other atexit handler, releases the GIL: a waiting worker
    finishes now. We sleep at least SETTLE_S[0] and, while another thread is still runnable (a worker that has not
    run yet), up to SETTLE_S[1]. Destroying the process group instead does not help (its threads live on while any
    Python object holds the group), and it would make peers still at work fail."""
    if "torch.distributed" not in sys.modules:
        return
    least, most = SETTLE_S
    t0 = time.monotonic()
    time.sleep(least)
    while time.monotonic() - t0 < most and _runnable_threads():
        time.sleep(least)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced streams
            pass


# ------------------------------------------------------------------------------------------- import finder

class _PostImportFinder:
    """Finds nothing itself: for a module of interest it asks the other finders, and makes the found loader run
    our hook right after the module's code has executed."""

    def __init__(self, hooks: dict):
        self.hooks = dict(hooks)
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        hook = self.hooks.get(fullname)
        if hook is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            if module.__name__ == fullname and self.hooks.pop(fullname, None) is not None:
                _run_hook(hook, module)

        try:
            loader.exec_module = exec_then_hook  # this module's own loader instance: nothing else is affected
        except (AttributeError, TypeError):
            _warn(f"cannot hook the import of {fullname}")
        return spec

    def invalidate_caches(self) -> None:
        pass


def _run_hook(hook, module) -> None:
    try:
        hook(module)
    except Exception as e:  # noqa: BLE001 - a failed hook must not fail the user's import
        _warn(f"hook on {module.__name__} failed: {type(e).__name__}: {e}")


HOOKS = {"torch.optim.optimizer": _on_torch_optimizer, "transformers.trainer": _on_transformers_trainer,
         "mlflow": tracking.on_mlflow}


# ----------------------------------------------------------------------------------------------- start-up

def _process_start_time() -> float | None:
    """When the kernel created this process (as orchestrator.node.proctools.process_start_time)."""
    try:
        with open("/proc/self/stat") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - int(rest[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _hang_responder() -> None:
    """The flight recorder sized and the rank's hang responder started (orchestrate_hangs)."""
    try:
        try:
            import orchestrate_hangs as hangs
        except ImportError:
            from orchestrator.node.hooks import orchestrate_hangs as hangs
        hangs.start()
    except Exception as e:  # noqa: BLE001 - never break the user's run
        _warn(f"no hang evidence in this rank: {type(e).__name__}: {e}")


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    import atexit

    atexit.register(_at_exit)  # before the user's code: runs after the handlers the script and its libraries add
    _watch_exit()
    if not any(a == "recipes.run" for a in getattr(sys, "orig_argv", ())):  # recipes.run writes its own
        hb.mark("boot", proc_start=_process_start_time())
    tracking.defaults()
    orchestrate_world.on_cpu_cluster()  # accelerate's state on a CPU cluster: the whole world, not one process
    _hang_responder()
    finder = _PostImportFinder(HOOKS)
    for name, hook in list(HOOKS.items()):
        if name in sys.modules:  # installed late (tests): hook what is already there
            finder.hooks.pop(name, None)
            _run_hook(hook, sys.modules[name])
    sys.meta_path.insert(0, finder)


hb.one_module_per_process(__name__, "orchestrate_hooks")
