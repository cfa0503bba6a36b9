"""What the router reads from a request body, and the 400s for what is wrong with it.

The body goes upstream unchanged; the router decodes only the few keys it
routes on. `messages` / `prompt` stay raw JSON: their bytes are the prompt the
prefix scorer hashes, with no re-serialisation.
"""

from __future__ import annotations

import msgspec

from llmgw.router import validation as v
from llmgw.router.errors import RouterError

CHAT = "chat"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"

KINDS = (CHAT, COMPLETIONS, EMBEDDINGS)
PATHS = {
    CHAT: "/v1/chat/completions",
    COMPLETIONS: "/v1/completions",
    EMBEDDINGS: "/v1/embeddings",
}


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _UsageHolder(msgspec.Struct):
    usage: Usage | None = None


# Each kind's fields, typed and range-checked (llmgw.router.validation).
_decode_head = {
    CHAT: msgspec.json.Decoder(v.ChatRequest).decode,
    COMPLETIONS: msgspec.json.Decoder(v.CompletionRequest).decode,
    EMBEDDINGS: msgspec.json.Decoder(v.EmbeddingRequest).decode,
}
_decode_usage = msgspec.json.Decoder(_UsageHolder).decode

# The key each kind of request cannot do without, and what its value must look like.
_REQUIRED = {CHAT: "messages", COMPLETIONS: "prompt", EMBEDDINGS: "input"}


class Parsed:
    __slots__ = ("kind", "model", "stream", "prompt", "body", "max_tokens")

    def __init__(
        self,
        kind: str,
        model: str,
        stream: bool,
        prompt: bytes,
        body: bytes,
        max_tokens: int | None = None,
    ):
        self.kind = kind
        self.model = model
        self.stream = stream
        self.prompt = prompt  # raw JSON of messages / prompt: what prefix affinity hashes
        self.body = body
        self.max_tokens = max_tokens  # the completion allowance admission counts against tpm


def parse(kind: str, body: bytes) -> Parsed:
    v.check_depth(body)  # before any decoder recurses into it
    try:
        head = _decode_head[kind](body)
    except msgspec.ValidationError as exc:
        raise v.field_error(exc) from None
    except msgspec.DecodeError as exc:
        raise RouterError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not head.model:
        raise RouterError(400, "missing_model", "you must provide a model parameter", param="model")
    v.check_model(head.model)
    key = _REQUIRED[kind]
    raw = bytes(getattr(head, key))
    if not raw or raw == b"null":
        raise RouterError(400, "invalid_request", f"{key} is required", param=key)
    if kind == CHAT:
        if raw[:1] != b"[":
            raise RouterError(400, "invalid_request", "messages must be an array", param="messages")
        v.check_messages(raw)
    else:
        v.check_prompt(raw, key)
    if kind == EMBEDDINGS:
        return Parsed(kind, head.model, False, b"", body, None)
    limit = head.max_tokens
    if kind == CHAT and head.max_completion_tokens is not None:
        limit = head.max_completion_tokens
    return Parsed(kind, head.model, bool(head.stream), raw, body, limit)


def with_model(body: bytes, model: str) -> bytes:
    """The body with `model` replaced: for aliases and fallbacks, which the engine
    knows only by the canonical name."""
    data = msgspec.json.decode(body)
    data["model"] = model
    return msgspec.json.encode(data)


def usage_of(data: bytes) -> Usage | None:
    """The usage object of a JSON response body or stream chunk, if it has one."""
    try:
        return _decode_usage(data).usage
    except msgspec.DecodeError:
        return None
