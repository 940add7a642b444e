"""`python -m orchestrator.node RUN_DIR ...`: the node agent (orchestrator.node.agent)."""

import sys

from orchestrator.node.agent import main

sys.exit(main())
