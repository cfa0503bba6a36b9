"""`/v1/embeddings`: request parsing and deterministic vectors, in vLLM's shapes.

A vector depends only on its input: a unit vector of `embedding_dim` floats drawn from a
generator seeded by a hash of the input's bytes, so the same text always embeds the same way
and different texts (almost surely) differently. `dimensions` keeps the first N values and
renormalizes (a Matryoshka model's behaviour; vLLM refuses `dimensions` for other models).
`encoding_format: base64` is the float32 little-endian bytes, base64-encoded, as vLLM and
OpenAI send it (and as the openai SDK asks for by default).

Inputs: a string, a list of strings, a list of token ids, a list of token-id lists, or
(vLLM's chat-style embeddings) `messages`. Prompt tokens are counted like completions'.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
from typing import Any, Literal

import msgspec

from llmgw.chatprompt import content_text
from llmgw.simengine import tokens
from llmgw.simengine.protocol import ApiError, ChatMessage, decode_body

_encode = msgspec.json.encode


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Any] | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


_decoder = msgspec.json.Decoder(EmbeddingRequest)

_FORMATS = ("float", "base64")


def parse(
    body: bytes, served: frozenset[str], max_model_len: int, dim: int
) -> tuple[EmbeddingRequest, list[bytes]]:
    """The request and its inputs as prompt bytes; raises ApiError for anything wrong."""
    req = decode_body(_decoder, body)
    if req.model is None:
        raise ApiError(400, "you must provide a model parameter", param="model")
    if req.model not in served:
        raise ApiError(
            404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found"
        )
    if req.encoding_format not in _FORMATS:
        raise ApiError(
            400,
            f"encoding_format {req.encoding_format!r}: expected 'float' or 'base64'",
            param="encoding_format",
        )
    if req.dimensions is not None and not 1 <= req.dimensions <= dim:
        raise ApiError(
            400,
            f"dimensions must be between 1 and {dim}, got {req.dimensions}",
            param="dimensions",
        )
    if req.messages is not None:
        turns = [(m.role, content_text(m.content)) for m in req.messages]
        prompts = [tokens.render_chat(turns)] if turns else []
    elif req.input is None:
        raise ApiError(400, "one of `input` or `messages` is required", param="input")
    else:
        prompts = _inputs(req.input)
    if not prompts:
        raise ApiError(400, "You must pass at least one prompt", param="input")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ApiError(400, "The decoder prompt cannot be empty", param="input")
        n = tokens.count_tokens(prompt)
        if n > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"input[{i}] has {n} tokens. Please reduce the length of the input.",
                param="input",
                code="context_length_exceeded",
            )
    return req, prompts


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _ids(ids: list[int]) -> bytes:
    if not all(0 <= t < 2**32 for t in ids):
        raise ApiError(400, "input: token ids must be in [0, 2**32)", param="input")
    return tokens.pack_token_ids(ids)


def _inputs(value: str | list[Any]) -> list[bytes]:
    if isinstance(value, str):
        return [value.encode()]
    if not value:
        return []
    if _is_ids(value):
        return [_ids(value)]
    out = []
    for item in value:
        if isinstance(item, str):
            out.append(item.encode())
        elif _is_ids(item):
            out.append(_ids(item))
        else:
            raise ApiError(
                400,
                "input must be a string, a list of strings, a list of token ids or a list "
                "of token-id lists",
                param="input",
            )
    return out


def vector(prompt: bytes, dim: int, dimensions: int | None) -> list[float]:
    rng = random.Random(hashlib.blake2b(prompt, digest_size=8).digest())
    values = [rng.gauss(0.0, 1.0) for _ in range(dimensions or dim)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def _encoded(values: list[float], fmt: Literal["float", "base64"] | str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


def response(
    req: EmbeddingRequest, prompts: list[bytes], dim: int, rid: str, created: int
) -> bytes:
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": _encoded(vector(p, dim, req.dimensions), req.encoding_format),
        }
        for i, p in enumerate(prompts)
    ]
    n = sum(tokens.count_tokens(p) for p in prompts)
    return _encode(
        {
            "id": rid,
            "object": "list",
            "created": created,
            "model": req.model,
            "data": data,
            "usage": {
                "prompt_tokens": n,
                "total_tokens": n,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
    )
