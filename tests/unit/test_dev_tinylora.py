"""The tiny LoRA adapter: PEFT's file layout and tensor shapes for the tiny Llama, made
without torch, and one directory per recipe."""

import json
import struct

from llmgw.dev import tinylora

TINY_LLAMA = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}


def _read_safetensors(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def test_the_adapter_has_peft_tensor_names_and_shapes(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    out = tinylora.make(model, tmp_path / "adapters", seed=1)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert config["target_modules"] == ["q_proj", "v_proj"]
    raw = (out / "adapter_model.safetensors").read_bytes()
    header = _read_safetensors(raw)
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    assert header[f"{prefix}.lora_A.weight"]["shape"] == [8, 128]
    assert header[f"{prefix}.lora_B.weight"]["shape"] == [128, 8]
    assert len([k for k in header if k != "__metadata__"]) == 2 * 2 * 2
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    (n,) = struct.unpack("<Q", raw[:8])
    assert len(raw) == 8 + n + end and n % 8 == 0
    # The same recipe is reused; another seed is another adapter.
    assert tinylora.make(model, tmp_path / "adapters", seed=1) == out
    other = tinylora.make(model, tmp_path / "adapters", seed=2)
    assert other != out
    assert (other / "adapter_model.safetensors").read_bytes() != raw
    wide = tinylora.make(model, tmp_path / "adapters", seed=1, rank=16)
    assert json.loads((wide / "adapter_config.json").read_text())["r"] == 16
    header = _read_safetensors((wide / "adapter_model.safetensors").read_bytes())
    assert header[f"{prefix}.lora_A.weight"]["shape"] == [16, 128]
