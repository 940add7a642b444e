"""A user's loop that steps no torch optimizer and never imports torch or orchestrator (say, a data-processing or
evaluation loop): it opts in to heartbeats with the one-line, standard-library-only `orchestrate_heartbeat.beat()`,
guarded so that the script runs the same outside orchestrate.

usage: beat_loop.py STEPS [SECONDS_PER_STEP]
"""

import os
import sys
import time

try:
    import orchestrate_heartbeat  # on the ranks' path only under orchestrate
except ImportError:
    orchestrate_heartbeat = None


def main() -> None:
    steps, pause = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    for step in range(1, steps + 1):
        time.sleep(pause)  # the work
        if orchestrate_heartbeat:
            orchestrate_heartbeat.beat(step, max_steps=steps)
    sys.stdout.write(f"BEAT_LOOP_DONE rank {os.environ.get('RANK', '0')}\n")


if __name__ == "__main__":
    main()
