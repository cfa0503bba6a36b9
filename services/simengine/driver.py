"""Runs the engine's step loop in real time and wakes the handlers whose requests progressed.

One task, owned by the app's lifespan, calls `engine.step(now)` whenever work falls due or an
input arrives. Steps due at the same instant (all of them, with zero simulated latency) run
back to back, up to a burst limit, before handlers are woken: a request then gets its tokens
in one wake-up and one write instead of one per token, which is what keeps a zero-latency
simulator fast.
"""

from __future__ import annotations

import asyncio
import logging

from llmgw.simengine.engine import Engine, Request
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Steps run without yielding to the event loop; bounds how long handlers and arrivals wait.
BURST_STEPS = 64

_TIMER = object()


def _release(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


class Driver:
    def __init__(self, engine: Engine, burst: int = BURST_STEPS):
        self.engine = engine
        self._burst = burst
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None
        # Set if the step loop died of a bug: /health then answers 503, as vLLM's does when
        # its engine core is gone.
        self.failure: BaseException | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="simengine-steps")
        self._task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()
            log.error("engine step loop died; requests will not progress", exc_info=self.failure)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def submit(self, req: Request) -> None:
        self.engine.add(req, self._loop.time())
        self._kick()

    def abort(self, req: Request) -> None:
        self.engine.abort(req)
        self._kick()

    def _kick(self) -> None:
        if self._wake is not None:
            _release(self._wake, None)

    async def _run(self) -> None:
        loop = self._loop
        engine = self.engine
        now = loop.time()
        while True:
            touched = engine.step(now)
            nxt = engine.next_step_at()
            steps = 1
            while nxt is not None and nxt <= now and steps < self._burst:
                touched += engine.step(now)
                nxt = engine.next_step_at()
                steps += 1
            for req in touched:
                if req.waiter is not None:
                    _release(req.waiter, None)
            if nxt is not None and nxt <= now:
                await asyncio.sleep(0)
                now = loop.time()
                continue
            self._wake = wake = loop.create_future()
            timer = loop.call_at(nxt, _release, wake, _TIMER) if nxt is not None else None
            try:
                reason = await wake
            finally:
                self._wake = None
                if timer is not None:
                    timer.cancel()
            now = loop.time()
            if reason is _TIMER and now < nxt:
                # Timers may fire a hair early; the work they were set for is due.
                now = nxt
