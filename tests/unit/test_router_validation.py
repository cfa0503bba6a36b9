"""Request limits and typed fields: each bad value is a 400 that names the field or the limit."""

import json

import pytest

from llmgw.router import requests as rq
from llmgw.router import validation as v
from llmgw.router.errors import RouterError

HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": HI, **fields}).encode()


def rejected(kind: str, body: bytes) -> RouterError:
    with pytest.raises(RouterError) as err:
        rq.parse(kind, body)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"temperature": "hot"}, "temperature", "Expected `float"),
        ({"temperature": 2.5}, "temperature", "<= 2"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"top_p": 1.5}, "top_p", "<= 1"),
        ({"n": 0}, "n", ">= 1"),
        ({"n": 1000}, "n", "<= 128"),
        ({"max_tokens": -1}, "max_tokens", ">= 0"),
        ({"max_tokens": 2**40}, "max_tokens", "<= 2147483647"),
        ({"max_completion_tokens": "ten"}, "max_completion_tokens", "Expected `int"),
        ({"stream": 1}, "stream", "Expected `bool"),
        ({"stop": 5}, "stop", "Expected `str | array"),
        ({"stop": ["a", 3]}, "stop[1]", "Expected `str`"),
        ({"presence_penalty": 3}, "presence_penalty", "<= 2.0"),
        ({"logit_bias": {"50256": 101}}, "logit_bias[...]", "<= 100"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "bool"),
        ({"logprobs": 3}, "logprobs", "Expected `bool"),
        ({"top_logprobs": 21}, "top_logprobs", "<= 20"),
        ({"seed": 1.5}, "seed", "Expected `int"),
        ({"messages": []}, "messages", "length >= 1"),
        ({"messages": [1]}, "messages[0]", "Expected `object`"),
        ({"messages": [{"content": "x"}]}, "messages[0]", "missing required field `role`"),
        ({"messages": [{"role": 7}]}, "messages[0].role", "Expected `str`"),
        ({"model": "m" * 257}, "model", "at most 256 characters"),
        ({"model": "m\x00"}, "model", "control characters"),
        ({"model": "m\n"}, "model", "control characters"),
    ],
)
def test_chat_fields_are_typed_and_ranged(fields, param, words):
    err = rejected(rq.CHAT, chat(**fields))
    assert err.param == param, err.message
    assert words in err.message


def test_message_count_is_limited_and_the_error_names_the_limit():
    ok = rq.parse(rq.CHAT, chat(messages=HI * v.MAX_MESSAGES))
    assert ok.prompt.count(b'"role"') == v.MAX_MESSAGES
    err = rejected(rq.CHAT, chat(messages=HI * (v.MAX_MESSAGES + 1)))
    assert err.param == "messages" and "length <= 2048" in err.message


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_nesting_beyond_the_limit_is_refused_before_decoding(opener):
    closer = "]" if opener == "[" else "}"

    def nested(levels: int) -> bytes:
        # The body itself is one level; `x` adds the rest.
        return ('{"model":"m","messages":[{"role":"user"}],"x":' + opener * (levels - 1)
                + "1" + closer * (levels - 1) + "}").encode()  # fmt: skip

    rq.parse(rq.CHAT, nested(v.MAX_DEPTH))
    err = rejected(rq.CHAT, nested(v.MAX_DEPTH + 1))
    assert err.reason == "too_deep" and "64 levels" in err.message
    err = rejected(rq.CHAT, nested(200_000))  # far past any recursion limit: still a 400
    assert err.reason == "too_deep"


def test_brackets_inside_strings_do_not_count_as_nesting():
    content = '[{"\\"[[[' * 200 + "\\\\"
    body = chat(messages=[{"role": "user", "content": content}])
    assert v.depth(body) == 3
    assert rq.parse(rq.CHAT, body).model == "m"


@pytest.mark.parametrize(
    ("kind", "body", "param", "words"),
    [
        (rq.COMPLETIONS, {"prompt": 5}, "prompt", "Expected `str | array`"),
        (rq.COMPLETIONS, {"prompt": []}, "prompt", "length >= 1"),
        (rq.COMPLETIONS, {"prompt": [[1, "a"]]}, "prompt[0][1]", "Expected `int`"),
        (rq.COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs", "Expected `int"),
        (rq.COMPLETIONS, {"prompt": "x", "best_of": 0}, "best_of", ">= 1"),
        (rq.EMBEDDINGS, {"input": {"a": 1}}, "input", "Expected `str | array`"),
        (rq.EMBEDDINGS, {"input": "x", "encoding_format": "hex"}, "encoding_format", "'hex'"),
        (rq.EMBEDDINGS, {"input": "x", "dimensions": 0}, "dimensions", ">= 1"),
    ],
)
def test_completions_and_embeddings_fields(kind, body, param, words):
    err = rejected(kind, json.dumps({"model": "m", **body}).encode())
    assert err.param == param, err.message
    assert words in err.message


def test_valid_requests_pass_with_unknown_fields_untouched():
    body = chat(temperature=0, top_p=1, n=2, stop=["\n"], max_tokens=0, guided_json={"a": [1]})
    parsed = rq.parse(rq.CHAT, body)
    assert parsed.body == body and parsed.max_tokens == 0
    tokens = rq.parse(rq.COMPLETIONS, b'{"model":"m","prompt":[[1,2],[3]],"echo":true}')
    assert tokens.prompt == b"[[1,2],[3]]"
    emb = rq.parse(rq.EMBEDDINGS, b'{"model":"m","input":["a","b"],"encoding_format":"base64"}')
    assert (emb.kind, emb.stream, emb.prompt) == (rq.EMBEDDINGS, False, b"")
