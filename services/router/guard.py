"""What may interrupt a request: a deadline passing, or its client going away.

Both act the same way, by cancelling the request's task, and the request tells
them apart by the guard's flags. One timer per request serves both, and it is
re-armed lazily: moving a deadline later (the idle watchdog does so after every
event) is a float store, and the timer, when it fires early, simply sets
itself for the new time. A streamed request therefore costs one timer, not one
per event.

Watching for the client leaving needs a task blocked in ASGI `receive()`. It is
started only once a request has run for `watch_after` seconds: most requests
to a fast upstream finish sooner, and a client that leaves earlier is noticed
when the watcher starts (so "at once" means within `watch_after`).
"""

from __future__ import annotations

import asyncio

_TOLERANCE = 0.001  # uvloop's clock ticks in milliseconds; a timer may fire a tick early


class Guard:
    __slots__ = (
        "_loop",
        "_task",
        "_receive",
        "_watch_at",
        "_watcher",
        "_timer",
        "_timer_at",
        "_phase",
        "_phase_at",
        "_closed",
        "fired",
        "client_gone",
        "total_at",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, task: asyncio.Task, receive, watch_after: float
    ):
        self._loop = loop
        self._task = task
        self._receive = receive
        self._watcher: asyncio.Task | None = None
        self._phase = ""
        self._phase_at = float("inf")
        self._closed = False
        self.fired: str | None = None  # the phase whose deadline passed
        self.client_gone = False
        self.total_at = float("inf")  # loop time of the request's total deadline
        self._watch_at = loop.time() + watch_after
        self._timer_at = self._watch_at
        self._timer: asyncio.TimerHandle | None = loop.call_at(self._watch_at, self._wake)

    def arm(self, phase: str, seconds: float) -> None:
        """From now on, cancel the task `seconds` from now (naming `phase`), or at the
        total deadline (naming "total") if that comes first."""
        at = self._loop.time() + seconds
        if at >= self.total_at:
            at = self.total_at
            phase = "total"
        self._phase = phase
        self._phase_at = at
        if at < self._timer_at:
            self._set_timer(at)

    def no_deadline(self) -> None:
        self._phase_at = float("inf")

    def close(self) -> None:
        """The request is over: nothing may cancel its task any more."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def _set_timer(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        if self._closed:
            return
        now = self._loop.time() + _TOLERANCE
        if self._watcher is None and now >= self._watch_at:
            self._watcher = self._loop.create_task(self._watch())
        if now >= self._phase_at:
            self.fired = self._phase
            self._phase_at = float("inf")
            self._task.cancel()
            return
        nxt = self._phase_at if self._watcher is not None else min(self._phase_at, self._watch_at)
        if nxt != float("inf"):
            self._set_timer(nxt)

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self._closed:
                    self.client_gone = True
                    self._task.cancel()
                return
