"""Scrapes each endpoint's /metrics into the view's load signals.

One task per endpoint scraped, started and stopped as the view's endpoint set
changes, so a slow or dead endpoint delays only its own samples. A failed scrape
keeps the previous sample, which then ages into staleness (see ScrapeConfig).

As a fallback (control-plane mode, `fallback_only`), an endpoint is scraped only
while the agents' samples for it are late: older than half of
`stale_after_seconds`, so the scraper takes over before the load goes stale. One
watch looks at every endpoint's lateness, waking when the soonest sample would
turn late, and starts a scrape task for each endpoint that is; the task ends
when samples flow again. A task per endpoint that woke to ask would cost each
router five wake-ups a second per engine at rest: thousands on a large fleet.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from llmgw.router.config import ScrapeConfig
from llmgw.router.endpoints.load import parse_metrics
from llmgw.router.endpoints.view import EndpointRuntime, EndpointView
from llmgw.router.metrics import RouterMetrics
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

WATCH_FLOOR = 0.01  # seconds: the watch's shortest sleep


class Scraper:
    def __init__(
        self,
        view: EndpointView,
        metrics: RouterMetrics,
        settings: ScrapeConfig,
        *,
        fallback_only: bool = False,
    ):
        self.view = view
        self.metrics = metrics
        self.settings = settings
        self.fallback_only = fallback_only
        self.late_after = settings.stale_after_seconds / 2
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._watch: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self.covering: dict[str, bool] = {}  # endpoint id -> scraped for late samples
        self._failing: set[str] = set()  # endpoints whose last scrape failed
        self.watch_turns = 0  # the watch's wake-ups (tests)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64),
            timeout=aiohttp.ClientTimeout(total=self.settings.timeout_seconds),
        )
        self.view.subscribe(self._sync)
        self._sync()
        if self.fallback_only:
            self._watch = asyncio.get_running_loop().create_task(self._watch_lateness())

    async def stop(self) -> None:
        if self._watch is not None:
            await cancel_and_wait(self._watch)
            self._watch = None
        self.covering.clear()
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _sync(self) -> None:
        if self._session is None:
            return
        wanted = {(ep.id, ep.url) for ep in self.view.endpoints.values()}
        for key in list(self._tasks):
            if key not in wanted:
                self._tasks.pop(key).cancel()
        if self.fallback_only:
            self._changed.set()  # the watch looks at the new set at once
            return
        for key in wanted:
            if key not in self._tasks:
                self._start(key)

    def _start(self, key: tuple[str, str]) -> None:
        self._tasks[key] = asyncio.get_running_loop().create_task(self._run(*key))

    def _late(self, ep: EndpointRuntime | None, now: float) -> bool:
        return ep is None or now - ep.pushed_at > self.late_after

    async def _watch_lateness(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.watch_turns += 1
            self._changed.clear()
            try:
                wait = self._watch_turn()
            except Exception:
                # The fallback must outlive a fault: a dead watch would leave every
                # engine unscraped exactly when the agents' samples stop.
                log.exception("the scraper's lateness watch failed; it goes on")
                wait = self.late_after
            # Wake when the soonest sample would turn late (a timer may fire a hair early:
            # the floor keeps that from spinning), or when the endpoints change. Not
            # asyncio.wait_for: on 3.11 it can swallow the cancel that stop() sends.
            timer = loop.call_later(max(WATCH_FLOOR, wait), self._changed.set)
            try:
                await self._changed.wait()
            finally:
                timer.cancel()

    def _watch_turn(self) -> float:
        """Start a scrape task for each endpoint whose samples are late; the seconds until
        the soonest of the others would turn late."""
        now = time.monotonic()
        soonest = self.late_after
        for ep in list(self.view.endpoints.values()):
            late = self._late(ep, now)
            was = self.covering.get(ep.id)
            if late != was:
                if late or was is not None:
                    log.log(
                        logging.DEBUG if was is None else logging.INFO,
                        "load samples for %s %s",
                        ep.id,
                        "are late: scraping its /metrics" if late else "flow: scraping stops",
                    )
                self.covering[ep.id] = late
            if late:
                if (ep.id, ep.url) not in self._tasks:
                    self._start((ep.id, ep.url))
            else:
                soonest = min(soonest, ep.pushed_at + self.late_after - now)
        for gone in self.covering.keys() - self.view.endpoints.keys():
            del self.covering[gone]
            self._failing.discard(gone)
        return soonest

    async def _run(self, endpoint_id: str, url: str) -> None:
        try:
            await self._scrape_loop(endpoint_id, url)
        except Exception:
            # In control-plane mode the watch starts it again; otherwise the next change of
            # the endpoint set does.
            log.exception("scraping %s failed", endpoint_id)
        finally:
            task = self._tasks.get((endpoint_id, url))
            if task is asyncio.current_task():
                del self._tasks[(endpoint_id, url)]

    async def _scrape_loop(self, endpoint_id: str, url: str) -> None:
        assert self._session is not None
        interval = self.settings.interval_seconds
        target = url + "/metrics"
        while True:
            began = time.monotonic()
            if self.fallback_only and not self._late(
                self.view.endpoints.get(endpoint_id), time.monotonic()
            ):
                return  # samples flow again: the watch starts a task if they stop
            self.metrics.scrapes.inc((endpoint_id,))
            error = None
            load = None
            try:
                async with self._session.get(target) as resp:
                    body = await resp.read()
                    if resp.status != 200:
                        error = f"/metrics answered {resp.status}"
                    else:
                        load = parse_metrics(body, time.monotonic())
                        if load is None:
                            error = "no known load gauges in /metrics"
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = f"{exc.__class__.__name__}: {exc}"[:200]
            # Whether it failed is kept across fallback episodes: an engine the router
            # cannot reach is one warning per outage, not one per episode.
            failing = endpoint_id in self._failing
            if error is not None:
                self.metrics.scrape_errors.inc((endpoint_id,))
                if not failing:
                    log.warning("scrape of %s failed: %s", endpoint_id, error)
                self._failing.add(endpoint_id)
            elif failing:
                log.info("scrape of %s works again", endpoint_id)
                self._failing.discard(endpoint_id)
            self.view.update_load(endpoint_id, load, error)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))
