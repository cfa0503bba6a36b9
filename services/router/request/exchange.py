"""One client exchange: its request id, headers, guard, body, and every byte sent back.

The proxy decides; this object does the client side of the I/O. It knows
whether anything reached the client yet (`started`: after that, no status
change, and no retry but a continuation of the stream, when its model allows
migration and `sent` tracks what the stream has said; else only an in-band
error event), and it puts the same headers on every answer: `x-request-id`
always, the admitted request's rate-limit headers, the endpoint that answered.
"""

from __future__ import annotations

import re

from starlette.types import Receive, Send

from llmgw.router.http.errors import RouterError
from llmgw.router.relay.continuation import Sent
from llmgw.router.request.body import Usage
from llmgw.router.request.guard import DeadlinePassed, Guard
from llmgw.router.request.kinds import DONE_RULE, StreamRule

_RID_OK = re.compile(rb"[\x21-\x7e]{1,128}").fullmatch
_JSON = b"application/json"
_NO_CACHE = (b"cache-control", b"no-cache")
TRACE_HEADERS = (b"traceparent", b"tracestate")


def request_id(headers: dict[bytes, bytes], new) -> bytes:
    rid = headers.get(b"x-request-id")
    return rid if rid is not None and _RID_OK(rid) else new()


class Exchange:
    __slots__ = (
        "rid",
        "t0",
        "headers",
        "guard",
        "receive",
        "send",
        "started",
        "status",
        "endpoint",
        "usage",
        "extra",
        "model",
        "owner",
        "sent",
        "prefilling",
    )

    def __init__(
        self,
        rid: bytes,
        t0: float,
        headers: dict[bytes, bytes],
        guard: Guard,
        receive: Receive,
        send: Send,
    ):
        self.rid = rid
        self.t0 = t0
        self.headers = headers
        self.guard = guard
        self.receive = receive
        self.send = send
        self.started = False  # bytes reached the client: only a continuation may follow
        self.status = 0
        self.endpoint = ""
        self.usage: Usage | None = None
        self.extra: list[tuple[bytes, bytes]] = []  # headers for every answer (rate limits)
        self.model = ""
        self.owner: str | None = None  # the tenant its stored responses belong to
        # What a migratable stream has sent, so another replica can continue it.
        self.sent: Sent | None = None
        # Counted in its endpoint's `prefilling` until its stream's first event.
        self.prefilling = False

    def upstream_headers(self, base: dict[str, str]) -> dict[str, str]:
        """`base` plus the W3C trace context the client sent, for the engine."""
        headers = self.headers
        if b"traceparent" not in headers and b"tracestate" not in headers:
            return base
        out = dict(base)
        for name in TRACE_HEADERS:
            value = headers.get(name)
            if value is not None:
                out[name.decode()] = value.decode("latin-1")
        return out

    # ------------------------------------------------------------ request body

    async def read_body(self, limit: int, seconds: float) -> bytes | None:
        """The whole body, or None if the client left while sending it."""
        declared = self.headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise RouterError(
                    400, "invalid_request", "content-length is not a number"
                ) from None
            if size > limit:
                raise RouterError(
                    413, "body_too_large", f"request body of {size} bytes exceeds {limit} bytes"
                )
        chunks = []
        total = 0
        receive = self.receive
        guard = self.guard
        guard.reading(seconds)
        try:
            with guard:
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None
                    chunk = message.get("body", b"")
                    if chunk:
                        total += len(chunk)
                        if total > limit:
                            raise RouterError(
                                413, "body_too_large", f"request body exceeds {limit} bytes"
                            )
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except DeadlinePassed:
            # The rest of the body may still arrive: the connection cannot be reused.
            raise RouterError(
                408,
                "body_timeout",
                f"request body not received within {seconds}s",
                headers=[(b"connection", b"close")],
            ) from None
        finally:
            guard.read_done()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # ------------------------------------------------------------ answers

    async def answer(self, status: int, ctype: bytes, body: bytes, endpoint: str) -> None:
        """A whole answer in one go (a non-streamed response)."""
        self.started = True
        self.status = status
        self.endpoint = endpoint
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", ctype or _JSON),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", self.rid),
                    (b"x-llmgw-endpoint", endpoint.encode()),
                    *self.extra,
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def start_stream(self, ctype: bytes, endpoint: str) -> None:
        self.started = True
        self.status = 200
        self.endpoint = endpoint
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", ctype),
                    _NO_CACHE,
                    (b"x-request-id", self.rid),
                    (b"x-llmgw-endpoint", endpoint.encode()),
                    *self.extra,
                ],
            }
        )

    async def end_stream(self, tail: bytes = b"") -> None:
        await self.send({"type": "http.response.body", "body": tail, "more_body": False})

    async def fail(self, err: RouterError, rule: StreamRule | None = None) -> None:
        """Answer `err`: as the response if nothing was sent yet, else as the stream's
        last event (in the API kind's own error shape)."""
        self.status = err.status
        if self.started:
            rule = rule or DONE_RULE
            await self.end_stream(rule.error_event(err.reason, err.message, err.status))
            return
        body = err.body()
        await self.send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", _JSON),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-llmgw-reason", err.reason.encode()),
                    (b"x-request-id", self.rid),
                    *self.extra,
                    *err.headers,
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
