"""What a request body must look like before any engine sees it: limits and typed fields.

The router relays bodies unchanged and passes unknown fields through (engines
have their own extensions), but the fields it knows are checked for type and
range here, so a bad value is a 400 naming the field rather than whatever an
engine makes of it. Limits keep one request from costing the router (or an
engine's JSON parser) more than a request should:

- nesting deeper than MAX_DEPTH levels (a JSON depth bomb otherwise exhausts
  the decoder's recursion);
- more than MAX_MESSAGES chat messages;
- model names longer than MAX_MODEL_NAME or holding control characters.

The request structs double as the schemas of the OpenAPI document
(`llmgw.router.openapi`), so the document says exactly what is enforced.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from llmgw import config
from llmgw.router.errors import RouterError

MAX_DEPTH = 64
MAX_MESSAGES = 2048
MAX_MODEL_NAME = 256

_EMPTY = msgspec.Raw()

Temperature = Annotated[float, Meta(ge=0, le=2, description="sampling temperature, 0 to 2")]
TopP = Annotated[float, Meta(ge=0, le=1, description="nucleus sampling mass, 0 to 1")]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Tokens = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Choices = Annotated[int, Meta(ge=1, le=128)]
LogprobCount = Annotated[int, Meta(ge=0, le=20)]
Bias = Annotated[float, Meta(ge=-100, le=100)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Sampling(msgspec.Struct):
    """Fields chat and completions share."""

    model: str | None = None
    stream: bool | None = None
    max_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Choices | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    user: str | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Bias] | None = None


class ChatRequest(_Sampling):
    messages: msgspec.Raw = _EMPTY  # kept raw: its bytes are what prefix affinity hashes
    max_completion_tokens: Tokens | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None


class CompletionRequest(_Sampling):
    prompt: msgspec.Raw = _EMPTY
    logprobs: LogprobCount | None = None
    echo: bool | None = None
    best_of: Choices | None = None
    suffix: str | None = None


class EmbeddingRequest(msgspec.Struct):
    model: str | None = None
    input: msgspec.Raw = _EMPTY
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None


class Message(msgspec.Struct):
    """What the router checks of a chat message; content and the rest go to the engine."""

    role: str


Messages = Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
# A string, a list of strings, token ids, or lists of token ids (batched prompts).
Prompt = str | Annotated[list[str | int | list[int]], Meta(min_length=1)]

_decode_messages = msgspec.json.Decoder(Messages).decode
_decode_prompt = msgspec.json.Decoder(Prompt).decode

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


def check_messages(raw: bytes) -> None:
    try:
        _decode_messages(raw)
    except msgspec.ValidationError as exc:
        raise field_error(exc, "messages") from None


def check_prompt(raw: bytes, key: str) -> None:
    try:
        _decode_prompt(raw)
    except msgspec.ValidationError as exc:
        raise field_error(exc, key) from None
