"""Passive health: the per-endpoint circuit breaker with a controllable clock."""

from llmgw.router.relay.circuit import CLOSED, HALF_OPEN, OPEN, Circuit


def test_consecutive_failures_open_the_circuit_and_a_success_resets_the_count():
    c = Circuit(threshold=3, cooldown=5.0)
    c.failure(0)
    c.failure(0)
    c.success()
    c.failure(0)
    c.failure(0)
    assert c.state is CLOSED and c.allows(0)
    c.failure(1)
    assert c.state is OPEN and not c.allows(1) and not c.allows(5.9)


def test_after_the_cool_down_exactly_one_probe_passes_and_its_success_closes():
    c = Circuit(threshold=1, cooldown=5.0)
    c.failure(10)
    assert c.allows(15.0)
    c.dispatched(15.0)
    assert c.state is HALF_OPEN
    assert not c.allows(15.1)  # one probe at a time
    c.success()
    assert c.state is CLOSED and c.allows(15.2)


def test_a_failed_probe_opens_the_circuit_for_another_cool_down():
    c = Circuit(threshold=1, cooldown=5.0)
    c.failure(0)
    c.dispatched(5.0)
    c.failure(5.5)
    assert c.state is OPEN
    assert not c.allows(10.0)
    assert c.allows(10.5)


def test_a_probe_without_a_verdict_lets_the_next_request_probe():
    c = Circuit(threshold=1, cooldown=1.0)
    c.failure(0)
    c.dispatched(2.0)
    c.abandoned()  # the client left before the engine answered
    assert c.allows(2.1)


def test_a_verdict_is_given_when_its_request_ends_even_by_an_exception():
    now = [0.0]
    c = Circuit(threshold=1, cooldown=5.0)
    try:
        with c.verdict(lambda: now[0]) as v:
            v.healthy = False
            now[0] = 3.0
            raise RuntimeError("the attempt broke")
    except RuntimeError:
        pass
    assert c.state is OPEN and c.opened_at == 3.0  # failed at the end's time, not the start's
    now[0] = 8.0
    with c.verdict(lambda: now[0]):
        assert c.state is HALF_OPEN and not c.allows(8.0)  # dispatched: the one probe
    assert c.state is HALF_OPEN and c.allows(8.1)  # no verdict: the next request may probe
    with c.verdict(lambda: now[0]) as v:
        v.healthy = True
    assert c.state is CLOSED
