"""What the router refuses itself (size, nesting, the types it reads), and what it leaves
to the engine: a gateway in front of vLLM must not refuse what vLLM accepts."""

import json

import pytest

from llmgw.router.http.errors import RouterError
from llmgw.router.request import body as rq
from llmgw.router.request import validation as v

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
        ({"stream": 1}, "stream", "Expected `bool"),
        ({"model": 7}, "model", "Expected `str"),
        ({"model": "m" * 257}, "model", "at most 256 characters"),
        ({"model": "m\x00"}, "model", "control characters"),
        ({"model": "m\n"}, "model", "control characters"),
    ],
)
def test_the_keys_the_router_reads_are_typed(fields, param, words):
    err = rejected("chat", chat(**fields))
    assert err.param == param, err.message
    assert words in err.message


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("chat", {"temperature": 2.5}),
        ("chat", {"top_logprobs": 21, "logprobs": True}),
        ("chat", {"max_tokens": 10.0}),
        ("chat", {"n": 1000, "stop": 5, "seed": 1.5, "logit_bias": {"1": 500}}),
        ("chat", {"messages": [1]}),
        ("chat", {"messages": "hi"}),
        ("embeddings", {"messages": HI}),  # vLLM's chat-style embeddings
        ("completions", {"prompt_embeds": "AAAA"}),  # no prompt at all
        ("completions", {"prompt": 5}),
        ("embeddings", {"input": {"a": 1}, "encoding_format": "hex"}),
    ],
)
def test_values_the_engine_judges_pass_through_unread(kind, fields):
    body = json.dumps({"model": "m", **fields}).encode()
    parsed = rq.parse(kind, body)
    assert parsed.body == body and parsed.model == "m"


def test_the_token_allowance_is_read_leniently_for_admission():
    assert rq.parse("chat", chat(max_tokens=10.0)).max_tokens == 10
    assert rq.parse("chat", chat(max_tokens=7, max_completion_tokens=3)).max_tokens == 3
    assert rq.parse("responses", b'{"model":"m","max_output_tokens":9}').max_tokens == 9
    assert rq.parse("chat", chat(max_tokens="ten")).max_tokens is None  # the engine's call
    assert rq.parse("chat", b'{"model":"m","max_tokens":1e999}').max_tokens is None


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_nesting_beyond_the_limit_is_refused_before_decoding(opener):
    closer = "]" if opener == "[" else "}"

    def nested(levels: int) -> bytes:
        # The body itself is one level; `x` adds the rest.
        return ('{"model":"m","messages":[{"role":"user"}],"x":' + opener * (levels - 1)
                + "1" + closer * (levels - 1) + "}").encode()  # fmt: skip

    rq.parse("chat", nested(v.MAX_DEPTH))
    err = rejected("chat", nested(v.MAX_DEPTH + 1))
    assert err.reason == "too_deep" and "64 levels" in err.message
    err = rejected("chat", nested(200_000))  # far past any recursion limit: still a 400
    assert err.reason == "too_deep"


def test_brackets_inside_strings_do_not_count_as_nesting():
    content = '[{"\\"[[[' * 200 + "\\\\"
    body = chat(messages=[{"role": "user", "content": content}])
    assert v.depth(body) == 3
    assert rq.parse("chat", body).model == "m"
