"""Prefill/decode disaggregation against aggregated serving, same engines: ITL and TTFT.

Run: .venv/bin/python tests/bench/bench_pd.py [--seconds 60] [--warmup 10] [--prefill 2]
(~3 min; --mode aggregated|pd runs one half only, with no verdict)

Four simulators with chunked prefill (`--enable-chunked-prefill`: a step carries every
decoding request's token plus prompt chunks up to --max-num-batched-tokens 2048, and lasts
longer by those chunks' compute) behind one llmgw router in router-only mode, two ways:

- aggregated: the 4 sims serve the model whole; the router's default pipeline spreads
  requests by load. A long prompt landing on an engine stretches the steps of every chat
  decoding there for as long as its chunks take.
- P/D: --prefill of the 4 sims are prefill endpoints, the rest decode endpoints
  (`role` in the router's file, `disaggregation: {min_prompt_tokens: 1024}` on the
  model). A long request's prompt is computed on a prefill sim (the prefill leg), its
  tokens on a decode sim that loads the KV instead (`kv_transfer_ms`); a chat's short
  prompt skips the prefill leg and is computed by the decode sim itself.

Load (open loop, Poisson arrivals, seeded, the same sequence both ways): --long-rate
requests/s of ~4,000-token prompts with 8 output tokens (summaries, RAG), and --chat-rate
streamed chat requests of a ~100-token prompt and 150 output tokens. Every prompt starts
with its request number, so no prefix is shared and no cache helps either mode. One
router, admission off (it would hold requests by each pool's saturation, which differs
between the layouts: this compares where the work runs).

Engine: itl 30 ms + 0.3 ms per running request, prefill 0.2 ms per prompt token (a large
model on a GPU node: ~5,000 prompt tokens/s, ~30 tokens/s per stream), budget 2,048 tokens
a step, KV transfer 30 ms. So a long prompt is two steps of ~0.44 s instead of ~0.035 s.
The time scale is deliberately slow: on a small shared machine a process may wait tens of
milliseconds for a core, and that noise must stay small beside the steps being measured.

Why 2 prefill + 2 decode (--prefill 2): the long prompts' compute is 1/s x 0.86 s = 0.86 of
one engine. On a single prefill engine the prompts queue at 86 % utilisation and TTFT p90
goes up several times; two keep it near 43 %, while decode is cheap to batch (two engines
hold every stream at ~35 ms a step). With one decode engine, that engine computes every
chat's prompt beside ~20 streams and its ITL p99 is higher. `--prefill 1` and `--prefill 3`
show the other splits (docs/disaggregation.md, Benchmark, has the figures).

Measured at the client: decode ITL = the gaps between consecutive content events of the
chat streams; TTFT = send to first content event, over all requests. Target (issue #23):
ITL p99 at least 2x lower under P/D, TTFT p90 no worse than 1.2x aggregated's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmgw.dev.routerkit import metric_sum, start_router  # noqa: E402
from llmgw.dev.simkit import SimProcess, start_sim  # noqa: E402

MODEL = "m"
ENGINES = 4
SIM_ARGS = {
    "model": MODEL,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 2048,
    "itl_ms": 30,
    "itl_ms_per_running": 0.3,
    "prefill_ms_per_token": 0.2,
    "kv_transfer_ms": 30,
    "log_level": "warning",
}
LONG_PROMPT_BYTES = 16_000  # ~4,000 tokens at the sim's 4 bytes a token
LONG_OUTPUT = 8
CHAT_PROMPT_BYTES = 400
CHAT_OUTPUT = 150
MIN_PROMPT_TOKENS = 1024
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge".split()


@dataclass
class Outcome:
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # chat streams' inter-token gaps
    errors: list[str] = field(default_factory=list)


def schedule(seconds: float, long_rate: float, chat_rate: float, seed: int = 23):
    """(offset, kind) of every request: two Poisson streams merged."""
    rng = random.Random(seed)
    out = []
    for kind, rate in (("long", long_rate), ("chat", chat_rate)):
        t = rng.expovariate(rate)
        while t < seconds:
            out.append((t, kind))
            t += rng.expovariate(rate)
    return sorted(out)


def prompt(n: int, size: int) -> str:
    rng = random.Random(n)
    words = [f"request {n}:"]
    length = len(words[0])
    while length < size:
        w = rng.choice(WORDS)
        words.append(w)
        length += len(w) + 1
    return " ".join(words)


async def one_request(
    http: httpx.AsyncClient, url: str, n: int, kind: str, out: Outcome | None
) -> None:
    size, max_tokens = (
        (LONG_PROMPT_BYTES, LONG_OUTPUT) if kind == "long" else (CHAT_PROMPT_BYTES, CHAT_OUTPUT)
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt(n, size)}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    started = time.perf_counter()
    times: list[float] = []
    try:
        async with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                error = f"{kind} {n}: {resp.status_code} {(await resp.aread())[:160]!r}"
                if out is not None:
                    out.errors.append(error)
                return
            async for line in resp.aiter_lines():
                # A content event; the role event's content is empty, the usage one has none.
                if '"content":"' in line and '"content":""' not in line:
                    times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        if out is not None:
            out.errors.append(f"{kind} {n}: {type(exc).__name__}: {exc}")
        return
    if out is None:
        return
    if len(times) != max_tokens:
        out.errors.append(f"{kind} {n}: {len(times)} of {max_tokens} tokens")
        return
    out.ttfts.append(times[0] - started)
    if kind == "chat":
        out.gaps += [b - a for a, b in zip(times, times[1:], strict=False)]


async def drive(url: str, plan: list[tuple[float, str]], warmup: float) -> Outcome:
    """Send each request at its time (open loop); those sent from `warmup` on are measured."""
    out = Outcome()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for n, (offset, kind) in enumerate(plan):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            into = out if offset >= warmup else None
            tasks.append(asyncio.create_task(one_request(http, url, n, kind, into)))
        await asyncio.gather(*tasks)
    return out


def router_config(sims: list[SimProcess], prefill: int) -> dict:
    """Router-only mode: the sims as static endpoints; with `prefill` > 0 the first
    `prefill` of them are the model's prefill pool and the rest its decode pool."""
    model: dict = {"name": MODEL}
    if prefill:
        model["disaggregation"] = {"min_prompt_tokens": MIN_PROMPT_TOKENS}
    endpoints = []
    for i, s in enumerate(sims):
        ep = {"id": f"sim-{i}", "url": s.url, "models": [MODEL], "engine": "sim"}
        if prefill:
            ep["role"] = "prefill" if i < prefill else "decode"
        endpoints.append(ep)
    # Admission off: it would hold requests by each pool's saturation, which differs
    # between the two layouts; this compares where the work runs, not admission.
    return {
        "log_level": "warning",
        "admission": {"enabled": False},
        "models": [model],
        "endpoints": endpoints,
    }


def external_tokens(sims: list[SimProcess]) -> float:
    """Prompt tokens the sims took from a prefill engine instead of computing."""
    total = 0.0
    for s in sims:
        text = httpx.get(f"{s.url}/metrics", timeout=5).text
        total += metric_sum(text, "vllm:external_prefix_cache_hits_total")
    return total


def run_mode(
    tmp: Path, plan: list[tuple[float, str]], warmup: float, prefill: int
) -> tuple[Outcome, float]:
    sims: list[SimProcess] = []
    router = None
    try:
        sims = [start_sim(**SIM_ARGS) for _ in range(ENGINES)]
        router = start_router(tmp, yaml.safe_dump(router_config(sims, prefill)))
        out = asyncio.run(drive(f"{router.url}/v1/chat/completions", plan, warmup))
        return out, external_tokens(sims)
    finally:
        if router is not None:
            router.stop()
        for s in sims:
            s.stop()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(rows: dict[str, tuple[Outcome, float]], longs: int) -> bool | None:
    print(
        f"\n{'mode':<11} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'requests':>9} {'errors':>7} {'P/D legs':>9}"
    )
    for name, (out, external) in rows.items():
        requests = len(out.ttfts) + len(out.errors)
        legs = round(external / (LONG_PROMPT_BYTES / 4))
        print(
            f"{name:<11} {pct(out.gaps, 0.5) * 1000:>6.1f}ms {pct(out.gaps, 0.99) * 1000:>6.1f}ms "
            f"{pct(out.ttfts, 0.5):>8.3f}s {pct(out.ttfts, 0.9):>8.3f}s "
            f"{requests:>9} {len(out.errors):>7} {legs:>9}"
        )
    for out, _ in rows.values():
        for err in out.errors[:3]:
            print(f"  ! {err[:200]}")
    if set(rows) != {"aggregated", "pd"}:
        return None
    (agg, _), (pd, external) = rows["aggregated"], rows["pd"]
    itl_ratio = pct(agg.gaps, 0.99) / pct(pd.gaps, 0.99)
    ttft_ratio = pct(pd.ttfts, 0.9) / pct(agg.ttfts, 0.9)
    took_legs = external >= 0.5 * longs * LONG_PROMPT_BYTES / 4
    itl_ok, ttft_ok = itl_ratio >= 2.0, ttft_ratio <= 1.2
    print(
        f"\nITL p99 aggregated/P/D {itl_ratio:.2f} (>= 2): {'PASS' if itl_ok else 'FAIL'}; "
        f"TTFT p90 P/D/aggregated {ttft_ratio:.2f} (<= 1.2): {'PASS' if ttft_ok else 'FAIL'}"
    )
    if not took_legs:
        print("the decode sims loaded almost no prompt: the router did not run the prefill leg")
    return itl_ok and ttft_ok and took_legs and not agg.errors and not pd.errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured, after --warmup")
    parser.add_argument("--warmup", type=float, default=10.0, help="traffic not measured")
    parser.add_argument("--long-rate", type=float, default=1.0, help="long requests per second")
    parser.add_argument("--chat-rate", type=float, default=4.0, help="chat requests per second")
    parser.add_argument("--prefill", type=int, default=2, help="prefill sims of the 4 in P/D")
    parser.add_argument("--mode", choices=["both", "aggregated", "pd"], default="both")
    args = parser.parse_args()
    if not 1 <= args.prefill < ENGINES:
        parser.error(f"--prefill must be between 1 and {ENGINES - 1}")
    plan = schedule(args.warmup + args.seconds, args.long_rate, args.chat_rate)
    longs = sum(1 for offset, kind in plan if kind == "long" and offset >= args.warmup)
    modes = {"aggregated": 0, "pd": args.prefill}
    if args.mode != "both":
        modes = {args.mode: modes[args.mode]}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, prefill in modes.items():
            split = f"{prefill} prefill + {ENGINES - prefill} decode" if prefill else "4 whole"
            print(
                f"running {name} ({split}): {len(plan)} requests over "
                f"{args.warmup + args.seconds:.0f} s ...",
                flush=True,
            )
            rows[name] = run_mode(Path(tmp), plan, args.warmup, prefill)
    verdict = report(rows, longs)
    if verdict is None:
        return 0
    print("PASS" if verdict else "FAIL")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
