"""Cross-origin access for browser clients (off unless `cors.allow_origins` is set).

A preflight (`OPTIONS` with `Access-Control-Request-Method`) from an allowed
origin is answered here with 204, before authentication: browsers send it
without credentials. Every other answer to an allowed origin gets
`Access-Control-Allow-Origin` and the response headers a client reads
(request id, rate limits, Retry-After) exposed. A request from any other
origin is served as if CORS were off: the browser then refuses the answer.
"""

from __future__ import annotations

from llmgw.router.config import CorsConfig

_METHODS = b"GET, POST, DELETE, OPTIONS"
_EXPOSE = (
    b"x-request-id, x-llmgw-endpoint, x-llmgw-reason, retry-after, retry-after-ms, "
    b"x-ratelimit-limit-requests, x-ratelimit-remaining-requests, x-ratelimit-reset-requests, "
    b"x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens"
)


class Cors:
    def __init__(self, config: CorsConfig):
        self.any_origin = "*" in config.allow_origins
        self.origins = frozenset(o.encode() for o in config.allow_origins)
        self.any_header = "*" in config.allow_headers
        self.allow_headers = ", ".join(config.allow_headers).encode()
        self.max_age = str(config.max_age_seconds).encode()

    def allowed(self, origin: bytes) -> bool:
        return self.any_origin or origin in self.origins

    def preflight_headers(
        self, origin: bytes, requested: bytes | None
    ) -> list[tuple[bytes, bytes]]:
        allow = requested if self.any_header else self.allow_headers
        headers = [
            (b"access-control-allow-origin", origin),
            (b"access-control-allow-methods", _METHODS),
            (b"access-control-max-age", self.max_age),
            (b"vary", b"Origin"),
            (b"content-length", b"0"),
        ]
        if allow:
            headers.append((b"access-control-allow-headers", allow))
        return headers

    def wrap(self, origin: bytes, send):
        """`send` with the CORS headers added to the response start."""
        extra = [
            (b"access-control-allow-origin", origin),
            (b"access-control-expose-headers", _EXPOSE),
            (b"vary", b"Origin"),
        ]

        async def cors_send(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return cors_send
