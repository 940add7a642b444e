"""The start-up hook on its own (real interpreters, no launch): when it is active, what it loads (standard
library only), the "boot" mark, chaining to a user's sitecustomize, W&B defaults, the writer's buffering, and a
single-process plain loop (optimizer-step records, `beat`)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from own_code_helpers import CONTRACT_FIELDS, HERE, HOOKS_DIR, base_env, records

PROBE = ("import json, os, sys; print('PROBE ' + json.dumps({'modules': sorted(m for m in sys.modules if m.startswith("
         "('orchestrat', 'torch', 'transformers', 'sitecustomize'))), 'env': {k: v for k, v in os.environ.items() "
         "if k.startswith(('WANDB_', 'ORCHESTRATE_HOOKS'))}}))")


def probe(tmp_path, code: str = PROBE, **env) -> dict:
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=base_env(**env), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("PROBE "))
    return {**json.loads(line[len("PROBE "):]), "stderr": p.stderr}


def test_inactive_outside_a_rank_of_an_orchestrate_launch(tmp_path):
    hb = tmp_path / "hb"
    for env in ({"RANK": "0"},  # no heartbeat dir: not run by orchestrate
                {"ORCHESTRATE_HEARTBEAT_DIR": hb},  # the launcher itself (no RANK / LOCAL_RANK)
                {"ORCHESTRATE_HEARTBEAT_DIR": hb, "RANK": "0", "ORCHESTRATE_HOOKS": "0"}):  # turned off
        out = probe(tmp_path, **env)
        assert out["modules"] == ["sitecustomize"], (env, out)
        assert not out["stderr"]
    assert not hb.exists()


def test_active_in_a_rank_stdlib_only_and_boot_mark(tmp_path):
    hb = tmp_path / "hb"
    out = probe(tmp_path, ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="1", LOCAL_RANK="1")
    # no torch, no transformers, not even the orchestrator package: the hooks directory is self-contained (its
    # modules only register their package names as aliases of themselves)
    loaded = [m for m in out["modules"] if not m.startswith("orchestrator.node.hooks.")]
    assert loaded == ["orchestrate_hangs", "orchestrate_heartbeat", "orchestrate_hooks", "orchestrate_tracking",
                      "orchestrate_world", "sitecustomize"], out
    assert out["env"]["ORCHESTRATE_HOOKS_PID"].isdigit() and not out["stderr"]
    assert sorted(os.listdir(hb)) == ["rank1.exit", "rank1.jsonl"]
    assert stat.S_IMODE(os.stat(hb / "rank1.jsonl").st_mode) == 0o600
    (boot,) = records(hb / "rank1.jsonl")
    assert set(boot) == CONTRACT_FIELDS | {"proc_start"} and boot["event"] == "boot" and boot["step"] == 0
    assert boot["rank"] == 1 and boot["loss"] is None and boot["proc_start"] <= boot["t"] < boot["proc_start"] + 60


def test_child_processes_of_a_rank_are_not_hooked(tmp_path):
    hb = tmp_path / "hb"
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', " + repr(PROBE) + "], check=True)")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=base_env(ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="0"))
    assert p.returncode == 0, p.stderr
    child = json.loads(p.stdout.split("PROBE ", 1)[1])
    assert child["modules"] == ["sitecustomize"], child  # inherits RANK, but is no rank: a worker, a tool
    assert [r["event"] for r in records(hb / "rank0.jsonl")] == ["boot"]  # the parent's only


def test_user_sitecustomize_still_runs(tmp_path):
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nUSER_SITE = True\nos.environ['USER_SITE_RAN'] = '1'\n")
    code = ("import os, sys, sitecustomize; print('PROBE ' + __import__('json').dumps({'ran': os.environ.get("
            "'USER_SITE_RAN'), 'user': getattr(sitecustomize, 'USER_SITE', False), 'hooks': 'orchestrate_hooks' in "
            "sys.modules}))")
    for env, hooked in (({}, False), ({"ORCHESTRATE_HEARTBEAT_DIR": tmp_path / "hb", "RANK": "0"}, True)):
        env["PYTHONPATH"] = HOOKS_DIR + os.pathsep + str(user)
        out = probe(tmp_path, code, **env)
        assert out["ran"] == "1" and out["user"] is True and out["hooks"] is hooked, out


def test_wandb_defaults_from_the_job_id(tmp_path):
    hb = tmp_path / "hb"
    env0 = probe(tmp_path, ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="0",
                 ORCHESTRATE_JOB_ID="sft.tiny-20250101-1200-ab12")["env"]
    assert env0["WANDB_RUN_ID"] == "sft-tiny-20250101-1200-ab12" and env0["WANDB_RESUME"] == "allow"
    assert env0["WANDB_RUN_GROUP"] == env0["WANDB_NAME"] == "sft.tiny-20250101-1200-ab12"
    env1 = probe(tmp_path, ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="1", ORCHESTRATE_JOB_ID="job-1")["env"]
    assert env1["WANDB_RUN_ID"] == "job-1-rank1" and env1["WANDB_NAME"] == "job-1-rank1"
    mine = probe(tmp_path, ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="0", ORCHESTRATE_JOB_ID="job-1", WANDB_RUN_ID="mine",
                 WANDB_NAME="my run")["env"]
    assert mine["WANDB_RUN_ID"] == "mine" and mine["WANDB_NAME"] == "my run" and "WANDB_RESUME" not in mine
    assert mine["WANDB_RUN_GROUP"] == "job-1"


def test_beat_is_a_noop_outside_orchestrate(tmp_path):
    code = ("import os, orchestrate_heartbeat as h; h.beat(1, loss=0.5); h.beat(event='end'); "
            "print('PROBE ' + __import__('json').dumps({'modules': os.listdir('.')}))")
    assert probe(tmp_path, code)["modules"] == []


def test_one_writer_module_under_both_names(tmp_path):
    code = ("import sys; sys.path.insert(0, " + repr(HOOKS_DIR) + "); import orchestrate_heartbeat as a; "
            "from orchestrator.node.hooks import orchestrate_heartbeat as b; import orchestrate_trainer as c; "
            "from orchestrator.node.hooks import orchestrate_trainer as d; "
            "print('PROBE ' + __import__('json').dumps({'modules': [a is b, c is d, c.hb is a]}))")
    assert probe(tmp_path, code)["modules"] == [True, True, True]


def test_writer_buffers_lazy_step_records_only(tmp_path, monkeypatch):
    from orchestrator.node.hooks import orchestrate_heartbeat as hb

    monkeypatch.setattr(hb, "FLUSH_S", 3600.0)
    w = hb.Writer(str(tmp_path), rank=5)
    try:
        w.write("step", 1, lazy=True)  # the first one goes out at once
        w.write("step", 2, lazy=True)
        w.write("step", 3, 10, 1.5, 7, lazy=True)
        assert [r["step"] for r in records(tmp_path / "rank5.jsonl")] == [1]
        w.write("save", 3)  # any other event flushes what was buffered, in order
        lines = records(tmp_path / "rank5.jsonl")
        assert [(r["event"], r["step"]) for r in lines] == [("step", 1), ("step", 2), ("step", 3), ("save", 3)]
        assert lines[2] == {**lines[2], "max_steps": 10, "loss": 1.5, "tokens": 7} and set(lines[2]) == CONTRACT_FIELDS
        assert w.records == 4 and w.writes == 2 and w.overhead_s > 0
    finally:
        w.close()


def test_record_text_is_json_dumps_text(tmp_path):
    from orchestrator.node.hooks import orchestrate_heartbeat as hb

    w = hb.Writer(str(tmp_path), rank=3)
    cases = [("step", 7, 100, 2.25, 4096), ("step", 1, 0, None, None), ("save_start", 9, 9, float("nan"), 0),
             ("end", 2, 0, float("inf"), None), ("custom \"event\"", 0, 0, 1e-20, 5)]
    try:
        for event, step, max_steps, loss, tokens in cases:
            w.write(event, step, max_steps, loss, tokens)
        w.write("boot", 0, proc_start=12.5)  # named extras take the json.dumps path
    finally:
        w.close()
    lines = (tmp_path / "rank3.jsonl").read_text().splitlines()
    for line in lines:
        rec = json.loads(line)
        assert line == json.dumps(rec), line  # byte-identical to json.dumps of the record, field order included
        assert list(rec)[:8] == ["t", "rank", "host", "step", "max_steps", "loss", "tokens", "event"]
    assert [json.loads(x)["event"] for x in lines] == [c[0] for c in cases] + ["boot"]


def _plain(tmp_path, *args, **env):
    hb = tmp_path / "hb"
    p = subprocess.run([sys.executable, str(HERE / "train_plain.py"), *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=base_env(ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="0", **env))
    assert p.returncode == 0, p.stderr[-3000:]
    return records(hb / "rank0.jsonl"), p


def test_plain_loop_optimizer_steps_single_process(tmp_path):
    recs, p = _plain(tmp_path, "20", "--two-optimizers")
    assert [r["event"] for r in recs] == ["boot"] + ["step"] * 20
    steps = recs[1:]
    assert [r["step"] for r in steps] == list(range(1, 21))  # the second optimizer does not count twice
    assert all(set(r) - {"compute_s"} == CONTRACT_FIELDS and r["loss"] is None and r["rank"] == 0 for r in steps)
    # the straggler evidence: the model's own forward time, on every step record after the first (the hooks start
    # timing at the first optimizer step)
    assert all(isinstance(r.get("compute_s"), float) and 0 < r["compute_s"] < 5 for r in steps[1:]), steps
    loaded = json.loads(p.stdout.split("PLAIN_RESULT ", 1)[1])["modules"]
    assert "orchestrator" not in loaded and "orchestrator.node" not in loaded, loaded  # standard library only


def test_beat_wins_over_the_optimizer_hook(tmp_path):
    recs, _ = _plain(tmp_path, "20", "--beat")
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 21))  # once per step: the hook stays silent
    assert all(isinstance(r["loss"], float) and r["max_steps"] == 20 for r in steps)


def test_resume_choice(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from orchestrator.node.hooks import orchestrate_hooks as hooks

    out = tmp_path / "out"
    for n in (5, 40, 12):
        (out / f"checkpoint-{n}").mkdir(parents=True)
        (out / f"checkpoint-{n}" / "trainer_state.json").write_text(f'{{"global_step": {n}}}')
    (out / "checkpoint-44").mkdir()  # a save cut short (no trainer_state.json): never resumed from
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(out)))
    latest = str(out / "checkpoint-40")

    def choice(mode, args=(), kwargs=None):
        if mode is None:
            monkeypatch.delenv("ORCHESTRATE_RESUME", raising=False)
        else:
            monkeypatch.setenv("ORCHESTRATE_RESUME", mode)
        return hooks._resume_arg(trainer, tuple(args), dict(kwargs or {}))

    assert choice(None) == ((), {})  # unset: a first attempt never picks up an old checkpoint by itself
    assert choice("never") == ((), {})
    assert choice("auto") == ((), {"resume_from_checkpoint": latest})
    assert choice("auto", kwargs={"resume_from_checkpoint": None}) == ((), {"resume_from_checkpoint": latest})
    assert choice("auto", kwargs={"resume_from_checkpoint": False}) == ((), {"resume_from_checkpoint": False})
    assert choice("auto", args=("mine",)) == (("mine",), {})  # the user's own choice stands
    assert choice(str(out / "checkpoint-5")) == ((), {"resume_from_checkpoint": str(out / "checkpoint-5")})
    trainer.args.output_dir = str(tmp_path / "empty")
    assert choice("auto") == ((), {})  # nothing saved yet: a fresh start


def test_settle_at_exit_waits_while_another_thread_is_runnable(monkeypatch):
    """_settle_at_exit (the exit race of pytorch#190489): with torch.distributed loaded it sleeps the minimum when no
    other thread is runnable, and keeps the GIL free while one is (a gloo worker that has not run yet), up to the
    maximum. The busy thread here hashes without the GIL, as a worker thread runs outside Python."""
    import hashlib
    import threading
    import time

    from orchestrator.node.hooks import orchestrate_hooks as hooks

    monkeypatch.setitem(sys.modules, "torch.distributed", sys.modules.get("torch.distributed") or object())
    least, most = hooks.SETTLE_S
    real = hooks._runnable_threads
    monkeypatch.setattr(hooks, "_runnable_threads", lambda: 0)  # no other thread runnable (pytest may have some)
    t0 = time.monotonic()
    hooks._settle_at_exit()
    idle = time.monotonic() - t0
    assert least <= idle < least + 0.15, idle
    monkeypatch.setattr(hooks, "_runnable_threads", real)

    stop = threading.Event()
    data = b"x" * (8 << 20)

    def busy():
        while not stop.is_set():
            hashlib.sha256(data).digest()  # releases the GIL: this thread stays runnable (state R)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 5
        while not hooks._runnable_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hooks._runnable_threads() >= 1
        t0 = time.monotonic()
        hooks._settle_at_exit()
        waited = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    assert most <= waited < most + 0.3, waited

    monkeypatch.delitem(sys.modules, "torch.distributed")
    t0 = time.monotonic()
    hooks._settle_at_exit()  # no torch.distributed: nothing to wait for
    assert time.monotonic() - t0 < 0.005


def test_exit_record_is_the_ranks_own(tmp_path):
    """rank<G>.exit names the rank's pid and code; a forked child that exits through Python writes none in its name."""
    hb = tmp_path / "hb"
    code = ("import os, sys, time\n"
            "print(os.getpid(), flush=True)\n"
            "if os.fork() == 0:\n"
            "    time.sleep(0.5)\n"  # the child outlives the rank (the pipes keep the test waiting for it) and
            "    sys.exit(7)\n"  # exits through Python's exit: atexit handlers run, after the rank's
            "sys.exit(3)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env=base_env(ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="2"))
    assert p.returncode == 3, p.stderr
    assert json.loads((hb / "rank2.exit").read_text()) == {"pid": int(p.stdout.split()[-1]), "code": 3}


@pytest.mark.parametrize("code,rc,recorded", [
    ("import sys; sys.exit(3)", 3, 3),
    ("exit(4)", 4, 4),
    ("import sys; sys.exit('bye')", 1, 1),
    ("raise ValueError('x')", 1, 1),
    ("import sys; sys.excepthook = lambda *a: None\nraise ValueError('x')", 1, 1),  # a replaced excepthook
    ("raise SystemExit(5)", 5, None),  # raised by the script itself: not known
    ("pass", 0, None),
    ("import sys, threading\nt = threading.Thread(target=sys.exit, args=(7,)); t.start(); t.join()", 0, None),
    ("import sys\ntry:\n    sys.exit(2)\nexcept SystemExit:\n    pass\nraise KeyboardInterrupt", -2, None),
])
def test_exit_record_codes(tmp_path, code, rc, recorded):
    """What rank<G>.exit says: the code the main thread asked for, 1 after an uncaught exception whoever printed it,
    null where it is not known (a thread's sys.exit ends only the thread; Ctrl-C ends the process by SIGINT)."""
    hb = tmp_path / "hb"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env=base_env(ORCHESTRATE_HEARTBEAT_DIR=hb, RANK="0"))
    assert p.returncode == rc, p.stderr
    rec = json.loads((hb / "rank0.exit").read_text())
    assert rec == {"pid": rec["pid"], "code": recorded}
