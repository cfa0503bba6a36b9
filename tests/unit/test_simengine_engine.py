"""The simulated engine's scheduling, KV accounting and timing, driven by invented times."""

from __future__ import annotations

import math

import pytest

from llmgw.simengine.engine import Engine, EngineParams, Request, State
from llmgw.simengine.kvcache import BlockPool


def run(engine: Engine, now: float, until: float = math.inf) -> float:
    """Step at every moment work falls due, as the driver does, until idle or past `until`."""
    for _ in range(100_000):
        engine.step(now)
        nxt = engine.next_step_at()
        if nxt is None or nxt > until:
            return now
        now = max(now, nxt)
    raise AssertionError("engine never went idle")


def req(prompt: int = 10, out: int = 4, **kw) -> Request:
    return Request(prompt_tokens=prompt, max_output=out, **kw)


def test_requests_beyond_max_num_seqs_wait_in_fifo_order():
    eng = Engine(EngineParams(max_num_seqs=2, itl=0.01))
    a, b, c, d = req(), req(), req(), req()
    for r in (a, b, c, d):
        eng.add(r, 0.0)
    eng.step(0.0)
    assert (len(eng.running), len(eng.waiting)) == (2, 2)
    assert a.state is b.state is State.RUNNING
    assert list(eng.waiting) == [c, d]
    run(eng, 0.0)
    assert all(r.finished and r.generated == 4 for r in (a, b, c, d))
    # c was admitted only when a slot freed, and before d.
    assert c.first_token_at >= max(a.last_token_at, b.last_token_at)
    assert c.first_token_at <= d.first_token_at
    assert eng.stats.finished["length"] == 4


def test_running_request_holds_ceil_prompt_plus_generated_over_block_size_blocks():
    eng = Engine(EngineParams(block_size=4, itl=0.01, enable_prefix_caching=False))
    r = req(prompt=6, out=5)
    eng.add(r, 0.0)
    eng.step(0.0)
    assert len(r.blocks) == 2 and eng.pool.used == 2  # ceil(6 / 4)
    now = 0.0
    while not r.finished:
        now = eng.next_step_at()
        eng.step(now)
        if not r.finished:
            assert len(r.blocks) == math.ceil((6 + r.generated) / 4)
            assert eng.pool.used == len(r.blocks)
    assert eng.pool.used == 0 and r.generated == 5


def test_first_token_time_is_overhead_plus_uncached_tokens_times_per_token_cost():
    eng = Engine(EngineParams(ttft=0.05, prefill_per_token=0.001))
    r = req(prompt=100, out=1)
    eng.add(r, 1.0)
    run(eng, 1.0)
    assert r.first_token_at == pytest.approx(1.0 + 0.05 + 100 * 0.001)
    assert eng.stats.ttft.count == 1 and eng.stats.ttft.sum == pytest.approx(0.15)


def test_decode_step_lengthens_with_the_running_batch():
    p = EngineParams(itl=0.01, itl_per_running=0.005)
    alone = Engine(p)
    r = req(out=3)
    alone.add(r, 0.0)
    run(alone, 0.0)
    assert r.last_token_at - r.first_token_at == pytest.approx(2 * 0.015)

    busy = Engine(p)
    rs = [req(out=3) for _ in range(3)]
    for x in rs:
        busy.add(x, 0.0)
    run(busy, 0.0)
    assert rs[0].last_token_at - rs[0].first_token_at == pytest.approx(2 * (0.01 + 3 * 0.005))
    assert busy.stats.itl.count == 3 * 2


def test_zero_latency_finishes_without_time_passing():
    eng = Engine(EngineParams())
    rs = [req(out=16) for _ in range(5)]
    for r in rs:
        eng.add(r, 0.0)
    assert run(eng, 0.0) == 0.0
    assert all(r.finished and r.generated == 16 for r in rs)
    assert eng.next_step_at() is None
    assert eng.stats.generation_tokens == 80


def test_shared_prefix_hits_the_cache_and_shortens_time_to_first_token():
    eng = Engine(EngineParams(block_size=4, ttft=0.01, prefill_per_token=0.001))
    shared = (11, 12, 13)  # three full prompt blocks
    first = req(prompt=14, out=2, block_hashes=shared)
    eng.add(first, 0.0)
    now = run(eng, 0.0)
    assert first.finished and eng.pool.used == 0
    assert eng.pool.cached == 3  # freed, still findable

    second = req(prompt=14, out=2, block_hashes=shared)
    eng.add(second, now)
    run(eng, now)
    assert second.cached_tokens == 12
    ttft_first = first.first_token_at - first.arrival
    ttft_second = second.first_token_at - second.arrival
    assert ttft_first == pytest.approx(0.01 + 14 * 0.001)
    assert ttft_second == pytest.approx(0.01 + 2 * 0.001)
    assert (eng.stats.prefix_cache_queries, eng.stats.prefix_cache_hits) == (28, 12)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    eng = Engine(EngineParams(block_size=4))
    hashes = (1, 2)
    a = req(prompt=8, out=1, block_hashes=hashes)
    eng.add(a, 0.0)
    run(eng, 0.0)
    b = req(prompt=8, out=1, block_hashes=hashes)
    eng.add(b, 0.0)
    run(eng, 0.0)
    assert b.cached_tokens == 4


def test_different_prefixes_do_not_hit_and_prefix_caching_can_be_off():
    eng = Engine(EngineParams(block_size=4))
    eng.add(req(prompt=9, out=1, block_hashes=(1, 2)), 0.0)
    run(eng, 0.0)
    other = req(prompt=9, out=1, block_hashes=(3, 4))
    eng.add(other, 0.0)
    run(eng, 0.0)
    assert other.cached_tokens == 0

    off = Engine(EngineParams(block_size=4, enable_prefix_caching=False))
    for _ in range(2):
        r = req(prompt=9, out=1, block_hashes=(1, 2))
        off.add(r, 0.0)
        run(off, 0.0)
    assert r.cached_tokens == 0 and off.pool.cached == 0


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.register(a[0], 100)
    pool.register(a[1], 101)
    b = pool.allocate(2)
    pool.register(b[0], 200)
    pool.release(a)  # freed first: evicted first
    pool.release(b)
    assert pool.free == 4 and pool.cached == 3  # b[1] has no hash: a plain free block
    pool.allocate(1)  # takes the plain block before evicting anything
    assert pool.match([100, 101]) == a
    pool.allocate(1)  # evicts a's tail block (released last-first, so it is the oldest)
    assert pool.match([100, 101]) == a[:1]
    assert pool.match([200]) == b[:1]


def test_a_request_without_blocks_waits_at_the_head_of_the_queue():
    eng = Engine(EngineParams(num_blocks=4, block_size=4, itl=0.01))
    big = req(prompt=12, out=1)  # 3 blocks, then a 4th for its token
    small = req(prompt=4, out=1)
    blocked = req(prompt=8, out=1)
    eng.add(big, 0.0)
    eng.add(blocked, 0.0)
    eng.add(small, 0.0)
    eng.step(0.0)
    # big takes 3 of 4 blocks; blocked needs 2 and waits, and small queues behind it (FIFO).
    assert list(eng.running) == [big]
    assert list(eng.waiting) == [blocked, small]
    run(eng, 0.0)
    assert big.finished and blocked.finished and small.finished


def test_running_out_of_blocks_preempts_the_newest_request_which_resumes_later():
    eng = Engine(EngineParams(num_blocks=6, block_size=4, itl=0.01))
    old = req(prompt=8, out=8)  # grows to 4 blocks
    new = req(prompt=8, out=8)
    eng.add(old, 0.0)
    eng.add(new, 0.0)
    eng.step(0.0)
    assert len(eng.running) == 2 and eng.pool.used == 4
    run(eng, 0.0)
    assert eng.stats.preemptions >= 1
    assert old.finished and new.finished
    assert (old.generated, new.generated) == (8, 8)
    assert old.last_token_at < new.last_token_at  # the newer one was the victim
    assert eng.pool.used == 0 and not eng.running


def test_abort_frees_slot_and_blocks_at_the_next_step():
    eng = Engine(EngineParams(max_num_seqs=1, itl=0.01))
    running = req(prompt=40, out=100)
    queued = req()
    eng.add(running, 0.0)
    eng.add(queued, 0.0)
    now = run(eng, 0.0, until=0.05)
    assert running.state is State.RUNNING and eng.pool.used == 3
    eng.abort(running)
    eng.abort(queued)
    assert eng.pool.used == 3  # nothing happens until the engine steps
    assert eng.next_step_at() <= now
    touched = eng.step(now)
    assert set(touched) == {running, queued}
    assert running.finished_reason == queued.finished_reason == "abort"
    assert (len(eng.running), len(eng.waiting), eng.pool.used) == (0, 0, 0)
    assert eng.stats.finished["abort"] == 2
    assert eng.next_step_at() is None


def test_hang_keeps_slot_and_blocks_and_produces_nothing_more():
    eng = Engine(EngineParams(itl=0.01))
    r = req(prompt=10, out=10, hang_after=3)
    eng.add(r, 0.0)
    run(eng, 0.0)
    assert r.generated == 3 and r.state is State.RUNNING
    assert eng.next_step_at() is None and eng.pool.used == 1
    eng.abort(r)
    eng.step(1.0)
    assert r.finished_reason == "abort" and eng.pool.used == 0


def test_hang_before_the_first_token():
    eng = Engine(EngineParams())
    r = req(hang_after=0)
    eng.add(r, 0.0)
    run(eng, 0.0)
    assert r.generated == 0 and r.state is State.RUNNING and r.first_token_at is None


def test_slow_first_token_delays_only_the_first_token():
    eng = Engine(EngineParams(ttft=0.01, itl=0.001))
    r = req(out=3, first_token_delay=0.5)
    eng.add(r, 0.0)
    run(eng, 0.0)
    assert r.first_token_at == pytest.approx(0.51)
    assert r.last_token_at - r.first_token_at == pytest.approx(0.002)


def test_zero_output_finishes_when_prefill_ends():
    eng = Engine(EngineParams(ttft=0.02))
    r = req(out=0, final_reason="stop")
    eng.add(r, 0.0)
    run(eng, 0.0)
    assert r.finished_reason == "stop" and r.generated == 0
    assert eng.stats.prompt_tokens == 10 and eng.pool.used == 0


def test_a_late_decode_step_keeps_the_cadence_unless_a_whole_step_was_missed():
    eng = Engine(EngineParams(itl=0.01))
    r = req(out=10)
    eng.add(r, 0.0)
    eng.step(0.0)
    eng.step(0.0)  # prefill done: first token, decode due at 0.01
    assert eng.next_step_at() == pytest.approx(0.01)
    eng.step(0.013)  # 3 ms late
    assert eng.next_step_at() == pytest.approx(0.02)
    eng.step(0.035)  # a whole step missed: restart from now
    assert eng.next_step_at() == pytest.approx(0.045)
    assert r.generated == 3
