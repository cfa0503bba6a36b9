"""The least mean TTFT any adapter placement can reach for a load budget, and back. Pure.

bench_lora's target asks for two things at once: at most a tenth of the baseline's
adapter loads, and a mean TTFT no worse than the baseline's. Whether any policy could
meet both on the benchmark's slots and traffic is a question about the traffic, not
about a policy, so this answers it with a bound that holds for every policy:

- At any moment at most `slots` adapters are resident. Arrivals are Poisson, so a request
  finds its adapter resident with the probability that it is resident at a random time.
  The bound gives the `slots` most requested adapters every slot all the time (the best
  any policy can do for them: they cost nothing) and charges only the rest, the tail.
- A request for a tail adapter waits for a load. With fewer loads than such requests,
  one load serves a batch: the requests that arrived while the adapter was not resident.
  The batch is served at once when the load ends, so each request waited at least until
  the batch's last arrival: for a batch of b Poisson arrivals at rate r that is
  b(b-1)/(2r) in all, (b-1)/2 per second of the adapter's traffic. Holding a batch until
  it has b requests is the best way to spend a load budget on Poisson arrivals (a
  control-limit rule), and letting b be fractional only lowers the cost.
- Spending `loads` per second over the tail at least cost gives b_i = sqrt(2 mu r_i)
  (Lagrange, at least 1), mu set so that sum(r_i / b_i) = loads.

Left out, each of which only adds to a real TTFT: the load's own time, the time a tail
adapter's load takes a slot away from a resident one, and every control-plane hop.
So a measured run can be above the bound, never below it.
"""

from __future__ import annotations

import math


def zipf_rates(adapters: int, exponent: float, rate: float) -> list[float]:
    """Requests per second per adapter, most requested first."""
    weights = [1.0 / (rank + 1) ** exponent for rank in range(adapters)]
    total = sum(weights)
    return [rate * w / total for w in weights]


def least_mean_ttft(
    rates: list[float], slots: int, loads_per_request: float, floor: float
) -> float:
    """The least mean TTFT (seconds) of any placement of `slots` resident adapters that
    makes at most `loads_per_request` loads per request; `floor` is every request's own
    TTFT with its adapter resident. `math.inf` when the budget cannot serve the tail."""
    ranked = sorted(rates, reverse=True)
    total, tail = sum(ranked), ranked[slots:]
    budget = loads_per_request * total  # loads per second
    if sum(tail) <= budget:
        return floor  # every tail request can have a load of its own
    if budget <= 0:
        return math.inf

    def batches(mu: float) -> list[float]:
        return [max(1.0, math.sqrt(2 * mu * r)) for r in tail]

    lo, hi = 1e-9, 1e9
    for _ in range(200):  # loads made fall as mu rises: bisect on its logarithm
        mu = math.sqrt(lo * hi)
        loads = sum(r / b for r, b in zip(tail, batches(mu), strict=True))
        lo, hi = (mu, hi) if loads > budget else (lo, mu)
    waited = sum((b - 1) / 2 for b in batches(hi))  # request-seconds waited per second
    return floor + waited / total


def least_loads(rates: list[float], slots: int, mean_ttft: float, floor: float) -> float:
    """The fewest loads per request with which any placement can keep its mean TTFT at
    `mean_ttft` or under (the inverse of `least_mean_ttft`)."""
    ranked = sorted(rates, reverse=True)
    lo, hi = 0.0, sum(ranked[slots:]) / sum(ranked)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if least_mean_ttft(rates, slots, mid, floor) > mean_ttft else (lo, mid)
    return hi
