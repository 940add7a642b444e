"""`orchestrate` command line: argument parsing, the commands, one-line errors, exit codes.

What the commands print lives elsewhere: `views` (data and plain text), `tty` (rich tables on a terminal),
`logtail` (node logs), `progress` (training progress). Imports nothing heavy at start-up (`orchestrate
--help` must stay fast): the api, launchers and rich are imported inside the commands that need them.
Exit codes: 0 ok, 1 job failed, 2 bad input, 130 cancelled.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys

from orchestrator import __version__
from orchestrator.errors import ConfigError, OrchestratorError, Problem
from orchestrator.types import is_terminal

EPILOG = """examples:
  orchestrate submit recipes/configs/sft_tiny.yaml
  orchestrate submit recipe.yaml --nodes 2 --cluster cluster_configs/ssh_example.yaml trainer.learning_rate=1e-4
  orchestrate submit examples/own_code/my_job.yaml --nodes 2    # your own script (run: {script|module|trl, args})
  orchestrate render recipe.yaml --nodes 2 --out /tmp/plan
  orchestrate submit recipe.yaml --detach ; orchestrate attach JOB
  orchestrate ls | status JOB | logs JOB [-f] [--rank R|--node N] [--grep RE] | plot JOB | cancel JOB
  orchestrate status JOB --color always | less -R     # rich tables into a pipe (--json for scripts)
  orchestrate gc --older-than 7d --keep-failed --dry-run  # what removing finished jobs would free
"""


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", metavar="job", help="the job: a recipe YAML (recipe: sft|dpo|cp, e.g. "
                   "recipes/configs/sft_tiny.yaml) or a job file of your own code (run: {script|module|trl, args})")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotlist overrides, e.g. trainer.max_steps=10; "
                                                                      "cluster.<key>=... overrides the cluster file")
    p.add_argument("--nodes", "-N", type=int, default=None, help="number of nodes (launch.nodes)")
    p.add_argument("--procs-per-node", type=int, default=None, help="processes per node (launch.procs_per_node)")
    p.add_argument("--profile", default=None, help="accelerate profile: multi_gpu zero1 zero2 zero3 fsdp1 fsdp2 "
                                                   "context_parallel alst_ulysses, or a YAML path")
    p.add_argument("--cluster", "-c", default=None, help="cluster YAML (default: this machine)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="orchestrate", description="Multi-node LLM training jobs on this machine, "
                                 "SSH hosts or SLURM, with accelerate + TRL.", epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"orchestrate {__version__}")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("submit", help="validate, plan and run a job", description="Validate, plan and run a job; "
                       "streams every node's output, fails fast, exits non-zero when the job fails.")
    _add_plan_args(s)
    s.add_argument("--quiet", "-q", action="store_true", help="do not stream node output (progress only)")
    _add_color(s, "with --quiet, a rich progress bar", "plain `progress:` lines")
    s.add_argument("--dry-run", action="store_true", help="print the plan and stop (like render, without files)")
    s.add_argument("--probe", action="store_true", help="with --dry-run: ask the SSH hosts what the plan needs "
                                                        "(GPU counts, container runtimes; a dry run asks nothing)")
    s.add_argument("--detach", "-d", action="store_true", help="validate, start a background supervisor that runs "
                   "and monitors the job (a sweep: its runner), print its id and return (then: orchestrate attach "
                   "JOB or SWEEP_ID)")
    s.add_argument("--no-wait", action="store_true", help="hosts or GPUs leased by another job: exit 75 at once "
                   "naming them and their holder, instead of waiting QUEUED for them")
    s.add_argument("--job-id", default=None, help=argparse.SUPPRESS)
    s.add_argument("--adopt", default=None, help=argparse.SUPPRESS)  # (a SLURM sweep's point: its array task's handle)
    s.add_argument("--sweep-id", default=None, help=argparse.SUPPRESS)  # (a detached sweep's runner)
    s.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2,...",
                   help="run a grid: one job per combination of the values (repeat for more keys); VALUES: a,b,c | "
                        "[a,b,c] | 1..4[:STEP] | log:LO:HI:N | lin:LO:HI:N; every point is planned first, then run "
                        "at most --max-parallel at once (on SLURM: one --array job)")
    s.add_argument("--max-parallel", type=int, default=None, help="with --sweep: points running at once (default all)")
    s.add_argument("--stop-if-worse", type=float, default=None, metavar="X",
                   help="with --sweep: cancel a point whose loss is NaN or above X times the best point's at the same "
                        "step (recorded as stopped early)")

    r = sub.add_parser("render", help="dry run: write the plan and every per-node file to a directory",
                       description="Dry run: writes DIR/plan.json, DIR/recipe.yaml and DIR/nodes/<rank>/"
                                   "{accelerate.yaml,command.txt}; starts nothing and records no job (besides DIR it "
                                   "may write a cache of TRL's config fields in $ORCHESTRATE_HOME/cache). A DIR "
                                   "holding another plan (or other files) is refused unless --force "
                                   "(docs/operations.md).")
    _add_plan_args(r)
    r.add_argument("--out", "-o", required=True, help="output directory")
    r.add_argument("--json", action="store_true", help="print the plan as JSON instead of the summary")
    r.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2,...",
                   help="render a grid (as submit --sweep; a sweep: block of the job file too): each point's files "
                        "under DIR/p<i>/, on SLURM DIR/job.sbatch (the array job: `sbatch DIR/job.sbatch` runs it)")
    r.add_argument("--max-parallel", type=int, default=None, help="with --sweep: points running at once")
    r.add_argument("--probe", action="store_true", help="ask the SSH hosts what the plan needs (GPU counts, "
                                                        "container runtimes); without it render touches no network")
    r.add_argument("--force", action="store_true", help="DIR holds another plan or other files: replace render's own "
                                                        "files there (other files are kept)")

    ls = sub.add_parser("ls", help="recent jobs (state, nodes, step, age, root cause)")
    ls.add_argument("--limit", type=int, default=20, help="show at most this many jobs, newest first (default 20)")
    st = sub.add_parser("status", help="one job per node and rank: host, step, loss, heartbeat age, exit code; of a "
                                       "sweep: its table (as `sweep SWEEP_ID`)")
    st.add_argument("job", help="job id (a unique prefix is enough), or a sweep id")
    for view in (ls, st):
        view.add_argument("--json", action="store_true", help="machine-readable output (unchanged by --color)")
        _add_color(view, "rich tables with coloured states", "the plain aligned text that pipes get")
    at = sub.add_parser("attach", help="follow a running job (logs and progress), or a detached sweep (its "
                                       "runner's output, then its table), until it ends; Ctrl-C detaches")
    at.add_argument("job", help="job id (a unique prefix is enough), or a sweep id")
    at.add_argument("--quiet", "-q", action="store_true", help="progress only, no node output")
    _add_color(at, "rich progress bar", "plain `progress:` lines")
    lg = sub.add_parser("logs", help="a job's logs, merged and prefixed by node and rank ([host nodeR rankG]); of a "
                                     "sweep: every point's, each line prefixed [p<i>]")
    lg.add_argument("job", help="job id (a unique prefix is enough), or a sweep id")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    who = lg.add_mutually_exclusive_group()
    who.add_argument("--node", type=int, default=None, help="only this node")
    who.add_argument("--rank", type=int, default=None,
                     help="only this global rank's lines (reads only the log of the node that holds it)")
    lg.add_argument("--grep", default=None, metavar="RE", help="only lines matching this regular expression")
    pl = sub.add_parser("plot", help="PNG of loss and tokens/s per rank over steps; of a sweep: its points' loss "
                                     "curves overlaid")
    pl.add_argument("job", help="job id (a unique prefix is enough), or a sweep id")
    pl.add_argument("--out", "-o", default=None, help="PNG path (default RUN_DIR/plot.png; a sweep's: "
                                                      "ORCHESTRATE_HOME/sweeps/SWEEP_ID.png)")
    pl.add_argument("--rank", type=int, action="append", default=None, metavar="R",
                    help="draw this global rank (repeatable; default: every rank of a job of at most 8, else rank 0)")
    sw = sub.add_parser("sweep", help="a sweep's points sorted by final loss: state, step, final and best loss")
    sw.add_argument("sweep_id", help="the sweep id that submit --sweep printed")
    sw.add_argument("--json", action="store_true", help="machine-readable output")
    c = sub.add_parser("cancel", help="cancel a job, or a sweep (every point): every process on every node")
    c.add_argument("job", help="job id (a unique prefix is enough), or a sweep id")
    g = sub.add_parser("gc", help="remove finished jobs: run dirs, records, their hosts' run dirs and staged files",
                       description="Remove finished jobs older than --older-than: their run dirs and store records "
                       "here and, for SSH hosts without a shared filesystem, each host's run dir and the staged files "
                       "no other job there uses. Never a job that is not finished or whose supervisor runs; output "
                       "dirs only with --outputs. Prints what it frees (--dry-run: the same list, nothing removed).")
    g.add_argument("jobs", nargs="*", metavar="JOB", help="only these jobs (ids or unique prefixes); any age unless "
                                                          "--older-than is given")
    g.add_argument("--older-than", default=None, metavar="AGE", help="only jobs that ended longer ago than AGE: 30d "
                   "(the default without JOB), 12h, 90m, 45s, 0")
    g.add_argument("--keep-failed", action="store_true", help="keep FAILED jobs (to debug them later)")
    g.add_argument("--outputs", action="store_true", help="also the jobs' output dirs (checkpoints!) that no kept job "
                                                          "uses")
    g.add_argument("--dry-run", "-n", action="store_true", help="print what would be freed, remove nothing")
    g.add_argument("--local-only", action="store_true", help="ask no SSH host (hosts gone for good): only this "
                                                             "machine's run dirs and records go")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    _add_dashboard(sub)
    return ap


def _add_dashboard(sub) -> None:
    """`orchestrate dashboard` (orchestrator.web: the second face; its own arguments and run)."""
    from orchestrator.web.command import add_parser
    add_parser(sub)


def cmd_dashboard(args) -> int:
    from orchestrator.web.command import run
    return run(args)


def _prepare(args, run_dir: str | None = None):
    from orchestrator import api
    return api.prepare(args.recipe, args.cluster, nodes=args.nodes, procs_per_node=args.procs_per_node,
                       profile=args.profile, overrides=args.overrides, run_dir=run_dir,
                       job_id=getattr(args, "job_id", None), probe=not args.dry_run or args.probe,
                       judge_checkpoints=not getattr(args, "adopt", None))  # (adopted: it may be saving already)


def _add_color(p: argparse.ArgumentParser, rich: str, plain: str) -> None:
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help=f"{rich}: auto (default) when stdout is a terminal or FORCE_COLOR is set, always, or never "
                        f"({plain})")


def cmd_render(args) -> int:
    from pathlib import Path
    from orchestrator import client
    from orchestrator.core.render import summary
    out = Path(args.out).expanduser().resolve()
    rendered = client.render(args.recipe, nodes=args.nodes, cluster=args.cluster, profile=args.profile,
                             overrides=list(args.overrides), procs_per_node=args.procs_per_node, run_dir=str(out),
                             grid=args.sweep, max_parallel=args.max_parallel, probe=args.probe)
    rendered.write(out, force=args.force)
    if rendered.points:
        doc = rendered.plan
        if args.json:
            print(json.dumps(doc, indent=2, sort_keys=True))
            return 0
        print(summary(rendered.points[0]._prepared.plan))
        print(f"sweep {doc['id']} (render): {len(doc['points'])} point(s), every one planned")
        for pt in doc["points"]:
            print(f"  p{pt['index']}  {' '.join(pt['overrides'])}")
        extra = f"; job.sbatch: the array job, at most {doc['max_parallel']} at once (submit it by hand with: " \
                f"sbatch {out / 'job.sbatch'})" if "job.sbatch" in rendered.files else ""
        print(f"wrote {len(rendered.files)} files to {out}/ (sweep.json; p<i>/: each point's plan.json, recipe.yaml, "
              f"nodes/<rank>/...{extra})")
        return 0
    prepared = rendered._prepared
    if args.json:
        print(prepared.plan.to_json(), end="")
    else:
        print(summary(prepared.plan))
        from orchestrator.cli.views import resuming_text, staging_text
        if resuming_text(prepared):
            print(resuming_text(prepared))
        if staging_text(prepared.files):
            print(staging_text(prepared.files))
        extra = ", job.sbatch (submit it by hand with: sbatch " + str(out / "job.sbatch") + ")" \
            if "job.sbatch" in prepared.files else ""
        print(f"wrote {len(prepared.files)} files to {out}/ (plan.json, recipe.yaml, nodes/<rank>/accelerate.yaml, "
              f"nodes/<rank>/command.txt{extra})")
    return 0


def cmd_submit(args) -> int:
    from orchestrator import running
    from orchestrator.core.render import summary
    from orchestrator.cli.views import resuming_text, staging_text
    if not args.job_id:  # (a point of a sweep is submitted with its job id: it runs the file without the sweep)
        _sweep_from_file(args)
    if args.sweep:
        return _submit_sweep(args)
    for flag, value in (("--max-parallel", args.max_parallel), ("--stop-if-worse", args.stop_if_worse)):
        if value is not None:
            raise ConfigError(Problem(flag, "only with --sweep"))
    prepared = _prepare(args)
    adopt = None
    if args.adopt:  # a SLURM sweep's point: its array task was submitted by the sweep's runner (orchestrator.sweeps)
        from orchestrator.types import JobHandle
        if not args.job_id or prepared.cluster.kind != "slurm":
            raise ConfigError(Problem("--adopt", "only for a point of a SLURM sweep (with --job-id)"))
        adopt = JobHandle(args.adopt, {"run_dir": prepared.plan.run_dir, "job_id": args.adopt.rpartition("/")[2],
                                       "nodes": prepared.plan.nodes})
    print(summary(prepared.plan), flush=True)
    if resuming_text(prepared):
        print(resuming_text(prepared), flush=True)
    if staging_text(prepared.files):
        print(staging_text(prepared.files), flush=True)
    if getattr(prepared.recipe, "notify", None) is not None and prepared.recipe.notify.on:
        from orchestrator.notify import describe
        print(describe(prepared.recipe.notify), flush=True)
    if args.dry_run:
        return 0
    if args.detach:
        from orchestrator.detach import detach
        return detach(sys.argv[1:] if args._argv is None else args._argv, prepared)
    from orchestrator.cli.progress import Progress
    from orchestrator.cli.tty import use_rich
    from orchestrator.node.ranklines import prefix, split_rank
    from orchestrator.supervise import Supervisor
    result_line: dict = {}
    hosts = {n.node_rank: n.host or f"node{n.node_rank}" for n in prepared.plan.node_plans}
    progress = Progress(rich=args.quiet and use_rich(args.color))

    def say(text: str) -> None:
        try:
            print(text, flush=True)
        except OSError as e:
            _output_failed(sup, e)

    def on_line(node: int, line: str) -> None:
        rank, text = split_rank(line)
        if text.startswith("ORCHESTRATE_RESULT "):
            try:
                result_line.update(json.loads(text.split(" ", 1)[1]))
            except ValueError:
                pass
        if not args.quiet:
            say(f"{prefix(hosts.get(node, '?'), node, rank)} {text}")

    def on_beat(rec: dict) -> None:
        try:
            progress.feed(rec)
        except OSError as e:
            _output_failed(sup, e)
        except SystemExit:  # rich's answer to a broken pipe (it has pointed stdout at /dev/null itself)
            _output_failed(sup, BrokenPipeError(errno.EPIPE, "Broken pipe"))

    def on_event(kind: str, data: dict) -> None:
        if kind == "submitting":
            say(f"job {data['job_id']}: run dir {data['run_dir']}")
        elif kind == "queued":
            say(f"job {data['job_id']}: QUEUED (#{data['position']} in this store's queue for these hosts): "
                f"{data['line']}; waiting (Ctrl-C cancels, nothing has started)")
        elif kind == "restart":
            say(f"job {data['job_id']}: restart {data['restart']}/{data['max_restarts']} from the latest "
                f"checkpoint (furthest step {data['step']}): {data['reason']}")
        elif kind == "replanned":  # a spare took a node over: its lines carry the host that runs it now
            hosts.update(data["hosts"])
        elif kind in ("notify", "note"):  # a notification not delivered; an end the store cannot take yet
            try:
                print(f"orchestrate: job {data['job_id']}: {data['line']}", file=sys.stderr, flush=True)
            except OSError:
                pass

    sup = Supervisor(prepared.plan)
    _watch_output_reader(sup)
    try:
        result = running.supervise_here(prepared, supervisor=sup, signals=lambda s: _supervisor_signals(
            s, prepared.plan.run_dir), on_line=on_line, on_beat=on_beat, on_event=on_event, wait=not args.no_wait,
            adopt=adopt)
    finally:
        try:
            progress.close()
        except OSError:
            pass
    job = prepared.plan.job_id
    if result.state == "RUNNING":  # detached (SIGHUP on SLURM): the terminal is gone, nobody may read this
        try:
            print(f"job {job} RUNNING: {result.root_cause}", file=sys.stderr, flush=True)
        except OSError:
            pass
        return 129
    if result.state == "COMPLETED":
        from orchestrator.cli.views import completed_text
        print(completed_text(job, result_line, prepared.plan.run_dir))
        return 0
    print(f"job {job} {result.state}: {result.root_cause}", file=sys.stderr)
    return 130 if result.state == "CANCELLED" else 1


def _quiet(fds: tuple[int, ...] = (1, 2)) -> None:
    """These descriptors to /dev/null (what is left of a hung-up terminal answers writes with EIO, a closed pipe
    EPIPE: either must not fail the watching and so stop the job)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in fds:
            os.dup2(null, fd)
        os.close(null)
    except OSError:
        pass


def _output_gone(sup, what: str, fds: tuple[int, ...] = (1, 2)) -> None:
    """Whoever watched the submit is gone: `fds` to /dev/null, then on SLURM stop watching (the job runs on in its
    allocation, its node agents judge hangs there, as sbatch would have left it; status / ls ask SLURM) unless the job
    has notifications to send (this process sends them: it watches on, quietly, to the end), elsewhere cancel
    (nothing runs on without the submitter)."""
    _quiet(fds)
    if sup.plan.cluster_kind == "slurm":
        if sup.notifies:
            return
        sup.request_detach(f"{what}: the job runs on under SLURM; `orchestrate status` asks SLURM")
    else:
        sup.request_cancel(what)


def _output_failed(sup, e: OSError) -> None:
    """A write to the submit's output failed. EIO: the terminal hung up (its SIGHUP may come later, or never); EPIPE:
    the reader of its output is gone (`orchestrate submit ... | head`): stderr may still be a live terminal, so it
    keeps it and says why. Anything else (a full disk under a redirect, a non-blocking pipe): the line is dropped."""
    if e.errno == errno.EIO:
        _output_gone(sup, "the submitting terminal went away (writing to it failed: EIO)")
    elif e.errno == errno.EPIPE:
        _output_gone(sup, "the reader of the submit's output went away (broken pipe)", fds=(1,))
        try:
            print(f"orchestrate: {sup.cancel_reason if sup.cancel.is_set() else sup.detach_reason}", file=sys.stderr,
                  flush=True)
        except OSError:
            pass


READER_GONE_AFTER_S = 1.0  # a closed reader is acted on this long after it is seen (a SIGHUP with it goes first)


def _watch_output_reader(sup) -> None:
    """stdout a pipe (a sweep's runner reads each point's submit through one): the reader's end closing (the runner
    SIGKILLed) is seen at once (POLLERR on the write end), as a failed write would see it, not at the next write: a
    QUEUED point writes nothing for as long as it waits."""
    import select
    import stat
    import threading
    import time
    try:
        if not stat.S_ISFIFO(os.fstat(1).st_mode):
            return
    except OSError:
        return

    def run() -> None:
        poll = select.poll()
        poll.register(1, select.POLLERR)
        events = 0
        while not events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
            for _fd, ev in poll.poll():
                events |= ev
        time.sleep(READER_GONE_AFTER_S)  # (a terminal's hang-up closes the reader and sends SIGHUP: that is the cause)
        if not sup.cancel.is_set() and not sup.detach.is_set() and not events & select.POLLNVAL:
            _output_failed(sup, BrokenPipeError(errno.EPIPE, "Broken pipe"))
    threading.Thread(target=run, daemon=True, name="output-reader").start()


def _supervisor_signals(sup, run_dir: str) -> None:
    """The supervising process installs its own handlers whatever it inherited (a background launch arrives with
    SIGINT ignored): Ctrl-C / SIGINT, SIGTERM (what `orchestrate cancel` sends, after writing its request in the run
    dir) and SIGHUP (the terminal went away; left ignored under nohup) all make the supervisor cancel the job: every
    node stopped, recorded. Except SIGHUP on SLURM: the job runs on in its allocation (its node agents judge hangs
    there), so a dropped login session only ends the watching, as it would for sbatch; `orchestrate status` / `ls`
    then ask SLURM (see _output_gone)."""
    import signal as _signal
    from orchestrator.node.rundir import RunDir

    def handler(signum, _frame) -> None:
        if signum == _signal.SIGHUP:
            _output_gone(sup, "the submitting terminal hung up (SIGHUP)")
            return
        req = RunDir(run_dir).cancel_request() if signum == _signal.SIGTERM else None
        why = (req or {}).get("by") or {_signal.SIGINT: "interrupted (Ctrl-C) on the submit host"}.get(
            signum, f"the supervising process got {_signal.Signals(signum).name}")
        sup.request_cancel(why)

    for s in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP):
        if s == _signal.SIGHUP and _signal.getsignal(s) == _signal.SIG_IGN:
            continue  # `nohup orchestrate submit ... &`: the user asked for a hang-up to be ignored
        _signal.signal(s, handler)


def _record(job: str):
    from orchestrator import client, records
    return records._record(client.find(job).id)  # (unknown: "no job or sweep ID")


def cmd_ls(args) -> int:
    from orchestrator import client
    from orchestrator import running
    jobs = client.jobs(args.limit)
    rows = [j.summary() for j in jobs]
    if any(r["state"] == "QUEUED" for r in rows):
        queue = running.queue_positions()
        rows = [dict(r, queue_position=queue[r["id"]]) if r["id"] in queue else r for r in rows]
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    else:
        from orchestrator.cli.tty import show_jobs
        show_jobs(rows, args.color)
    return 0


def cmd_status(args) -> int:
    from orchestrator import client
    from orchestrator.cli.views import SHOWN
    target = client.find(args.job)
    if isinstance(target, client.Sweep):  # its table, as `orchestrate sweep SWEEP_ID`
        return _show_sweep(target, args.json)
    st = client.status_data(target.id)
    if args.json:  # a big job's on one line: the indenting encoder is pure Python (0.5 s for 8,192 ranks)
        print(json.dumps(st, indent=2 if len(st["ranks"]) <= SHOWN else None, sort_keys=True))
    else:
        from orchestrator.cli.tty import show_status
        show_status(st, args.color)
    return 0


def cmd_logs(args) -> int:
    from orchestrator.client import find
    for line in find(args.job).logs(args.rank, args.follow, node=args.node, grep=args.grep):
        print(line, flush=True)
    return 0


def cmd_attach(args) -> int:
    import time
    from pathlib import Path
    from orchestrator.node.heartbeat import HeartbeatTail
    from orchestrator.cli.logtail import LogTail
    from orchestrator.cli.progress import Progress
    from orchestrator.store import JobStore
    if args.job.startswith("sweep-"):
        from orchestrator import sweeps
        doc = sweeps.read_sweep(args.job)
        if doc is not None:
            print(f"attached to sweep {doc['id']}; Ctrl-C detaches, the sweep keeps running", flush=True)
            try:
                if not sweeps.follow(doc, lambda line: print(line, flush=True)):
                    print(f"sweep {doc['id']} was not run detached: its runner's output is in its terminal")
            except KeyboardInterrupt:
                print(f"\ndetached from sweep {doc['id']}; it keeps running (orchestrate attach {doc['id']})")
                return 0
            print(sweeps.sweep_text(doc, sweeps.table_rows(doc)))
            return 0
    rec = _record(args.job)
    print(f"attached to job {rec.id} ({rec.state}); Ctrl-C detaches, the job keeps running", flush=True)
    from orchestrator.cli.tty import use_rich
    progress = Progress(rich=use_rich(args.color))
    beats = HeartbeatTail(Path(rec.run_dir) / "heartbeats", {0})
    tail = LogTail(rec.run_dir)
    last_check = time.monotonic()
    try:
        while True:
            state = JobStore().get(rec.id).state
            if time.monotonic() - last_check > 10:  # nobody may be supervising it any more: ask its backend
                last_check = time.monotonic()
                from orchestrator import records
                state = records.reconcile(JobStore().get(rec.id))[0].state
            if not args.quiet:
                tail.drain()
            for b in beats.read():
                progress.feed(b)
            if is_terminal(state):
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        progress.close()
        print(f"detached from job {rec.id}; it keeps running (orchestrate attach {rec.id})")
        return 0
    progress.close()
    rec = JobStore().get(rec.id)
    print(f"job {rec.id} {rec.state}" + (f": {rec.root_cause}" if rec.root_cause else ""))
    return 0 if rec.state == "COMPLETED" else 130 if rec.state == "CANCELLED" else 1


def cmd_plot(args) -> int:
    from pathlib import Path
    from orchestrator.cli.plot import plot_job, plot_sweep
    from orchestrator.store import sweeps_dir
    from orchestrator.sweeps import read_sweep
    doc = read_sweep(args.job) if args.job.startswith("sweep-") else None
    if doc is not None:  # a sweep: its points' loss curves overlaid
        from orchestrator.store import JobStore
        store = JobStore()
        points = [(f"p{pt['index']} {' '.join(pt['overrides'])}", rec.run_dir) for pt in doc.get("points") or []
                  if (rec := store.get(pt["job_id"])) is not None]
        path, note = plot_sweep(points, args.out or str(sweeps_dir() / f"{doc['id']}.png"), title=doc["id"])
        print(f"wrote {path}" + (f" ({note})" if note else ""))
        return 0
    rec = _record(args.job)
    path, drew = plot_job(rec.run_dir, args.out or str(Path(rec.run_dir) / "plot.png"), title=rec.id,
                          ranks=args.rank)
    print(f"wrote {path}: {drew}")
    return 0


def _sweep_from_file(args) -> None:
    """A `sweep:` block in the job file (core.spec.SweepSpec): its grid becomes --sweep options (the command line's
    replace a key's values or add keys), its max_parallel / stop_if_worse the flags' defaults."""
    from orchestrator.client import sweep_block
    from orchestrator.core.sweep import block_options, merge_options
    spec = sweep_block(args.recipe)
    if spec is None:
        return
    args.sweep = merge_options(block_options(spec.grid), list(args.sweep or []))
    if args.max_parallel is None:
        args.max_parallel = spec.max_parallel
    if args.stop_if_worse is None:
        args.stop_if_worse = spec.stop_if_worse


def _submit_sweep(args) -> int:
    from orchestrator import sweeps
    if args.stop_if_worse is not None and not args.stop_if_worse > 1:
        raise ConfigError(Problem("--stop-if-worse", f"must be a number > 1, got {args.stop_if_worse}"))
    if args.job_id:
        raise ConfigError(Problem("--sweep", "not with --job-id (each point gets its own)"))
    if args.detach and not args.dry_run:
        return sweeps.detach(args, sys.argv[1:] if args._argv is None else args._argv,
                            say=lambda line: print(line, flush=True))
    if args.dry_run:
        sweep_id, planned, first = sweeps.plan_points(args, args.sweep)
        print(f"sweep {sweep_id} (dry run): {len(planned)} point(s), every one planned")
        for point, *_ in planned:
            print(f"  p{point.index}  {point.label()}")
        if first.cluster.kind == "slurm":  # ONE array job: its script, as `submit` would write and sbatch it
            from orchestrator.core.sweep import check_parallel
            parallel = check_parallel(args.max_parallel, len(planned))
            print(f"SLURM: one array job; submit writes it to {sweeps.sweep_folder(first, sweep_id)}/job.sbatch:")
            print(sweeps.array_script(sweep_id, planned, first, parallel), end="")
        return 0
    return sweeps.run(args, args.sweep, say=lambda line: print(line, flush=True))


def cmd_sweep(args) -> int:
    from orchestrator.client import Sweep
    return _show_sweep(Sweep.attach(args.sweep_id), args.json)


def _show_sweep(sw, as_json: bool) -> int:
    from orchestrator import sweeps
    doc, rows = sw.doc(), sw.table()
    if as_json:
        print(json.dumps({"id": doc["id"], "max_parallel": doc.get("max_parallel"), "points": rows}, indent=2))
    else:
        print(sweeps.sweep_text(doc, rows))
    return 0


def cmd_cancel(args) -> int:
    from orchestrator import sweeps
    from orchestrator.client import Job, Sweep
    if sweeps.read_sweep(args.job) is not None:
        states = Sweep(args.job).cancel()
        for job, state in states.items():
            print(f"job {job} {state}")
        return 0 if all(s in ("CANCELLED", "NOT STARTED") or is_terminal(s) for s in states.values()) else 1
    rec = _record(args.job)
    if is_terminal(rec.state):
        print(f"job {rec.id} already {rec.state}")
        return 0
    state = Job(rec.id).cancel()
    print(f"job {rec.id} {state}")
    return 0 if state == "CANCELLED" else 1


def cmd_gc(args) -> int:
    from orchestrator.gc import DEFAULT_OLDER_THAN, gc, parse_age
    age = parse_age(args.older_than if args.older_than is not None else "0" if args.jobs else DEFAULT_OLDER_THAN)

    def progress(msg: str) -> None:
        print(f"gc: {msg}", file=sys.stderr, flush=True)

    report = gc(age, keep_failed=args.keep_failed, jobs=tuple(args.jobs), outputs=args.outputs,
                dry_run=args.dry_run, local_only=args.local_only, progress=progress)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        from orchestrator.cli.views import gc_text
        print(gc_text(report.to_dict(), args.older_than or (None if args.jobs else DEFAULT_OLDER_THAN)))
    return 1 if any(i.error for i in report.items) else 0


COMMANDS = {"submit": cmd_submit, "render": cmd_render, "ls": cmd_ls, "status": cmd_status, "logs": cmd_logs,
            "attach": cmd_attach, "plot": cmd_plot, "cancel": cmd_cancel, "gc": cmd_gc, "sweep": cmd_sweep,
            "dashboard": cmd_dashboard}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args._argv = list(argv) if argv is not None else None
    if extra:
        # overrides may come after options (`render r.yaml --out d a.b=1`): argparse leaves them over
        if getattr(args, "overrides", None) is None or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    if not args.command:
        parser.print_help()
        return 2
    os.umask(0o077)  # run dirs, logs, the store, caches: everything orchestrate creates is owner-only
    try:
        return COMMANDS[args.command](args)
    except OrchestratorError as e:
        if args.debug:
            import traceback
            traceback.print_exc()
        print(f"orchestrate: error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("orchestrate: cancelled", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
            raise
        if args.debug:
            import traceback
            traceback.print_exc()
        what = "no space left on device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        print(f"orchestrate: error: {e.filename or 'a file'}: {what}", file=sys.stderr)
        return 2 if args.command in ("submit", "render") else 1  # (refused before anything started, as bad input is)


if __name__ == "__main__":
    sys.exit(main())
