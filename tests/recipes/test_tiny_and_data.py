"""Built-in tiny models (cheap import, race-free build) and the shipped data (deterministic, small)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_builtin_models_importable_without_torch():
    code = ("import sys; from recipes.tiny import BUILTIN_MODELS as B; "
            "assert not any(m in sys.modules for m in ('torch', 'transformers')), 'heavy import'; "
            "print(B['tiny-llama']['num_attention_heads'], B['tiny-qwen2']['num_key_value_heads'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["4", "2"]


def test_resolve_passes_through_other_names():
    from recipes.tiny import resolve_model_path

    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert resolve_model_path("/some/dir") == "/some/dir"


def test_concurrent_build_is_race_free(tmp_path, job_guard):
    # Three "ranks" with a live process group build at once (transformers' save_pretrained writes only on
    # global rank 0 when a group is up: the build must not depend on that).
    env = {**os.environ, "ORCHESTRATE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "GLOO_SOCKET_IFNAME": "lo"}
    code = ("import sys, torch.distributed as d; "
            f"d.init_process_group('gloo', init_method='file://{tmp_path}/pg', world_size=3, rank=int(sys.argv[1])); "
            "from recipes.tiny import resolve_model_path; "
            "from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer; "
            "p = resolve_model_path('tiny-qwen2'); c = AutoConfig.from_pretrained(p); "
            "m = AutoModelForCausalLM.from_pretrained(p); "
            "t = AutoTokenizer.from_pretrained(p); print(p, c.model_type, c.num_key_value_heads, t.eos_token)")
    procs = [job_guard.spawn([sys.executable, "-c", code, str(i)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    lines = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(lines) == 1
    path, model_type, kv, eos = lines.pop().split()
    assert (model_type, kv, eos) == ("qwen2", "2", "<|im_end|>")
    leftovers = [p.name for p in Path(path).parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # losers cleaned up their temp dirs


def test_shipped_data_is_deterministic_and_small(tmp_path):
    sys.path.insert(0, str(REPO / "recipes" / "data"))
    import make_data

    sft, dpo = make_data.make()
    make_data.write_jsonl(sft, tmp_path / "sft.jsonl")
    make_data.write_jsonl(dpo, tmp_path / "dpo.jsonl")
    for ours, shipped in (("sft.jsonl", "sft_tiny.jsonl"), ("dpo.jsonl", "dpo_tiny.jsonl")):
        shipped_path = REPO / "recipes" / "data" / shipped
        assert (tmp_path / ours).read_bytes() == shipped_path.read_bytes()
        assert shipped_path.stat().st_size < 200_000
    row = json.loads((REPO / "recipes/data/dpo_tiny.jsonl").read_text().splitlines()[0])
    assert set(row) == {"prompt", "chosen", "rejected"} and row["prompt"][0]["role"] == "user"
    assert len(sft) >= 200


def test_incomplete_leftover_is_replaced(tmp_path, monkeypatch):
    from recipes import tiny

    monkeypatch.setenv("ORCHESTRATE_CACHE", str(tmp_path))
    broken = tiny.model_dir("tiny-llama")
    broken.mkdir(parents=True)
    (broken / "tokenizer.json").write_text("{}")  # what a build that died half-way leaves behind
    path = tiny.resolve_model_path("tiny-llama")
    assert path == str(broken) and tiny._complete(broken)
    assert [p.name for p in broken.parent.iterdir()] == [broken.name]
