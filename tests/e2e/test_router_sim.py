"""The router end to end: a real `llmgw router` process in front of real sim engines.

The openai SDK talks to the router, streaming and not; a client that leaves
mid-stream frees its KV blocks on the engine; SIGTERM drains; with --workers 2
the admin listener merges both workers.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.dev.routerkit import start_router
from llmgw.dev.simkit import start_sim

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sims():
    started = []
    try:
        for _ in range(2):
            started.append(
                start_sim(model="m", itl_ms=2, ttft_ms=1, max_num_seqs=16, kv_blocks=512)
            )
        yield started
    finally:
        for s in started:
            s.stop()


def router_yaml(sims, extra: str = "") -> str:
    eps = "\n".join(
        f"  - {{id: s{i}, url: '{s.url}', models: [m], engine: sim}}" for i, s in enumerate(sims)
    )
    return (
        "log_level: warning\n"
        "admission: {enabled: false}\n"
        "model_defaults: {deadlines: {idle: 1.0}}\n"  # cuts a wedged engine; a busy box never
        "models: [{name: m, aliases: [m-latest]}]\n"
        f"endpoints:\n{eps}\n{extra}"
    )


@pytest.fixture(scope="module")
def router(sims, tmp_path_factory):
    r = start_router(tmp_path_factory.mktemp("router"), router_yaml(sims))
    try:
        yield r
    finally:
        assert r.stop() == 0, r.log_tail()


def settle(sims, timeout: float = 30.0) -> list[dict]:
    """The engines' states once nothing runs or waits (or whatever they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        states = [s.state() for s in sims]
        if all(st["running"] == 0 and st["waiting"] == 0 for st in states):
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(0.02)


def test_openai_sdk_streaming_and_not_chat_and_completions(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="m-latest", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 6
    done = client.completions.create(model="m", prompt="once upon", max_tokens=4)
    assert done.choices[0].text
    streamed = list(client.completions.create(model="m", prompt="a", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in streamed)
    assert [m.id for m in client.models.list()] == ["m", "m-latest"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "x"}])


def test_structured_output_through_the_router_parses_into_a_pydantic_model(router):
    # The simulator answers response_format as vLLM's guided decoding does, so a
    # structured-output client can be tested through the router.
    import pydantic

    class Answer(pydantic.BaseModel):
        city: str
        days: list[int] = pydantic.Field(min_length=2)

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "weather?"}]
    parsed = client.beta.chat.completions.parse(
        model="m", messages=messages, response_format=Answer
    )
    assert len(parsed.choices[0].message.parsed.days) >= 2
    with client.beta.chat.completions.stream(
        model="m", messages=messages, response_format=Answer
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Answer)


def test_a_client_leaving_mid_stream_frees_kv_blocks_on_the_engine(router, sims):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    streams = [
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"tell me a long story {i}"}],
            max_tokens=2000,
            stream=True,
        )
        for i in range(4)
    ]
    for s in streams:
        next(iter(s))
    busy = [s.state() for s in sims]
    assert sum(st["running"] for st in busy) == 4
    assert sum(st["kv_blocks_used"] for st in busy) > 0
    for s in streams:
        s.close()
    states = settle(sims)
    assert [st["kv_blocks_used"] for st in states] == [0, 0]
    assert sum(st["aborted"] for st in states) >= 4


def test_an_engine_error_reaches_the_sdk_as_an_exception_not_a_short_answer(router, sims):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    for s in sims:
        s.set_faults(error_rate=1.0, error_status=500)
    try:
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert err.value.response.headers["x-llmgw-reason"] == "upstream_500"
    finally:
        for s in sims:
            s.set_faults()


def test_a_wedged_engine_is_cut_by_the_idle_watchdog_and_the_sdk_raises(router, sims):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    for s in sims:
        s.set_faults(hang_after_tokens=2)
    try:
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=50, stream=True
        )
        got = []
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                got.append(chunk)
        assert 1 <= len(got) <= 3 and "idle deadline" in err.value.message
        # the router closed the upstream request: the engine freed what it held
        assert [st["kv_blocks_used"] for st in settle(sims)] == [0, 0]
    finally:
        for s in sims:
            s.set_faults()


def test_sigterm_lets_streams_in_flight_finish(sims, tmp_path):
    r = start_router(tmp_path, router_yaml(sims))
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
    result: dict = {}

    under_way = threading.Event()

    def consume():
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=100, stream=True
        )
        n = 0
        for _ in stream:
            n += 1
            under_way.set()
        result["chunks"] = n

    t = threading.Thread(target=consume)
    t.start()
    assert under_way.wait(10)  # 100 tokens at ~2 ms each: SIGTERM lands mid-stream
    code = r.stop()
    t.join(10)
    assert code == 0
    assert result["chunks"] >= 100


def ok_requests(metrics: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "llmgw_router_requests_total" and s.labels["status"] == "200"
    )


def test_two_workers_share_one_admin_listener(sims, tmp_path):
    r = start_router(tmp_path, router_yaml(sims), "--workers", "2")
    try:
        with httpx.Client(timeout=5) as http:
            for _ in range(40):
                resp = http.post(
                    r.url + "/v1/chat/completions",
                    json={
                        "model": "m",
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 1,
                    },
                )
                assert resp.status_code == 200
            # The parent merges the workers' snapshots, sent every interval: wait for the
            # count to arrive (a loaded machine can delay a snapshot well past one interval).
            deadline = time.monotonic() + 30
            while True:
                total = ok_requests(http.get(r.admin_url + "/metrics").text)
                debug = http.get(r.admin_url + "/debug/endpoints").json()
                if total >= 40 and debug["workers"] == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    finally:
        assert r.stop() == 0, r.log_tail()
    assert total == 40
    assert debug["workers"] == 2
    assert {e["id"] for e in debug["endpoints"]} == {"s0", "s1"}
