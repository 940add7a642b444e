"""Emulated ranks, for scale tests and benchmarks (issue #29): ONE cheap process that stands in for a node's
`accelerate launch` and all of its ranks, speaking the real protocol through the real writer.

A node agent runs it instead of the plan's launch command when ORCHESTRATE_EMULATE is set in the agent's
environment (or given as `--emulate`): it parses the spec ONCE into an `Emulation` (`Emulation.of`; a bad spec is
refused before anything starts) and that one value says both whether the node is emulated and what it runs
(`Emulation.argv`); everything else is the real path: the agent, its records (agent.json, exit.json),
the heartbeat files, the backend's events, the one Supervisor, teardown. No torch, no accelerate: a 256-node x
8-rank job runs on a laptop.

ORCHESTRATE_EMULATE is a comma-separated list of `key=value`:
- `rate`: heartbeat records per second per rank (default 1);
- `steps`: steps before every rank ends (default 60) - a clean exit 0;
- `die`: `<global rank>@<seconds>`: the node holding that rank dies of SIGKILL that many seconds after its start,
  as a crashed rank's launcher would (the node agent sees its launch killed).

Standard library only, run as a script (`python emulate.py ...`): the writer is the hooks' orchestrate_heartbeat,
on the ranks' PYTHONPATH as for any rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

EMULATE_VAR = "ORCHESTRATE_EMULATE"


def parse(spec: str) -> dict[str, str]:
    """`rate=1,steps=60,die=9@5` -> {"rate": "1", ...}; unknown keys are refused (ValueError)."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("rate", "steps", "die"):
            raise ValueError(f"{EMULATE_VAR}: {part!r} is not one of rate=, steps=, die=")
        out[key] = value
    return out


@dataclass(frozen=True)
class Emulation:
    """A node agent's emulated ranks: the spec as given and its parsed options."""

    spec: str
    options: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, spec: str | None) -> "Emulation | None":
        """None for no spec (the real launch); ValueError for a bad one."""
        return cls(spec, tuple(parse(spec).items())) if spec else None

    def argv(self, ranks: tuple[int, ...] | list[int], python: str | None = None) -> list[str]:
        """What the agent runs for its node's `ranks` instead of `accelerate launch`."""
        return [python or sys.executable, str(Path(__file__).resolve()), self.spec, ",".join(map(str, ranks))]


def main(argv: list[str]) -> int:
    import orchestrate_heartbeat as hb  # the ranks' path (orchestrator/node/hooks)
    opts = parse(argv[0])
    ranks = [int(r) for r in argv[1].split(",") if r]
    rate, steps = float(opts.get("rate", 1)), int(opts.get("steps", 60))
    die_rank, _, die_after = opts.get("die", "").partition("@")
    dies = float(die_after) if die_rank and int(die_rank) in ranks else None
    directory = os.environ.get("ORCHESTRATE_HEARTBEAT_DIR")
    writers = {g: hb.Writer(directory, rank=g) for g in ranks}
    start = time.monotonic()
    for w in writers.values():
        w.write("boot")
    interval = 1.0 / rate
    for step in range(1, steps + 1):
        due = start + step * interval
        while True:
            now = time.monotonic()
            if dies is not None and now - start >= dies:
                os.kill(os.getpid(), signal.SIGKILL)
            if now >= due:
                break
            time.sleep(min(due - now, 0.2))
        for g, w in writers.items():
            w.write("step", step, max_steps=steps, loss=4.0 / (1 + 0.01 * step), tokens=step * 4096,
                    compute_s=0.1 + 0.001 * (g % 7))
    for w in writers.values():
        w.write("end", steps, max_steps=steps)
        w.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
