"""Request bodies: what is routed on, the model rewrite, multipart forms, usage."""

import pytest

from llmgw.router.http.errors import RouterError
from llmgw.router.request import body as rq


def bad(kind, body, ctype=None):
    with pytest.raises(RouterError) as err:
        rq.parse(kind, body, ctype)
    assert err.value.status == 400
    return err.value


def test_chat_body_keeps_the_raw_messages_as_the_prompt():
    p = rq.parse("chat", b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}')
    assert (p.model, p.stream) == ("m", True)
    assert p.prompt == b'[{"role":"user","content":"hi"}]'


def test_responses_input_is_the_prompt_and_non_streaming_kinds_never_stream():
    p = rq.parse("responses", b'{"model":"m","stream":true,"input":"hi"}')
    assert (p.stream, p.prompt) == (True, b'"hi"')
    assert rq.parse("tokenize", b'{"model":"m","stream":true,"prompt":"x"}').stream is False


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "Expected `object`"),
        (b'{"messages": []}', "model", "model"),
        (b'{"model": 3, "messages": []}', "model", "Expected `str"),
        (b'{"model": "m", "stream": "yes", "messages": []}', "stream", "bool"),
    ],
)
def test_bad_bodies_name_the_field(body, param, words):
    err = bad("chat", body)
    assert err.param == param
    assert words in err.message


def test_with_model_rewrites_only_the_model_and_keeps_numbers_no_decoder_takes():
    req = rq.parse("chat", b'{"model":"alias","messages":[],"x":{"y":1e999}}')
    assert rq.with_model(req, "m") == b'{"model":"m","messages":[],"x":{"y":1e999}}'


FORM = (
    b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
    b"Content-Type: audio/wav\r\n\r\nRIFF\x00\x01model\r\n"
    b'--XX\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
    b'--XX\r\nContent-Disposition: form-data; name="stream"\r\n\r\ntrue\r\n--XX--\r\n'
)


def test_a_multipart_form_is_routed_by_its_model_field_and_rewritten_in_place():
    req = rq.parse("transcriptions", FORM, b"multipart/form-data; boundary=XX")
    assert (req.model, req.stream) == ("whisper", True)
    assert req.content_type == "multipart/form-data; boundary=XX"
    assert rq.with_model(req, "w2") == FORM.replace(b"\r\n\r\nwhisper\r\n", b"\r\n\r\nw2\r\n")
    no_model = FORM.replace(b'name="model"', b'name="language"')
    assert bad("transcriptions", no_model, b"multipart/form-data; boundary=XX").param == "model"
    assert bad("transcriptions", b"{}", b"application/json").reason == "invalid_request"


def test_usage_is_read_from_bodies_and_chunks():
    assert rq.usage_of(b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}') == rq.Usage(3, 4)
    assert rq.usage_of(b'{"choices":[]}') is None
    assert rq.usage_of(b"garbage") is None
    done = (
        b'{"type":"response.completed","response":{"usage":{"input_tokens":2,"output_tokens":5}}}'
    )
    assert rq.response_usage_of(done) == rq.Usage(2, 5)
    assert rq.response_usage_of(
        b'{"id":"resp_1","usage":{"input_tokens":1,"output_tokens":1}}'
    ) == rq.Usage(1, 1)
