"""Start-up phase marks of a rank, for the per-phase breakdown of a launch (no heavy imports: it runs first).

`mark(event)` appends one heartbeat-format line to ORCHESTRATE_HEARTBEAT_DIR/rank<RANK>.jsonl (a no-op when the
variable is unset): "boot" when `recipes.run` starts (with `proc_start`, when the kernel created this process),
"dist" once the process group is up (rendezvous done). With the agent's `started` (launch exec'd), the callback's
"start" (train begin: model, data, trainer built) and the first "step", a launch splits into launcher start,
interpreter + imports, rendezvous, model load and first step. Records carry step 0, so the health monitor counts
them as start-up progress, never as training steps.
"""

from __future__ import annotations

import json
import os
import socket
import time


def mark(event: str, **extra) -> None:
    d = os.environ.get("ORCHESTRATE_HEARTBEAT_DIR")
    if not d:
        return
    rank = int(os.environ.get("RANK", "0"))
    rec = {"t": time.time(), "rank": rank, "host": socket.gethostname(), "step": 0, "max_steps": 0, "loss": None,
           "tokens": None, "event": event, **extra}  # the heartbeat contract's fields (docs/CONTRACT.md)
    try:
        os.makedirs(d, exist_ok=True)
        fd = os.open(os.path.join(d, f"rank{rank}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a phase mark never fails a run
