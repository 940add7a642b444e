"""Pure SLURM rendering: the standalone `job.sbatch` of a LaunchPlan, and the checks of a cluster's
`slurm:` block. No I/O, no subprocess, no environment reads: golden files compare byte for byte.

The script is a product on its own: a user can `sbatch RUN_DIR/job.sbatch` by hand and it does what
`orchestrate submit` does (same node agent, same rank binding, same preemption handling):

- one task per node (`srun --ntasks-per-node=1 --kill-on-bad-exit=1`): one rank failing ends the step;
- nothing node-specific is expanded in the batch shell: each node agent binds its own rank from
  SLURM_NODEID and the main address from SLURM_JOB_NODELIST inside its task (the classic
  `$SLURM_NODEID`-in-the-batch-shell bug, every node rank 0 and a silent hang, cannot happen);
- `--signal=B:USR2@LEAD` tells the batch shell ahead of the time limit; it forwards USR2 to the
  step (srun hands it to every task: the agents and the ranks, which save a checkpoint), waits for
  the step, and requeues the job when the restart budget (`python -m launchers.slurm.task requeue`)
  allows; the next run resumes from the checkpoint (`checkpoint.resume: auto`).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from orchestrator.errors import Problem
from orchestrator.core.container import PACKAGE_DIR, srun_flags
from orchestrator.core.jobplan import RUN_DIR_VAR, LaunchPlan
from orchestrator.node.agent import agent_argv
from orchestrator.core.plan import parse_time_s, slurm_problems

SIGNAL = "USR2"  # NCCL uses USR1 itself
_EXTRA_OK = re.compile(r"^--?[A-Za-z][A-Za-z0-9_-]*(=.*)?$")
# Options the script sets itself: overriding them through extra_sbatch would break what it relies on.
RESERVED = frozenset({"nodes", "N", "ntasks-per-node", "ntasks", "n", "output", "o", "error", "e", "signal",
                      "open-mode", "job-name", "J", "array", "a", "no-requeue", "wrap"})


def time_seconds(value: str) -> int | None:
    """SLURM time limits (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> seconds; None if malformed."""
    return parse_time_s(str(value))


def extra_option(arg: str) -> tuple[str, Any]:
    """'--reservation=foo' -> ('reservation', 'foo'); '--exclusive' -> ('exclusive', True)."""
    body = arg.lstrip("-")
    key, sep, value = body.partition("=")
    return key, (value if sep else True)


def check_slurm(slurm: Any, cluster_name: str, procs_per_node: int = 1, accelerator: str = "cpu") -> list[Problem]:
    """Every problem of a `slurm:` block that can be seen without asking the cluster."""
    problems: list[Problem] = []
    where = f"cluster {cluster_name!r}"
    if slurm is None:
        return [Problem("slurm", f"{where} has kind slurm but no slurm: block")]
    problems.extend(slurm_problems(slurm, cluster_name, procs_per_node, accelerator))
    if slurm.signal_lead_s > 65535:
        problems.append(Problem("slurm.signal_lead_s", f"SLURM accepts at most 65535 s, got {slurm.signal_lead_s}"))
    for i, arg in enumerate(slurm.extra_sbatch):
        if not _EXTRA_OK.match(arg) or "\n" in arg:
            problems.append(Problem(f"slurm.extra_sbatch[{i}]", f"expected one option like --reservation=foo, "
                                                                f"got {arg!r}"))
        elif extra_option(arg)[0] in RESERVED:
            problems.append(Problem(f"slurm.extra_sbatch[{i}]", f"{arg!r} is set by orchestrate itself "
                                                                f"(one task per node, logs, signal)"))
    for i, line in enumerate(slurm.setup):
        if "\n" in line:
            problems.append(Problem(f"slurm.setup[{i}]", "one shell line per entry"))
    return problems


def sbatch_options(plan: LaunchPlan, slurm: Any, run_dir: str, *, array: str | None = None,
                   job_name: str | None = None) -> list[tuple[str, Any]]:
    """The #SBATCH options, in the order they are written. Values are plain data (True = a flag). `array`
    (`0-3%2`): a sweep's one array job (its name `job_name`, SLURM's output per task in `run_dir`, the sweep's dir)."""
    opts: list[tuple[str, Any]] = [("job-name", job_name or plan.job_id)]
    opts += [("array", array)] if array else []
    opts += [("nodes", plan.nodes), ("ntasks-per-node", 1)]
    for key, value in (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos)):
        if value:
            opts.append((key, value))
    opts.append(("time", slurm.time))
    if slurm.gpus_per_node:
        opts.append(("gpus-per-node", slurm.gpus_per_node))
    if slurm.cpus_per_task:
        opts.append(("cpus-per-task", slurm.cpus_per_task))
    if slurm.mem:
        opts.append(("mem", slurm.mem))
    if slurm.constraint:
        opts.append(("constraint", slurm.constraint))
    if slurm.exclusive:
        opts.append(("exclusive", True))
    if slurm.exclude:
        opts.append(("exclude", ",".join(slurm.exclude)))
    opts += [("output", f"{run_dir}/slurm-{'%A_%a' if array else '%j'}.out"), ("open-mode", "append"),
             ("signal", f"B:{SIGNAL}@{slurm.signal_lead_s}"), ("requeue", True)]
    opts += [extra_option(a) for a in slurm.extra_sbatch]
    return opts


def _flag(key: str, value: Any) -> str:
    return f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}"


def render_sbatch(plan: LaunchPlan, slurm: Any, run_dir: str | None = None, python: str | None = None) -> str:
    """The standalone batch script for `plan` (RUN_DIR/job.sbatch)."""
    run_dir = run_dir or plan.run_dir
    python = python or plan.python
    q = shlex.quote
    head = [
        "#!/bin/bash",
        f"# orchestrate job {plan.job_id}: {_what(plan)} on SLURM cluster '{plan.cluster_name}'",
        f"# {_shape(plan)}",
        f"# Submit by hand with:  sbatch {q(run_dir + '/job.sbatch')}   (what `orchestrate submit` runs)",
        f"# Per-node output: {run_dir}/logs/node<R>.log; preemption: {SIGNAL} {slurm.signal_lead_s} s before "
        f"the time limit -> checkpoint -> requeue (at most {int(plan.health.max_restarts or 0)} restarts).",
    ]
    head += [_flag(k, v) for k, v in sbatch_options(plan, slurm, run_dir)]
    bind = [f"RUN_DIR={q(run_dir)}", f"PYTHON={q(python)}", f"MAX_RESTARTS={int(plan.health.max_restarts or 0)}"]
    return _script(plan, slurm, head, bind, run_dir, python)


ARRAY_RUN_DIR = "${RUN_DIR}"  # (the run dir an array task picks; only ever mapped back to "$RUN_DIR" below)


def array_spec(n: int, parallel: int) -> str:
    """`--array` of a sweep of `n` points, at most `parallel` running at once: `0-3%2`."""
    return f"0-{n - 1}%{max(1, min(parallel, n))}"


def array_problems(points: list[tuple[LaunchPlan, Any]]) -> list[Problem]:
    """What keeps a sweep's points from being ONE array job: SLURM gives every task of an array the same options,
    so the points must agree on everything but their run dirs (nodes, time, partition, ... , the python, the setup
    lines, a pyxis container's image and flags: they stand on the one task step, the run dir's mount bound per task)."""
    problems: list[Problem] = []
    plan0, slurm0 = points[0]

    def shape(plan: LaunchPlan, slurm: Any) -> dict[str, Any]:
        return dict(sbatch_options(plan, slurm, "", array="-", job_name="-"), python=plan.python,
                    setup=list(slurm.setup), pyxis=_pyxis_flags(plan, ARRAY_RUN_DIR))
    first = shape(plan0, slurm0)
    for i, (plan, slurm) in enumerate(points):
        if i == 0:
            continue
        mine = shape(plan, slurm)
        for key in sorted(set(first) | set(mine)):
            if first.get(key) != mine.get(key):
                problems.append(Problem(f"point p{i}", f"SLURM gives every task of the sweep's array job the same "
                                        f"{key}: p0 has {first.get(key)!r}, p{i} {mine.get(key)!r} (sweep such a key "
                                        "as separate submits)"))
    return problems


def render_array_sbatch(points: list[tuple[LaunchPlan, Any]], parallel: int, sweep_id: str, sweep_dir: str,
                        python: str | None = None) -> str:
    """The batch script of a sweep as ONE array job (SWEEP_DIR/job.sbatch): array task i runs point p<i> (its run dir,
    its restart budget) exactly as that point's own job.sbatch would, in an allocation of its own (its own nodes, main
    address and rendezvous); at most `parallel` tasks run at once (`--array=0-N%P`). `array_problems` must be empty."""
    plan, slurm = points[0]
    python = python or plan.python
    q = shlex.quote
    n = len(points)
    head = [
        "#!/bin/bash",
        f"# orchestrate sweep {sweep_id}: {n} point(s) of {_what(plan)} on SLURM cluster '{plan.cluster_name}', "
        "as ONE array job",
        f"# each point: {_shape(plan)}",
        f"# Array task i is point p<i> (job {sweep_id}-p<i>, its own run dir): a multi-node job in an allocation of "
        f"its own, at most {max(1, min(parallel, n))} at once;",
        f"# its rendezvous port is launch.port + 1 + i ({plan.port + 1}-{plan.port + n}: tasks sharing nodes never "
        "collide).",
        f"# Submit by hand with:  sbatch {q(sweep_dir + '/job.sbatch')}   (what `orchestrate submit --sweep` runs)",
        f"# Per-node output: <run dir>/logs/node<R>.log; preemption: {SIGNAL} {slurm.signal_lead_s} s before the time "
        "limit -> checkpoint -> requeue of that task (at most its health.max_restarts restarts).",
    ]
    head += [_flag(k, v) for k, v in sbatch_options(plan, slurm, sweep_dir, array=array_spec(n, parallel),
                                                    job_name=sweep_id)]
    bind = ["# array task i -> point p<i>: its run dir (plan, logs, records) and its restart budget",
            "RUN_DIRS=(", *[f"    {q(p.run_dir)}" for p, _ in points], ")",
            f"BUDGETS=({' '.join(str(int(p.health.max_restarts or 0)) for p, _ in points)})",
            'RUN_DIR="${RUN_DIRS[$SLURM_ARRAY_TASK_ID]}"',
            f"PYTHON={q(python)}",
            'MAX_RESTARTS="${BUDGETS[$SLURM_ARRAY_TASK_ID]}"']
    return _script(plan, slurm, head, bind, ARRAY_RUN_DIR, python)


def _what(plan: LaunchPlan) -> str:
    return (f"{plan.recipe} recipe '{plan.recipe_name}'" if plan.run_kind == "recipe"
            else f"own code ({plan.run_kind} {plan.run_target})")


def _shape(plan: LaunchPlan) -> str:
    return (f"{plan.nodes} node(s) x {plan.procs_per_node} process(es) = world {plan.world_size}; profile "
            f"{plan.profile} -> {plan.distributed_type}; effective batch "
            + (str(plan.effective_batch) if plan.effective_batch is not None else "set by the job's own code"))


def _script(plan: LaunchPlan, slurm: Any, head: list[str], bind: list[str], run_dir: str, python: str) -> str:
    """The batch script: `head` (comments, #SBATCH lines), the setup, `bind` (RUN_DIR, PYTHON, MAX_RESTARTS), then
    the one body every script shares (`run_dir`: the path that stands for "$RUN_DIR" in the agent's argv)."""
    lines = head + ["", "set -u"]
    if slurm.setup:
        lines += ["", "# setup (slurm.setup)"] + list(slurm.setup)
    lines += [""] + bind
    lines += [
        'mkdir -p "$RUN_DIR/logs"',
        'echo "orchestrate: SLURM job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}"',
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt "$MAX_RESTARTS" ]; then',
        '    echo "orchestrate: restart ${SLURM_RESTART_COUNT} exceeds health.max_restarts=$MAX_RESTARTS;'
        ' giving up" >&2',
        "    exit 3",
        "fi",
        "",
        "# One task per node. Each node agent binds its own rank from SLURM_NODEID and the main address from",
        "# SLURM_JOB_NODELIST inside its task: nothing node-specific is expanded in this batch shell.",
        "# --kill-on-bad-exit: one node failing ends every node's task.",
        *_container_lines(plan, run_dir),
        'srun --kill-on-bad-exit=1 --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" '
        "--ntasks-per-node=1 \\",
        '    --output="$RUN_DIR/logs/node%n.log" --open-mode=append \\',
        *_pyxis_flags(plan, run_dir),
        "    " + " ".join({python: '"$PYTHON"', run_dir: '"$RUN_DIR"'}.get(a, shlex.quote(a))
                       for a in agent_argv(_agent_python(plan, python), run_dir)) + " &",
        "SRUN_PID=$!",
        "",
        f"# {SIGNAL} ahead of the time limit (or `scancel --batch --signal={SIGNAL}`): forward it to every task;",
        "# the ranks save a checkpoint and exit, then the job is requeued while the budget allows.",
        "PREEMPTED=0",
        f"on_preempt() {{ PREEMPTED=1; echo \"orchestrate: {SIGNAL} received, forwarding to all nodes\"; "
        f"kill -{SIGNAL} \"$SRUN_PID\" 2>/dev/null; }}",
        f"trap on_preempt {SIGNAL}",
        "trap 'kill -TERM \"$SRUN_PID\" 2>/dev/null' TERM INT",
        "RC=0",
        'while :; do wait "$SRUN_PID"; RC=$?; kill -0 "$SRUN_PID" 2>/dev/null || break; done',
        'if [ "$PREEMPTED" = 1 ]; then',
        '    if "$PYTHON" -m launchers.slurm.task requeue "$RUN_DIR" --max-restarts "$MAX_RESTARTS"; then',
        '        scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "    fi",
        '    [ "$RC" = 0 ] && RC=75',
        "fi",
        'exit "$RC"',
        "",
    ]
    return "\n".join(lines)


def _pyxis(plan: LaunchPlan) -> bool:
    return plan.container is not None and plan.container.runtime == "pyxis"


def _agent_python(plan: LaunchPlan, python: str) -> str:
    """pyxis: the node agent runs in the image, by its python; else this cluster's (slurm.python)."""
    return plan.container.python if _pyxis(plan) and plan.container is not None else python


def _container_lines(plan: LaunchPlan, run_dir: str) -> list[str]:
    """What the batch shell says and sets for a container job."""
    cp = plan.container
    if cp is None:
        return []
    if not _pyxis(plan):
        return [f"# Each node agent starts the launcher in the container ({cp.runtime}, image {cp.image}); see",
                "# nodes/<R>/command.txt for the exact command line.", ""]
    return [f"# The task step runs in the container (pyxis, image {cp.image}): the node agent, the launcher and the",
            f"# ranks, with orchestrate's node package mounted read-only at {PACKAGE_DIR}.",
            f"export PYTHONPATH={shlex.quote(PACKAGE_DIR)}", ""]


def _pyxis_flags(plan: LaunchPlan, run_dir: str) -> list[str]:
    """The task step's --container-* flags (core.container.srun_flags), one per line."""
    cp = plan.container
    if cp is None or not _pyxis(plan):
        return []
    cwd = plan.rank_cwd.replace(RUN_DIR_VAR, run_dir)
    flags = srun_flags(cp, run_dir=run_dir, package=plan.package_root, cwd=cwd, env_names=["PYTHONPATH"])
    return [f"    {_quote_keeping(f, ARRAY_RUN_DIR)} \\" for f in flags]


def _quote_keeping(arg: str, var: str) -> str:
    """`arg` quoted for bash, except that `var` (an array task's "${RUN_DIR}") still expands where it stands."""
    return f'"{var}"'.join(shlex.quote(part) if part else "" for part in arg.split(var)) or "''"
