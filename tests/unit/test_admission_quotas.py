"""Quotas: rpm, tpm with correction from actual usage, concurrency, Retry-After, divisor."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import contracts
from llmgw.router.admission import AdmissionRejected
from llmgw.router.admission.quotas import MinuteWindow, TenantQuotas


def q(routers: int = 1, **limits) -> TenantQuotas:
    return TenantQuotas(contracts.Quotas(**limits), routers)


def rejected(quotas: TenantQuotas, now: float, tokens: int = 1) -> AdmissionRejected:
    with pytest.raises(AdmissionRejected) as err:
        quotas.acquire(now, tokens)
    return err.value


def test_rpm_retry_after_is_when_the_window_frees():
    quotas = q(rpm=3)
    for t in (1000.2, 1000.5, 1010.7):
        quotas.acquire(t, 1)
    e = rejected(quotas, 1020.3)
    assert (e.status, e.reason, e.retry_after) == (429, "rate_limit_rpm", 40)  # 1060.0 - 1020.3
    assert (b"retry-after", b"40") in e.headers
    body = msgspec.json.decode(e.body())["error"]
    assert body["type"] == "requests" and body["code"] == "rate_limit_exceeded"
    assert "40s" in body["message"]
    assert rejected(quotas, 1059.9).retry_after == 1
    quotas.acquire(1060.0, 1)  # the two requests of second 1000 have left the window
    quotas.acquire(1060.0, 1)
    # Whole-second buckets: what came in during second 1010 leaves the window at 1070.
    assert rejected(quotas, 1060.0).retry_after == 10


def test_tpm_counts_the_estimate_then_the_actual_usage():
    quotas = q(tpm=1000)
    sec = quotas.acquire(100.0, 600)  # prompt estimate + max_tokens
    e = rejected(quotas, 101.0, 600)
    assert (e.reason, e.retry_after) == ("rate_limit_tpm", 59)
    assert msgspec.json.decode(e.body())["error"]["type"] == "tokens"
    quotas.release(102.0, sec, 600, 120)  # the engine reported 120 tokens used
    assert quotas.tokens.total == 120
    quotas.acquire(103.0, 600)
    assert quotas.tokens.total == 720


def test_actual_usage_above_the_estimate_counts_too():
    quotas = q(tpm=1000)
    sec = quotas.acquire(100.0, 100)
    quotas.release(101.0, sec, 100, 950)
    assert rejected(quotas, 102.0, 100).reason == "rate_limit_tpm"


def test_a_correction_after_the_window_passed_changes_nothing():
    quotas = q(tpm=1000)
    sec = quotas.acquire(100.0, 900)
    quotas.acquire(150.0, 50)
    quotas.release(170.0, sec, 900, 10)  # second 100 left the window at 160
    assert quotas.tokens.total == 50


def test_usage_unknown_keeps_the_estimate():
    quotas = q(tpm=1000)
    sec = quotas.acquire(100.0, 700)
    quotas.release(101.0, sec, 700, None)
    assert quotas.tokens.total == 700 and quotas.in_flight == 0


def test_a_request_larger_than_the_whole_tpm_is_told_not_to_retry():
    e = rejected(q(tpm=1000), 100.0, 1001)
    assert (e.status, e.reason) == (429, "request_too_large")
    assert (b"x-should-retry", b"false") in e.headers


def test_concurrency():
    quotas = q(concurrency=2)
    a = quotas.acquire(1.0, 1)
    quotas.acquire(1.0, 1)
    e = rejected(quotas, 1.0)
    assert (e.reason, e.retry_after) == ("rate_limit_concurrency", 1)
    quotas.release(2.0, a, 1, 1)
    quotas.acquire(2.0, 1)


def test_a_rejected_request_counts_against_nothing():
    quotas = q(rpm=10, tpm=100, concurrency=1)
    quotas.acquire(1.0, 50)
    rejected(quotas, 1.0, 10)  # concurrency
    assert (quotas.requests.total, quotas.tokens.total, quotas.in_flight) == (1, 50, 1)


def test_global_limits_are_divided_among_routers():
    quotas = q(routers=3, rpm=600, tpm=200_000, concurrency=64)
    assert (quotas.rpm, quotas.tpm, quotas.concurrency) == (200, 66_666, 21)
    quotas.set_limits(contracts.Quotas(rpm=600, concurrency=2), 4)
    assert (quotas.rpm, quotas.tpm, quotas.concurrency) == (150, None, 1)  # never below 1


def test_no_quotas_means_no_limits():
    quotas = q()
    for i in range(10_000):
        quotas.acquire(1.0 + i / 1000, 10_000)


def test_minute_window_forgets_after_a_long_quiet():
    w = MinuteWindow()
    w.add(10.0, 5)
    w.add(30.0, 5)
    assert w.advance(69.9) and w.total == 10
    assert w.advance(70.0) and w.total == 5
    assert w.advance(500.0) and w.total == 0


def test_rate_limit_headers_say_the_limit_what_is_left_and_when_it_resets():
    from llmgw import contracts
    from llmgw.router.admission.quotas import TenantQuotas

    q = TenantQuotas(contracts.Quotas(rpm=10, tpm=1000))
    assert dict(q.headers(100.0))[b"x-ratelimit-remaining-requests"] == b"10"
    q.acquire(100.2, 300)
    q.acquire(130.5, 200)
    h = dict(q.headers(131.0))
    assert h[b"x-ratelimit-limit-requests"] == b"10"
    assert h[b"x-ratelimit-remaining-requests"] == b"8"
    assert h[b"x-ratelimit-remaining-tokens"] == b"500"
    # Back to its initial state once the request of second 130 leaves the window, at 190.
    assert h[b"x-ratelimit-reset-requests"] == b"59s"
    assert TenantQuotas(contracts.Quotas(concurrency=2)).headers(1.0) == []


def test_rate_limit_headers_state_the_tenants_limit_behind_several_routers():
    # rpm 6,000 behind two routers: each enforces 3,000, but the client's limit is 6,000,
    # and what it has left is this router's remaining share times the router count
    # (load balancing spreads its requests evenly), so 0 exactly when this router refuses.
    from llmgw import contracts
    from llmgw.router.admission.quotas import TenantQuotas

    q = TenantQuotas(contracts.Quotas(rpm=6000, tpm=1_000_000), routers=2)
    h = dict(q.headers(100.0))
    assert h[b"x-ratelimit-limit-requests"] == b"6000"
    assert h[b"x-ratelimit-remaining-requests"] == b"6000"
    assert h[b"x-ratelimit-limit-tokens"] == b"1000000"
    for _ in range(1000):
        q.acquire(100.5, 100)
    h = dict(q.headers(101.0))
    assert h[b"x-ratelimit-remaining-requests"] == b"4000"
    assert h[b"x-ratelimit-remaining-tokens"] == b"800000"
    for _ in range(2000):
        q.acquire(101.5, 1)
    assert dict(q.headers(102.0))[b"x-ratelimit-remaining-requests"] == b"0"
    with pytest.raises(AdmissionRejected):
        q.acquire(102.0, 1)

    # A share rounded up to 1 never claims more than the tenant's limit.
    tiny = TenantQuotas(contracts.Quotas(rpm=1), routers=3)
    h = dict(tiny.headers(1.0))
    assert h[b"x-ratelimit-limit-requests"] == b"1"
    assert h[b"x-ratelimit-remaining-requests"] == b"1"

    # The live router count changes: the headers follow it.
    q.set_limits(contracts.Quotas(rpm=6000, tpm=1_000_000), 3)
    assert dict(q.headers(102.0))[b"x-ratelimit-limit-requests"] == b"6000"


def test_a_refusal_states_the_tenants_limit_and_this_routers_share():
    # The x-ratelimit headers state the tenant's own limit; the 429 must not contradict
    # them with one router's share alone.
    two = q(routers=2, rpm=6000)
    for _ in range(3000):
        two.acquire(0.0, 1)
    rpm = rejected(two, 0.0)
    assert "limit 6000, 3000 of it on this router of 2" in str(rpm)
    alone = q(rpm=2)
    alone.acquire(0.0, 1)
    alone.acquire(0.0, 1)
    assert "(RPM): limit 2." in str(rejected(alone, 0.0))


def test_reset_found_from_the_newest_second_agrees_with_the_full_scan():
    # seconds_until_empty answers the reset header per request; it must say what
    # the oldest-first scan says, with corrections (usage replacing estimates) mixed in.
    import random

    rng = random.Random(7)
    w = MinuteWindow()
    now = 1000.25
    recorded: list[tuple[int, int]] = []
    for _ in range(2000):
        now += rng.choice((0.0, 0.01, 0.3, 1.0, 7.5, 61.0))
        if recorded and rng.random() < 0.3:
            sec, estimate = recorded.pop(rng.randrange(len(recorded)))
            w.adjust(sec, rng.randint(0, estimate) - estimate, now)
        else:
            amount = rng.randint(0, 50)
            recorded.append((w.add(now, amount), amount))
        w.advance(now)
        if w.total > 0:
            assert w.seconds_until_empty(now) == w.seconds_until(now, 0)
