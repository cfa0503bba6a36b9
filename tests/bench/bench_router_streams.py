"""1,000 concurrent streams through one router (`--workers 2`) across 3 sim engines.

    .venv/bin/python tests/bench/bench_router_streams.py [--streams 1000] [--tokens 64]

Run 1: every client opens its stream at once and reads it to the end; target:
zero errors (every stream ends with `[DONE]`, no error event, no failed
request), with the engines running nearly all streams at the same time.
Run 2: the same, but every third client goes away after its second event;
target: the others complete without error, and afterwards every engine's
/sim/state shows zero KV blocks in use and nothing running or waiting: the
router cancelled each abandoned request upstream.

The load generator is a lean asyncio client (aiohttp); it shares the CPUs
with the router and the engines, so the figure that matters is "no errors".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import httpx

from llmgw.dev.routerkit import start_router
from llmgw.dev.simkit import start_sim


async def stream(session, url: str, i: int, tokens: int, leave_after: int | None) -> str:
    """'ok', 'left' or an error description."""
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": f"client {i} wants a story"}],
    }
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return f"status {resp.status}"
            events = 0
            last = b""
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if b'"error"' in line:
                    return "error event"
                events += 1
                last = line
                if leave_after is not None and events >= leave_after:
                    resp.close()
                    return "left"
            return "ok" if last.strip() == b"data: [DONE]" else "truncated"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__


async def run(url: str, n: int, tokens: int, leave_every: int | None) -> tuple[dict, float]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        began = time.monotonic()
        results = await asyncio.gather(
            *(
                stream(session, url, i, tokens, 2 if leave_every and i % leave_every == 0 else None)
                for i in range(n)
            )
        )
        elapsed = time.monotonic() - began
    counts: dict[str, int] = {}
    for r in results:
        counts[r] = counts.get(r, 0) + 1
    return counts, elapsed


class PeakRunning:
    """Polls the engines during a run: the most requests they ran at one time."""

    def __init__(self, sims):
        self.sims = sims
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=2) as http:
            while not self._stop.is_set():
                try:
                    total = sum(http.get(f"{s.url}/sim/state").json()["running"] for s in self.sims)
                    self.peak = max(self.peak, total)
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def settle(sims, timeout: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        states = [s.state() for s in sims]
        idle = all(st["running"] == 0 and st["waiting"] == 0 for st in states)
        if (
            idle and all(st["kv_blocks_used"] == 0 for st in states)
        ) or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    args = ap.parse_args()
    per_engine = args.streams // 3 + 64
    sims = []
    router = None
    try:
        for _ in range(3):
            sims.append(
                start_sim(
                    model="m",
                    itl_ms=args.itl_ms,
                    max_num_seqs=per_engine,
                    kv_blocks=max(4096, per_engine * (args.tokens // 16 + 4)),
                    log_level="warning",
                )
            )
        eps = "\n".join(
            f"  - {{id: sim{i}, url: '{s.url}', models: [m], engine: sim}}"
            for i, s in enumerate(sims)
        )
        router = start_router(
            Path(tempfile.mkdtemp(prefix="bench-streams-")),
            "log_level: warning\nadmission: {enabled: false}\nmodels: [{name: m}]\n"
            f"upstream: {{pool_limit: {args.streams * 2}}}\nendpoints:\n{eps}\n",
            "--workers",
            "2",
        )
        url = router.url + "/v1/chat/completions"

        with PeakRunning(sims) as peak:
            counts, elapsed = asyncio.run(run(url, args.streams, args.tokens, None))
        errors1 = args.streams - counts.get("ok", 0)
        served = [s.state()["finished"] for s in sims]
        print(f"run 1: {args.streams} streams of {args.tokens} tokens in {elapsed:.2f}s "
              f"({args.streams / elapsed:.0f} streams/s); outcomes {counts}")  # fmt: skip
        print(f"       engines ran at most {peak.peak} at once; finished per engine {served}")
        ok1 = errors1 == 0 and peak.peak >= 0.9 * args.streams

        counts2, elapsed2 = asyncio.run(run(url, args.streams, args.tokens, 3))
        left = counts2.get("left", 0)
        errors2 = args.streams - left - counts2.get("ok", 0)
        states = settle(sims)
        kv = [st["kv_blocks_used"] for st in states]
        busy = [st["running"] + st["waiting"] for st in states]
        aborted = sum(st["aborted"] for st in states)
        print(f"run 2: {args.streams} streams, {left} clients left after 2 events, "
              f"{elapsed2:.2f}s; outcomes {counts2}")  # fmt: skip
        print(f"       afterwards: KV blocks in use per engine {kv}, running+waiting {busy}, "
              f"aborted {aborted}")  # fmt: skip
        ok2 = errors2 == 0 and kv == [0, 0, 0] and busy == [0, 0, 0] and aborted >= left
        ok = ok1 and ok2
        print(
            f"target: zero errors with >= 90% of the streams running at once "
            f"({'PASS' if ok1 else 'FAIL'}); zero errors and zero KV blocks in use after a "
            f"third disconnect ({'PASS' if ok2 else 'FAIL'}): {'PASS' if ok else 'FAIL'}"
        )
        return 0 if ok else 1
    finally:
        if router is not None:
            router.stop()
        for s in sims:
            s.stop()


if __name__ == "__main__":
    sys.exit(main())
