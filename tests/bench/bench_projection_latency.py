"""How long an endpoint change takes to reach every router, in control-plane mode.

    .venv/bin/python tests/bench/bench_projection_latency.py [--routers 3] [--changes 50]

Starts a NATS server (JetStream) and N `llmgw router` processes with
`nats_url`, then writes the endpoint record of one model `changes` times,
each time with a different endpoint set, as the reconciler would. For each
change and each router it measures the time from just before the KV put to
the moment the router's /debug/endpoints shows the new set (polled every
millisecond or so, per router, concurrently). Prints p50, p99 and max over
all (change, router) pairs; PASS when p99 < 1 s.

The polling shares the 2 CPUs with the routers and NATS, so the figures are
an upper bound on what a router needs (the watch itself is sub-millisecond).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmgw import bus, projection
from llmgw import contracts as c
from llmgw.dev import servers as localservers
from llmgw.dev.routerkit import RouterProcess, start_router

MODEL = "m"
TARGET_P99 = 1.0


def endpoint_set(i: int) -> c.ModelEndpoints:
    # Engines need not exist: the router only has to learn the set (scraping is off).
    ids = [f"e{i}-{k}" for k in range(3)]
    return c.ModelEndpoints(
        model=MODEL,
        endpoints=[c.Endpoint(id=e, url=f"http://127.0.0.1:{9 + k}") for k, e in enumerate(ids)],
    )


async def visible(http: httpx.AsyncClient, router: RouterProcess, want: set[str]) -> float:
    while True:
        body = (await http.get(router.admin_url + "/debug/endpoints")).json()
        if {e["id"] for e in body["endpoints"]} == want:
            return time.perf_counter()
        await asyncio.sleep(0.001)


async def run(routers: int, changes: int, directory: Path) -> int:
    server = localservers.NatsServer(directory / "nats").start()
    procs: list[RouterProcess] = []
    try:
        nc = await bus.connect(server.url, "bench", wait_for_server=False)
        js = nc.jetstream()
        await bus.provision(js)
        kv = await js.key_value(projection.ENDPOINTS_BUCKET)
        await kv.put(projection.model_key(MODEL), c.encode(endpoint_set(0)))
        yaml = f"nats_url: {server.url}\nscrape: {{enabled: false}}\nlog_level: warning\n"
        procs = await asyncio.gather(
            *(
                asyncio.to_thread(start_router, directory, yaml + f"router_id: bench-{i}\n")
                for i in range(routers)
            )
        )
        latencies: list[float] = []
        async with httpx.AsyncClient(timeout=10) as http:
            for i in range(1, changes + 1):
                rec = endpoint_set(i)
                want = {e.id for e in rec.endpoints}
                began = time.perf_counter()
                watchers = [asyncio.create_task(visible(http, p, want)) for p in procs]
                await kv.put(projection.model_key(MODEL), c.encode(rec))
                seen = await asyncio.wait_for(asyncio.gather(*watchers), timeout=30)
                latencies += [t - began for t in seen]
        await bus.close_quietly(nc)
    finally:
        for p in procs:
            p.stop()
        server.stop()

    latencies.sort()
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    print(f"routers: {routers}   changes: {changes}   samples: {len(latencies)}")
    print(
        f"KV put -> visible in a router: p50 {p50 * 1000:.1f} ms   p99 {p99 * 1000:.1f} ms   "
        f"max {latencies[-1] * 1000:.1f} ms"
    )
    ok = p99 < TARGET_P99
    print(
        f"{'PASS' if ok else 'FAIL'}: p99 {p99 * 1000:.1f} ms (target < {TARGET_P99 * 1000:.0f} ms)"
    )
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=int, default=3)
    parser.add_argument("--changes", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-projection-") as d:
        return asyncio.run(run(args.routers, args.changes, Path(d)))


if __name__ == "__main__":
    sys.exit(main())
