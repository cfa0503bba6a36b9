"""A tiny random LoRA adapter for the tiny Llama (tinymodel.py), made locally in pure Python.

Real vLLM tests need an adapter to load at run time, and nothing may be downloaded.
vLLM reads two files of a PEFT adapter: `adapter_config.json` and
`adapter_model.safetensors`. Both are simple enough to write without peft, torch or
safetensors (peft is not in the vLLM environment; the safetensors format is an 8-byte
header length, a JSON header and raw little-endian tensors), so this runs in llmgw's
own environment.

The recipe: rank 8 (or `rank`), alpha twice the rank, on every layer's q_proj and v_proj, shapes read from the
model's config.json; lora_A and lora_B both random (PEFT initialises B to zeros, which
would make the adapter a no-op), drawn from `seed`. Different seeds answer differently
under greedy decoding, so a test can tell which adapter answered.

`make(model_dir, out_root, seed, rank)` returns OUT_ROOT/tiny-lora-<digest>, where the
digest covers this file, the model's config, the seed and the rank: the same recipe is reused, a changed
one makes a new directory, built beside its final name and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
import sys
import tempfile
from array import array
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "v_proj")
# Small weights: a noticeable change to the base model's output, never NaN or inf.
SCALE = 0.1


def _shapes(model_config: dict) -> dict[str, tuple[int, int]]:
    """Each target projection's (in_features, out_features) for the model's config."""
    hidden = model_config["hidden_size"]
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or hidden // heads
    kv_heads = model_config.get("num_key_value_heads") or heads
    return {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv_heads * head_dim)}


def digest(model_dir: str | Path, seed: int, rank: int) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update((Path(model_dir) / "config.json").read_bytes())
    h.update(f"{seed}/{rank}".encode())
    return h.hexdigest()[:12]


def adapter_dir(
    model_dir: str | Path, out_root: str | Path, seed: int = 0, rank: int = RANK
) -> Path:
    return Path(out_root) / f"tiny-lora-{digest(model_dir, seed, rank)}"


def tensors(
    model_config: dict, seed: int, rank: int = RANK
) -> dict[str, tuple[tuple[int, int], array]]:
    """PEFT's tensor names -> (shape, float32 values, row-major), for every layer."""
    rng = random.Random(seed)
    shapes = _shapes(model_config)
    out: dict[str, tuple[tuple[int, int], array]] = {}
    for layer in range(model_config["num_hidden_layers"]):
        for target in TARGETS:
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            for part, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                values = array("f", (rng.gauss(0.0, SCALE) for _ in range(shape[0] * shape[1])))
                out[f"{prefix}.{part}.weight"] = (shape, values)
    return out


def safetensors_bytes(named: dict[str, tuple[tuple[int, int], array]]) -> bytes:
    """The safetensors encoding of float32 tensors (little-endian, offsets in the header)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks = []
    offset = 0
    for name, (shape, values) in named.items():
        if sys.byteorder == "big":  # the format is little-endian
            values = array("f", values)
            values.byteswap()
        data = values.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(head)) + head + b"".join(chunks)


def adapter_config(model_dir: str | Path, rank: int = RANK) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def make(model_dir: str | Path, out_root: str | Path, seed: int = 0, rank: int = RANK) -> Path:
    """The adapter directory under `out_root`, built now unless a complete one is there."""
    final = adapter_dir(model_dir, out_root, seed, rank)
    if (final / "adapter_model.safetensors").exists():
        return final
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        config = adapter_config(model_dir, rank)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        (tmp / "adapter_model.safetensors").write_bytes(
            safetensors_bytes(tensors(model_config, seed, rank))
        )
        try:
            tmp.rename(final)
        except OSError:  # another build finished first: use that one
            if not (final / "adapter_model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
