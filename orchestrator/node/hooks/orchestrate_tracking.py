"""Trackers: ONE run per job for its whole life (restarts, requeues, spare-host replacements), with no code change.

Every attempt of a job starts new rank processes; a tracker left alone opens a new run in each. Here, in the ranks'
zero-code hooks (standard library only; a tracker's own package is touched only when the user's code imports it):

- W&B (`defaults`, at the rank's start-up): WANDB_RUN_ID (rank 0: the job id; rank G > 0: <job id>-rank<G>),
  WANDB_RESUME=allow, WANDB_RUN_GROUP, WANDB_NAME, each where unset.
- TensorBoard (`tensorboard_dir`, each Trainer): a Trainer whose log dir nobody chose logs to
  <output_dir>/runs/<job id> (transformers >= 5).
- MLflow (`on_mlflow`, when the rank imports mlflow): rank 0's first top-level `mlflow.start_run()` (transformers'
  MLflowCallback's, or the user's own) resumes the job's run: the run of the tracking store tagged
  `orchestrate.job_id=<job id>`, created by the first attempt.

MLflow generates a run's id itself, so the job's run is FOUND, not named: the first attempt's rank 0 creates it with
the tag `orchestrate.job_id` (and logs the job's facts once: params `orchestrate.*`, `job_params`), every later
attempt's rank 0 searches the active experiment for that tag and resumes the run it finds. That needs nothing but
the tracking store itself, which rank 0 reaches anyway: no shared filesystem, no mlflow on the submit host; a spare
host in rank 0's place finds the same run. Rank 0 then writes a
"tracking" heartbeat record (`{"tracker": "mlflow", "run_id", "experiment_id", "tracking_uri", "resumed"}`, the URI
without credentials) that travels to the submit host like every heartbeat; the supervisor keeps it in
RUN_DIR/tracking.json for `status`. Left alone: a run id the user gave (`start_run(run_id=...)`, MLFLOW_RUN_ID), a
nested run, a call while a run is active, and every rank but 0. Nothing here ever fails the user's run: a tracking
store that cannot be searched leaves `start_run` to do what it would have done, and says so on stderr.
See docs/tracking.md.
"""

from __future__ import annotations

import functools
import json
import os
import sys

try:
    import orchestrate_heartbeat as hb
except ImportError:
    from orchestrator.node.hooks import orchestrate_heartbeat as hb

JOB_TAG = "orchestrate.job_id"  # the tag that finds a job's MLflow run
EVENT = "tracking"  # the heartbeat record that names the run (docs/CONTRACT.md)


def _warn(msg: str) -> None:
    print(f"orchestrate: {msg}", file=sys.stderr, flush=True)


def _job() -> str:
    return os.environ.get("ORCHESTRATE_JOB_ID", "").strip()


def safe_job_name(job: str, limit: int = 64) -> str:
    """The job id as a tracker run id / directory name: letters, digits, '-' and '_' only, at most `limit` long."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in job)[:limit]


# ---------------------------------------------------------------------------------------------------- W&B

def defaults() -> None:
    """W&B's run of this rank from the job id, where the user set none (at start-up, before the user's code)."""
    env = os.environ
    job = _job()
    if not job:
        return
    rank = hb.env_rank()
    suffix = f"-rank{rank}" if rank else ""
    run_id = safe_job_name(job, 64 - len(suffix)) + suffix
    if "WANDB_RUN_ID" not in env:
        env["WANDB_RUN_ID"] = run_id
        env.setdefault("WANDB_RESUME", "allow")
    env.setdefault("WANDB_RUN_GROUP", job)
    env.setdefault("WANDB_NAME", job + suffix)


# ---------------------------------------------------------------------------------------------- TensorBoard

def tensorboard_dir(trainer) -> None:
    """transformers' TensorBoardCallback logs to <output_dir>/runs/<start time>_<host> unless TENSORBOARD_LOGGING_DIR
    is set: every restart or requeue of a job would show up as one more run. Where the user chose no dir, the job's
    attempts share <output_dir>/runs/<job id> (TensorBoard reads every event file of a dir as one run; a resumed
    Trainer goes on from the checkpoint's step). transformers 4 (no `logging_dir` on the callback): left alone.
    Never fails the user's Trainer."""
    job = _job()
    if not job or os.environ.get("TENSORBOARD_LOGGING_DIR"):
        return
    try:
        for cb in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
            if type(cb).__name__ == "TensorBoardCallback" and getattr(cb, "logging_dir", "") is None \
                    and getattr(cb, "tb_writer", None) is None and getattr(trainer.args, "output_dir", None):
                cb.logging_dir = os.path.join(trainer.args.output_dir, "runs", safe_job_name(job))
    except Exception as e:  # noqa: BLE001
        _warn(f"TensorBoard log dir left as it was: {type(e).__name__}: {e}")


# --------------------------------------------------------------------------------------------------- MLflow

PLAN_PARAMS = {"cluster_name": "orchestrate.cluster", "cluster_kind": "orchestrate.backend",
               "nodes": "orchestrate.nodes", "world_size": "orchestrate.world_size",
               "effective_batch": "orchestrate.effective_batch"}


def job_params() -> dict:
    """The job's facts logged once on its MLflow run: the job id and, from the plan of the rank's run dir
    (ORCHESTRATE_RUN_DIR/plan.json, orchestrator.node.rundir.RunDir.PLAN: the hooks import no package), its cluster,
    backend, nodes, world size and effective batch (a value the plan does not know is left out)."""
    params = {JOB_TAG: _job()}
    try:
        with open(os.path.join(os.environ.get("ORCHESTRATE_RUN_DIR", ""), "plan.json")) as fh:
            plan = json.load(fh)
    except (OSError, ValueError):
        return params
    if isinstance(plan, dict):
        params.update({name: plan[key] for key, name in PLAN_PARAMS.items() if plan.get(key) is not None})
    return params


def public_uri(uri: str) -> str:
    """A tracking URI as it may be written down: user:password@ and the query (tokens) replaced by ***."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return "***"
    if "@" not in parts.netloc and not parts.query:
        return uri  # (as it is: urlunsplit would turn sqlite:////abs/path into sqlite://abs/path)
    netloc = "***@" + parts.netloc.rsplit("@", 1)[1] if "@" in parts.netloc else parts.netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


def on_mlflow(module) -> None:
    """`import mlflow` in rank 0 of a job: its `start_run` resumes the job's run (see the module docstring)."""
    start_run = getattr(module, "start_run", None)
    if not _job() or hb.env_rank() != 0 or start_run is None or getattr(start_run, "_orchestrate", False):
        return
    import inspect

    try:
        signature = inspect.signature(start_run)
    except (TypeError, ValueError):
        return

    @functools.wraps(start_run)
    def start_run_(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return start_run(*args, **kwargs)
        given = bound.arguments
        if given.get("run_id") or given.get("nested") or given.get("parent_run_id") or \
                os.environ.get("MLFLOW_RUN_ID") or module.active_run() is not None:
            return start_run(*args, **kwargs)  # the user's own choice of run, or not the job's top-level run
        return _start_job_run(module, start_run, bound)

    start_run_._orchestrate = True  # type: ignore[attr-defined]
    module.start_run = start_run_
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is not None and getattr(fluent, "start_run", None) is start_run:
        fluent.start_run = start_run_


def find_job_run(module, job: str, experiment_id: str | None = None) -> str | None:
    """The id of `job`'s run in the experiment (default: the active one), the earliest if several; None: none yet."""
    if "'" in job:
        return None
    runs = module.search_runs(experiment_ids=[experiment_id] if experiment_id else None,
                              filter_string=f"tags.`{JOB_TAG}` = '{job}'", output_format="list",
                              order_by=["attributes.start_time ASC"], max_results=1)
    return runs[0].info.run_id if runs else None


def _start_job_run(module, start_run, bound):
    job = _job()
    given = bound.arguments
    try:
        found = find_job_run(module, job, given.get("experiment_id"))
    except Exception as e:  # noqa: BLE001 - the store cannot be searched: the user's call as it was
        _warn(f"MLflow: the run of job {job} not looked up ({type(e).__name__}: {e}); a run of its own is started")
        return start_run(*bound.args, **bound.kwargs)
    if found:
        given["run_id"] = found
        run = start_run(*bound.args, **bound.kwargs)
    else:
        params = job_params()
        given["tags"] = {**(given.get("tags") or {}),
                         **{k: str(params[k]) for k in (JOB_TAG, "orchestrate.cluster") if k in params}}
        given.setdefault("run_name", None)
        given["run_name"] = given["run_name"] or job
        run = start_run(*bound.args, **bound.kwargs)
        try:
            module.log_params(params)  # once: only the attempt that creates the run
        except Exception as e:  # noqa: BLE001
            _warn(f"MLflow: the job's params not logged: {type(e).__name__}: {e}")
    _announce(module, run, resumed=bool(found))
    return run


def _announce(module, run, resumed: bool) -> None:
    """Say which run this is: one line on rank 0's output and the "tracking" heartbeat record (-> RUN_DIR/
    tracking.json on the submit host, for `status`)."""
    try:
        info = run.info
        uri = public_uri(str(module.get_tracking_uri()))
        _warn(f"MLflow run {info.run_id} of job {_job()} ({'resumed' if resumed else 'created'}; experiment "
              f"{info.experiment_id}, tracking URI {uri})")
        hb.mark(EVENT, tracker="mlflow", run_id=info.run_id, experiment_id=str(info.experiment_id),
                tracking_uri=uri, resumed=resumed)
        hb.flush_all()
    except Exception as e:  # noqa: BLE001
        _warn(f"MLflow run not recorded: {type(e).__name__}: {e}")


hb.one_module_per_process(__name__, "orchestrate_tracking")
