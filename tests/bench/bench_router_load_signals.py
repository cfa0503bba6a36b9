"""What a router's load signals cost: agents' samples over NATS versus scraping /metrics.

    .venv/bin/python tests/bench/bench_router_load_signals.py [--endpoints 32] [--seconds 8]

One `llmgw router` process in control-plane mode holds a model with N endpoints
(all on one sim engine, so each scrape is a real /metrics page). Phase 1: a
publisher sends each endpoint's LoadSample every 250 ms, as agents do; the
router should not scrape at all. Phase 2: the samples stop; the router falls
back to scraping every endpoint every 200 ms. For each phase: router CPU
(user + system, from /proc) per wall second, and scrapes made. Also: how long
after the last sample the fallback starts (target: within stale_after / 2 plus
one scrape interval, 0.7 s with the defaults).

PASS when phase 1 makes no scrape, the fallback starts in time, and samples
cost the router less CPU than scraping.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmgw import bus, projection, subjects
from llmgw import contracts as c
from llmgw.dev import servers as localservers
from llmgw.dev.routerkit import RouterProcess, start_router
from llmgw.dev.simkit import start_sim

MODEL = "m"
SAMPLE_INTERVAL = 0.25
FALLBACK_TARGET = 0.7


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def scrapes(http: httpx.AsyncClient, router: RouterProcess) -> float:
    text = (await http.get(router.admin_url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgw_router_scrapes_total{")
    )


async def publish_samples(nc, endpoints: list[c.Endpoint], stop: asyncio.Event) -> float:
    """Publish until stopped; returns when the last round went out (monotonic)."""
    last = time.monotonic()
    while not stop.is_set():
        for ep in endpoints:
            sample = c.LoadSample(node="n1", shard_id=ep.id, model=MODEL, url=ep.url, running=1)
            await nc.publish(subjects.load("n1"), c.encode(sample))
        await nc.flush()
        last = time.monotonic()
        await asyncio.sleep(SAMPLE_INTERVAL)
    return last


async def run(n: int, seconds: float, directory: Path) -> int:
    server = localservers.NatsServer(directory / "nats").start()
    sim = start_sim(model=MODEL)
    router = None
    try:
        nc = await bus.connect(server.url, "bench", wait_for_server=False)
        js = nc.jetstream()
        await bus.provision(js)
        endpoints = [c.Endpoint(id=f"e{i}", url=sim.url) for i in range(n)]
        kv = await js.key_value(projection.ENDPOINTS_BUCKET)
        await kv.put(
            projection.model_key(MODEL),
            c.encode(c.ModelEndpoints(model=MODEL, endpoints=endpoints)),
        )
        stop = asyncio.Event()
        publisher = asyncio.create_task(publish_samples(nc, endpoints, stop))
        router = await asyncio.to_thread(
            start_router, directory, f"nats_url: {server.url}\nlog_level: warning\n"
        )
        pid = router.proc.pid
        async with httpx.AsyncClient(timeout=10) as http:
            await asyncio.sleep(1.0)  # settle: every endpoint has its samples
            rows = []
            for phase in ("samples", "scraping"):
                if phase == "scraping":
                    stop.set()
                    stopped = await publisher
                    base = await scrapes(http, router)
                    while await scrapes(http, router) < base + n and time.monotonic() - stopped < 5:
                        await asyncio.sleep(0.01)
                    fallback_after = time.monotonic() - stopped
                    await asyncio.sleep(0.5)
                s0, t0, w0 = await scrapes(http, router), cpu_seconds(pid), time.monotonic()
                await asyncio.sleep(seconds)
                s1, t1, w1 = await scrapes(http, router), cpu_seconds(pid), time.monotonic()
                rows.append((phase, (t1 - t0) / (w1 - w0), (s1 - s0) / (w1 - w0)))
        await bus.close_quietly(nc)
    finally:
        if router is not None:
            router.stop()
        sim.stop()
        server.stop()

    print(f"endpoints: {n}   seconds per phase: {seconds:g}")
    print(f"{'load signal':<12} {'router CPU':>12} {'scrapes/s':>10}")
    for phase, cpu, rate in rows:
        print(f"{phase:<12} {cpu * 100:>11.1f}% {rate:>10.1f}")
    print(f"fallback scraping started {fallback_after * 1000:.0f} ms after the last sample")
    checks = {
        "no scrape while samples flow": rows[0][2] == 0,
        f"fallback within {FALLBACK_TARGET * 1000:.0f} ms": fallback_after < FALLBACK_TARGET,
        "samples cost less CPU than scraping": rows[0][1] < rows[1][1],
    }
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    return 0 if all(checks.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-load-signals-") as d:
        return asyncio.run(run(args.endpoints, args.seconds, Path(d)))


if __name__ == "__main__":
    sys.exit(main())
