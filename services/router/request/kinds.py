"""The API kinds the router relays: their paths, body form and end-of-stream rule.

Every kind is routed the same way (by the model its body names, through
admission and scheduling) and relayed by the same upstream attempt; what
differs is pure data, here. A stream is complete only when its kind's last
event arrived: chat and completions (and vLLM's streamed transcriptions) end
with `data: [DONE]`, the Responses API with a terminal `event:` and no
`[DONE]`. A stream that stops before that was cut, and the client is told so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from llmgw.router.http.errors import error_event
from llmgw.router.relay import continuation

_DONE = b"data: [DONE]\n\n"
_RESPONSE_ENDS = (
    b"event: response.completed\n",
    b"event: response.failed\n",
    b"event: response.incomplete\n",
    b"event: error\n",
)
_encode = msgspec.json.Encoder().encode


def _ends_with_done(out: bytes) -> bool:
    return out.endswith(_DONE)


def _ends_with_response_end(out: bytes) -> bool:
    """The last event of `out` (whole events only) is one the Responses API ends with."""
    i = out.rfind(b"\n\n", 0, len(out) - 2)
    return out.startswith(_RESPONSE_ENDS, 0 if i < 0 else i + 2)


def _response_error(reason: str, message: str, status: int) -> bytes:
    # The Responses API's own error event: the SDK raises on `event: error` with `error`.
    data = {
        "type": "error",
        "code": reason,
        "message": message,
        "param": None,
        "error": {"type": "server_error", "code": reason, "message": message},
    }
    return b"event: error\ndata: " + _encode(data) + b"\n\n"


@dataclass(frozen=True, slots=True)
class StreamRule:
    """How a kind's stream ends, and the in-band error that ends one cut short."""

    ended: Callable[[bytes], bool]
    error_event: Callable[[str, str, int], bytes]


DONE_RULE = StreamRule(_ends_with_done, error_event)
RESPONSES_RULE = StreamRule(_ends_with_response_end, _response_error)


@dataclass(frozen=True, slots=True)
class ApiKind:
    name: str
    paths: tuple[str, ...]
    stream: StreamRule | None  # None: never streams
    prompt_key: str = ""  # the raw field prefix affinity hashes
    multipart: bool = False  # the model is a form field, not a JSON key
    salted: bool = False  # vLLM keys its prefix cache by the body's `cache_salt`
    # How a stream cut after its first byte continues on another replica; None: it cannot.
    continuation: continuation.Continuation | None = None


CHAT = ApiKind(
    "chat",
    ("/v1/chat/completions",),
    DONE_RULE,
    "messages",
    salted=True,
    continuation=continuation.CHAT,
)
COMPLETIONS = ApiKind(
    "completions",
    ("/v1/completions",),
    DONE_RULE,
    "prompt",
    salted=True,
    continuation=continuation.COMPLETIONS,
)
EMBEDDINGS = ApiKind("embeddings", ("/v1/embeddings",), None)
RESPONSES = ApiKind("responses", ("/v1/responses",), RESPONSES_RULE, "input", salted=True)
TRANSCRIPTIONS = ApiKind(
    "transcriptions",
    ("/v1/audio/transcriptions", "/v1/audio/translations"),
    DONE_RULE,
    multipart=True,
)
TOKENIZE = ApiKind("tokenize", ("/tokenize",), None)
DETOKENIZE = ApiKind("detokenize", ("/detokenize",), None)
RERANK = ApiKind("rerank", ("/v1/rerank", "/rerank", "/v2/rerank"), None)
SCORE = ApiKind("score", ("/v1/score", "/score"), None)
POOLING = ApiKind("pooling", ("/pooling",), None)
CLASSIFY = ApiKind("classify", ("/classify",), None)

ALL = (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    TRANSCRIPTIONS,
    TOKENIZE,
    DETOKENIZE,
    RERANK,
    SCORE,
    POOLING,
    CLASSIFY,
)
BY_NAME = {k.name: k for k in ALL}
BY_PATH = {path: k for k in ALL for path in k.paths}

# Stored responses (GET, DELETE, cancel, input_items) go to the endpoint that made them.
RESPONSES_PREFIX = "/v1/responses/"
