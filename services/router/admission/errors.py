"""Admission refusals as OpenAI-shaped errors.

Each refusal carries its HTTP status, a stable reason (sent as `x-llmgw-reason`
and used as the metrics label) and the headers a client acts on: `Retry-After`
for 429, which the openai SDK honours, and `x-should-retry: false` where
retrying cannot help.
"""

from __future__ import annotations

from llmgw.router.http.errors import RouterError, error_body

# reason -> (status, OpenAI error type, OpenAI error code)
REASONS: dict[str, tuple[int, str, str | None]] = {
    "missing_api_key": (401, "invalid_request_error", "missing_api_key"),
    "invalid_api_key": (401, "invalid_request_error", "invalid_api_key"),
    "rate_limit_rpm": (429, "requests", "rate_limit_exceeded"),
    "rate_limit_concurrency": (429, "requests", "rate_limit_exceeded"),
    # OpenAI reports token limits with type "tokens"; the SDK keys its retry on the status.
    "rate_limit_tpm": (429, "tokens", "rate_limit_exceeded"),
    "request_too_large": (429, "tokens", "rate_limit_exceeded"),
    "queue_full": (503, "server_error", "queue_full"),
    "queue_timeout": (504, "server_error", "queue_timeout"),
    # Scaled to zero and the control plane cannot place a replica now.
    "no_replica": (503, "server_error", "no_replica"),
    # A LoRA adapter no replica had loaded by the end of the request's queue TTL.
    "adapter_not_loaded": (503, "server_error", "adapter_not_loaded"),
}


class AdmissionRejected(RouterError):
    """A request admission refused. The router answers it like any RouterError: `status`,
    `x-llmgw-reason: <reason>`, `headers` (bytes pairs) and `body()`."""

    def __init__(self, reason: str, message: str, retry_after: int | None = None):
        status, self.type, self.code = REASONS[reason]
        headers: list[tuple[bytes, bytes]] = []
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if reason == "request_too_large":
            headers.append((b"x-should-retry", b"false"))
        super().__init__(status, reason, message, headers=headers)
        self.retry_after = retry_after

    def body(self) -> bytes:
        return error_body(
            self.status, self.reason, self.message, error_type=self.type, code=self.code
        )
