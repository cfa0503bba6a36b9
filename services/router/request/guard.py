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

Code that awaits under the guard does so inside `with guard:`. Leaving that
block by the guard's own cancellation raises one exception instead: a
`DeadlinePassed` naming the phase, or `ClientGone`; the task is uncancelled
there, and nowhere else. A cancellation the guard did not cause (the server
stopping) passes through unchanged.

The same timer bounds reading the request body (`reading`/`read_done`): a
client that declares more bytes than it sends, or trickles them, is cut off.
While the body is read the watcher is held back, since it would compete for
`receive()` and swallow body chunks; a body read sooner than `watch_after`
(nearly all of them) costs no timer operation at all.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive

_TOLERANCE = 0.001  # uvloop's clock ticks in milliseconds; a timer may fire a tick early


class Interrupted(Exception):
    """The guard stopped the request's current await."""


class DeadlinePassed(Interrupted):
    def __init__(self, phase: str):
        super().__init__(f"{phase} deadline passed")
        self.phase = phase


class ClientGone(Interrupted):
    pass


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
        "_reading",
        "fired",
        "client_gone",
        "total_at",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        task: asyncio.Task,
        receive: Receive,
        watch_after: float,
    ):
        self._loop = loop
        self._task = task
        self._receive = receive
        self._watcher: asyncio.Task | None = None
        self._phase = ""
        self._phase_at = float("inf")
        self._closed = False
        self._reading = False
        self.fired: str | None = None  # the phase whose deadline passed
        self.client_gone = False
        self.total_at = float("inf")  # loop time of the request's total deadline
        self._watch_at = loop.time() + watch_after
        self._timer_at = self._watch_at
        self._timer: asyncio.TimerHandle | None = loop.call_at(self._watch_at, self._wake)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not asyncio.CancelledError:
            return
        if self.client_gone:
            self._task.uncancel()
            raise ClientGone("the client went away") from None
        phase = self.fired
        if phase is not None:
            self.fired = None
            self._task.uncancel()
            raise DeadlinePassed(phase) from None

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

    def reading(self, seconds: float) -> None:
        """The request body is being read: it must arrive within `seconds`."""
        self._reading = True
        self.arm("body_read", seconds)

    def read_done(self) -> None:
        """The body is in (or its read failed): lift its deadline and let the watcher start."""
        self._reading = False
        self._phase_at = float("inf")
        if self._watcher is None and self._timer_at > self._watch_at:
            # The watch time passed while reading: the timer now fires at once.
            self._set_timer(self._watch_at)

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
        if self._watcher is None and not self._reading and now >= self._watch_at:
            self._watcher = self._loop.create_task(self._watch())
        if now >= self._phase_at:
            self.fired = self._phase
            self._phase_at = float("inf")
            self._task.cancel()
            return
        if self._watcher is not None or self._reading:
            nxt = self._phase_at
        else:
            nxt = min(self._phase_at, self._watch_at)
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
