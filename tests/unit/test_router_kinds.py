"""Each API kind's end-of-stream rule: what counts as a complete stream."""

from llmgw.router.request import kinds

COMPLETED = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
DELTA = b'event: response.output_text.delta\ndata: {"delta":"event: response.completed\\n"}\n\n'


def test_chat_streams_end_with_done():
    assert kinds.CHAT.stream.ended(b'data: {"x":1}\n\ndata: [DONE]\n\n')
    assert not kinds.CHAT.stream.ended(b'data: {"x":1}\n\n')


def test_responses_streams_end_with_a_terminal_event_and_no_done():
    rule = kinds.RESPONSES.stream
    assert rule.ended(COMPLETED)
    assert rule.ended(DELTA + COMPLETED)
    assert rule.ended(b"event: response.failed\ndata: {}\n\n")
    assert rule.ended(b"event: response.incomplete\ndata: {}\n\n")
    assert not rule.ended(COMPLETED + DELTA)  # the last event is what counts
    assert not rule.ended(DELTA)  # the name inside a delta's text is not an event
    assert not rule.ended(b"data: [DONE]\n\n")


def test_each_kind_ends_a_broken_stream_in_its_own_error_shape():
    chat = kinds.CHAT.stream.error_event("upstream_broken", "broke", 502)
    assert chat.startswith(b'data: {"error":') and chat.endswith(b"data: [DONE]\n\n")
    resp = kinds.RESPONSES.stream.error_event("upstream_broken", "broke", 502)
    assert resp.startswith(b"event: error\ndata: {") and b"[DONE]" not in resp
    assert kinds.RESPONSES.stream.ended(resp)


def test_the_contract_names_every_kind_the_router_relays():
    from llmgw.contracts import API_KINDS

    assert API_KINDS == tuple(k.name for k in kinds.ALL)
