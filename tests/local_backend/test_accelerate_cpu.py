"""A user's accelerate code on a CPU cluster never trains alone (issue #37). The plan's CPU config (MULTI_GPU,
use_cpu false: the torchrun path) leaves accelerate's state at DistributedType.NO with 1 process on every rank while
torchrun started the whole world: each rank would train alone, in silence. On 2 local nodes, code that never imports
orchestrate:
- accelerate's own `accelerate.test_utils.scripts.test_ops` passes (its first assertion: the state's process count is
  torch.distributed's world size), and then a 10-line `Accelerator()` loop is one distributed run: 2 processes,
  MULTI_CPU, the same parameters on both ranks after steps on different data (one job for both);
- a loop whose `PartialState()` is not told about the CPU (and so starts no process group) is stopped at its first
  optimizer step with a one-line cause naming the fix. Slow."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from helpers import OFFLINE_ENV, PYTHON, run

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

ACCELERATOR_LOOP = """\
import torch
from accelerate import Accelerator
from accelerate.test_utils.scripts import test_ops
acc = Accelerator()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
for step in range(3):
    loss = model(torch.ones(2, 4) * (acc.process_index + 1)).sum()
    opt.zero_grad(); acc.backward(loss); opt.step()
w = acc.unwrap_model(model).weight.detach().sum().item()
print(f"ACC {acc.process_index} of {acc.num_processes} {acc.distributed_type.value} {w:.6f}", flush=True)
test_ops.main()  # accelerate's own check, as `python -m accelerate.test_utils.scripts.test_ops` runs it (it ends
"""                # by destroying the process group: last)

PARTIAL_STATE_LOOP = """\
import torch
from accelerate import PartialState
state = PartialState()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.ones(2, 4)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
print("TRAINED ALONE", state.num_processes, flush=True)
"""


def submit(tmp_path: Path, job: str) -> tuple[int, str]:
    (tmp_path / "job.yaml").write_text(job)
    r = run([PYTHON, "-m", "orchestrator.cli", "submit", "job.yaml", "--nodes", "2"],
            env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=600, stderr=None)
    return r.returncode, r.stdout


def test_accelerates_test_ops_and_an_accelerator_loop_are_one_distributed_run(tmp_path, job_guard):
    (tmp_path / "train.py").write_text(ACCELERATOR_LOOP)
    rc, text = submit(tmp_path, "run: {script: train.py}\n")
    assert rc == 0, text[-4000:]
    assert "Distributed environment: DistributedType.MULTI_CPU" in text and "Num processes: 2" in text, text[-4000:]
    got = dict(re.findall(r"\[localhost node\d rank(\d)\] ACC (\d of 2 MULTI_CPU \S+)", text))
    assert set(got) == {"0", "1"}, text[-4000:]
    assert got["0"].split()[1:] == got["1"].split()[1:]  # the same weights: gradients were averaged across ranks


def test_a_partial_state_that_would_train_alone_is_stopped_at_its_first_step(tmp_path, job_guard):
    (tmp_path / "train.py").write_text(PARTIAL_STATE_LOOP)
    rc, text = submit(tmp_path, "run: {script: train.py}\n")
    assert rc == 1, text[-4000:]
    assert "TRAINED ALONE" not in text, text[-4000:]
    cause = "TrainsAlone: this rank trains alone: accelerate's state has 1 process (NO) but WORLD_SIZE is 2"
    assert cause in text and "PartialState(cpu=True)" in text, text[-4000:]
