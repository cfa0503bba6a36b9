"""Scrapes each endpoint's /metrics into the view's load signals.

One task per endpoint, started and stopped as the view's endpoint set changes,
so a slow or dead endpoint delays only its own samples. A failed scrape keeps
the previous sample, which then ages into staleness (see ScrapeConfig).

As a fallback (control-plane mode, `fallback_only`), an endpoint is scraped
only while the agents' samples for it are late: older than half of
`stale_after_seconds`, so the scraper takes over before the load goes stale.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from llmgw.router.config import ScrapeConfig
from llmgw.router.endpoints.load import parse_metrics
from llmgw.router.endpoints.view import EndpointView
from llmgw.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


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
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64),
            timeout=aiohttp.ClientTimeout(total=self.settings.timeout_seconds),
        )
        self.view.subscribe(self._sync)
        self._sync()

    async def stop(self) -> None:
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
        for key in wanted:
            if key not in self._tasks:
                self._tasks[key] = asyncio.get_running_loop().create_task(self._run(*key))

    async def _run(self, endpoint_id: str, url: str) -> None:
        assert self._session is not None
        interval = self.settings.interval_seconds
        target = url + "/metrics"
        failing = False
        covering: bool | None = None  # fallback mode: the agents' samples are late, we scrape
        late_after = self.settings.stale_after_seconds / 2
        while True:
            began = time.monotonic()
            if self.fallback_only:
                ep = self.view.endpoints.get(endpoint_id)
                late = ep is None or began - ep.pushed_at > late_after
                if late != covering:
                    log.log(
                        logging.DEBUG if covering is None else logging.INFO,
                        "load samples for %s %s",
                        endpoint_id,
                        "are late: scraping its /metrics" if late else "flow: scraping stops",
                    )
                    covering = late
                if not late:
                    await asyncio.sleep(interval)
                    continue
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
            if error is not None:
                self.metrics.scrape_errors.inc((endpoint_id,))
                if not failing:
                    log.warning("scrape of %s failed: %s", endpoint_id, error)
            elif failing:
                log.info("scrape of %s works again", endpoint_id)
            failing = error is not None
            self.view.update_load(endpoint_id, load, error)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))
