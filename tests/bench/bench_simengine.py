"""Benchmark: streamed requests per second one sim-engine process sustains at zero latency.

    .venv/bin/python tests/bench/bench_simengine.py [--seconds 10] [--connections 64]

Target: >= 3,000 streamed completions/s of 16 tokens each, all latencies 0, on a
2-core machine. The load generator shares the machine, so the simulator is pinned to CPU 0
and the generator to CPU 1 where `taskset` exists. The generator is `wrk` (C, one thread,
keep-alive) when installed, else a small asyncio client over raw sockets (which costs more CPU
per request, so it measures a lower bound). Every response is checked for `data: [DONE]`; a
run with failed or truncated responses FAILs whatever its rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmgw.dev.simkit import start_sim

TARGET_RPS = 3000
TOKENS = 16
BODY = json.dumps(
    {"model": "sim-model", "prompt": "benchmark prompt", "max_tokens": TOKENS, "stream": True}
)

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[%s]]
bad = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function response(status, headers, body)
  if status ~= 200 or not string.find(body, "data: [DONE]", 1, true) then bad = bad + 1 end
end
function done(summary, latency, requests)
  local total_bad = 0
  for _, t in ipairs(threads) do total_bad = total_bad + t:get("bad") end
  io.write(string.format("BAD %%d\\n", total_bad))
end
"""


def _pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() >= 2 else []


def run_wrk(url: str, seconds: float, connections: int) -> tuple[float, int, int, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT % BODY)
        script = f.name
    try:
        cmd = [
            *_pin(1),
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(seconds))}s",
            "--latency",
            "-s",
            script,
            f"{url}/v1/completions",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"wrk failed ({res.returncode}): {res.stderr or res.stdout}")
        out = res.stdout
    finally:
        Path(script).unlink()
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    bad = int(re.search(r"BAD (\d+)", out).group(1))
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    bad += int(m.group(1)) if m else 0
    return rps, total, bad, out


async def _client(host: str, port: int, deadline: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n{BODY}"
    ).encode()
    try:
        while time.monotonic() < deadline:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readuntil(b"0\r\n\r\n")  # end of a chunked body
            ok = head.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in body
            counts[0 if ok else 1] += 1
    finally:
        writer.close()


def run_asyncio(url: str, seconds: float, connections: int) -> tuple[float, int, int, str]:
    host, port = url.removeprefix("http://").split(":")

    async def main() -> tuple[float, list[int]]:
        counts = [0, 0]
        start = time.monotonic()
        deadline = start + seconds
        await asyncio.gather(
            *(_client(host, int(port), deadline, counts) for _ in range(connections))
        )
        return time.monotonic() - start, counts

    if _pin(1):
        os.sched_setaffinity(0, {1})
    elapsed, (ok, bad) = asyncio.run(main())
    return (ok + bad) / elapsed, ok + bad, bad, ""


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--generator", choices=["auto", "wrk", "asyncio"], default="auto")
    args = ap.parse_args()
    gen = args.generator
    if gen == "auto":
        gen = "wrk" if shutil.which("wrk") else "asyncio"

    with start_sim("--log-level", "warning", wrapper=_pin(0)) as sim:
        # Warm up (and check the response shape) before measuring.
        run_wrk(sim.url, 1, 8) if gen == "wrk" else run_asyncio(sim.url, 1, 8)
        before = sim.state()
        runner = run_wrk if gen == "wrk" else run_asyncio
        rps, total, bad, raw = runner(sim.url, args.seconds, args.connections)
        after = sim.state()
    served = (after["finished"] - before["finished"]) + (after["aborted"] - before["aborted"])
    tokens = after["generation_tokens"] - before["generation_tokens"]
    print(
        f"generator: {gen}, {args.connections} connections, {args.seconds:g}s, sim pinned: {bool(_pin(0))}"
    )
    if raw:
        print(raw.rstrip())
    print(
        f"requests: {total} ({bad} failed or truncated); engine finished {served}, {tokens} tokens"
    )
    print(f"streamed req/s ({TOKENS} tokens each): {rps:,.0f}  target >= {TARGET_RPS:,}")
    ok = rps >= TARGET_RPS and bad == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
