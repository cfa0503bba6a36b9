"""What a request body must look like before any engine sees it: only what protects the router.

A gateway in front of vLLM must not refuse what vLLM accepts, so sampling
fields, ranges and message shapes are the engine's to judge (its 400 is
relayed as it sent it). The router checks only what it needs itself:

- the body's size (handler.py) and nesting: deeper than MAX_DEPTH levels, a JSON
  depth bomb would exhaust a decoder's recursion;
- the types of the keys it reads (`RoutedFields`): `model` a string of at most
  MAX_MODEL_NAME characters without control characters, `stream` a boolean.

`RoutedFields` doubles as the schema of the OpenAPI document
(`llmgw.router.http.openapi`), so the document says exactly what is enforced.
"""

from __future__ import annotations

import re
from itertools import accumulate

import msgspec

from llmgw import config
from llmgw.router.http.errors import RouterError

MAX_DEPTH = 64
MAX_MODEL_NAME = 256

ABSENT = msgspec.Raw()  # a key the body does not have


class RoutedFields(msgspec.Struct):
    """The keys the router itself reads from a JSON body; all others pass through unread.

    `stream` must be a boolean, since the router picks its deadlines by it. The
    token allowances stay raw: admission reads a number from them if it can, and
    the engine judges the value (vLLM takes `max_tokens: 10.0`).
    """

    model: str | None = None
    stream: bool | None = None
    max_tokens: msgspec.Raw = ABSENT
    max_completion_tokens: msgspec.Raw = ABSENT
    max_output_tokens: msgspec.Raw = ABSENT
    # Raw: the engine judges it (vLLM: a non-empty string); the KV-event scorer keys a
    # prompt's first block by it, as vLLM does, when it is a non-empty string.
    cache_salt: msgspec.Raw = ABSENT
    # Raw: prefix affinity hashes the prompt's bytes as sent.
    messages: msgspec.Raw = ABSENT
    prompt: msgspec.Raw = ABSENT
    input: msgspec.Raw = ABSENT


# ---------------------------------------------------------------- nesting depth

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [0] * 256
for _ch in b"[{":
    _DEPTH_STEP[_ch] = 1
for _ch in b"]}":
    _DEPTH_STEP[_ch] = -1


def depth(body: bytes) -> int:
    """How deep the JSON in `body` nests, brackets inside strings not counted; 0 if it
    cannot exceed MAX_DEPTH (the common case costs two counts)."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return 0
    # Escaped backslashes and quotes out first, then every other piece between quotes
    # is outside a string.
    flat = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = b"".join(flat.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, skeleton)), default=0)


def check_depth(body: bytes) -> None:
    if depth(body) > MAX_DEPTH:
        raise RouterError(
            400, "too_deep", f"request body nests deeper than {MAX_DEPTH} levels of JSON"
        )


# ---------------------------------------------------------------- fields

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_model(model: str) -> None:
    if len(model) > MAX_MODEL_NAME or _CONTROL.search(model):
        raise RouterError(
            400,
            "invalid_model",
            f"model: must be at most {MAX_MODEL_NAME} characters, without control characters",
            param="model",
        )


def field_error(exc: msgspec.ValidationError, prefix: str = "") -> RouterError:
    """A 400 naming the field msgspec found wrong, e.g. `temperature` or `messages[3].role`."""
    message, at = config.split_validation_error(exc)
    path = (prefix + (at or "")).lstrip(".")
    if not path:
        return RouterError(400, "invalid_request", f"request body: {message}")
    return RouterError(400, "invalid_request", f"{path}: {message}", param=path)
