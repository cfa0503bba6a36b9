"""Autoscaling figures: a step load up and back down on a local cluster of sim engines.

Run: .venv/bin/python tests/bench/bench_autoscale.py   (about 4 minutes)

Starts the cluster `llmgw dev` runs (real processes: NATS, Postgres, a reconciler,
an agent with fake GPUs, two routers), declares `auto` with
`autoscale: {min: 1, max: 4}` on sim engines that take STARTUP_SECONDS to load,
then keeps CONCURRENCY clients per phase busy through both routers (closed loop,
streaming, retries off): low, high, low. It prints:

  - replicas over time (desired, and ready in the routers' projection);
  - p99 time to first token per phase;
  - failed requests (target 0);
  - GPU-seconds the model held (a replica holds its GPU from placement until its
    shard stops) against a fixed fleet sized for the peak over the same time
    (target <= 60%);
  - the time from the step up to the first new replica serving.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e import clusterkit as ck  # noqa: E402

STARTUP_SECONDS = 5
SLOTS = 4  # max_num_seqs of one replica
PHASES = [("low", 2, 60.0), ("high", 14, 60.0), ("low", 2, 90.0)]  # name, clients, seconds
GPU_TARGET = 0.60

AUTO = {
    "name": "auto",
    "autoscale": {
        "min": 1,
        "max": 4,
        "target": 0.7,
        "scale_up_after_seconds": 5,
        "scale_down_after_seconds": 15,
        "tolerance": 0.2,
    },
    "profile": {
        "engine": "sim",
        "model_ref": "sim/auto",
        "gpus_per_shard": 1,
        "max_num_seqs": SLOTS,
        "engine_args": [
            "--itl-ms", "20", "--ttft-ms", "30", "--startup-seconds", str(STARTUP_SECONDS)
        ],
    },
}  # fmt: skip

HOLDING = ("pending", "validating", "launching", "loading", "ready", "draining")


class Load:
    """Closed-loop streaming clients; the number of busy ones follows the phase."""

    def __init__(self, routers: list[str], key: str):
        self.clients = [
            openai.AsyncOpenAI(base_url=r, api_key=key, max_retries=0, timeout=120) for r in routers
        ]
        self.phase = ""
        self.active = 0
        self.ttft: dict[str, list[float]] = {}
        self.failures: list[str] = []
        self.ok = 0

    async def worker(self, i: int, stop: asyncio.Event) -> None:
        client = self.clients[i % len(self.clients)]
        while not stop.is_set():
            if i >= self.active:
                await asyncio.sleep(0.2)
                continue
            phase = self.phase
            t0 = time.monotonic()
            first = None
            try:
                stream = await client.chat.completions.create(
                    model="auto",
                    messages=[{"role": "user", "content": f"client {i} at {t0}"}],
                    max_tokens=32,
                    stream=True,
                )
                async for chunk in stream:
                    if first is None and any(ch.delta.content for ch in chunk.choices):
                        first = time.monotonic() - t0
                if first is None:
                    raise RuntimeError("stream ended without content")
                self.ttft.setdefault(phase, []).append(first)
                self.ok += 1
            except Exception as exc:
                self.failures.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.1)


async def sample(api: str, headers: dict, timeline: list, stop: asyncio.Event) -> None:
    """Once a second: desired count, replicas holding a GPU, ready endpoints."""
    async with httpx.AsyncClient(base_url=api, headers=headers, timeout=5) as http:
        while not stop.is_set():
            try:
                explain = (await http.get("/api/explain/auto")).json()
                replicas = (await http.get("/api/replicas")).json()
                endpoints = (await http.get("/api/endpoints")).json()
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(1)
                continue
            rows = ck._list(replicas)
            # A replica holds its GPU until its shard stops: retired and draining counts too.
            holding = sum(
                r.get("model") == "auto"
                and any(sh.get("state") in HOLDING for sh in r.get("shards", []))
                for r in rows
            )
            ready = 0
            for row in ck._list(endpoints):
                if row.get("model") == "auto":
                    ready = sum(e.get("state") == "ready" for e in row.get("endpoints", []))
            timeline.append((time.monotonic(), explain.get("desired_replicas", 0), holding, ready))
            await asyncio.sleep(1)


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))] if xs else float("nan")


async def drive(cluster) -> tuple[Load, list, list]:
    load = Load(cluster.info["routers"], cluster.info["api_key"])
    timeline: list = []
    marks: list = []  # (phase name, start)
    stop = asyncio.Event()
    most = max(n for _, n, _ in PHASES)
    tasks = [asyncio.create_task(load.worker(i, stop)) for i in range(most)]
    tasks.append(
        asyncio.create_task(
            sample(cluster.info["api_url"], ck.api_headers(cluster), timeline, stop)
        )
    )
    for name, clients, seconds in PHASES:
        load.phase, load.active = name + str(len(marks)), clients
        marks.append((load.phase, time.monotonic()))
        print(f"{time.strftime('%H:%M:%S')} phase {load.phase}: {clients} clients for {seconds:g}s")
        await asyncio.sleep(seconds)
    marks.append(("end", time.monotonic()))
    stop.set()
    await asyncio.wait(tasks, timeout=150)
    for c in load.clients:
        await c.close()
    return load, timeline, marks


def report(load: Load, timeline: list, marks: list, explain_text: str) -> bool:
    start, end = marks[0][1], marks[-1][1]
    print("\nreplicas over time (t s: desired / holding a GPU / ready)")
    last = None
    for at, desired, holding, ready in timeline:
        if at > end:
            break
        row = (desired, holding, ready)
        if row != last:
            print(f"  t={at - start:6.1f}  {desired} / {holding} / {ready}")
            last = row
    print("\np99 time to first token per phase")
    for name, _ in marks[:-1]:
        xs = load.ttft.get(name, [])
        print(f"  {name:6s}  p99 {p99(xs) * 1000:8.0f} ms  over {len(xs)} requests")
    # GPU-seconds: replicas holding a GPU, integrated over the load's duration.
    used = 0.0
    peak = 0
    for (t0, _, held, _), (t1, _, _, _) in zip(timeline, timeline[1:], strict=False):
        lo, hi = max(t0, start), min(t1, end)
        if hi > lo:
            used += held * (hi - lo)
            peak = max(peak, held)
    fixed = peak * (end - start)
    ratio = used / fixed if fixed else float("nan")
    step_up = marks[1][1]
    before = max((r for at, _, _, r in timeline if at <= step_up), default=0)
    first_new = next((at for at, _, _, r in timeline if at > step_up and r > before), None)
    print(f"\nrequests: {load.ok} ok, {len(load.failures)} failed (target 0)")
    for f in load.failures[:5]:
        print(f"  {f}")
    print(
        f"GPU-seconds: {used:.0f} used vs {fixed:.0f} for a fixed fleet of {peak} "
        f"(the peak) = {ratio:.0%} (target <= {GPU_TARGET:.0%})"
    )
    if first_new is not None:
        print(
            f"step up to first new replica serving: {first_new - step_up:.1f} s "
            f"(scale_up_after {AUTO['autoscale']['scale_up_after_seconds']} s + engine "
            f"startup {STARTUP_SECONDS} s + placement and projection)"
        )
    else:
        print("step up to first new replica serving: never")
    print("\nllmgw explain auto:\n" + explain_text)
    ok = not load.failures and ratio <= GPU_TARGET and first_new is not None
    print("PASS" if ok else "FAIL")
    return ok


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as tmp:
        print("starting the cluster ...")
        cluster = ck.start_cluster(
            Path(tmp),
            routers=2,
            agents=1,
            reconcilers=1,
            gpus="7x80GiB",  # 3 for the demo models, 4 for `auto` at its max
            env={"LLMGW_ACTOR__DRAIN_DEADLINE": "10"},
        )
        try:
            catalog = ck.demo_catalog(cluster)
            catalog["models"].append(AUTO)
            ck.apply_catalog(cluster, catalog)
            ck.wait(lambda: ck.ready_endpoints(cluster, "auto"), 60, "auto's first replica")
            load, timeline, marks = asyncio.run(drive(cluster))
            res = ck.cli(cluster, "explain", "auto", "--api", cluster.info["api_url"])
            ok = report(load, timeline, marks, res.stdout)
            res = ck.cli(cluster, "audit", "replay", "--api", cluster.info["api_url"], timeout=120)
            print("\nllmgw audit replay:\n" + res.stdout[-600:])
            return 0 if ok and res.returncode == 0 else 1
        finally:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
