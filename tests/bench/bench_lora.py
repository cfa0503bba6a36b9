"""LoRA placement against loading wherever a request lands: adapter loads and TTFT.

Run: .venv/bin/python tests/bench/bench_lora.py [--warmup 60] [--seconds 120] [--rate 50]
(~8 min; --dump FILE writes the placed run's AdaptersPlaced events and adapter reports)

The same open-loop traffic (Poisson arrivals at --rate requests/s, each a streamed chat
request for one of 40 adapters drawn from a Zipf distribution of exponent 1.0, the usual
model of popularity across tenants, seeded, so both modes see the same sequence) goes to
two routers in two modes. The first --warmup seconds are not measured: the leader smooths
each adapter's demand with a 30 s half-life, so the first minute is a placement learning
what is popular (which a fleet does once), not its steady state. Then --seconds measured:

- placed: the local cluster `llmgw dev` runs (real reconcilers, agents, routers), a
  base model of 4 sim replicas with 4 adapter slots each (--max-loras 4) and the 40
  adapters declared in the catalog. The leader places adapters from the routers' demand;
  agents load them through the sims' runtime LoRA API; routers send a request only where
  its adapter is held, and hold it in admission while none is.
- baseline: the same 4 sims with --lora-on-demand (any adapter name is served, loaded
  into a least-recently-used slot on its first request there, as vLLM's LRU does with
  every adapter registered everywhere), behind two routers in router-only mode whose
  file declares every adapter name as a model served by all 4 sims: the router's default
  pipeline (in-flight and prefix scorers) puts each request wherever it likes, with no adapter
  filter, no affinity and no placement.

A load is an adapter brought into an engine's slot (`llmgw_sim_lora_loads_total`,
summed over the 4 sims): by the runtime API in placed mode, by a request in the baseline.
TTFT is measured by the client: from sending the request to the first content chunk, so
a placed request's wait in admission for its adapter counts. Each load costs
--lora-load-seconds 0.3: vLLM's CPU build took ~0.2-0.5 s per runtime load of the tiny
adapter here (docs/agent.md), and a GPU engine loading a rank-16 adapter of a 7-8B model
from local disk takes a few hundred milliseconds too.

Target (issue #22): placed loads per 1,000 requests at most a tenth of the baseline's,
and placed mean TTFT no worse than the baseline's. The last line printed is what no
placement of the 16 slots can beat on this traffic (_lora_frontier.py): the least mean
TTFT at a tenth of the baseline's loads, the fewest loads at the baseline's mean TTFT,
and how far the placed run is from the least mean TTFT at its own loads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

sys.path.insert(0, str(Path(__file__).parent))
from _lora_frontier import least_loads, least_mean_ttft, zipf_rates  # noqa: E402

from llmgw.dev.routerkit import metric_sum, start_router  # noqa: E402
from llmgw.dev.simkit import start_sim  # noqa: E402
from tests.e2e import clusterkit as ck  # noqa: E402

BASE = "lora-base"
ADAPTERS = [f"tenant-{i:02d}" for i in range(40)]
ZIPF_EXPONENT = 1.0
REPLICAS, SLOTS = 4, 4
LOAD_SECONDS = 0.3
TTFT_MS = 20  # the sims' own time to first token: every request's least TTFT
SIM_ARGS = {"itl_ms": 5, "ttft_ms": TTFT_MS, "max_loras": SLOTS, "lora_load_seconds": LOAD_SECONDS}
ENGINE_ARGS = ["--itl-ms", "5", "--ttft-ms", str(TTFT_MS), "--lora-load-seconds", str(LOAD_SECONDS)]
MAX_TOKENS = 4


@dataclass
class Outcome:
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "<adapter>@<offset>: <what>"
    start: float = field(default_factory=time.monotonic)


def schedule(seconds: float, rate: float, seed: int = 22) -> list[tuple[float, str]]:
    """(offset, adapter) for each request: Poisson arrivals, Zipf-ranked adapters."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** ZIPF_EXPONENT for rank in range(len(ADAPTERS))]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append((t, rng.choices(ADAPTERS, weights)[0]))


async def one_request(
    http: httpx.AsyncClient, router: str, key: str, adapter: str, n: int, out: Outcome
) -> None:
    body = {
        "model": adapter,
        "messages": [{"role": "user", "content": f"request {n} for {adapter}"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    started = time.monotonic()
    who = f"{adapter}@{started - out.start:.1f}s"
    try:
        async with http.stream(
            "POST",
            f"{router}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as resp:
            if resp.status_code != 200:
                out.errors.append(f"{who}: {resp.status_code} {(await resp.aread())[:200]!r}")
                return
            first = None
            async for line in resp.aiter_lines():  # read to the end: the engine finishes it
                if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("model") != adapter:
                    out.errors.append(f"{who}: answered as {chunk.get('model')!r}")
                    return
                if any(ch.get("delta", {}).get("content") for ch in chunk.get("choices", [])):
                    first = time.monotonic() - started
            if first is None:
                out.errors.append(f"{who}: the stream ended without content")
            else:
                out.ttfts.append(first)
    except httpx.HTTPError as exc:
        out.errors.append(f"{who}: {type(exc).__name__}: {exc}")


async def drive(
    routers: list[str], key: str, plan: list[tuple[float, str]], warmup: float, metrics: list[str]
) -> tuple[Outcome, float]:
    """Send each planned request at its time (open loop: a slow answer delays nobody); the
    requests sent from `warmup` on are measured, and the loads counted from then on."""
    warm, out = Outcome(), Outcome()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=90, limits=limits) as http:
        start = warm.start = out.start = time.monotonic()
        tasks, before = [], None
        for n, (offset, adapter) in enumerate(plan):
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            if before is None and offset >= warmup:
                before = await asyncio.to_thread(loads, metrics)
            router = routers[n % len(routers)]
            into = out if offset >= warmup else warm
            tasks.append(asyncio.create_task(one_request(http, router, key, adapter, n, into)))
        await asyncio.gather(*tasks)
    for err in warm.errors[:3]:
        print(f"  (warm-up) {err[:160]}")
    return out, await asyncio.to_thread(loads, metrics) - (before or 0.0)


def loads(metrics_urls: list[str]) -> float:
    return sum(
        metric_sum(httpx.get(f"{u}/metrics", timeout=5).text, "llmgw_sim_lora_loads_total")
        for u in metrics_urls
    )


def run_baseline(
    tmp: Path, plan: list[tuple[float, str]], warmup: float, dump: None = None
) -> tuple[Outcome, float]:
    sims = [start_sim("--lora-on-demand", model=BASE, **SIM_ARGS) for _ in range(REPLICAS)]
    routers = []
    try:
        names = [BASE, *ADAPTERS]
        config = {
            "log_level": "warning",
            "models": [{"name": n} for n in names],
            "endpoints": [
                {"id": f"sim-{i}", "url": s.url, "models": names, "engine": "sim"}
                for i, s in enumerate(sims)
            ],
        }
        routers = [start_router(tmp, yaml.safe_dump(config)) for _ in range(2)]
        urls = [f"{r.url}/v1" for r in routers]
        return asyncio.run(drive(urls, "none", plan, warmup, [s.url for s in sims]))
    finally:
        for r in routers:
            r.stop()
        for s in sims:
            s.stop()


def placed_catalog(cluster) -> dict:
    catalog = ck.demo_catalog(cluster)
    source = Path(cluster.info["data_dir"]) / "adapters"
    catalog["models"] = [
        {
            "name": BASE,
            "replicas": REPLICAS,
            "profile": {
                "engine": "sim",
                "model_ref": "sim/lora-base",
                "gpus_per_shard": 1,
                "engine_args": ENGINE_ARGS,
                "max_loras": SLOTS,
            },
        }
    ]
    catalog["adapters"] = []
    for name in ADAPTERS:
        (source / name).mkdir(parents=True, exist_ok=True)
        (source / name / "adapter_config.json").write_text(json.dumps({"r": 8}))
        catalog["adapters"].append({"name": name, "base": BASE, "source": str(source / name)})
    return catalog


def listed(router: str, key: str) -> set[str]:
    body = httpx.get(f"{router}/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    return {m["id"] for m in body.json()["data"]}


def adapter_events(cluster) -> list[dict]:
    """Every AdaptersPlaced of the run, for reading what the leader did and why, and every
    agent report of what an engine holds, for how long a decision took to be held."""
    out, seq = [], 1
    while batch := ck.api(cluster, f"/api/events?from_seq={seq}&limit=1000"):
        out += [
            e
            for e in batch
            if e["type"].endswith("adapters.placed")
            or (e["type"] == "shard.status" and e["event"].get("adapters") is not None)
        ]
        seq = batch[-1]["seq"] + 1
    return out


def run_placed(
    tmp: Path, plan: list[tuple[float, str]], warmup: float, dump: Path | None = None
) -> tuple[Outcome, float]:
    cluster = ck.start_cluster(tmp / "cluster")
    try:
        ck.apply_catalog(cluster, placed_catalog(cluster))
        ck.wait(lambda: len(ck.ready_endpoints(cluster, BASE)) == REPLICAS, 120, "4 ready replicas")
        urls = {e["url"].rstrip("/") for e in ck.ready_endpoints(cluster, BASE)}
        for admin in cluster.info["router_admin"]:
            ck.wait(
                lambda a=admin: {u.rstrip("/") for u in ck.router_endpoint_urls(a, BASE)} == urls,
                60,
                "the routers to see the 4 replicas",
            )
        for router in cluster.info["routers"]:  # the adapters' routes, or 404 until then
            ck.wait(
                lambda r=router: set(ADAPTERS) <= listed(r, cluster.info["api_key"]),
                60,
                "the routers to list the adapters",
            )
        metrics = [u.removesuffix("/v1") for u in urls]
        key = cluster.info["api_key"]
        out, loaded = asyncio.run(drive(cluster.info["routers"], key, plan, warmup, metrics))
        if dump is not None:
            dump.write_text(json.dumps(adapter_events(cluster), indent=1))
        return out, loaded
    finally:
        cluster.stop()


def row(name: str, out: Outcome, loaded: float) -> tuple[str, float, float, float, int, int]:
    ttfts = sorted(out.ttfts) or [float("nan")]
    requests = len(out.ttfts) + len(out.errors)
    per_1000 = 1000 * loaded / max(requests, 1)
    mean = sum(ttfts) / len(ttfts)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    return name, per_1000, mean, p90, requests, len(out.errors)


def print_frontier(
    rate: float, base_loads: float, base_mean: float, placed_loads: float, placed_mean: float
) -> None:
    """What no placement of these slots can beat on this traffic (_lora_frontier.py), so a
    FAIL says whether the policy or the target is out of reach."""
    rates, slots, floor = (
        zipf_rates(len(ADAPTERS), ZIPF_EXPONENT, rate),
        REPLICAS * SLOTS,
        TTFT_MS / 1000,
    )
    at_target = least_mean_ttft(rates, slots, base_loads / 10 / 1000, floor)
    needed = 1000 * least_loads(rates, slots, base_mean, floor)
    at_placed = least_mean_ttft(rates, slots, placed_loads / 1000, floor)
    print(
        f"any placement of {slots} slots on this traffic: at {base_loads / 10:.1f} loads/1000 a "
        f"mean TTFT of at least {at_target:.3f}s; at the baseline's {base_mean:.3f}s, at least "
        f"{needed:.1f} loads/1000; at placed's {placed_loads:.1f} loads/1000, at least "
        f"{at_placed:.3f}s (placed: {placed_mean / at_placed:.1f}x that)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="measured, after --warmup")
    parser.add_argument("--warmup", type=float, default=60.0, help="traffic not measured")
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second")
    parser.add_argument(
        "--dump", type=Path, help="write the placed run's AdaptersPlaced and adapter reports here"
    )
    args = parser.parse_args()
    plan = schedule(args.warmup + args.seconds, args.rate)
    measured = sum(1 for offset, _ in plan if offset >= args.warmup)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("baseline", run_baseline), ("placed", run_placed)):
            print(
                f"running {name}: {len(plan)} requests over {args.warmup + args.seconds:.0f} s, "
                f"the last {measured} measured ..."
            )
            dump = args.dump if name == "placed" else None
            out, loaded = run(Path(tmp), plan, args.warmup, dump)
            kinds: dict[str, int] = {}
            for err in out.errors:
                kind = err.split(": ", 1)[1][:40]
                kinds[kind] = kinds.get(kind, 0) + 1
            for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
                print(f"  ! {n} x {kind}")
            rows.append(row(name, out, loaded))
    print()
    print(
        f"{'mode':<9} {'loads/1000':>10} {'mean TTFT':>10} {'p90 TTFT':>9} {'requests':>9} {'errors':>7}"
    )
    for name, per_1000, mean, p90, requests, errors in rows:
        print(f"{name:<9} {per_1000:>10.1f} {mean:>9.3f}s {p90:>8.3f}s {requests:>9} {errors:>7}")
    (_, base_loads, base_mean, *_), (_, placed_loads, placed_mean, *_, placed_errors) = rows
    loads_ok = placed_loads <= base_loads / 10
    ttft_ok = placed_mean <= base_mean
    print(
        f"\nloads: placed {placed_loads:.1f} vs baseline/10 {base_loads / 10:.1f}: "
        f"{'PASS' if loads_ok else 'FAIL'}; mean TTFT: placed/baseline "
        f"{placed_mean / base_mean:.2f}: {'PASS' if ttft_ok else 'FAIL'}"
    )
    print_frontier(args.rate, base_loads, base_mean, placed_loads, placed_mean)
    ok = loads_ok and ttft_ok and not placed_errors
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
