"""Built-in tiny models (`tiny-llama`, `tiny-qwen2`): random weights and a byte-level BPE tokenizer,
built locally (no hub access) into ORCHESTRATE_CACHE/tiny/<id>-v1/ on first use.

Owns `resolve_model_path` (the shapes live in orchestrator.core.models), and the race-free build (temp dir + atomic
rename; several ranks or nodes may build at once, the loser discards its copy).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from orchestrator.core.models import BUILTIN_MODELS, VOCAB_SIZE

VERSION = "v1"
SEED = 1234

_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML with `{% generation %}` markers around what the assistant says, so TRL's
# assistant_only_loss can build its mask.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    return Path(os.environ.get("ORCHESTRATE_CACHE") or Path.home() / ".cache" / "orchestrate")


def model_dir(name: str) -> Path:
    return cache_root() / "tiny" / f"{name}-{VERSION}"


def resolve_model_path(name_or_path: str) -> str:
    """A built-in tiny id -> its local directory (built on demand); anything else unchanged."""
    if name_or_path not in BUILTIN_MODELS:
        return name_or_path
    target = model_dir(name_or_path)
    if not _complete(target):
        _build(name_or_path, target)
    return str(target)


def _complete(d: Path) -> bool:
    return all((d / f).exists() for f in _REQUIRED)


def _corpus() -> list[str]:
    """Deterministic training text for the tokenizer: the shipped task styles plus chat markup."""
    import random

    rng = random.Random(SEED)
    words = ["apple", "river", "stone", "cloud", "tiger", "orange", "planet", "garden", "silver",
             "window", "number", "letter", "reverse", "count", "upper", "case", "add", "sum", "word"]
    lines = []
    for _ in range(600):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        w = rng.choice(words)
        lines.append(f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>")
        lines.append(f"Reverse the word '{w}'. The answer is {w[::-1]}. Uppercase: {w.upper()}.")
        lines.append(f"How many letters are in '{w}'? There are {len(w)} letters.")
    return lines


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token=None, unk_token=None,
                                   additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = BUILTIN_MODELS["tiny-llama"]["max_position_embeddings"]
    return fast


def build_model(name: str, vocab_size: int, eos_id: int, pad_id: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = dict(BUILTIN_MODELS[name])
    arch = spec.pop("architecture")
    spec["vocab_size"] = vocab_size
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    config = cls(**spec, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, dtype="float32")
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config)


def _build(name: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        tokenizer = build_tokenizer()
        model = build_model(name, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        # Not model.save_pretrained: with a process group up, transformers writes only on global rank 0, and a
        # rank > 0 building its own copy would end up with a tokenizer-only directory.
        from safetensors.torch import save_file

        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        missing = [f for f in _REQUIRED if not (tmp / f).exists()]
        if missing:
            raise RuntimeError(f"building {name}: {missing} were not written to {tmp}")
        for attempt in range(3):
            try:
                os.rename(tmp, target)  # atomic; fails if another process won the race
                return
            except OSError:
                if _complete(target):
                    return  # lost the race to a complete copy: fine
                # An incomplete leftover (an older build that died half-way): move it aside and retry.
                stale = target.parent / f".{target.name}.stale-{os.getpid()}-{attempt}"
                try:
                    os.rename(target, stale)
                except OSError:
                    pass
                shutil.rmtree(stale, ignore_errors=True)
        raise RuntimeError(f"could not install {name} into {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover - convenience: python -m recipes.tiny tiny-llama
    import sys

    for n in sys.argv[1:] or list(BUILTIN_MODELS):
        print(resolve_model_path(n))
