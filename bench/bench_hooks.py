#!/usr/bin/env python3
"""Cost of the zero-code hooks (orchestrator/node/hooks) on a training step (not CI).

1. in-process, paired: the same plain torch loop (AdamW, one process) in blocks of --block steps, alternately
   with torch's global optimizer-step post hook (orchestrate_hooks._optimizer_stepped, writing real records to a
   temporary heartbeat dir) registered and removed (ABBA order, --pairs pairs); per pair the relative step-time
   difference, reported as median and mean. Also the hook's self-timed cost per step (perf_counter inside the
   hook) over the measured step time. For two model sizes: --widths (MLP 32->W->1: W=64 is a ~0.2 ms step, the
   worst case; W=2048 a few ms) and heartbeat buffering off (FLUSH_S=0, every record written at once) and on
   (the default 0.5 s).
2. HF Trainer, paired: the tiny Llama on the shipped chat data (as tests/own_code/train_hf.py), one process,
   --trainer-steps steps per run, alternately with the hooks' Trainer callbacks (heartbeat + save-on-signal,
   records to a temporary dir) and without; train_runtime per run, and the heartbeat callback's self-timed cost.
3. end-to-end, paired: tests/own_code/train_plain.py as separate processes (single rank, RANK=0), with the hooks
   directory on PYTHONPATH + ORCHESTRATE_HEARTBEAT_DIR vs without, alternating; its training-loop wall time.
4. two ranks, paired blocks inside one run (what the issue's "< 1 %" is about): `orchestrate submit` of a user's HF
   Trainer script (tests/faults/user_train.py, the tiny Llama) on 2 local nodes (gloo). A bench-only callback
   switches the injected callbacks (heartbeat and save-on-signal, with its all-reduce agreements) off and on in
   blocks of --rank-block steps, ABBA, the same steps on both ranks, after --rank-warmup steps; rank 0 times each
   block and the time spent inside the injected callbacks (self-timed). Per adjacent on/off pair the relative
   difference; median, mean, standard error and spread over --ranks runs. Once with the default agreement interval
   (ORCHESTRATE_SIGNAL_CHECK_S=0.5) and once agreeing every step (=0, as before).

    .venv/bin/python bench/bench_hooks.py [--pairs 20] [--block 200] [--widths 64,2048] [--trainer 8]
        [--trainer-steps 100] [--e2e 6] [--e2e-steps 2000] [--ranks 4] [--rank-blocks 48] [--rank-block 20]

Writes bench/results/hooks.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from orchestrator.node.hooks import HOOKS_DIR  # noqa: E402


def _block(model, opt, x, y, n: int) -> float:
    import torch

    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def in_process(width: int, pairs: int, block: int, flush_s: float, hb_dir: str, device: str = "cpu") -> dict:
    """The torch optimizer-step hook on and off in ABBA blocks of one process's MLP steps (`device`: cpu or cuda; a
    synchronize ends each CUDA block)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from orchestrator.node.hooks import orchestrate_heartbeat as hb
    from orchestrator.node.hooks import orchestrate_hooks as hooks

    hb.FLUSH_S = flush_s
    hb._hook = None
    s0 = hooks._OptimizerSteps
    s0.first, s0.steps, s0.calls, s0.overhead_s = None, 0, 0, 0.0
    os.environ["ORCHESTRATE_HEARTBEAT_DIR"] = hb_dir
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    _block(model, opt, x, y, block)  # warm-up
    on_t, off_t, rel = [], [], []
    for i in range(pairs):
        pair = {}
        for with_hook in ((True, False) if i % 2 == 0 else (False, True)):
            handle = register_optimizer_step_post_hook(hooks._optimizer_stepped) if with_hook else None
            pair[with_hook] = _block(model, opt, x, y, block)
            if handle is not None:
                handle.remove()
        on_t.append(pair[True])
        off_t.append(pair[False])
        rel.append(pair[True] / pair[False] - 1.0)
    s = hooks.stats()
    w = hb._hook
    hook_s = s["hook_overhead_s"]
    return {"width": width, "flush_s": flush_s, "pairs": pairs, "block": block,
            "step_ms_without": round(statistics.median(off_t) * 1e3, 4),
            "step_ms_with": round(statistics.median(on_t) * 1e3, 4),
            "paired_overhead_median": round(statistics.median(rel), 5),
            "paired_overhead_mean": round(statistics.mean(rel), 5),
            "paired_overhead_stdev": round(statistics.stdev(rel), 5) if len(rel) > 1 else None,
            "paired_overhead_range": [round(min(rel), 5), round(max(rel), 5)],
            "hook_self_us_per_step": round(hook_s / max(1, s["hook_calls"]) * 1e6, 3),
            "hook_self_frac": round(hook_s / (sum(on_t) * block), 6),
            "records": s["records"], "os_writes": w.writes if w else 0}


def trainer_runs(pairs: int, steps: int, hb_dir: str) -> dict:
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false", ORCHESTRATE_HEARTBEAT_DIR=hb_dir)
    import transformers.trainer as trainer_module
    from datasets import load_dataset
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                              TrainingArguments)

    from orchestrator.node.hooks import orchestrate_hooks as hooks
    from recipes.tiny import resolve_model_path

    hooks._on_transformers_trainer(trainer_module)  # what the import hook does in a rank
    model_dir = resolve_model_path("tiny-llama")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    ds = load_dataset("json", data_files=str(REPO / "recipes" / "data" / "sft_tiny.jsonl"), split="train")
    ds = ds.map(lambda ex: tok(tok.apply_chat_template(ex["messages"], tokenize=False), truncation=True,
                               max_length=128), remove_columns=ds.column_names)

    def run(hooked: bool, out: str) -> tuple[float, float]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
                                 save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True, seed=42)
        tr = Trainer(model=model, args=args, train_dataset=ds,
                     data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
        ours = tr._orchestrate_hooks
        if not hooked:
            for cb in ours:
                tr.remove_callback(cb)
            tr._orchestrate_hooks = None
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints every log dict without tqdm
            res = tr.train()
        return float(res.metrics["train_runtime"]), (ours[1].overhead_s if hooked else 0.0)

    with tempfile.TemporaryDirectory() as d:
        run(False, d)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        rel, self_s = [], []
        for i in range(pairs):
            pair = {}
            for hooked in ((True, False) if i % 2 == 0 else (False, True)):
                pair[hooked], cost = run(hooked, d)
                times[hooked].append(pair[hooked])
                if hooked:
                    self_s.append(cost / pair[hooked])
            rel.append(pair[True] / pair[False] - 1.0)
    return {"pairs": pairs, "steps": steps, "train_runtime_without": round(statistics.median(times[False]), 4),
            "train_runtime_with": round(statistics.median(times[True]), 4),
            "step_ms_without": round(statistics.median(times[False]) / steps * 1e3, 3),
            "paired_overhead_median": round(statistics.median(rel), 5),
            "paired_overhead_mean": round(statistics.mean(rel), 5),
            "callback_self_frac_median": round(statistics.median(self_s), 6)}


def end_to_end(runs: int, steps: int, width: int) -> dict:
    script = REPO / "tests" / "own_code" / "train_plain.py"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATE_", "RANK", "LOCAL_RANK"))}
    times: dict[bool, list[float]] = {True: [], False: []}
    rel = []
    for i in range(runs):
        pair = {}
        for hooked in ((True, False) if i % 2 == 0 else (False, True)):
            with tempfile.TemporaryDirectory() as d:
                env = dict(base, RANK="0", OMP_NUM_THREADS="1")
                if hooked:
                    env.update(PYTHONPATH=HOOKS_DIR, ORCHESTRATE_HEARTBEAT_DIR=d)
                p = subprocess.run([sys.executable, str(script), str(steps), "--width", str(width)], env=env, cwd=d,
                                   capture_output=True, text=True, check=True)
                res = json.loads(p.stdout.split("PLAIN_RESULT ", 1)[1])
                if hooked:
                    n = sum(1 for _ in open(os.path.join(d, "rank0.jsonl")))
                    assert n == steps + 1, n  # boot + one record per step
            pair[hooked] = res["loop_s"]
            times[hooked].append(res["loop_s"])
        rel.append(pair[True] / pair[False] - 1.0)
    return {"runs": runs, "steps": steps, "width": width,
            "loop_s_without": round(statistics.median(times[False]), 4),
            "loop_s_with": round(statistics.median(times[True]), 4),
            "paired_overhead_median": round(statistics.median(rel), 5),
            "paired_overhead_mean": round(statistics.mean(rel), 5)}


TOGGLE = '''
import json, os, runpy, sys, time
from transformers import Trainer, TrainerCallback
WARMUP, BLOCK, BLOCKS = (int(x) for x in os.environ["BENCH_TOGGLE"].split(","))
EVENTS = ("on_step_end", "on_log")  # the injected callbacks' per-step work


class Toggle(TrainerCallback):
    """Blocks of BLOCK steps after WARMUP, ABBA (on off off on ...): the same steps on every rank."""
    def __init__(self):
        self.ours, self.marks, self.on, self.inside, self.by_role = [], [], True, 0.0, {}

    def on_train_begin(self, args, state, control, **kw):
        self.ours = [cb for cb in self.handler.callbacks if getattr(cb, "orchestrate_role", None)]
        assert len(self.ours) == 2, self.handler.callbacks

    def _timed(self, method, role):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                took = time.perf_counter() - t0
                self.inside += took
                self.by_role[role] = self.by_role.get(role, 0.0) + took
        return run

    def _set(self, on):
        for cb in self.ours:
            for ev in EVENTS:  # on: the callback's own method, timed; off: nothing
                setattr(cb, ev, self._timed(getattr(type(cb), ev).__get__(cb), cb.orchestrate_role) if on else
                        lambda *a, **k: None)
        self.on = on

    def on_step_end(self, args, state, control, **kw):
        s = state.global_step
        if s >= WARMUP and (s - WARMUP) % BLOCK == 0:
            b = (s - WARMUP) // BLOCK  # block b starts after step s
            self.marks.append((time.perf_counter(), self.on, self.inside))
            if b < BLOCKS:
                self._set(b % 4 in (0, 3))
            else:  # every rank stops here
                control.should_training_stop = True
                if args.process_index == 0:
                    t = [m[0] for m in self.marks]
                    blocks = [[t[i + 1] - t[i], self.marks[i + 1][1], self.marks[i + 1][2] - self.marks[i][2]]
                              for i in range(len(t) - 1)]  # [seconds, on, seconds inside our callbacks]
                    sys.stdout.write("TOGGLE_RESULT " + json.dumps(blocks) + "\\n")
                    sys.stdout.write("TOGGLE_ROLES " + json.dumps(self.by_role) + "\\n")
                    sys.stdout.flush()
        return control


_init = Trainer.__init__
def init(self, *a, **k):
    _init(self, *a, **k)
    cb = Toggle()
    cb.handler = self.callback_handler
    self.add_callback(cb)
Trainer.__init__ = init
runpy.run_path(sys.argv.pop(1), run_name="__main__")
'''


class ToggleBlocks:
    """The [on, off] block pairs of TOGGLE's output (TOGGLE_RESULT / TOGGLE_ROLES lines), gathered over runs."""

    def __init__(self, block: int):
        self.block = block
        self.rel: list[float] = []
        self.on_s: list[float] = []
        self.off_s: list[float] = []
        self.inside: list[float] = []
        self.by_role: dict[str, list[float]] = {}

    def add(self, stdout: str) -> bool:
        """One run's output; False when it holds no TOGGLE_RESULT line."""
        line = next((x for x in stdout.splitlines() if "TOGGLE_RESULT " in x), None)
        if not line:
            return False
        got = json.loads(line.split("TOGGLE_RESULT ", 1)[1])
        roles = json.loads(next(x for x in stdout.splitlines() if "TOGGLE_ROLES " in x).split("TOGGLE_ROLES ")[1])
        on_total = sum(b[0] for b in got if b[1])
        for role, s in roles.items():
            self.by_role.setdefault(role, []).append(s / on_total)
        for i in range(0, len(got) - 1, 2):  # (on, off) or (off, on): adjacent blocks
            (a, a_on, a_in), (b, _, b_in) = got[i], got[i + 1]
            on, off = (a, b) if a_on else (b, a)
            self.inside.append((a_in if a_on else b_in) / on)
            self.rel.append(on / off - 1.0)
            self.on_s.append(on / self.block)
            self.off_s.append(off / self.block)
        return True

    def summary(self) -> dict:
        rel = self.rel
        return {"pairs": len(rel), "block": self.block,
                "step_ms_off": round(statistics.median(self.off_s) * 1e3, 3),
                "step_ms_on": round(statistics.median(self.on_s) * 1e3, 3),
                "paired_overhead_median": round(statistics.median(rel), 5),
                "paired_overhead_mean": round(statistics.mean(rel), 5),
                "paired_overhead_sem": round(statistics.stdev(rel) / len(rel) ** 0.5, 5),
                "paired_overhead_range": [round(min(rel), 5), round(max(rel), 5)],
                "self_timed_frac_median": round(statistics.median(self.inside), 6),
                "self_timed_frac_by_callback": {k: round(statistics.median(v), 6) for k, v in self.by_role.items()}}


def two_ranks(runs: int, blocks: int, block: int, warmup: int, check_s: str) -> dict:
    """Section 4: [on, off] block pairs inside `runs` 2-rank runs (see the module docstring)."""
    from recipes.tiny import resolve_model_path
    model = resolve_model_path("tiny-llama")
    pairs = ToggleBlocks(block)
    with tempfile.TemporaryDirectory() as d:
        wrapper = Path(d) / "toggle.py"
        wrapper.write_text(TOGGLE)
        job = Path(d) / "job.yaml"
        steps = warmup + block * blocks + 1
        job.write_text(json.dumps({"run": {"script": str(wrapper), "args": [
            str(REPO / "tests" / "faults" / "user_train.py"), model, str(REPO / "recipes" / "data" / "sft_tiny.jsonl"),
            str(Path(d) / "out"), str(steps)]},
            "launch": {"env": {"BENCH_TOGGLE": f"{warmup},{block},{blocks}", "ORCHESTRATE_SIGNAL_CHECK_S": check_s}}}))
        env = {**os.environ, "ORCHESTRATE_HOME": str(Path(d) / "home"), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for _ in range(runs):
            p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(job), "--nodes", "2"],
                               capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
            if p.returncode != 0 or not pairs.add(p.stdout):
                (Path(tempfile.gettempdir()) / "bench_hooks_two_ranks.log").write_text(p.stdout + p.stderr)
                raise SystemExit(f"two-rank run failed (rc {p.returncode}): {p.stdout.splitlines()[-1:]} (whole "
                                 f"output: {tempfile.gettempdir()}/bench_hooks_two_ranks.log)")
    return {"check_s": float(check_s), "runs": runs, "warmup": warmup, **pairs.summary()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--block", type=int, default=200)
    ap.add_argument("--widths", default="64,2048")
    ap.add_argument("--trainer", type=int, default=8, help="Trainer pairs (0: skip)")
    ap.add_argument("--trainer-steps", type=int, default=100)
    ap.add_argument("--e2e", type=int, default=6, help="end-to-end pairs (0: skip)")
    ap.add_argument("--e2e-steps", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=4, help="two-rank runs per agreement setting (0: skip)")
    ap.add_argument("--rank-blocks", type=int, default=48)
    ap.add_argument("--rank-block", type=int, default=20)
    ap.add_argument("--rank-warmup", type=int, default=20)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "hooks.json"))
    a = ap.parse_args()
    out = {"in_process": [], "trainer": None, "end_to_end": None, "two_ranks": []}
    for check_s in ("0.5", "0") if a.ranks else ():
        r = two_ranks(a.ranks, a.rank_blocks, a.rank_block, a.rank_warmup, check_s)
        print(json.dumps(r), flush=True)
        out["two_ranks"].append(r)
    with tempfile.TemporaryDirectory() as d:
        for width in (int(w) for w in a.widths.split(",") if w):  # --widths "": skip section 1
            for flush_s in (0.0, 0.5):
                r = in_process(width, a.pairs, a.block, flush_s, os.path.join(d, f"w{width}_f{flush_s}"))
                print(json.dumps(r), flush=True)
                out["in_process"].append(r)
        if a.trainer:
            out["trainer"] = trainer_runs(a.trainer, a.trainer_steps, os.path.join(d, "trainer"))
            print(json.dumps(out["trainer"]), flush=True)
    if a.e2e:
        out["end_to_end"] = end_to_end(a.e2e, a.e2e_steps, 64)
        print(json.dumps(out["end_to_end"]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
