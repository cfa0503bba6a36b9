"""Request bodies: what is routed on, and the 400s naming the field at fault."""

import pytest

from llmgw.router import requests as rq
from llmgw.router.errors import RouterError


def bad(kind, body):
    with pytest.raises(RouterError) as err:
        rq.parse(kind, body)
    assert err.value.status == 400
    return err.value


def test_chat_body_keeps_the_raw_messages_as_the_prompt():
    p = rq.parse(
        rq.CHAT, b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    )
    assert (p.model, p.stream) == ("m", True)
    assert p.prompt == b'[{"role":"user","content":"hi"}]'


@pytest.mark.parametrize(
    ("kind", "body", "param", "words"),
    [
        (rq.CHAT, b"{not json", None, "not valid JSON"),
        (rq.CHAT, b"[1, 2]", None, "Expected `object`"),
        (rq.CHAT, b'{"messages": []}', "model", "model"),
        (rq.CHAT, b'{"model": 3, "messages": []}', "model", "Expected `str"),
        (rq.CHAT, b'{"model": "m", "stream": "yes", "messages": []}', "stream", "bool"),
        (rq.CHAT, b'{"model": "m"}', "messages", "messages is required"),
        (rq.CHAT, b'{"model": "m", "messages": "hi"}', "messages", "must be an array"),
        (rq.COMPLETIONS, b'{"model": "m"}', "prompt", "prompt is required"),
        (rq.EMBEDDINGS, b'{"model": "m", "input": null}', "input", "input is required"),
    ],
)
def test_bad_bodies_name_the_field(kind, body, param, words):
    err = bad(kind, body)
    assert err.param == param
    assert words in err.message


def test_with_model_rewrites_only_the_model():
    out = rq.with_model(b'{"model":"alias","messages":[],"x":{"y":1}}', "m")
    assert out == b'{"model":"m","messages":[],"x":{"y":1}}'


def test_usage_is_read_from_bodies_and_chunks():
    assert rq.usage_of(b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}') == rq.Usage(3, 4)
    assert rq.usage_of(b'{"choices":[]}') is None
    assert rq.usage_of(b"garbage") is None
