"""The LoRA placement policy alone, on bench_lora's traffic: loads and waits per tuning.

Run: .venv/bin/python tests/bench/bench_lora_policy.py [--seconds 240] [--loop 0.7]
(seconds of CPU, no cluster)

bench_lora takes 8 minutes a run on the shared machine and moves with its load, so a
tuning is chosen here first and measured there after. The real `placement.place` decides
every 0.25 s (the leader decides at once on a queue) on demand smoothed as the leader
smooths it (30 s half-life) and the requests waiting per adapter; the control loop is a
delay: an adapter a decision loads serves `--loop` seconds later (command, a 0.3 s load,
the agent's report, fold, projection: about 0.7 s on the local cluster), and one it
unloads serves no more at once. A request for an adapter no engine holds waits until one
does, or 30 s (admission's limit, counted as an error); a queue's age is its oldest
request's (the leader counts from when it first heard of the queue: the same, give or
take a summary's delay). Traffic: bench_lora's (Poisson
at 50 requests/s, 40 adapters by Zipf 1.0, 4 replicas x 4 slots), the first 60 s not
measured. TTFT is the wait plus 30 ms; `worst` is the longest wait served, `errors` the
requests turned away at 30 s. The last column is the least mean TTFT any placement could
reach with as many loads (_lora_frontier.py). Each tuning is a hold, a horizon and a
`max_wait` (inf: no aging, the rule before it).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _lora_frontier import least_mean_ttft, zipf_rates  # noqa: E402

from llmgw import contracts as c  # noqa: E402
from llmgw.reconciler.controllers.lora import placement as pl  # noqa: E402
from llmgw.reconciler.state.model import AdapterHoldings  # noqa: E402

ADAPTERS = [f"tenant-{i:02d}" for i in range(40)]
REPLICAS = [f"lora-base-r{i}" for i in range(1, 5)]
SLOTS, RATE, WARMUP, TICK, HALF_LIFE, SERVED, TIMEOUT = 4, 50.0, 60.0, 0.25, 30.0, 0.03, 30.0
# (waiting hold, horizon, max wait): the default without aging and with it, then the
# holds and horizons around the default.
TUNINGS = [
    (1.5, 6.0, math.inf),
    (1.5, 6.0, pl.MAX_WAIT),
    (1.0, 4.0, pl.MAX_WAIT),
    (1.5, 5.0, pl.MAX_WAIT),
    (2.0, 6.0, pl.MAX_WAIT),
    (1.5, 7.0, pl.MAX_WAIT),
]


class Cluster:
    """The holdings as decided, what engines serve, and the requests waiting."""

    def __init__(self):
        self.holdings = AdapterHoldings(model="lora-base", holdings={r: [] for r in REPLICAS})
        self.serving: set[str] = set()  # (one copy each here: enough for this traffic)
        self.landing: list[tuple[float, str, str]] = []  # (serves at, replica, adapter)
        self.waiting: dict[str, list[float]] = {}  # adapter -> arrival times
        self.loads, self.ttfts, self.errors, self.worst = 0, [], 0, 0.0

    def served(self, arrival: float, now: float) -> None:
        if arrival >= WARMUP:
            self.ttfts.append(now - arrival + SERVED)
            self.worst = max(self.worst, now - arrival)

    def land(self, now: float) -> None:
        _, rid, a = heapq.heappop(self.landing)
        if a in self.holdings.holdings.get(rid, []):
            self.serving.add(a)
            self.loads += now >= WARMUP
            for arrival in self.waiting.pop(a, []):
                self.served(arrival, now)

    def apply(self, decided: pl.Placement, now: float, loop: float) -> None:
        before = self.holdings
        loaded_at = {}
        for rid, held in decided.holdings.items():
            was = before.holdings.get(rid, [])
            loaded_at[rid] = {
                a: before.loaded_at.get(rid, {}).get(a, now) for a in held if a in was
            }
            for a in held:
                if a not in was:
                    loaded_at[rid][a] = now
                    heapq.heappush(self.landing, (now + loop, rid, a))
        held_now = {a for held in decided.holdings.values() for a in held}
        self.serving &= held_now
        self.holdings = AdapterHoldings(
            model="lora-base", holdings=decided.holdings, loaded_at=loaded_at
        )

    def time_out(self, now: float) -> None:
        for a in list(self.waiting):
            late = [t for t in self.waiting[a] if now - t >= TIMEOUT]
            self.errors += sum(t >= WARMUP for t in late)
            self.waiting[a] = [t for t in self.waiting[a] if now - t < TIMEOUT]
            if not self.waiting[a]:
                del self.waiting[a]


def run(tuning: pl.Tuning, seconds: float, loop: float, seed: int) -> dict:
    rng, weights = random.Random(seed), zipf_rates(len(ADAPTERS), 1.0, 1.0)
    declared = [c.AdapterDeclared(name=a, base="lora-base", source="/x") for a in ADAPTERS]
    cl, rates, arrived = Cluster(), {}, {}
    arrival, tick, end = rng.expovariate(RATE), 0.0, WARMUP + seconds
    while (now := min(arrival, tick, cl.landing[0][0] if cl.landing else math.inf)) < end:
        if cl.landing and now == cl.landing[0][0]:
            cl.land(now)
        elif now == arrival:
            a = rng.choices(ADAPTERS, weights)[0]
            arrived[a] = arrived.get(a, 0) + 1
            if a in cl.serving:
                cl.served(now, now)
            else:
                cl.waiting.setdefault(a, []).append(now)
            arrival = now + rng.expovariate(RATE)
        else:
            cl.time_out(now)
            alpha = 1 - 0.5 ** (TICK / HALF_LIFE)
            for a in set(rates) | set(arrived):
                rates[a] = rates.get(a, 0.0) + alpha * (
                    arrived.get(a, 0) / TICK - rates.get(a, 0.0)
                )
            arrived = {}
            inp = pl.Inputs(
                adapters=declared,
                replicas=REPLICAS,
                slots=SLOTS,
                current=cl.holdings,
                demand={a: r for a, r in rates.items() if r > 1e-6},
                queued={a: len(ts) for a, ts in cl.waiting.items()},
                waited={a: now - min(ts) for a, ts in cl.waiting.items()},
                now=now,
            )
            cl.apply(pl.place(inp, tuning), now, loop)
            tick = now + TICK
    done = sorted(cl.ttfts)
    n = len(done) + cl.errors
    return {
        "loads": 1000 * cl.loads / n,
        "mean": sum(done) / len(done),
        "p90": done[int(0.9 * len(done))],
        "p99": done[int(0.99 * len(done))],
        "worst": cl.worst,
        "errors": cl.errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=240.0, help="measured, after 60 s")
    parser.add_argument("--loop", type=float, default=0.7, help="decision to serving, s")
    args = parser.parse_args()
    rates = zipf_rates(len(ADAPTERS), 1.0, RATE)
    print(
        f"{'hold':>5} {'horizon':>7} {'max wait':>8} {'loads/1000':>10} {'mean':>6} {'p90':>6} "
        f"{'p99':>6} {'worst':>6} {'errors':>6} {'least mean':>10}"
    )
    for hold, horizon, max_wait in TUNINGS:
        for seed in (1, 2):
            tuning = pl.Tuning(waiting_hold=hold, horizon=horizon, max_wait=max_wait)
            r = run(tuning, args.seconds, args.loop, seed)
            least = least_mean_ttft(rates, SLOTS * len(REPLICAS), r["loads"] / 1000, SERVED)
            print(
                f"{hold:>5} {horizon:>7} {max_wait:>8} {r['loads']:>10.1f} {r['mean']:>5.2f}s "
                f"{r['p90']:>5.2f}s {r['p99']:>5.1f}s {r['worst']:>5.1f}s {r['errors']:>6} "
                f"{least:>9.2f}s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
