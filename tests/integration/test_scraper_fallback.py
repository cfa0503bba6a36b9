"""The fallback scraper (control-plane mode): engines whose agents' samples flow are
left alone, at a cost that does not grow with the fleet; one whose samples stop is
scraped over a real socket within the lateness bound, until its samples flow again."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from llmgw.contracts import Endpoint, ModelEndpoints
from llmgw.router.config import ScrapeConfig
from llmgw.router.endpoints.scraper import Scraper
from llmgw.router.endpoints.view import EndpointView
from llmgw.router.metrics import RouterMetrics

METRICS = b"""# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 5.0
"""
ENGINES = 200
SECONDS = 1.5


async def metrics_server() -> tuple[web.AppRunner, str, list[float]]:
    hits: list[float] = []

    async def metrics(_: web.Request) -> web.Response:
        hits.append(time.monotonic())
        return web.Response(body=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", hits


def fallback_scraper(endpoints: list[Endpoint], stale_after: float) -> Scraper:
    """A control-plane router's scraper over a view of `endpoints`, polling every 0.05 s."""
    view = EndpointView()
    view.replace([ModelEndpoints(model="m", endpoints=endpoints)])
    settings = ScrapeConfig(interval_seconds=0.05, stale_after_seconds=stale_after)
    return Scraper(view, RouterMetrics(), settings, fallback_only=True)


async def test_samples_flowing_cost_no_wakeups_per_engine_and_a_silent_one_is_scraped():
    runner, url, hits = await metrics_server()
    # Every engine but e0 points at a closed port: a scrape of one would fail and count.
    eps = [Endpoint(id="e0", url=url)] + [
        Endpoint(id=f"e{i}", url=f"http://127.0.0.1:9/{i}") for i in range(1, ENGINES)
    ]
    # Late 0.5 s after a sample; samples come every 0.1 s: a stall of 0.4 s on a loaded
    # machine still leaves every engine fed.
    scraper = fallback_scraper(eps, stale_after=1.0)
    view, metrics, settings = scraper.view, scraper.metrics, scraper.settings

    def push(*ids: str) -> None:  # what SampleFeed does for an agent's sample
        now = time.monotonic()
        for i in ids:
            view.endpoints[i].pushed_at = now

    everyone = [f"e{i}" for i in range(ENGINES)]
    push(*everyone)
    await scraper.start()
    try:
        # Samples flow for all, every 0.1 s: nothing is scraped, and the watch wakes about
        # once per lateness bound, not once per engine.
        turns = scraper.watch_turns
        began = time.monotonic()
        while time.monotonic() - began < SECONDS:
            push(*everyone)
            await asyncio.sleep(0.1)
        woke = scraper.watch_turns - turns
        assert not hits and not scraper._tasks
        assert not metrics.scrapes.values, "an engine whose samples flow was scraped"
        # Each turn sleeps until the soonest sample would turn late, by when the next
        # push has landed: about a turn per push, 15 in 1.5 s; a poll per engine each
        # 0.05 s, as before the watch, would be 6,000.
        assert woke <= 40, woke

        # e0's samples stop: it is scraped within the lateness bound and a watch turn.
        stopped = time.monotonic()
        while not hits and time.monotonic() - stopped < 3:
            push(*everyone[1:])
            await asyncio.sleep(0.02)
        assert hits, "the engine whose samples stopped was never scraped"
        assert hits[0] - stopped < settings.stale_after_seconds / 2 + 0.5
        assert scraper.covering["e0"] is True
        assert view.endpoints["e0"].load is not None
        assert (view.endpoints["e0"].load.waiting, view.endpoints["e0"].load.running) == (3, 5)

        # Its samples flow again: the scraping stops.
        resumed = time.monotonic()
        while time.monotonic() - resumed < 1.0:
            push(*everyone)
            await asyncio.sleep(0.05)
        after = len(hits)
        for _ in range(5):
            push(*everyone)
            await asyncio.sleep(0.1)
        assert len(hits) == after and not scraper._tasks
        assert scraper.covering["e0"] is False
    finally:
        await scraper.stop()
        await runner.cleanup()


async def test_a_new_endpoint_without_samples_is_scraped_at_once():
    runner, url, hits = await metrics_server()
    scraper = fallback_scraper([Endpoint(id="a", url="http://127.0.0.1:9")], stale_after=10)
    view = scraper.view
    view.endpoints["a"].pushed_at = time.monotonic() + 3600  # its samples flow throughout
    await scraper.start()
    try:
        await asyncio.sleep(0.1)  # the watch now sleeps up to the 5 s lateness bound
        added = time.monotonic()
        view.replace(
            [
                ModelEndpoints(
                    model="m",
                    endpoints=[
                        Endpoint(id="a", url="http://127.0.0.1:9"),
                        Endpoint(id="b", url=url),
                    ],
                )
            ]
        )
        while not hits and time.monotonic() - added < 3:
            await asyncio.sleep(0.01)
        assert hits and hits[0] - added < 0.5  # not after the watch's 5 s sleep
    finally:
        await scraper.stop()
        await runner.cleanup()


async def test_the_watch_outlives_a_fault_in_a_turn():
    runner, url, hits = await metrics_server()
    scraper = fallback_scraper([Endpoint(id="a", url=url)], stale_after=0.2)
    late, faults = scraper._late, [RuntimeError("a fault in the watch's first turn")]

    def faulty(ep, now):
        if faults:
            raise faults.pop()
        return late(ep, now)

    scraper._late = faulty  # type: ignore[method-assign]
    await scraper.start()
    try:
        began = time.monotonic()
        while not hits and time.monotonic() - began < 3:
            await asyncio.sleep(0.01)
        assert not faults and hits, "a fault in one turn ended the fallback for good"
    finally:
        await scraper.stop()
        await runner.cleanup()
    assert scraper._watch is None and not scraper._tasks
