"""`orchestrate dashboard [--port P] [--host H]`: the subcommand's arguments and its run (the CLI registers both;
nothing heavy is imported until it runs)."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 8470


def add_parser(sub) -> argparse.ArgumentParser:
    d = sub.add_parser("dashboard", help="a live web page of this store's jobs, sweeps and queue (prints its URL)",
                       description="Serve a live site of the local job store and run dirs (ORCHESTRATE_HOME): jobs, "
                       "a job's ranks, charts and log, sweeps, the queue. Prints its URL with an access token; runs "
                       "until Ctrl-C. docs/dashboard.md")
    d.add_argument("--port", "-p", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any "
                                                                         "free one)")
    d.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                                                       "any other needs the token on every request)")
    return d


def run(args) -> int:
    from orchestrator.web.app import serve
    return serve(args.host, args.port)
