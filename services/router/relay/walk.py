"""Where a request may go next, and what the client hears when nothing answered.

Pure: no I/O, no clock of its own. The walk goes through the model's endpoints
(each picked by the model's scheduling pipeline, never one already tried, at
most `attempts_per_model` of them), then down the fallback chain, and stops at
a failure no further attempt can help (the total deadline passed). A stream
cut after its first byte and to be continued (`Failure.resume`) gets a fresh
`attempts_per_model` on the model it started on, and no fallbacks.

The failure policy: when every attempt ended because an engine was busy (429)
or timed the request out (408), the client gets that status and the soonest
Retry-After an engine gave, so code that catches `RateLimitError` and backs
off does the right thing. Otherwise the last failure's status (and its
Retry-After, when it has one). Messages for
the client never name an endpoint or quote an engine's body; the log does,
with the request id.

A LoRA adapter's request answered 404 by an engine the projection lists as holding the
adapter (`adapter_missing`) met a replica that unloaded it before its agent's report
reached this router: the 404 is an attempt failure like a 5xx, and the next attempt goes
to another holder. When none is left (or a later request finds the listed holders so
refuted) the outcome is the 503 `adapter_not_loaded` admission gives an adapter no
replica loads in time, never the engine's 404, which would read as "this model does not
exist", nor a bare `no_endpoint`; the handler first waits for a next holder
(request/holder.py).
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.router.endpoints.view import EndpointRuntime, ModelRoute
from llmgw.router.http.errors import RouterError
from llmgw.router.scheduling.pipeline import Context

TIMEOUT_STATUS = 504
BROKEN_STATUS = 502
BUSY = (408, 429)  # engine answers that mean "not now", relayed as they are
ADAPTER_MISSING_STATUS = 503
# Seconds a client is told to wait when every holder had unloaded its adapter: as long as
# admission tells one whose adapter was not loaded in time (placement acts within seconds).
ADAPTER_RETRY_AFTER = 5.0


class Failure:
    """An attempt that failed before anything reached the client, or (`resume`) one
    whose stream another endpoint of the same model is to continue."""

    __slots__ = ("kind", "message", "detail", "status", "final", "retry_after", "resume")

    def __init__(
        self,
        kind: str,
        message: str,
        status: int,
        *,
        detail: str = "",
        final: bool = False,
        retry_after: float | None = None,
    ):
        self.kind = kind
        self.message = message  # for the client: no endpoint ids, no engine bodies
        self.detail = detail  # for the log
        self.status = status  # what the client gets if no later attempt succeeds
        self.final = final  # no further attempt can help (the total deadline passed)
        self.retry_after = retry_after  # seconds, from an engine's Retry-After
        # The stream had started: the next attempt continues it (relay/continuation.py).
        self.resume = False


class Walk:
    """The attempts of one request, in order: `next`, then `failed` for each that failed."""

    __slots__ = (
        "route",
        "current",
        "lookup",
        "per_model",
        "tried",
        "attempts",
        "prepare",
        "failures",
        "_hop",
        "_left",
        "resuming",
    )

    def __init__(
        self,
        route: ModelRoute,
        lookup: Callable[[str], ModelRoute | None],
        per_model: int,
        tried: list[str],
        prepare: Callable[[Context, ModelRoute], None],
    ):
        self.route = route
        self.current: ModelRoute | None = route
        self.lookup = lookup
        self.per_model = per_model
        self.tried = tried  # the scheduling context's exclude list: never the same one twice
        self.attempts = 0
        self.prepare = prepare  # sets the context up for a model (name, prefix, session)
        self.failures: list[Failure] = []
        self._hop = 0
        self._left = per_model
        # A stream is being continued: only its own model's endpoints may take it up.
        self.resuming = False

    def next(self, ctx: Context, past_total: bool) -> EndpointRuntime | None:
        """The endpoint to try now (on `self.current`), or None when the walk is over."""
        if past_total:
            self.failures.append(
                Failure(
                    "total_timeout",
                    f"no answer within the total deadline of {self.route.deadlines.total}s",
                    TIMEOUT_STATUS,
                    final=True,
                )
            )
            return None
        current = self.current
        while current is not None:
            if self._left > 0:
                ep = current.pipeline.pick(current.endpoints, ctx)
                if ep is not None:
                    self._left -= 1
                    self.attempts += 1
                    return ep
            if self.resuming:
                return None
            current = self._advance()
            if current is not None:
                self.prepare(ctx, current)
        return None

    def _advance(self) -> ModelRoute | None:
        self.current = None
        chain = self.route.fallbacks
        while self._hop < len(chain) and self.current is None:
            self.current = self.lookup(chain[self._hop])
            self._hop += 1
        self._left = self.per_model
        return self.current

    def failed(self, ep: EndpointRuntime, failure: Failure) -> bool:
        """Record a failed attempt; False when the walk must stop here."""
        self.tried.append(ep.id)
        self.failures.append(failure)
        if failure.resume:
            # A continuation gets a fresh set of attempts, on the same model: another
            # model's text cannot carry on this one's.
            self.resuming = True
            self._left = self.per_model
        return not failure.final

    def outcome(self) -> RouterError:
        """The error the client gets once the walk is over without an answer."""
        route = self.route
        if not self.failures:
            if route.adapter_of and any(route.name not in ep.adapters for ep in route.endpoints):
                # Listed as holders, but each said it unloaded the adapter (upstream.py).
                return RouterError(
                    ADAPTER_MISSING_STATUS,
                    "adapter_not_loaded",
                    f"adapter '{route.name}' is not loaded on any replica now; it is being moved",
                    headers=[(b"retry-after", _seconds(ADAPTER_RETRY_AFTER))],
                )
            chain = route.fallbacks
            return RouterError(
                503,
                "no_endpoint",
                f"no endpoint is available for model '{route.name}'"
                + (f" or its fallbacks ({', '.join(chain)})" if chain else ""),
            )
        n = self.attempts
        after = f" (after {n} attempt{'s' if n != 1 else ''})"
        if all(f.status in BUSY for f in self.failures):
            status = 429 if any(f.status == 429 for f in self.failures) else 408
            waits = [f.retry_after for f in self.failures if f.retry_after is not None]
            headers = []
            if waits:
                wait = min(waits)
                headers.append((b"retry-after", _seconds(wait)))
                headers.append((b"retry-after-ms", str(int(wait * 1000)).encode()))
            last = next(f for f in reversed(self.failures) if f.status == status)
            return RouterError(status, last.kind, last.message + after, headers=headers)
        last = self.failures[-1]
        headers = []
        if last.retry_after is not None:
            headers.append((b"retry-after", _seconds(last.retry_after)))
        return RouterError(last.status, last.kind, last.message + after, headers=headers)


def adapter_missing(adapter: str, endpoint: str, status: int, body: bytes) -> Failure | None:
    """The Failure of an engine's answer saying it does not hold `adapter` (a 404 naming
    it: vLLM's "The model `a1` does not exist."), None for any other answer. A 404 that
    does not name the adapter (an unknown path, say) is the engine's to tell the client."""
    if status != 404 or adapter.encode() not in body:
        return None
    return Failure(
        "adapter_not_loaded",
        f"adapter '{adapter}' is not loaded on any replica that was tried; it is being moved",
        ADAPTER_MISSING_STATUS,
        detail=f"endpoint {endpoint} does not hold adapter {adapter}: {body[:300]!r}",
        retry_after=ADAPTER_RETRY_AFTER,
    )


def _seconds(wait: float) -> bytes:
    whole = int(wait)
    return str(whole if whole == wait else whole + 1).encode()


def retry_after(headers) -> float | None:
    """An engine's Retry-After (seconds; an HTTP date is not worth parsing here) or
    retry-after-ms, in seconds."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is not None:
        try:
            return max(0.0, float(value))
        except ValueError:
            return None
    return None
