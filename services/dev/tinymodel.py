"""A tiny random-weight Llama that a real vLLM serves, made locally (nothing downloaded).

Run it with the Python of a vLLM environment (where transformers, tokenizers and
torch live), by path; it imports nothing from llmgw:

    /path/to/vllm-venv/bin/python services/dev/tinymodel.py OUT_ROOT

It prints the model directory, OUT_ROOT/tiny-llama-<digest>, where the digest is
that of this file: a directory made by the same recipe is reused, a changed recipe
makes a new one. The directory is built beside its final name and renamed into
place, so an interrupted build is never mistaken for a model.

From llmgw's own environment, `ensure(python, out_root)` returns the directory,
running this file under `python` only when the directory is missing.

The recipe: a byte-level BPE tokenizer trained with `tokenizers` on a fixed text
(vocab 512) with a chat template, and `LlamaConfig(hidden_size=128,
num_attention_heads=2)`, so head_dim is 64 (vLLM's CPU attention refuses 16), two
layers, float32, fixed seed. About half a megabyte; vLLM on two CPU cores serves it
in ~80 ms per 16-token completion.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
# Renders tools too (vLLM passes `tools` to the template), so a tool request is a
# well-formed prompt; the model's answer to it is random bytes all the same.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def model_dir(out_root: str | os.PathLike) -> Path:
    return Path(out_root) / f"tiny-llama-{digest()}"


def _corpus() -> list[str]:
    words = (
        "the a an of to in and is was for on with as by at from that this it be are or "
        "hello world model engine token request stream router agent replica node cluster "
        "once upon a time there was a small llama who served requests very quickly "
        "def return import class self value list dict print true false none "
        '{ } [ ] ( ) : , . ; " = + - * / 0 1 2 3 4 5 6 7 8 9 function arguments name'
    ).split()
    # Deterministic: the same text, so the same merges, every build.
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(24)) for i in range(400)]


def build(out: Path) -> None:
    """Write the tokenizer, config and random weights into `out` (which must exist)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8192,  # room for long streams in tests
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)


def make(out_root: str | os.PathLike) -> Path:
    """The model directory under `out_root`, built now unless a complete one is there."""
    final = model_dir(out_root)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another build finished first: use that one
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure(python: str, out_root: str | os.PathLike, timeout: float = 600.0) -> Path:
    """From any Python: the model directory, built under `python` (a vLLM environment's)
    only when it is not there yet."""
    final = model_dir(out_root)
    if (final / "config.json").exists():
        return final
    res = subprocess.run(
        [python, __file__, str(out_root)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    if res.returncode != 0 or not (final / "config.json").exists():
        raise RuntimeError(
            f"building the tiny model with {python} failed (exit {res.returncode}):\n"
            + (res.stderr or res.stdout)[-3000:]
        )
    return final


if __name__ == "__main__":
    # Run by path, this file's directory heads sys.path; its sibling modules (config,
    # logs, ...) must not shadow what transformers imports.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here]
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(f"usage: {sys.argv[0]} OUT_ROOT  (prints the model directory)", file=sys.stderr)
        sys.exit(2)
    print(make(sys.argv[1]))
