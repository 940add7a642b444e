"""`python -m orchestrator.node RUN_DIR ...`: the node agent (orchestrator.node.agent).

Once `main` returned, everything of the node is recorded and its launch is gone: the agent flushes its output and
leaves with os._exit, skipping the interpreter's teardown (tens of ms of CPU per agent, which a job of hundreds of
nodes on shared cores pays at once; nothing of the agent uses atexit)."""

import os
import sys

from orchestrator.node.agent import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code if isinstance(code, int) else 1)
