"""A real `llmgw sim-engine` process, driven over HTTP by the openai SDK, httpx and raw streams."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.dev.simkit import SimProcess, start_sim

MODEL = "sim-model"
# Slow enough that a long stream is still running when the test looks at it, fast enough to
# keep the whole file to a few seconds.
SIM_OPTIONS = dict(
    served_model_name=[MODEL, "alias"],
    max_num_seqs=4,
    itl_ms=2,
    prefill_ms_per_token=0.2,
    block_size=16,
    max_model_len=4096,
)


@pytest.fixture(scope="module")
def sim() -> SimProcess:
    with start_sim(**SIM_OPTIONS) as s:
        yield s


@pytest.fixture(autouse=True)
def no_faults(sim: SimProcess):
    yield
    sim.set_faults()


@pytest.fixture
def client(sim: SimProcess) -> openai.OpenAI:
    with openai.OpenAI(base_url=sim.base_url, api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def wait_for_state(sim: SimProcess, pred, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = sim.state()
        if pred(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"state never matched: {state}")
        time.sleep(0.02)


def metrics(sim: SimProcess) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(sim.metrics_text())}


def sample(families: dict, name: str, **labels) -> float:
    for family in families.values():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels}")


# -- the openai SDK parses every shape ---------------------------------------------------------


def test_chat_completion(client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=7
    )
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_stream_with_usage_chunk(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model="alias",
        messages=[{"role": "user", "content": "Stream please."}],
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(content) == 5
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert len({c.id for c in chunks}) == 1


def test_completion_and_completion_stream(client: openai.OpenAI):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 4

    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True))
    assert len(chunks) == 3  # no usage chunk unless asked
    assert "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_sequence_ends_with_stop(client: openai.OpenAI):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=50, stop=[" "], seed=3)
    assert r.choices[0].finish_reason == "stop"
    assert " " not in r.choices[0].text


def test_models_list_reports_max_model_len(client: openai.OpenAI):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "alias"]
    assert models[0].model_extra["max_model_len"] == 4096


def test_errors_are_openai_shaped_and_raised_by_the_sdk(client: openai.OpenAI, sim: SimProcess):
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert nf.value.status_code == 404 and "nope" in nf.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", n=0)
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt="word " * 4000, max_tokens=1)
    assert long.value.code == "context_length_exceeded"
    # Malformed bodies and wrong types never reach a 500.
    for raw in (b"{", b'{"model": 1, "prompt": "x"}', b'{"model": "sim-model", "prompt": null}'):
        r = httpx.post(f"{sim.url}/v1/completions", content=raw, timeout=5)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{sim.url}/v2/nothing", timeout=5)
    assert r.status_code == 404 and "error" in r.json()


# -- metrics -----------------------------------------------------------------------------------


def test_metrics_have_vllm_names_types_and_labels(client: openai.OpenAI, sim: SimProcess):
    before = metrics(sim)
    client.completions.create(model=MODEL, prompt="12345678", max_tokens=3)
    after = metrics(sim)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }
    assert {name: after[name].type for name in expected} == expected
    for name in expected:
        assert all(s.labels["model_name"] == MODEL for s in after[name].samples)
    info = after["vllm:cache_config_info"].samples[0].labels
    assert (info["block_size"], info["num_gpu_blocks"]) == ("16", "4096")

    def delta(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == 2
    assert delta("vllm:generation_tokens_total") == 3
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert 0 <= sample(after, "vllm:kv_cache_usage_perc") <= 1


# -- engine behaviour seen from outside --------------------------------------------------------


async def _open_stream(http: httpx.AsyncClient, max_tokens: int, **extra) -> tuple:
    """Start a streamed completion; returns (response, its line iterator) once headers arrive."""
    body = {
        "model": MODEL,
        "prompt": "tell me a long story",
        "max_tokens": max_tokens,
        "stream": True,
    }
    body.update(extra)
    cm = http.stream("POST", "/v1/completions", json=body)
    resp = await cm.__aenter__()
    return cm, resp, resp.aiter_lines()


async def _next_event(lines, timeout: float = 5.0) -> str:
    while True:
        line = await asyncio.wait_for(lines.__anext__(), timeout)
        if line.startswith("data: "):
            return line


async def test_disconnect_mid_stream_frees_blocks_and_slot(sim: SimProcess):
    aborted_before = sim.state()["aborted"]
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:
        cm, resp, lines = await _open_stream(http, max_tokens=3000)
        for _ in range(3):
            await _next_event(lines)
        busy = sim.state()
        assert busy["running"] == 1 and busy["kv_blocks_used"] >= 1
        await cm.__aexit__(None, None, None)
    state = wait_for_state(sim, lambda s: s["running"] == 0 and s["kv_blocks_used"] == 0)
    assert state["aborted"] == aborted_before + 1
    assert sample(metrics(sim), "vllm:request_success_total", finished_reason="abort") >= 1


async def test_requests_beyond_max_num_seqs_wait(sim: SimProcess):
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:
        streams = [await _open_stream(http, max_tokens=3000) for _ in range(6)]
        state = await asyncio.to_thread(
            wait_for_state, sim, lambda s: s["running"] == 4 and s["waiting"] == 2
        )
        assert state["kv_blocks_used"] >= 4
        m = metrics(sim)
        assert sample(m, "vllm:num_requests_running") == 4
        assert sample(m, "vllm:num_requests_waiting") == 2
        for cm, _, _ in streams:
            await cm.__aexit__(None, None, None)
    wait_for_state(sim, lambda s: (s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0))


def test_shared_prefix_hits_the_cache_and_shortens_time_to_first_token(sim: SimProcess):
    # ~3k tokens: a cold prefill of ~600 ms leaves a loaded box room for a warm one's delays.
    system = "You are a meticulous assistant who answers in full sentences. " * 180

    def ttft(question: str) -> tuple[float, int]:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = None
        cached = None
        with httpx.stream("POST", f"{sim.url}/v1/chat/completions", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line and first is None:
                    first = time.perf_counter() - start
                if '"prompt_tokens_details"' in line:
                    cached = httpx.Response(200, content=line[6:]).json()["usage"]
                    cached = cached["prompt_tokens_details"]["cached_tokens"]
        return first, cached

    hits_before = sim.state()["prefix_cache_hits"]
    cold, cold_cached = ttft("What is a prefix cache?")
    warm = [ttft(q) for q in ("And why does it help?", "Where?", "When?")]
    assert cold_cached == 0 and all(cached >= 2700 for _, cached in warm)
    assert sim.state()["prefix_cache_hits"] - hits_before == sum(cached for _, cached in warm)
    # ~3k uncached tokens at 0.2 ms each against a handful: the warm ones are far quicker.
    # (The cold one cannot be quicker than its simulated prefill; a loaded machine only adds
    # delay, so the best of three warm ones is compared.)
    assert min(t for t, _ in warm) < cold / 2


# -- faults ------------------------------------------------------------------------------------


def test_error_rate_fault_answers_with_the_chosen_status(client: openai.OpenAI, sim: SimProcess):
    assert sim.set_faults(error_rate=1.0, error_status=503)["error_status"] == 503
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert err.value.status_code == 503 and err.value.code == "injected_fault"
    sim.set_faults(error_rate=1.0, error_status=429)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    sim.set_faults(error_rate=0.5)
    outcomes = []
    for _ in range(40):
        try:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
            outcomes.append(True)
        except openai.InternalServerError:
            outcomes.append(False)
    assert 5 < outcomes.count(False) < 35
    sim.set_faults()
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_bad_fault_settings_are_rejected(sim: SimProcess):
    r = httpx.post(f"{sim.url}/sim/faults", json={"error_rate": 2}, timeout=5)
    assert r.status_code == 400 and "error_rate" in r.json()["error"]["message"]
    r = httpx.post(f"{sim.url}/sim/faults", json={"no_such_fault": 1}, timeout=5)
    assert r.status_code == 400 and "no_such_fault" in r.json()["error"]["message"]


async def test_hang_after_tokens_keeps_the_connection_open_and_silent(sim: SimProcess):
    sim.set_faults(hang_after_tokens=2)
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:
        cm, resp, lines = await _open_stream(http, max_tokens=50)
        assert resp.status_code == 200
        events: list[str] = []

        async def read() -> None:
            async for line in lines:
                if line.startswith("data: "):
                    events.append(line)

        # A reader that is never cancelled: cancelling a read would close the stream.
        reader = asyncio.create_task(read())
        deadline = time.monotonic() + 10
        while len(events) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.4)  # 48 more tokens would take ~100 ms
        assert len(events) == 2 and not reader.done()
        wedged = sim.state()
        assert wedged["running"] == 1 and wedged["kv_blocks_used"] >= 1
        await cm.__aexit__(None, None, None)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.StreamClosed):
            await reader
    wait_for_state(sim, lambda s: s["running"] == 0 and s["kv_blocks_used"] == 0)


def test_slow_first_token_delays_the_first_token(sim: SimProcess):
    sim.set_faults(slow_first_token_ms=300)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as r:
        headers_at = time.perf_counter() - start
        first_at = None
        for line in r.iter_lines():
            if line.startswith("data: {") and first_at is None:
                first_at = time.perf_counter() - start
    assert first_at >= 0.3
    assert headers_at < first_at  # headers go out at once, as vLLM's do


async def test_disconnect_before_headers_of_a_non_streamed_request_aborts_it(sim: SimProcess):
    sim.set_faults(hang_after_tokens=0)
    async with httpx.AsyncClient(base_url=sim.url, timeout=0.3) as http:
        with contextlib.suppress(httpx.ReadTimeout):
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    wait_for_state(sim, lambda s: s["running"] == 0 and s["kv_blocks_used"] == 0)
