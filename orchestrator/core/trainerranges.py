"""The ranges of trainer values: the one table (RANGES) of every numeric TrainingArguments / TRL config field whose
range the trainer enforces or documents, checked at plan time.

Who uses it: orchestrator.core.spec.check_trainer (a built-in recipe's `trainer:` block) and check_run (own code's
`run.args`, where an option is a field of the run's config class: TrainingArguments for a script or module, the TRL
subcommand's config). A value that breaks a rule is one problem naming its key (`trainer.warmup_steps: must be an
integer >= 0 or a ratio in [0, 1), got -5`), exit 2, before anything is written or started: not an exception on
every rank once the job has started (TrainingArguments.__post_init__, torch's optimizers and DataLoader, TRL's
trainers), nor a run that silently trains nothing.

Each rule says why (`why`): who refuses the value, or where its range is documented. A field's type (int, float,
null allowed) is checked before its range from the installed class's field kinds (orchestrator.trlfields); the rules
never admit a value the trainer refuses, and refuse only what the trainer refuses or documents as out of range
(a negative max_grad_norm turns clipping off just like 0 does, a label_smoothing_factor outside [0, 1] is
taken as it is: no rule). A rule may hold only where another
setting has a value (`when`: logging_steps must not be 0 while logging_strategy is steps, its default) or only for
some config classes (`only`: DistillationConfig's beta).

Pure: imports no transformers or trl; the ranges are written down here (read from transformers 4.56-5.x, TRL
0.24-1.x and torch; a field the installed class lacks is refused as unknown before any range applies).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The built-in recipes' config classes (the sft and cp recipes train with SFTConfig, dpo with DPOConfig).
RECIPE_CONFIGS = {"sft": "SFTConfig", "cp": "SFTConfig", "dpo": "DPOConfig"}


def config_class_name(recipe: str) -> str:
    """The TRL config class a built-in recipe's `trainer:` block is passed to."""
    return RECIPE_CONFIGS.get(recipe, "SFTConfig")


@dataclass(frozen=True)
class Rule:
    """One range: what a value must be, and why.

    A number in [lo, hi] (`lo_open` / `hi_open`: the bound itself excluded; `integer`: an int), or, with `ratio`, an
    integer >= 0 (>= 1 with `lo_open`) or a ratio of the total steps in [0, 1) ((0, 1) with `lo_open`). `null`: None
    also passes; `also`: further values that pass (-1, "auto"); `unset`: only None passes. `when = (setting, value,
    default)`: the rule holds only where that setting is (or, a list, holds) value, the default standing in for a
    setting not given. `only`: the config classes it holds for (empty: every class with the field). `always`: checked
    in own code's args even where the option is not a known field of its config (the plan reads it). `text`: the
    wording of what the value must be, where the generated one would not do."""

    why: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    ratio: bool = False
    null: bool = False
    also: tuple[Any, ...] = ()
    unset: bool = False
    when: tuple[str, Any, Any] | None = None
    only: tuple[str, ...] = ()
    always: bool = False
    text: str = ""

    def describe(self) -> str:
        """What the value must be, as the message says it (`an integer >= 1`, `a number in [0, 1)`)."""
        if self.text:
            return self.text
        if self.unset:
            return "null (unset)"
        what = "an integer" if self.integer else "a number"
        if self.ratio:
            s = f"an integer >= {1 if self.lo_open else 0} or a ratio in {'(' if self.lo_open else '['}0, 1)"
        elif self.lo is not None and self.hi is not None:
            s = (f"{what} in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                 f"{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            s = f"{what} {'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            s = f"{what} {'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            s = what
        return " or ".join([s, *(_word(a) for a in self.also)])

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.null or self.unset
        if self.unset:
            return False
        if any(type(value) is type(a) and value == a for a in self.also):
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return False
        if self.ratio:
            return (value > 0 if self.lo_open else value >= 0) and (value < 1 or float(value).is_integer())
        if self.integer and not isinstance(value, int):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def applies(self, settings: Mapping[str, Any], config: str | None) -> bool:
        """Whether the rule holds for these settings (the block or the args, as read) of `config` (a class name)."""
        if self.only and config not in self.only:
            return False
        if self.when is None:
            return True
        name, want, default = self.when
        return _matches(settings.get(name, default), want)

    def problem(self, value: Any) -> str:
        """The message for a value that breaks the rule (`must be an integer >= 1, got 0`)."""
        when = f" when {self.when[0]} is {_word(self.when[1])}" if self.when else ""
        return f"must be {self.describe()}{when}, got {value!r}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _word(x: Any) -> str:
    return ("true" if x else "false") if isinstance(x, bool) else str(x)


def _matches(got: Any, want: Any) -> bool:
    if isinstance(got, (list, tuple)):
        return any(_matches(g, want) for g in got)
    if isinstance(want, bool):
        return got is want or (isinstance(got, str) and got.strip().lower() == _word(want))
    if isinstance(want, str):
        return isinstance(got, str) and got.strip().lower() == want
    return not isinstance(got, bool) and got == want


_BATCH = "torch's DataLoader refuses a batch size < 1"
_STEPS_DOC = "documented: an integer or a float in [0, 1) (a ratio of the total steps)"
_NUM_PROC = "datasets' map refuses a negative number of processes (0: none)"

# field -> its rules, checked in order; the first one a value breaks is the message.
RANGES: dict[str, tuple[Rule, ...]] = {
    # ------------------------------------------------------------------ transformers' TrainingArguments
    "per_device_train_batch_size": (Rule(_BATCH + "; the plan's batch arithmetic", lo=1, integer=True, always=True),),
    "per_device_eval_batch_size": (Rule(_BATCH + " (at the first evaluation)", lo=1, integer=True),),
    "gradient_accumulation_steps": (Rule("the Trainer divides by it; the plan's batch arithmetic", lo=1, integer=True,
                                         always=True),),
    "eval_accumulation_steps": (Rule("the evaluation loop divides by it", lo=1, integer=True, null=True),),
    "num_train_epochs": (Rule("a number of epochs: with a negative one the Trainer trains nothing and does not say so",
                              lo=0),),
    "max_steps": (Rule("documented: a positive number of steps overrides num_train_epochs, -1 leaves the length to "
                       "them; the plan's step count", lo=1, integer=True, also=(-1,), always=True,
                       text="-1 (no limit) or an integer >= 1"),),
    "learning_rate": (Rule("torch's optimizers refuse a negative learning rate", lo=0, always=True),),
    "weight_decay": (Rule("torch's AdamW (the default optimizer) and SGD refuse a negative weight decay", lo=0),),
    "adam_beta1": (Rule("torch's Adam / AdamW refuse a beta outside [0, 1)", lo=0, hi=1, hi_open=True),),
    "adam_beta2": (Rule("torch's Adam / AdamW refuse a beta outside [0, 1)", lo=0, hi=1, hi_open=True),),
    "adam_epsilon": (Rule("torch's Adam / AdamW refuse a negative epsilon", lo=0),),
    "warmup_steps": (Rule("TrainingArguments raises on a negative one; documented (transformers 5): an integer or a "
                          "float in [0, 1) (a ratio of the total steps)", ratio=True),),
    "warmup_ratio": (Rule("TrainingArguments (transformers 4) raises outside [0, 1]", lo=0, hi=1),),
    "logging_steps": (Rule(_STEPS_DOC + "; TrainingArguments raises on a fraction above 1", ratio=True),
                      Rule("TrainingArguments raises on 0 under logging_strategy steps (the default)", ratio=True,
                           lo_open=True, when=("logging_strategy", "steps", "steps"))),
    "save_steps": (Rule(_STEPS_DOC + "; TrainingArguments raises on a fraction above 1 (0: no step saves)",
                        ratio=True),),
    "eval_steps": (Rule(_STEPS_DOC + "; TrainingArguments raises on a fraction above 1 (null or 0: logging_steps)",
                        ratio=True, null=True),),
    "neftune_noise_alpha": (Rule("the NEFTune hook draws noise in [-alpha, alpha] / sqrt(d): torch refuses a negative "
                                 "alpha at the first step", lo=0, null=True),),
    "torch_empty_cache_steps": (Rule("TrainingArguments raises unless it is an integer > 0", lo=1, integer=True,
                                     null=True),),
    "seed": (Rule("transformers' set_seed seeds numpy, which refuses a seed outside [0, 2**32 - 1]", lo=0,
                  hi=2**32 - 1, integer=True),),
    "dataloader_num_workers": (Rule("torch's DataLoader refuses a negative number of workers", lo=0, integer=True),),
    "dataloader_prefetch_factor": (Rule("torch's DataLoader refuses a negative prefetch factor", lo=0, integer=True,
                                        null=True),
                                   Rule("TrainingArguments raises: it needs dataloader_num_workers > 0", unset=True,
                                        when=("dataloader_num_workers", 0, 0))),
    # ------------------------------------------------------------------ TRL's configs
    "max_length": (Rule("TRL truncates or filters to it; the plan's token counts", lo=1, integer=True, null=True,
                        always=True),),
    "pad_to_multiple_of": (Rule("a multiple to pad to (TRL 1 also takes auto); the plan's sequence multiples", lo=1,
                                integer=True, null=True, also=("auto",), always=True),),
    "dataset_num_proc": (Rule(_NUM_PROC, lo=0, integer=True, null=True),),
    "precompute_ref_batch_size": (Rule(_BATCH + " (0 or null: the per-device batch size)", lo=0, integer=True,
                                       null=True),),
    "ld_alpha": (Rule("documented (DPOConfig): must be in [0.0, 1.0]", lo=0, hi=1, null=True),),
    "label_smoothing": (Rule("DPOTrainer raises on 0 with the exo_pair loss", lo=0, lo_open=True,
                             when=("loss_type", "exo_pair", "sigmoid")),
                        Rule("documented (DPOConfig): must lie in [0.0, 0.5) for the robust loss", lo=0, hi=0.5,
                             hi_open=True, when=("loss_type", "robust", "sigmoid"))),
    "ref_model_sync_steps": (Rule("TRL's SyncRefModelCallback divides by it", lo=1, integer=True,
                                  when=("sync_ref_model", True, False)),),
    "beta": (Rule("DistillationConfig raises outside [0.0, 1.0]", lo=0, hi=1, only=("DistillationConfig",)),),
    "num_generations": (Rule("GRPOConfig / RLOOConfig raise below 2 (advantages need two completions a prompt)", lo=2,
                             integer=True),),
    "steps_per_generation": (Rule("GRPO / RLOO divide by it", lo=1, integer=True, null=True),),
    "generation_batch_size": (Rule("GRPO / RLOO divide by the steps per generation it gives", lo=1, integer=True,
                                   null=True),),
    "num_iterations": (Rule("GRPO divides by it", lo=1, integer=True),),
    "max_completion_length": (Rule("generation refuses max_new_tokens <= 0", lo=1, integer=True, null=True),),
    "temperature": (Rule("TRL's log-prob helpers raise 'temperature must be positive'", lo=0, lo_open=True),),
    "top_p": (Rule("documented (GRPOConfig): must be in (0, 1]; transformers' TopPLogitsWarper refuses outside [0, 1]",
                   lo=0, hi=1, lo_open=True),),
    "min_p": (Rule("documented: between 0.0 and 1.0; transformers' MinPLogitsWarper raises outside [0, 1]", lo=0,
                   hi=1, null=True),),
    "repetition_penalty": (Rule("transformers' RepetitionPenaltyLogitsProcessor raises unless it is > 0", lo=0,
                                lo_open=True),),
    "top_entropy_quantile": (Rule("documented (GRPOConfig): range [0.0-1.0]", lo=0, hi=1),),
}


def always_checked(field: str) -> bool:
    """Whether own code's `field` option is checked even where it is not a known field of the run's config."""
    return any(r.always for r in RANGES.get(field, ()))


def takes_fractions(field: str) -> bool:
    """Whether `field` takes non-integer numbers (a number written as a string may then be read as a float)."""
    return any(not (r.integer or r.unset) for r in RANGES.get(field, ()))


def broken_rule(field: str, value: Any, settings: Mapping[str, Any], config: str | None) -> Rule | None:
    """The first rule of `field` that `value` (as the trainer reads it) breaks, or None. `settings`: the whole block
    (or the args) as read, for rules that hold only `when` another setting has a value; `config`: the config class
    name, for rules that hold `only` for some classes (None: not known)."""
    return next((r for r in RANGES.get(field, ()) if r.applies(settings, config) and not r.accepts(value)), None)
