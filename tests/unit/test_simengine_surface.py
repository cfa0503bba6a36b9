"""Tool-call decisions, schema-made arguments, logprobs, embeddings and Responses events:
the sim's pure logic, no sockets."""

from __future__ import annotations

import json

import msgspec
import pytest

from llmgw.simengine import embeddings, logprobs, responses, tools, wire
from llmgw.simengine.protocol import ApiError, Limits, RequestParser

FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
G = {"type": "function", "function": {"name": "g"}}


def parser() -> RequestParser:
    return RequestParser(Limits(frozenset({"m"}), 4096, "lorem", 8), seed=1)


@pytest.mark.parametrize(
    ("choice", "last", "name", "reason"),
    [
        ({"type": "function", "function": {"name": "g"}}, "user", "g", "stop"),
        ("required", "tool", "f", "tool_calls"),
        ("auto", "user", "f", "tool_calls"),
        (None, "user", "f", "tool_calls"),
        ("auto", "tool", None, None),
        ("none", "user", None, None),
    ],
)
def test_tool_choice_decides_the_call_as_vllm_does(choice, last, name, reason):
    call = tools.decide([FN, G], choice, last)
    assert (call.name, call.finish_reason) == (name, reason) if name else call is None


def test_responses_flat_tools_and_named_choice():
    flat = [{"type": "function", "name": "h", "parameters": None}]
    call = tools.decide(flat, {"type": "function", "name": "h"}, "user")
    assert call.name == "h" and call.arguments == "{}"


@pytest.mark.parametrize(
    ("tools_", "choice", "param"),
    [
        ([], None, "tools"),
        (None, "required", "tool_choice"),
        ([FN], {"type": "function", "function": {"name": "zz"}}, "tool_choice"),
        ([FN], {"type": "function", "function": {}}, "tool_choice.function.name"),
        ([FN], "sometimes", "tool_choice"),
    ],
)
def test_bad_tool_choices_name_the_field(tools_, choice, param):
    with pytest.raises(tools.ToolChoiceError) as info:
        tools.decide(tools_, choice, "user")
    assert info.value.param == param


def test_arguments_follow_the_schema_loosely():
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer", "minimum": 3},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "e": {"enum": ["x", "y"]},
            "a": {"type": "array", "items": {"type": "integer"}},
            "o": {"type": "object", "properties": {"deep": {"type": ["null", "string"]}}},
            "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "d": {"type": "string", "default": "dflt"},
        },
    }
    args = json.loads(tools.arguments(schema))
    assert args["s"] == "s lorem" and args["i"] == 3 and isinstance(args["n"], float)
    assert args["b"] is True and args["e"] == "x" and args["a"] == [1]
    assert args["o"] == {"deep": "deep lorem"} and args["u"] == 1 and args["d"] == "dflt"
    assert tools.arguments(None) == "{}" and tools.arguments({"type": "string"}) == "{}"


def test_tool_call_arguments_are_the_output_tokens_and_max_tokens_cuts_them():
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": params}}],
        "tool_choice": "required",
    }
    job = parser().chat(msgspec.json.encode(body))
    out = job.outputs[0]
    assert "".join(out.pieces) == '{"city":"city lorem"}' and out.final_reason == "stop"
    assert wire.finish_reason(out, "stop") == "tool_calls"
    cut = parser().chat(msgspec.json.encode({**body, "max_tokens": 2})).outputs[0]
    assert len(cut.pieces) == 2 and cut.final_reason == "length"
    assert wire.finish_reason(cut, "length") == "length"


def test_top_logprobs_without_logprobs_is_refused():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    with pytest.raises(ApiError) as info:
        parser().chat(msgspec.json.encode(body))
    assert info.value.param == "top_logprobs"


def test_logprobs_put_the_sampled_token_first_and_alternatives_below_it():
    pieces = ["lorem", " ipsum", " dolor"]
    content = logprobs.chat_content(pieces, 1, 3)["content"]
    assert [c["token"] for c in content] == [" ipsum", " dolor"]
    for c in content:
        tops = c["top_logprobs"]
        assert tops[0]["token"] == c["token"] and len(tops) == 3
        assert len({t["token"] for t in tops}) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    assert logprobs.chat_content(pieces, 0, 0)["content"][0]["top_logprobs"] == []
    comp = logprobs.completion(pieces, 0, 1, 10)
    assert comp["text_offset"] == [10, 15, 21] and comp["tokens"] == pieces
    assert all(len(top) == 2 for top in comp["top_logprobs"])


def test_embedding_vectors_are_deterministic_unit_vectors():
    a = embeddings.vector(b"hello", 16, None)
    assert a == embeddings.vector(b"hello", 16, None) != embeddings.vector(b"hellp", 16, None)
    assert sum(x * x for x in a) == pytest.approx(1.0)
    short = embeddings.vector(b"hello", 16, 4)
    assert len(short) == 4 and sum(x * x for x in short) == pytest.approx(1.0)


def test_embedding_inputs_of_every_allowed_form():
    served = frozenset({"m"})

    def prompts(value):
        return embeddings.parse(msgspec.json.encode({"model": "m", **value}), served, 100, 8)[1]

    assert prompts({"input": "ab"}) == [b"ab"]
    assert len(prompts({"input": ["a", "b"]})) == 2
    assert len(prompts({"input": [1, 2]})) == 1
    assert len(prompts({"input": [[1], [2, 3]]})) == 2
    assert prompts({"messages": [{"role": "user", "content": "hi"}]})[0].endswith(b"assistant\n")
    for bad in ({"input": ""}, {"input": []}, {"input": [True]}, {}):
        with pytest.raises(ApiError):
            prompts(bad)
    with pytest.raises(ApiError) as too_long:
        prompts({"input": "x" * 500})
    assert too_long.value.code == "context_length_exceeded"


def _response(body: dict) -> responses.Response:
    store = responses.ResponseStore(4)
    parsed = responses.parse(msgspec.json.encode({"model": "m", **body}), parser(), store)
    return responses.Response(parsed)


def test_responses_input_items_become_conversation_turns():
    turns = responses.input_turns(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
        ]
    )
    assert turns == [("user", "q"), ("assistant", "f({})"), ("tool", "42")]
    for bad in ([], [3], [{"role": "robot", "content": "x"}]):
        with pytest.raises(ApiError):
            responses.input_turns(bad)


def test_response_event_sequence_for_text_and_the_final_object():
    resp = _response({"input": "hi", "max_output_tokens": 3, "stream": True})
    enc = responses.EventEncoder(resp)
    events = enc.start() + enc.tokens(0, 2) + enc.tokens(2, 3)
    resp.finish(3, "length", 0)
    events += enc.end()
    kinds = [e.split(b"\n", 1)[0].decode().removeprefix("event: ") for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 3 and kinds[-1] == "response.completed"
    datas = [json.loads(e.split(b"data: ", 1)[1]) for e in events]
    assert [d["sequence_number"] for d in datas] == list(range(len(events)))
    final = datas[-1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 3
    assert final["output"][0]["content"][0]["text"] == resp.text()


def test_response_store_forgets_the_oldest_first():
    store = responses.ResponseStore(2)
    items = [_response({"input": "x"}) for _ in range(3)]
    for r in items:
        store.put(r)
    assert store.get(items[0].id) is None and store.get(items[2].id) is items[2]
    assert len(store) == 2 and store.delete(items[1].id) is items[1] and len(store) == 1
