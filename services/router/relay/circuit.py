"""Passive health: a per-endpoint circuit breaker driven by real traffic.

Consecutive failures (connect errors, 5xx, deadline misses) open the circuit;
while open the endpoint gets no requests. After the cool-down one request is let
through as a probe: its success closes the circuit, its failure opens it for
another cool-down. Pure: the caller passes the time (or, for a `verdict`, the
clock to read it from).
"""

from __future__ import annotations

from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class Circuit:
    __slots__ = ("threshold", "cooldown", "state", "consecutive", "opened_at", "probing")

    def __init__(self, threshold: int, cooldown: float):
        self.threshold = threshold
        self.cooldown = cooldown
        self.state = CLOSED
        self.consecutive = 0
        self.opened_at = 0.0
        self.probing = False  # the half-open probe is in flight

    def allows(self, now: float) -> bool:
        state = self.state
        if state is CLOSED:
            return True
        if state is OPEN:
            return now >= self.opened_at + self.cooldown
        return not self.probing

    def dispatched(self, now: float) -> None:
        """A request was sent; after the cool-down it becomes the one probe."""
        if self.state is OPEN and now >= self.opened_at + self.cooldown:
            self.state = HALF_OPEN
        if self.state is HALF_OPEN:
            self.probing = True

    def success(self) -> None:
        self.state = CLOSED
        self.consecutive = 0
        self.probing = False

    def failure(self, now: float) -> None:
        self.consecutive += 1
        if self.state is HALF_OPEN or (self.state is CLOSED and self.consecutive >= self.threshold):
            self.state = OPEN
            self.opened_at = now
        self.probing = False

    def abandoned(self) -> None:
        """The request ended with no verdict (the client left): let another probe go."""
        self.probing = False

    def verdict(self, clock: Callable[[], float]) -> Verdict:
        """One request's verdict, as a context: dispatched on entry, given on exit."""
        return Verdict(self, clock)

    def describe(self, now: float) -> dict:
        out: dict = {"state": self.state, "consecutive_failures": self.consecutive}
        if self.state is OPEN:
            out["retry_in_s"] = round(max(0.0, self.opened_at + self.cooldown - now), 3)
        return out


class Verdict:
    """What one request says of its endpoint, given when the request ends however it ends.

    `healthy` is True (the engine answered), False (it failed: the next cool-down
    counts it), or None, the default, for no verdict: the engine was only busy, or
    the client left or ran out of budget, which says nothing of the engine.
    """

    __slots__ = ("circuit", "clock", "healthy")

    def __init__(self, circuit: Circuit, clock: Callable[[], float]):
        self.circuit = circuit
        self.clock = clock
        self.healthy: bool | None = None

    def __enter__(self) -> Verdict:
        self.circuit.dispatched(self.clock())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        healthy = self.healthy
        if healthy is True:
            self.circuit.success()
        elif healthy is False:
            self.circuit.failure(self.clock())
        else:
            self.circuit.abandoned()
