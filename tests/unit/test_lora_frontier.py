"""The bound bench_lora prints: no placement of the benchmark's 16 slots can reach both of
issue #22's targets, and a concrete policy simulated here never beats the bound."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _lora_frontier import least_loads, least_mean_ttft, zipf_rates  # noqa: E402

# bench_lora's traffic: 40 adapters, Zipf 1.0, 50 requests/s, 4 replicas x 4 slots; the
# sims' own TTFT is 20 ms; the baseline measured 615.7 loads per 1,000 and 0.229 s.
RATES = zipf_rates(40, 1.0, 50.0)
SLOTS, FLOOR = 16, 0.02
BASELINE_LOADS, BASELINE_TTFT = 0.6157, 0.229


def test_a_tenth_of_the_baselines_loads_cannot_keep_its_mean_ttft():
    at_target = least_mean_ttft(RATES, SLOTS, BASELINE_LOADS / 10, FLOOR)
    assert at_target > 2 * BASELINE_TTFT  # about 0.58 s
    needed = least_loads(RATES, SLOTS, BASELINE_TTFT, FLOOR)
    assert needed > 1.5 * BASELINE_LOADS / 10  # about 107 per 1,000


def test_a_load_for_every_tail_request_costs_no_wait_and_no_load_cannot_serve_the_tail():
    tail_share = sum(RATES[SLOTS:]) / sum(RATES)  # about 21%
    assert least_mean_ttft(RATES, SLOTS, tail_share, FLOOR) == FLOOR
    assert least_mean_ttft(RATES, SLOTS, tail_share * 0.99, FLOOR) > FLOOR
    assert least_mean_ttft(RATES, SLOTS, 0.0, FLOOR) == math.inf
    assert least_mean_ttft(RATES, 40, 0.0, FLOOR) == FLOOR  # every adapter resident


def test_fewer_loads_never_lower_the_bound_and_least_loads_inverts_it():
    budgets = [0.02, 0.04, 0.06, 0.1, 0.15, 0.2]
    bounds = [least_mean_ttft(RATES, SLOTS, b, FLOOR) for b in budgets]
    assert bounds == sorted(bounds, reverse=True) and len(set(bounds)) == len(bounds)
    for ttft in (0.3, 0.6, 1.0):
        loads = least_loads(RATES, SLOTS, ttft, FLOOR)
        assert math.isclose(least_mean_ttft(RATES, SLOTS, loads, FLOOR), ttft, rel_tol=1e-3)


def test_a_simulated_policy_never_beats_the_bound():
    # The 16 most requested always resident; each tail adapter loaded (instantly, then
    # given up) when `batch` of its requests wait: the best shape of policy, as simulated.
    rng, seconds = random.Random(7), 3000.0
    for batch in (2, 4, 8):
        loads = waited = requests = 0.0
        for rate in RATES[SLOTS:]:
            t, queue = 0.0, []
            while (t := t + rng.expovariate(rate)) < seconds:
                queue.append(t)
                if len(queue) == batch:
                    loads, waited = loads + 1, waited + sum(t - q for q in queue)
                    queue = []
            requests += len(queue)  # still waiting at the end: neither loaded nor counted
        requests = sum(RATES) * seconds - requests
        simulated = FLOOR + waited / requests
        bound = least_mean_ttft(RATES, SLOTS, loads / requests, FLOOR)
        assert bound <= simulated <= 1.3 * bound
