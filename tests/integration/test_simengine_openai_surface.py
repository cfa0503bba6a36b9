"""What real clients send, through the openai SDK, against a real `llmgw sim-engine` process:
tool calls, n > 1, logprobs, embeddings and the Responses API, in vLLM's shapes."""

from __future__ import annotations

import base64
import json
import struct
import time

import httpx
import openai
import pytest

from llmgw.dev.simkit import SimProcess, start_sim

MODEL = "sim-model"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sim() -> SimProcess:
    with start_sim(max_num_seqs=8, itl_ms=1, max_model_len=4096, embedding_dim=32) as s:
        yield s


@pytest.fixture
def client(sim: SimProcess) -> openai.OpenAI:
    with openai.OpenAI(base_url=sim.base_url, api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def wait_idle(sim: SimProcess, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = sim.state()
        if state["running"] == 0 and state["waiting"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"sim never went idle: {state}")
        time.sleep(0.02)


# -- tool calls ---------------------------------------------------------------------------------


def test_named_tool_choice_returns_a_call_with_schema_shaped_arguments(client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[TIME, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = r.choices[0]
    # vLLM ends a named tool call with "stop" ("tool_calls" is for required and auto).
    assert choice.finish_reason == "stop"
    assert choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days", "unit"}
    assert isinstance(args["city"], str) and isinstance(args["days"], int)
    assert args["unit"] == "celsius"
    assert r.usage.completion_tokens > 0


def test_required_tool_choice_streams_id_and_name_first_then_argument_fragments(
    client: openai.OpenAI,
):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[WEATHER],
        tool_choice="required",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    first, rest = calls[0], calls[1:]
    assert first.id.startswith("chatcmpl-tool-") and first.type == "function"
    assert first.function.name == "get_weather" and first.index == 0
    assert first.function.arguments is None  # vLLM's header carries no arguments
    assert len(rest) > 1, "arguments arrive in several fragments"
    assert all(c.id is None and c.function.name is None and c.index == 0 for c in rest)
    args = json.loads("".join(c.function.arguments for c in rest))
    assert "city" in args
    finals = [c.choices[0] for c in chunks if c.choices]
    assert finals[-1].finish_reason == "tool_calls" and finals[-1].delta.tool_calls is None
    assert all(f.finish_reason is None for f in finals[:-1])
    assert chunks[-1].usage.completion_tokens == len(rest)


def test_auto_calls_a_tool_for_the_user_then_answers_the_tool_result(client: openai.OpenAI):
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    history = [
        *USER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=5
    )
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content and second.choices[0].finish_reason == "length"
    # The tool call and its result are part of the second prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_tool_choice_none_answers_with_text(client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=3
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_bad_tool_choices_are_400_naming_the_field(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert unknown.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as no_tools:
        client.chat.completions.create(model=MODEL, messages=USER, tool_choice="required")
    assert "tools" in no_tools.value.message


# -- n > 1 and logprobs -------------------------------------------------------------------------


def test_n_choices_are_indexed_and_usage_sums_their_tokens(client: openai.OpenAI, sim):
    r = client.chat.completions.create(model=MODEL, messages=USER, n=3, max_tokens=4, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3, "seeded choices still differ"
    assert r.usage.completion_tokens == 12
    again = client.chat.completions.create(model=MODEL, messages=USER, n=3, max_tokens=4, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    c = client.completions.create(model=MODEL, prompt="hello", n=2, max_tokens=3)
    assert [x.index for x in c.choices] == [0, 1] and c.usage.completion_tokens == 6
    assert wait_idle(sim)["running"] == 0


def test_n_choices_stream_interleaved_one_choice_per_chunk(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        n=2,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    per_choice: dict[int, list] = {0: [], 1: []}
    for chunk in chunks:
        if chunk.choices:
            assert len(chunk.choices) == 1
            per_choice[chunk.choices[0].index].append(chunk.choices[0])
    for choices in per_choice.values():
        assert choices[0].delta.role == "assistant"
        assert choices[-1].finish_reason == "length"
        assert sum(1 for c in choices if c.delta.content) == 5
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob < 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob > t.top_logprobs[1].logprob
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, logprobs=True, stream=True
    )
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert len(streamed) == 3 and all(len(lp.content) == 1 for lp in streamed)
    assert streamed[0].content[0].top_logprobs == []


def test_completion_logprobs_in_vllm_shape(client: openai.OpenAI):
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert len(lp.token_logprobs) == 3 and all(v < 0 for v in lp.token_logprobs)
    assert all(
        len(top) == 3 and tok in top for top, tok in zip(lp.top_logprobs, lp.tokens, strict=True)
    )
    stream = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, logprobs=1, stream=True
    )
    offsets = [c.choices[0].logprobs.text_offset[0] for c in stream]
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(set(offsets)) == 3


def test_disconnect_aborts_every_choice(sim: SimProcess):
    body = {"model": MODEL, "messages": USER, "n": 3, "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{sim.url}/v1/chat/completions", json=body, timeout=10) as r:
        for _ in r.iter_lines():
            if sim.state()["running"] == 3:
                break
    state = wait_idle(sim)
    assert state["finished_by_reason"].get("abort", 0) >= 3


# -- embeddings ---------------------------------------------------------------------------------


def test_embeddings_of_strings_and_token_ids_base64_and_float(client: openai.OpenAI, sim):
    # The SDK asks for base64 and decodes it.
    r = client.embeddings.create(model=MODEL, input=["hello", "world", "hello"])
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and all(len(v) == 32 for v in vecs)
    assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
    assert abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-4
    assert r.usage.prompt_tokens == 6 and r.usage.total_tokens == 6
    floats = client.embeddings.create(
        model=MODEL, input="hello", encoding_format="float", dimensions=8
    )
    assert len(floats.data[0].embedding) == 8
    ids = client.embeddings.create(model=MODEL, input=[[1, 2, 3], [4, 5]])
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 5
    raw = httpx.post(
        f"{sim.url}/v1/embeddings",
        json={"model": MODEL, "input": "hello", "encoding_format": "base64"},
        timeout=5,
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert len(packed) == 32 * 4
    assert list(struct.unpack("<32f", packed)) == pytest.approx(vecs[0], abs=1e-6)


def test_bad_embedding_requests_are_400(client: openai.OpenAI):
    for kwargs, param in (
        ({"input": []}, "input"),
        ({"input": "x", "dimensions": 33}, "dimensions"),
        ({"input": [{"x": 1}]}, "input"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.embeddings.create(model=MODEL, **kwargs)
        assert bad.value.body["param"] == param


# -- the Responses API --------------------------------------------------------------------------


def test_responses_create_and_retrieve(client: openai.OpenAI):
    r = client.responses.create(
        model=MODEL, input="Say something.", instructions="Be brief.", max_output_tokens=6
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert len(r.output_text.split()) == 6 and r.instructions == "Be brief."
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert r.usage.input_tokens_details.cached_tokens == 0
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_stream_is_typed_events_without_done(client: openai.OpenAI, sim):
    events = list(
        client.responses.create(model=MODEL, input="hi", max_output_tokens=4, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 4
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # On the wire: `event:` lines and no [DONE].
    with httpx.stream(
        "POST",
        f"{sim.url}/v1/responses",
        json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": True},
        timeout=10,
    ) as r:
        raw = r.read().decode()
    assert raw.startswith("event: response.created\ndata: {")
    assert raw.rstrip().split("\n")[-2] == "event: response.completed"
    assert "[DONE]" not in raw


def test_responses_function_call_stream_and_follow_up(client: openai.OpenAI):
    tool = {"type": "function", **WEATHER["function"]}
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Paris?",
            tools=[tool],
            tool_choice="required",
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    added = events[2].item
    assert added.type == "function_call" and added.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    call = events[-1].response.output[0]
    assert call.arguments == args and json.loads(args)["city"]
    # A follow-up with the tool's output and previous_response_id answers in text.
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=events[-1].response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[tool],
        max_output_tokens=3,
    )
    assert follow.output[0].type == "message" and follow.output_text
    assert follow.usage.input_tokens > events[-1].response.usage.input_tokens


def test_background_response_can_be_cancelled_then_deleted(client: openai.OpenAI, sim):
    r = client.responses.create(model=MODEL, input="long", background=True, max_output_tokens=4000)
    assert r.status == "queued"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    wait_idle(sim)
    done = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)  # vLLM: "Cannot cancel a synchronous response."
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)


def test_background_response_completes_and_is_retrieved(client: openai.OpenAI):
    r = client.responses.create(model=MODEL, input="x", background=True, max_output_tokens=3)
    deadline = time.monotonic() + 20
    while (got := client.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, got.status
        time.sleep(0.02)
    assert got.status == "incomplete" and got.usage.output_tokens == 3


def test_responses_output_text_logprobs_when_included(client: openai.OpenAI):
    include = ["message.output_text.logprobs"]
    r = client.responses.create(
        model=MODEL, input="x", max_output_tokens=3, include=include, top_logprobs=2
    )
    lps = r.output[0].content[0].logprobs
    assert "".join(lp.token for lp in lps) == r.output_text and len(lps) == 3
    assert all(len(lp.top_logprobs) == 2 for lp in lps) and r.top_logprobs == 2
    plain = client.responses.create(model=MODEL, input="x", max_output_tokens=3)
    assert plain.output[0].content[0].logprobs is None and plain.top_logprobs is None
    events = list(
        client.responses.create(
            model=MODEL, input="x", max_output_tokens=3, include=include, stream=True
        )
    )
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(len(e.logprobs) == 1 and e.logprobs[0].token == e.delta for e in deltas)
