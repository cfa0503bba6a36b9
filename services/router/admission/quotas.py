"""Per-tenant quotas: requests per minute, tokens per minute, concurrent requests.

Minute windows are 60 one-second buckets in a ring: O(1) per request, fixed
memory per tenant, and a Retry-After exact to the second in which enough of
the window expires. Token use is recorded at admission as an estimate (prompt
plus max_tokens) and corrected once the engine reports actual usage.

Each router enforces limit // routers (at least 1), where `routers` is how many
routers share the global quota, as the presence bucket counts them (presence.py);
the x-ratelimit headers still state the tenant's own limit (`TenantQuotas.headers`).
"""

from __future__ import annotations

import math

from llmgw import contracts

from .errors import AdmissionRejected

WINDOW = 60  # seconds


class MinuteWindow:
    """A sum over the last 60 whole seconds; what was added in second s expires at s + 60."""

    __slots__ = ("_buckets", "_head", "total")

    def __init__(self) -> None:
        self._buckets = [0] * WINDOW
        self._head = 0  # the latest second the ring has advanced to
        self.total = 0

    def advance(self, now: float) -> int:
        sec = int(now)
        if sec > self._head:
            if sec - self._head >= WINDOW:
                self._buckets = [0] * WINDOW
                self.total = 0
            else:
                for s in range(self._head + 1, sec + 1):
                    i = s % WINDOW
                    self.total -= self._buckets[i]
                    self._buckets[i] = 0
            self._head = sec
        return self._head

    def add(self, now: float, amount: int) -> int:
        """Record `amount` now; returns the second it was recorded in (for `adjust`)."""
        sec = self.advance(now)
        self._buckets[sec % WINDOW] += amount
        self.total += amount
        return sec

    def adjust(self, sec: int, delta: int, now: float) -> None:
        """Correct an earlier `add`; a no-op once that second has left the window."""
        head = self.advance(now)
        if head - WINDOW < sec <= head:
            self._buckets[sec % WINDOW] += delta
            self.total += delta

    def seconds_until(self, now: float, room: int) -> int:
        """Whole seconds until total <= room, as the oldest seconds expire (>= 1)."""
        head = self.advance(now)
        freed = 0
        for s in range(head - WINDOW + 1, head + 1):
            freed += self._buckets[s % WINDOW]
            if self.total - freed <= room:
                return max(1, math.ceil(s + WINDOW - now))
        return WINDOW

    def seconds_until_empty(self, now: float) -> int:
        """`seconds_until(now, 0)` in O(1) under steady traffic: buckets never go below
        zero (a correction replaces its own estimate), so the window is empty once its
        latest non-empty second expires, and under load that is the current one. The
        x-ratelimit-reset headers ask this of every request."""
        head = self.advance(now)
        buckets = self._buckets
        for s in range(head, head - WINDOW, -1):
            if buckets[s % WINDOW]:
                return max(1, math.ceil(s + WINDOW - now))
        return WINDOW


def share(limit: int | None, routers: int) -> int | None:
    return None if limit is None else max(1, limit // routers)


class TenantQuotas:
    """One tenant's usage against its quotas, on this router."""

    __slots__ = (
        "rpm",
        "tpm",
        "concurrency",
        "requests",
        "tokens",
        "in_flight",
        "declared",
        "routers",
    )

    def __init__(self, quotas: contracts.Quotas, routers: int = 1) -> None:
        self.requests = MinuteWindow()
        self.tokens = MinuteWindow()
        self.in_flight = 0
        self.set_limits(quotas, routers)

    def set_limits(self, quotas: contracts.Quotas, routers: int) -> None:
        self.declared = quotas  # the tenant's own limits, which the headers state
        self.routers = routers
        self.rpm = share(quotas.rpm, routers)
        self.tpm = share(quotas.tpm, routers)
        self.concurrency = share(quotas.concurrency, routers)

    def _limit(self, declared: int | None, enforced: int) -> str:
        """A limit as the client knows it (the tenant's, as the headers state it), and
        this router's share when the routers split it."""
        if self.routers <= 1 or declared is None or declared == enforced:
            return f"limit {enforced}"
        return f"limit {declared}, {enforced} of it on this router of {self.routers}"

    def acquire(self, now: float, tokens: int) -> int:
        """Count one request of ~`tokens` or raise 429; returns the second to correct later."""
        if self.rpm is not None:
            self.requests.advance(now)
            if self.requests.total + 1 > self.rpm:
                wait = self.requests.seconds_until(now, self.rpm - 1)
                raise AdmissionRejected(
                    "rate_limit_rpm",
                    f"Rate limit reached on requests per minute (RPM): "
                    f"{self._limit(self.declared.rpm, self.rpm)}. "
                    f"Please try again in {wait}s.",
                    retry_after=wait,
                )
        # A call that costs no tokens (about a stored response) is not held back by tpm.
        if self.tpm is not None and tokens > 0:
            if tokens > self.tpm:
                raise AdmissionRejected(
                    "request_too_large",
                    f"Request too large for tokens per minute (TPM): "
                    f"{self._limit(self.declared.tpm, self.tpm)}, "
                    f"requested {tokens} (prompt estimate plus max_tokens). "
                    "Reduce the prompt or max_tokens.",
                )
            self.tokens.advance(now)
            if self.tokens.total + tokens > self.tpm:
                wait = self.tokens.seconds_until(now, self.tpm - tokens)
                raise AdmissionRejected(
                    "rate_limit_tpm",
                    f"Rate limit reached on tokens per minute (TPM): "
                    f"{self._limit(self.declared.tpm, self.tpm)}, "
                    f"used {self.tokens.total}, requested {tokens}. "
                    f"Please try again in {wait}s.",
                    retry_after=wait,
                )
        if self.concurrency is not None and self.in_flight >= self.concurrency:
            # When a request will finish is unknowable; one second is a polite retry pace.
            raise AdmissionRejected(
                "rate_limit_concurrency",
                f"Rate limit reached on concurrent requests: "
                f"{self._limit(self.declared.concurrency, self.concurrency)}. "
                "Please try again in 1s.",
                retry_after=1,
            )
        self.in_flight += 1
        self.requests.add(now, 1)
        return self.tokens.add(now, tokens)

    def headers(self, now: float) -> list[tuple[bytes, bytes]]:
        """x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the limits this
        tenant has, as OpenAI sends them (reset: when the window has room for the
        full limit again, e.g. "12s").

        A client reads its own limit there, so `limit` is the tenant's, not this
        router's share. `remaining` is this router's share left, times the router
        count: the load balancer spreads a client's requests evenly, so the other
        routers have about as much left, and it reaches 0 exactly when this router
        starts refusing. Capped at the limit, which a share rounded up to 1 exceeds.
        """
        out: list[tuple[bytes, bytes]] = []
        for unit, limit, enforced, window in (
            (b"requests", self.declared.rpm, self.rpm, self.requests),
            (b"tokens", self.declared.tpm, self.tpm, self.tokens),
        ):
            if limit is None or enforced is None:
                continue
            window.advance(now)
            used = window.total
            reset = 0 if used <= 0 else window.seconds_until_empty(now)
            remaining = min(limit, max(0, enforced - used) * self.routers)
            out.append((b"x-ratelimit-limit-" + unit, str(limit).encode()))
            out.append((b"x-ratelimit-remaining-" + unit, str(remaining).encode()))
            out.append((b"x-ratelimit-reset-" + unit, f"{reset}s".encode()))
        return out

    def release(self, now: float, sec: int, estimated: int, actual: int | None) -> None:
        """The request ended; `actual` tokens replace the estimate when known."""
        self.in_flight -= 1
        if actual is not None and actual != estimated:
            self.tokens.adjust(sec, actual - estimated, now)
