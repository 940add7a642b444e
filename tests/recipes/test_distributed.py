"""Two processes on one machine, launched like the node agent does (accelerate launch -> recipes.run):
DDP on the torchrun path (gradient sync proven), DeepSpeed ZeRO-2/ZeRO-3 and FSDP2 on CPU (same loss
curve as DDP, real sharding), DPO under ZeRO-3, and the save-on-signal preemption hook + resume."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from helpers import kill_tree, steps_seen, wait_until
from orchestrator.node.proctools import marked_ranks

pytestmark = pytest.mark.slow


def _check_ok(rc, res, out):
    rank_errors = "\n".join(x for x in out.splitlines() if x.startswith("[rank") or "Error" in x)
    assert rc == 0 and res is not None, rank_errors[-6000:] + "\n---\n" + out[-2500:]


def _assert_synced(res):
    ranks = res["ranks"]
    assert res["world_size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
    assert len({r["param_sha"] for r in ranks}) == 1, ranks  # same weights everywhere...
    assert len({r["first_batch_sha"] for r in ranks}) == 2, ranks  # ...from different data


@pytest.fixture(scope="module")
def ddp_curve():
    return {}


def test_sft_ddp_two_processes(recipe_cfg, launch, tmp_path, ddp_curve):
    rc, res, out = launch(recipe_cfg("sft_tiny", max_steps=20), "multi_gpu",
                          env={"ORCHESTRATE_HEARTBEAT_DIR": str(tmp_path / "hb")})
    _check_ok(rc, res, out)
    _assert_synced(res)
    assert res["runtime"] == {"accelerator": "cpu", "engine": "ddp", "pg_timeout_s": 300, "use_cpu": True}
    assert res["final_loss"] < res["first_loss"] - 1.5
    assert sorted(os.listdir(tmp_path / "hb")) == ["rank0.jsonl", "rank1.jsonl"]
    r1 = [json.loads(x) for x in (tmp_path / "hb" / "rank1.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in r1} == {1} and r1[-1]["event"] == "end"
    ddp_curve["losses"] = [loss for _, loss in res["losses"]]


@pytest.mark.parametrize("stage", [pytest.param("zero2", marks=pytest.mark.deepspeed),
                                   pytest.param("zero3", marks=pytest.mark.deepspeed), "fsdp2"])
def test_sft_sharded_matches_ddp(stage, recipe_cfg, launch, ddp_curve):
    rc, res, out = launch(recipe_cfg("sft_tiny", max_steps=20), stage, timeout=400)
    _check_ok(rc, res, out)
    assert res["runtime"]["engine"] == ("fsdp" if stage == "fsdp2" else "deepspeed") and res["world_size"] == 2
    ranks = res["ranks"]
    assert len({r["first_batch_sha"] for r in ranks}) == 2
    full = ranks[0]["full_param_numel"]
    # ZeRO-2, ZeRO-3 and FSDP2 all shard the optimizer state; ZeRO-3 and FSDP2 also the parameters
    assert all(r["optimizer_state_numel"] <= full // 2 + 64 for r in ranks), ranks
    if stage in ("zero3", "fsdp2"):
        assert all(r["local_param_numel"] <= full // 2 + 64 for r in ranks), ranks
        assert sum(r["local_param_numel"] for r in ranks) >= full
    else:
        assert len({r["param_sha"] for r in ranks}) == 1
    losses = [loss for _, loss in res["losses"]]
    if "losses" in ddp_curve:
        assert losses == pytest.approx(ddp_curve["losses"], rel=1e-3, abs=1e-3)
    assert losses[-1] < losses[0] - 1.5


@pytest.mark.deepspeed
def test_dpo_zero3_two_processes(recipe_cfg, launch):
    rc, res, out = launch(recipe_cfg("dpo_tiny", max_steps=12), "zero3", timeout=400)
    _check_ok(rc, res, out)
    assert res["world_size"] == 2 and res["global_step"] == 12
    assert len({r["first_batch_sha"] for r in res["ranks"]}) == 2
    assert all(r["local_param_numel"] < r["full_param_numel"] for r in res["ranks"])
    assert res["final_loss"] < res["first_loss"] - 0.03, res["losses"]


def _wait_steps(p, hb, steps: int, timeout: float = 120) -> int:
    """Wait until rank 1 has reported `steps` steps (heartbeats in `hb`) while the launch runs; its pid then."""
    def ready():
        assert p.poll() is None, "run ended early"
        return steps_seen(None, 1, heartbeat_dir=hb) >= steps
    wait_until(ready, timeout, 0.2, f"rank 1 to report {steps} steps")
    # the worker with RANK=1 (marked with the launch's token), not `accelerate launch` whose argv also says recipes.run
    return wait_until(lambda: marked_ranks(p.token).get(1), 10, 0.1, "rank 1's process")


def test_signal_saves_checkpoint_then_resume_continues(recipe_cfg, launch, tmp_path):
    hb = tmp_path / "hb"
    cfg = recipe_cfg("sft_tiny", max_steps=100000, logging_steps=1)
    p = launch(cfg, "multi_gpu", env={"ORCHESTRATE_HEARTBEAT_DIR": str(hb)}, wait=False, tag="pre")
    try:
        pid = _wait_steps(p, hb, 3)
        os.kill(pid, signal.SIGTERM)  # one rank only: the others must follow at the next step boundary
        rc = p.wait(timeout=120)
    finally:  # and job_guard kills every marked process of the launch at the end
        if p.poll() is None:
            kill_tree(p)
            p.wait()
    p.log.seek(0)
    out = p.log.read()
    assert rc != 0, out[-3000:]  # a preempted run is not a finished run
    ckpts = sorted((tmp_path / "out").glob("checkpoint-*"), key=lambda d: int(d.name.split("-")[1]))
    assert len(ckpts) == 1, out[-3000:]
    step = int(ckpts[0].name.split("-")[1])
    assert step >= 3 and (ckpts[0] / "optimizer.pt").exists()
    for r in (0, 1):
        ev = [json.loads(x) for x in (hb / f"rank{r}.jsonl").read_text().splitlines()]
        assert any(e["event"] == "save" and e["step"] == step for e in ev), (r, ev[-3:])
    # every rank exited 128+SIGTERM after saving (torchrun's failure report lists each rank's exit code)
    assert out.count("exitcode  : 143") >= 1 and "exitcode  : -" not in out, out[-3000:]
    print(out[-1500:])

    rc, res, out = launch(recipe_cfg("sft_tiny", max_steps=step + 2, logging_steps=1), "multi_gpu", tag="post")
    _check_ok(rc, res, out)
    assert res["resumed_from"] == str(ckpts[0]) and res["global_step"] == step + 2
    _assert_synced(res)


def test_hung_peer_times_out_on_cpu(recipe_cfg, launch, tmp_path):
    """transformers ignores ddp_timeout with use_cpu: the recipe's own gloo group must time out a hung peer."""
    hb = tmp_path / "hb"
    cfg = recipe_cfg("sft_tiny", max_steps=100000, logging_steps=1)
    p = launch(cfg, "multi_gpu", env={"ORCHESTRATE_HEARTBEAT_DIR": str(hb), "ORCHESTRATE_PG_TIMEOUT": "6"},
               wait=False, tag="hang")
    try:
        pid = _wait_steps(p, hb, 2)
        os.kill(pid, signal.SIGSTOP)  # hung, not dead: only a collective timeout can notice
        t0 = time.time()
        rc = p.wait(timeout=90)
        waited = time.time() - t0
    finally:  # the stopped rank, if the launcher left it behind, is killed by job_guard (marked with the token)
        if p.poll() is None:
            kill_tree(p)
            p.wait()
    p.log.seek(0)
    out = p.log.read()
    assert rc != 0 and waited < 60, (rc, waited, out[-2000:])
    assert "timed out" in out.lower() or "timeout" in out.lower(), out[-2000:]
    # rank 0 fails after 6 s ("Timed out waiting 6000ms"); torchrun then gives the stopped rank its 30 s grace
    print(f"launcher exited {waited:.1f} s after the peer hung (pg timeout 6 s)")
