"""What the router reads from a request body, and the 400s for what is wrong with it.

The body goes upstream unchanged; the router decodes only the few keys it
routes on. `messages` / `prompt` stay raw JSON: their bytes are the prompt the
prefix scorer hashes, with no re-serialisation.
"""

from __future__ import annotations

import msgspec

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

_EMPTY = msgspec.Raw()


class _Head(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    messages: msgspec.Raw = _EMPTY
    prompt: msgspec.Raw = _EMPTY
    input: msgspec.Raw = _EMPTY
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _UsageHolder(msgspec.Struct):
    usage: Usage | None = None


_decode_head = msgspec.json.Decoder(_Head).decode
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
    try:
        head = _decode_head(body)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        param = None
        if " - at `$." in msg:
            msg, _, path = msg.partition(" - at `$.")
            param = path.rstrip("`")
            raise RouterError(400, "invalid_request", f"{param}: {msg}", param=param) from None
        raise RouterError(400, "invalid_request", f"request body: {msg}") from None
    except msgspec.DecodeError as exc:
        raise RouterError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not head.model:
        raise RouterError(400, "missing_model", "you must provide a model parameter", param="model")
    key = _REQUIRED[kind]
    raw = bytes(getattr(head, key))
    if not raw or raw == b"null":
        raise RouterError(400, "invalid_request", f"{key} is required", param=key)
    if kind == CHAT and raw[:1] != b"[":
        raise RouterError(400, "invalid_request", "messages must be an array", param="messages")
    limit = head.max_tokens if head.max_completion_tokens is None else head.max_completion_tokens
    return Parsed(
        kind, head.model, bool(head.stream), raw if kind != EMBEDDINGS else b"", body, limit
    )


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
