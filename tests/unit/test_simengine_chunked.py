"""Chunked prefill: prompt chunks share the decode steps under a token budget, so a long
prompt stalls every running decode (the interference P/D disaggregation removes). Pure engine,
invented times."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw.config import ConfigError
from llmgw.simengine import batch
from llmgw.simengine.config import SimConfig, validate
from llmgw.simengine.engine import Engine, EngineParams, Request
from tests.unit.test_simengine_engine import run

ITL = 0.01
PER_TOKEN = 0.001
CHUNKED = EngineParams(
    itl=ITL, prefill_per_token=PER_TOKEN, enable_chunked_prefill=True, max_num_batched_tokens=512
)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def token_times(eng: Engine, watched: Request, until: float) -> list[float]:
    """Every moment `watched` got a token, stepping as the driver does."""
    times: list[float] = []
    now = 0.0
    while now <= until:
        if watched in eng.step(now) and watched.generated > len(times):
            times.append(now)
        nxt = eng.next_step_at()
        if nxt is None:
            break
        now = max(now, nxt)
    return times


def test_a_long_prompt_stalls_running_decodes_only_with_chunked_prefill():
    def decode_gaps(params: EngineParams) -> list[float]:
        eng = Engine(params)
        chat = Request(10, 30)
        eng.add(chat, 0.0)
        run(eng, 0.0, until=0.1)
        eng.add(Request(2000, 1), 0.1)  # arrives while the chat decodes
        return gaps(token_times(eng, chat, until=10.0))

    separate = decode_gaps(EngineParams(itl=ITL, prefill_per_token=PER_TOKEN))
    assert max(separate) == pytest.approx(ITL)
    shared = decode_gaps(CHUNKED)
    # Four steps carry the prompt's 2000 tokens, 511 at most beside the chat's one token.
    stalled = [g for g in shared if g > 1.5 * ITL]
    assert len(stalled) == 4
    assert max(shared) == pytest.approx(ITL + 511 * PER_TOKEN)
    assert sum(stalled) == pytest.approx(4 * ITL + 2000 * PER_TOKEN, abs=ITL)


def test_without_prefill_in_flight_chunked_steps_last_as_decode_steps_do():
    params = EngineParams(itl=ITL, itl_per_running=0.002)
    for p in (params, replace(params, enable_chunked_prefill=True)):
        eng = Engine(p)
        a, b = Request(10, 20), Request(10, 20)
        eng.add(a, 0.0)
        eng.add(b, 0.0)
        run(eng, 0.0)
        steady = (a.last_token_at - a.first_token_at) / (a.generated - 1)
        assert steady == pytest.approx(ITL + 2 * 0.002)


def test_first_token_time_is_the_steps_that_carried_the_prompt():
    eng = Engine(CHUNKED)
    long = Request(1000, 1)
    eng.add(long, 0.0)
    run(eng, 0.0)
    # Two steps: 512 then 488 prompt tokens.
    assert long.first_token_at == pytest.approx(2 * ITL + 1000 * PER_TOKEN)


def test_prompts_are_chunked_first_come_first_served_within_the_budget():
    params = CHUNKED
    first, second = Request(600, 1), Request(300, 1)
    first.prefill_left, second.prefill_left = 600, 300
    decoding = [Request(10, 5) for _ in range(12)]
    step = batch.plan(params, 1.0, 14, decoding, [first, second])
    assert [(c.req, c.tokens) for c in step.chunks] == [(first, 500)]
    assert step.due == pytest.approx(1.0 + ITL + 500 * PER_TOKEN)
    first.prefill_left = 100
    step = batch.plan(params, 1.0, 14, decoding, [first, second])
    assert [(c.req, c.tokens) for c in step.chunks] == [(first, 100), (second, 300)]


def test_nothing_ready_plans_no_step_and_a_kv_transfer_waits_outside_the_batch():
    params = replace(CHUNKED, kv_transfer=0.05)
    eng = Engine(params)
    leg = Request(3000, 2, external_prefill=True)
    eng.add(leg, 0.0)
    eng.step(0.0)
    assert eng.next_step_at() == pytest.approx(0.05)
    run(eng, 0.0)
    # The transfer, then one step recomputing the last prompt token, as vLLM does.
    assert leg.first_token_at == pytest.approx(0.05 + ITL + PER_TOKEN)
    assert leg.generated == 2


def test_an_aborted_prefill_leaves_the_step_and_frees_its_blocks():
    eng = Engine(CHUNKED)
    long = Request(5000, 1)
    eng.add(long, 0.0)
    eng.step(0.0)
    eng.abort(long)
    run(eng, 0.0)
    assert long.finished_reason == "abort" and eng.pool.used == 0
    assert long.first_token_at is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
        (dict(ttft_ms=5.0), "ttft_ms"),
    ],
)
def test_chunked_prefill_settings_that_cannot_work_are_refused_naming_the_key(options, named):
    with pytest.raises(ConfigError, match=named):
        validate(SimConfig(enable_chunked_prefill=True, **options))
    validate(SimConfig(**options))  # fine with chunked prefill off
