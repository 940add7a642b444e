"""Whether a new job may continue the checkpoint its `checkpoint.resume` would pick up (pure: the facts are read by
orchestrator.api from the output dir, each checkpoint's `orchestrate.json` saying which job wrote it).

`checkpoint.resume: auto` (the default) exists so that restarts and requeues of a job go on from its own latest
checkpoint. A NEW job whose output dir already holds another job's checkpoints (or ones written outside
orchestrate, with no record) must not continue them silently: `decide` refuses it, naming the checkpoint, its job
and step and the two ways out (`checkpoint.resume: latest` or that path, to continue on purpose; or another output
dir). When the user asked for it (`latest` or a path), the job continues and says so (`Decision.announce`: the
submit output, RUN_DIR/resumed_from.json, `orchestrate status`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

KEYWORDS = ("auto", "latest", "never")  # checkpoint.resume's words; anything else is a checkpoint path


@dataclass(frozen=True)
class Checkpoint:
    path: str
    job: str | None = None  # the job that wrote it (its orchestrate.json); None: no record, written outside orchestrate
    step: int | None = None

    @property
    def name(self) -> str:
        return PurePath(self.path).name

    def of(self) -> str:
        """'checkpoint-120 of job X (step 120)'."""
        step = f"step {'unknown' if self.step is None else self.step}"
        if self.job is None:
            return f"{self.name} of an unknown job ({step}; no orchestrate.json: written outside orchestrate)"
        return f"{self.name} of job {self.job} ({step})"

    def to_dict(self) -> dict[str, str | int | None]:
        return {"path": self.path, "job": self.job, "step": self.step}


@dataclass(frozen=True)
class Decision:
    action: str  # fresh | continue | refuse
    checkpoint: Checkpoint | None = None
    message: str = ""  # refuse: why, and the ways out
    announce: bool = False  # continue from a checkpoint another job wrote, as the user asked: say so


def decide(mode: str, job_id: str, picked: Checkpoint | None, output_key: str = "trainer.output_dir") -> Decision:
    """`mode`: checkpoint.resume; `job_id`: the job being submitted; `picked`: the checkpoint the ranks would resume
    from (auto / latest: the latest checkpoint-N of the output dir; a path: that one), None when there is none;
    `output_key`: where the user sets the output dir (named in the refusal)."""
    if mode == "never" or picked is None:
        return Decision("fresh")
    if picked.job is not None and picked.job == job_id:
        return Decision("continue", picked)  # the job's own checkpoint (a restart or requeue): as always, quietly
    if mode == "auto":
        return Decision("refuse", picked,
                        f"auto would continue {picked.of()} in {PurePath(picked.path).parent}, another job's "
                        f"checkpoint: set "
                        f"checkpoint.resume: latest (or checkpoint.resume: {picked.path}) to continue it on purpose, "
                        f"or give this job another output dir ({output_key})")
    return Decision("continue", picked, announce=True)
