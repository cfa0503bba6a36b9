"""OpenAI-shaped errors: one status, one reason, one body shape for every failure.

Every failure the router answers carries a precise HTTP status, an
`x-llmgw-reason` header with a short machine-readable reason, and a body the
official SDKs parse: {"error": {"message", "type", "param", "code"}}. Mid-stream
failures use the same body as one SSE event.
"""

from __future__ import annotations

import msgspec

_encode = msgspec.json.Encoder().encode

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    # OpenAI's type for a missing or wrong key; the SDK's AuthenticationError keys on 401.
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "timeout",
}


class RouterError(Exception):
    """A failure to answer with `status`; `reason` goes into x-llmgw-reason and `code`."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        *,
        param: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.param = param
        self.headers = headers or []

    def body(self) -> bytes:
        return error_body(self.status, self.reason, self.message, self.param)


def error_body(
    status: int,
    reason: str,
    message: str,
    param: str | None = None,
    *,
    error_type: str | None = None,
    code: str | None = None,
) -> bytes:
    """The body; `error_type` and `code` default to the status's type and the reason."""
    return _encode(
        {
            "error": {
                "message": message,
                "type": error_type or _TYPES.get(status, "server_error"),
                "param": param,
                "code": code or reason,
            }
        }
    )


def error_event(reason: str, message: str, status: int = 502) -> bytes:
    """The SSE tail that ends a stream that broke after its first byte.

    The openai SDK raises on an event with an `error` key, so the caller sees an
    exception rather than a silently short answer; `[DONE]` follows, as vLLM does,
    so clients that only look for the terminator still stop reading.
    """
    return b"data: " + error_body(status, reason, message) + b"\n\ndata: [DONE]\n\n"
