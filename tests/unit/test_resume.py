"""No silent resume of another job's checkpoint (issue #28): the pure rule (orchestrator.core.resume.decide), the record
each checkpoint gets (orchestrator/node/hooks/orchestrate_checkpoint.py, written by HeartbeatCallback.on_save), the
rank's choice of checkpoint, and the submitter's check (api.check_resume through api.prepare): refused with exit 2
before anything is written, or continued as asked and said (resumed_from.json, `status`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.core.resume import Checkpoint, decide
from orchestrator.node.hooks import orchestrate_checkpoint as oc

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes/configs/sft_tiny.yaml")
A = "sft_tiny-20260101-000000-aaaa"
B = "sft_tiny-20260102-000000-bbbb"


def ckpt(out: Path, step: int, job: str | None = A) -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    if job is not None:
        assert oc.write_record(str(d), job, step)
    return d


# ------------------------------------------------------------------------------------------- the rule (pure)

def test_never_or_nothing_to_resume_is_a_fresh_start():
    other = Checkpoint("/o/checkpoint-8", A, 8)
    assert decide("never", B, other).action == "fresh"
    for mode in ("auto", "latest", "/o/checkpoint-8"):
        assert decide(mode, B, None).action == "fresh"


def test_the_jobs_own_checkpoint_continues_quietly():
    """A restart or requeue (same job id): auto goes on from the job's own checkpoint, as always, unannounced."""
    own = Checkpoint("/o/checkpoint-8", B, 8)
    for mode in ("auto", "latest", "/o/checkpoint-8"):
        d = decide(mode, B, own)
        assert (d.action, d.announce, d.message) == ("continue", False, ""), mode


def test_auto_refuses_another_jobs_checkpoint_naming_it_and_the_ways_out():
    d = decide("auto", B, Checkpoint("/o/checkpoint-120", A, 120))
    assert d.action == "refuse" and "\n" not in d.message
    assert f"checkpoint-120 of job {A} (step 120) in /o" in d.message, d.message
    assert "checkpoint.resume: latest" in d.message and "checkpoint.resume: /o/checkpoint-120" in d.message
    assert "another output dir (trainer.output_dir)" in d.message
    d = decide("auto", B, Checkpoint("/o/checkpoint-3", A, 3), output_key="run.args.output_dir")
    assert d.action == "refuse" and "(run.args.output_dir)" in d.message


def test_auto_refuses_a_checkpoint_without_a_record():
    """Written outside orchestrate (no orchestrate.json): another job, unknown."""
    d = decide("auto", B, Checkpoint("/o/checkpoint-5", None, 5))
    assert d.action == "refuse"
    assert "checkpoint-5 of an unknown job (step 5; no orchestrate.json: written outside orchestrate)" in d.message


@pytest.mark.parametrize("mode", ["latest", "/o/checkpoint-120"])
def test_asked_for_another_jobs_checkpoint_continues_and_is_announced(mode):
    picked = Checkpoint("/o/checkpoint-120", A, 120)
    d = decide(mode, B, picked)
    assert (d.action, d.checkpoint, d.announce) == ("continue", picked, True)
    assert picked.of() == f"checkpoint-120 of job {A} (step 120)"
    d = decide(mode, B, Checkpoint("/o/checkpoint-120", None, None))  # unknown job, unknown step: still as asked
    assert d.action == "continue" and d.announce


# ------------------------------------------------------------------------------------------- the record

def test_latest_follows_transformers_rule(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint
    out = tmp_path / "out"
    for name in ("checkpoint-5", "checkpoint-40", "checkpoint-12", "checkpoint-x", "checkpoint-7-old", "runs"):
        (out / name).mkdir(parents=True)
    (out / "checkpoint-99").write_text("a file, not a checkpoint")
    assert oc.latest(str(out)) == get_last_checkpoint(str(out)) == str(out / "checkpoint-40")
    assert oc.checkpoints(str(out)) == [str(out / f"checkpoint-{n}") for n in (5, 12, 40)]
    assert oc.latest(str(tmp_path / "missing")) is None and oc.checkpoints(str(tmp_path / "missing")) == []


def test_record_and_describe(tmp_path):
    d = ckpt(tmp_path, 8, A)
    rec = json.loads((d / oc.RECORD).read_text())
    assert rec["job_id"] == A and rec["step"] == 8 and rec["t"] > 0
    assert oc.describe(str(d)) == {"path": str(d), "job": A, "step": 8}
    bare = ckpt(tmp_path, 6, None)
    (bare / "trainer_state.json").write_text(json.dumps({"global_step": 6}))
    assert oc.describe(str(bare)) == {"path": str(bare), "job": None, "step": 6}  # step from trainer_state.json
    assert oc.describe(str(ckpt(tmp_path, 4, None)))["step"] == 4  # else from the name
    assert oc.whose(str(d), B) == f": a checkpoint of job {A}" and oc.whose(str(d), A) == "" == oc.whose(str(bare), B)
    assert not oc.write_record(str(tmp_path / "checkpoint-9"), A, 9)  # no checkpoint there: nothing written
    assert not oc.write_record(str(d), "", 8)  # outside orchestrate (no job id): nothing written
    assert not (tmp_path / "checkpoint-9").exists()


def test_heartbeat_callback_records_the_saved_checkpoint(tmp_path, monkeypatch):
    """The one writer, shared by the built-in recipes and the zero-code hooks: the process that saved it."""
    from orchestrator.node.hooks.orchestrate_trainer import HeartbeatCallback
    (tmp_path / "checkpoint-6").mkdir()
    state = SimpleNamespace(global_step=6, max_steps=10, num_input_tokens_seen=0)
    cb = HeartbeatCallback(directory=None)
    monkeypatch.setenv("ORCHESTRATE_JOB_ID", B)
    cb.on_save(SimpleNamespace(output_dir=str(tmp_path), should_save=False), state, None)
    assert not (tmp_path / "checkpoint-6" / oc.RECORD).exists()  # not the saving process (another rank)
    cb.on_save(SimpleNamespace(output_dir=str(tmp_path), should_save=True), state, None)
    assert oc.describe(str(tmp_path / "checkpoint-6")) == {"path": str(tmp_path / "checkpoint-6"), "job": B, "step": 6}


def test_rank_resume_choice(tmp_path):
    out = tmp_path / "out"
    ckpt(out, 4, A)
    latest = ckpt(out, 8, A)
    for mode in (None, False, "", "never", "off"):
        assert oc.resume_from(mode, str(out), B) is None
    assert oc.resume_from("auto", str(out), B) == oc.resume_from("latest", str(out), B) == str(latest)
    given = str(out / "checkpoint-4")
    assert oc.resume_from(given, str(out), B) == given  # the first attempt of a job begun from a path
    own = ckpt(out, 10, B)
    assert oc.resume_from(given, str(out), B) == str(own)  # its restart goes on from its own progress
    assert oc.resume_from(given, str(out), "") == given
    with pytest.raises(FileNotFoundError, match="is not a checkpoint directory"):
        oc.resume_from(str(tmp_path / "nope"), str(tmp_path / "empty"), B)
    assert oc.resume_from("auto", "", B) is None


def test_a_checkpoint_cut_short_by_a_kill_is_not_resumed_from(tmp_path, capsys):
    """A rank SIGKILLed while saving leaves checkpoint-N without trainer_state.json (the Trainer writes it last) and
    without the record: resuming from it failed every restart (FileNotFoundError). The rank resumes from the newest
    complete one and says why; the hosts' list of checkpoints (the staging server's `checkpoints` op, which decides
    which host gets a copy of the newest) leaves it out too, so the host that was killed is given the whole one."""
    import io

    from orchestrator.node import stagecache
    out = tmp_path / "out"
    ckpt(out, 4, A)
    foreign = ckpt(out, 8, None)
    (foreign / "trainer_state.json").write_text(json.dumps({"global_step": 8}))  # written outside orchestrate
    cut = ckpt(out, 12, None)
    (cut / "model.safetensors").write_bytes(b"half")
    assert not oc.complete(str(cut)) and oc.complete(str(foreign)) and oc.complete(str(out / "checkpoint-4"))
    assert oc.latest(str(out)) == str(cut)  # transformers' rule alone would take it
    assert oc.resume_from("auto", str(out), A) == str(foreign)
    assert f"{cut} is incomplete" in capsys.readouterr().err
    ckpt(out, 16, A)  # the restart's own, after the cut one: the path mode goes on from it
    assert oc.resume_from(str(out / "checkpoint-4"), str(out), A) == str(out / "checkpoint-16")
    (out / "checkpoint-20").mkdir()
    assert oc.resume_from(str(out / "checkpoint-4"), str(out), A) == str(out / "checkpoint-16")
    srv = stagecache.Server(str(tmp_path), io.BytesIO(), io.BytesIO())
    assert srv.op_checkpoints({"dir": "out"}) == {"steps": [4, 8, 16]}
    assert oc.latest_complete(str(tmp_path / "none")) is None


# ------------------------------------------------------------------------------------------- the submitter's check

def _prepare(out: Path, *over: str, **kw):
    from orchestrator import api
    return api.prepare(RECIPE, cwd=REPO, check_trainer=False,
                       overrides=[f"trainer.output_dir={out}", *over], **kw)


def test_submit_refuses_another_jobs_checkpoint_before_anything(tmp_path, monkeypatch):
    from orchestrator.errors import ConfigError
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    ckpt(out, 2, A)
    ckpt(out, 4, A)
    with pytest.raises(ConfigError) as e:
        _prepare(out)
    line = e.value.one_line()
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert f"checkpoint.resume: auto would continue checkpoint-4 of job {A} (step 4) in {out}" in line, line
    assert f"checkpoint.resume: {out / 'checkpoint-4'}" in line and "trainer.output_dir" in line
    assert not (tmp_path / "home").exists()  # nothing written, nothing recorded
    assert _prepare(out, "checkpoint.resume=never").resumed_from is None  # a fresh start, as asked
    assert _prepare(out, job_id="x", judge_checkpoints=False).resumed_from is None  # a re-plan: not judged


@pytest.mark.parametrize("how", ["latest", "path"])
def test_submit_continues_as_asked_and_records_it(tmp_path, how):
    out = tmp_path / "out"
    two, four = ckpt(out, 2, A), ckpt(out, 4, A)
    mode = "latest" if how == "latest" else str(two)
    prep = _prepare(out, f"checkpoint.resume={mode}")
    want = {"path": str(four), "job": A, "step": 4} if how == "latest" else {"path": str(two), "job": A, "step": 2}
    assert prep.resumed_from == want
    assert json.loads(prep.files["resumed_from.json"]) == want  # the run dir keeps it for `status`
    assert prep.recipe.checkpoint.resume == mode


def test_submit_with_empty_or_own_output_dir_says_nothing(tmp_path):
    out = tmp_path / "out"
    prep = _prepare(out)
    assert prep.resumed_from is None and "resumed_from.json" not in prep.files
    ckpt(out, 4, prep.plan.job_id)  # the job's own (a detached supervisor re-preparing its job, a restart)
    again = _prepare(out, job_id=prep.plan.job_id)
    assert again.resumed_from is None


def test_a_missing_resume_path_is_refused(tmp_path):
    from orchestrator.errors import ConfigError
    with pytest.raises(ConfigError, match=r"checkpoint.resume: .*/nope is not a checkpoint directory"):
        _prepare(tmp_path / "out", f"checkpoint.resume={tmp_path / 'nope'}")


def test_where_the_output_dir_is_not_visible_nothing_is_judged(tmp_path):
    """SSH hosts without a shared filesystem keep their outputs in their own cache: the submitter cannot see them."""
    from orchestrator.api import check_resume
    from orchestrator.core.spec import parse_cluster
    out = tmp_path / "out"
    ckpt(out, 4, A)
    recipe = SimpleNamespace(checkpoint=SimpleNamespace(resume="auto"), source="r.yaml")
    private = parse_cluster({"kind": "ssh", "ssh": {"hosts": ["h1", "h2"], "shared_fs": False}})
    assert check_resume(recipe, private, str(out), B) is None
    shared = parse_cluster({"kind": "ssh", "ssh": {"hosts": ["h1", "h2"], "shared_fs": True}})
    from orchestrator.errors import ConfigError
    with pytest.raises(ConfigError, match="another job's checkpoint"):
        check_resume(recipe, shared, str(out), B)


def test_own_code_is_judged_by_its_output_dir_option(tmp_path):
    """A `run:` job: the output dir its args name (run.args.output_dir); without one the script chooses: not judged."""
    import yaml
    from orchestrator import api
    from orchestrator.errors import ConfigError
    out = tmp_path / "out"
    ckpt(out, 4, A)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(script), "args": {"output_dir": str(out)}}}))
    with pytest.raises(ConfigError, match=r"another output dir \(run.args.output_dir\)"):
        api.prepare(str(job), cwd=tmp_path, check_trainer=False)
    job.write_text(yaml.safe_dump({"run": {"script": str(script), "args": ["--lr", "1"]}}))
    assert api.prepare(str(job), cwd=tmp_path, check_trainer=False).resumed_from is None


# ------------------------------------------------------------------------------------------- status

def test_status_says_which_checkpoint_of_which_job_it_resumed(tmp_path):
    import io

    from rich.console import Console
    from view_helpers import status_fixture

    from orchestrator.cli import tty
    from orchestrator.cli.views import job_status, status_text
    rec = status_fixture(tmp_path)
    assert job_status(rec, now=1010.0)["resumed_from"] is None
    assert "resumed" not in status_text(job_status(rec, now=1010.0))
    path = str(tmp_path / "out" / "checkpoint-120")
    (tmp_path / "run" / "resumed_from.json").write_text(json.dumps({"path": path, "job": A, "step": 120}))
    st = job_status(rec, now=1010.0)
    assert st["resumed_from"] == {"path": path, "job": A, "step": 120}
    line = f"resumed from checkpoint-120 of job {A} (step 120): {path}"
    assert line in status_text(st).splitlines()
    console = Console(file=io.StringIO(), width=300, force_terminal=True, record=True)
    console.print(tty.status_view(st))
    assert any(ln.split() == line.split() for ln in console.export_text().splitlines())


def test_private_ssh_hosts_stage_no_path_for_latest_and_are_not_judged(tmp_path, monkeypatch):
    """`latest` is a word, not a path to stage; and the submitter cannot see the hosts' output dirs (each host's
    cache, docs/staging.md): a local output dir that holds another job's checkpoint is no reason to refuse."""
    import yaml

    from orchestrator import api
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    ckpt(out, 4, A)
    cluster = tmp_path / "c.yaml"
    cluster.write_text(json.dumps({"kind": "ssh", "accelerator": "cpu",
                                   "ssh": {"hosts": ["127.0.0.2", "127.0.0.3"], "workdir": "/srv/w"}}))
    for mode in ("latest", "auto"):
        p = api.prepare(RECIPE, str(cluster), nodes=2, cwd=REPO, check_trainer=False,
                        overrides=[f"trainer.output_dir={out}", f"checkpoint.resume={mode}"])
        assert yaml.safe_load(p.files["recipe.yaml"])["checkpoint"]["resume"] == mode
        assert "resume" not in [s["label"] for s in json.loads(p.files["stage.json"])["sources"]]
        assert p.resumed_from is None


def test_a_sweep_over_an_output_dir_with_another_jobs_checkpoints_is_planned(tmp_path):
    """A sweep's points get output dirs of their own (<output dir>/<sweep id>-p<i>), each judged: the checkpoints of an
    earlier job in the base output dir are no reason to refuse the sweep."""
    from helpers import cli
    out = tmp_path / "out"
    ckpt(out, 4, A)
    r = cli("submit", RECIPE, "--nodes", "2", "--sweep", "trainer.learning_rate=1e-4,3e-4", "--dry-run",
            f"trainer.output_dir={out}", env={"ORCHESTRATE_HOME": str(tmp_path / "home")}, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "p0" in r.stdout and "p1" in r.stdout, r.stdout
    assert cli("submit", RECIPE, f"trainer.output_dir={out}", "--dry-run", cwd=REPO,
               env={"ORCHESTRATE_HOME": str(tmp_path / "home")}).returncode == 2  # (the same dir, one job: refused)
