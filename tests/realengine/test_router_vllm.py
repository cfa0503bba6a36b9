"""A real `llmgw router` in front of one real vLLM (CPU, tiny random Llama).

What the relay must guarantee against the real engine: the openai SDK's requests,
streamed and not, reach vLLM unchanged and come back whole (usage, logprobs, n>1,
tool calls); the router reads the engine's load from vLLM's own /metrics; a client
that leaves mid-stream ends the request inside vLLM.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from llmgw.dev.routerkit import start_router
from tests.realengine import kit
from tests.realengine.kit import MODEL, NO_EOS

pytestmark = pytest.mark.real_engine

GENERATED = "vllm:generation_tokens_total"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def router(vllm_engine, tmp_path_factory):
    body = (
        "log_level: warning\n"
        "admission: {enabled: false}\n"
        f"models: [{{name: {MODEL}, aliases: [{MODEL}-latest]}}]\n"
        f"endpoints:\n  - {{id: v0, url: '{vllm_engine.url}', models: [{MODEL}], engine: vllm}}\n"
    )
    r = start_router(tmp_path_factory.mktemp("router"), body)
    try:
        yield r
    finally:
        assert r.stop() == 0, r.log_tail()


@pytest.fixture
def sdk(router):
    with openai.OpenAI(
        base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


@pytest.fixture
def direct(vllm_engine):
    with openai.OpenAI(
        base_url=vllm_engine.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def test_the_adapters_command_line_is_what_the_engine_runs(vllm_engine):
    # The engine of this module was started from the agent adapter's argv, in the
    # `python -m vllm.entrypoints.openai.api_server --model` form.
    assert vllm_engine.argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert httpx.get(f"{vllm_engine.url}/health", timeout=10).status_code == 200


def test_chat_and_completions_streamed_and_not_with_usage(sdk):
    reply = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, extra_body=NO_EOS)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens > 0 and reply.model == MODEL
    chunks = list(
        sdk.chat.completions.create(
            model=f"{MODEL}-latest",  # an alias: the router names the model the engine serves
            messages=HI,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage.completion_tokens == 7
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    done = sdk.completions.create(model=MODEL, prompt="once upon", max_tokens=4, extra_body=NO_EOS)
    assert done.choices[0].text and done.usage.completion_tokens == 4
    streamed = list(
        sdk.completions.create(
            model=MODEL, prompt="a", max_tokens=3, stream=True, extra_body=NO_EOS
        )
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices)
    assert [m.id for m in sdk.models.list()] == [MODEL, f"{MODEL}-latest"]


def test_logprobs_and_n_greater_than_one_come_back_whole(sdk):
    reply = sdk.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, n=3, logprobs=True, top_logprobs=2,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert sorted(ch.index for ch in reply.choices) == [0, 1, 2]
    assert reply.usage.completion_tokens == 15
    for ch in reply.choices:
        assert len(ch.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in ch.logprobs.content)
    # Streamed: every choice's tokens arrive, each chunk with its logprobs.
    per_choice: dict[int, int] = {}
    for chunk in sdk.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=4, n=2, logprobs=True, stream=True,
        extra_body=NO_EOS,
    ):  # fmt: skip
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                per_choice[ch.index] = per_choice.get(ch.index, 0) + len(ch.logprobs.content)
    assert per_choice == {0: 4, 1: 4}


def _answer(resp) -> tuple[str, list[tuple[str, str]]]:
    msg = resp.choices[0].message
    calls = [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls or []]
    return msg.content or "", calls


def _assembled(stream) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                if tc.function:
                    name += tc.function.name or ""
                    args += tc.function.arguments or ""
                calls[tc.index] = (name, args)
    return content, [calls[i] for i in sorted(calls)]


def test_a_tool_call_request_passes_through_as_the_engine_answers_it(sdk, direct):
    # The tiny model writes random arguments (often no complete call within max_tokens),
    # so what is asserted is what the relay owes: the tools and the tool_choice reach
    # vLLM (the tools are in the prompt it counts; the named choice forces its hermes
    # `<tool_call>` format), and its answer comes back as it gave it, streamed and not:
    # greedy decoding makes the router's answer and the engine's own the same.
    req = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
    )
    via_router = sdk.chat.completions.create(**req)
    straight = direct.chat.completions.create(**req)
    assert via_router.usage == straight.usage
    without_tools = sdk.chat.completions.create(model=MODEL, messages=req["messages"], max_tokens=1)
    assert via_router.usage.prompt_tokens > without_tools.usage.prompt_tokens
    content, calls = _answer(via_router)
    assert (content, calls) == _answer(straight)
    assert calls == [("get_weather", calls[0][1])] if calls else "<tool_call>" in content
    streamed = _assembled(sdk.chat.completions.create(**req, stream=True))
    assert streamed == _assembled(direct.chat.completions.create(**req, stream=True))
    # "required" and "auto" (this engine runs a tool parser): answered, never refused.
    for choice in ("required", "auto"):
        reply = sdk.chat.completions.create(**{**req, "tool_choice": choice})
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _router_load(router) -> dict | None:
    [ep] = httpx.get(f"{router.admin_url}/debug/endpoints", timeout=10).json()["endpoints"]
    return ep["load"] if ep["load"] and not ep["stale"] else None


def test_the_router_reads_the_load_from_vllms_metrics_and_a_client_leaving_aborts_the_request(
    router, sdk, vllm_engine
):
    assert kit.wait(lambda: _router_load(router), 60, "a fresh load sample in the router")
    generated = vllm_engine.counter(GENERATED)
    streams = [
        sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"a long story {i}"}],
            max_tokens=8000,  # a minute or more on a CPU: still running when abandoned
            stream=True,
            extra_body=NO_EOS,
        )
        for i in range(2)
    ]
    for s in streams:
        next(iter(s))
    # Both run in vLLM, and the router's view says so from vLLM's own gauges.
    kit.wait(lambda: vllm_engine.running() == 2, 60, "vLLM to run both requests")
    seen = kit.wait(
        lambda: (load := _router_load(router)) and load["running"] == 2 and load,
        60,
        "the router to read 2 running requests from /metrics",
    )
    assert seen["source"] and seen["kv_usage"] > 0
    for s in streams:
        s.close()
    # vLLM aborts what nobody reads any more: running back to 0 and no more tokens made,
    # far short of the 16000 asked for. (vLLM 0.32 does not count client aborts in
    # vllm:request_success_total{finished_reason="abort"}.)
    kit.wait(lambda: vllm_engine.running() == 0, 30, "vLLM to abort the abandoned requests")
    made = vllm_engine.counter(GENERATED) - generated
    time.sleep(1)  # nothing more happens: the requests are gone, not paused
    assert vllm_engine.counter(GENERATED) - generated == made < 2 * 8000
    kit.wait(
        lambda: (load := _router_load(router)) and load["running"] == 0,
        30,
        "the router to see the engine idle",
    )
