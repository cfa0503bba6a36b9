"""Mid-stream migration's pure rule: the continued body, the token arithmetic, and the
continuation's chunks rewritten to read as the first attempt's."""

import json

import pytest

from llmgw.router.relay import continuation as c
from llmgw.router.request import kinds


def chat_chunk(i, content=None, role=None, finish=None, cid="chatcmpl-1", created=100):
    delta = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return json.dumps(
        {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": "m",
            "choices": [choice],
        }
    ).encode()


def usage_chunk(prompt, completion, cid="chatcmpl-1", created=100):
    return json.dumps(
        {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": "m",
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
    ).encode()


def sse(*datas: bytes) -> bytes:
    return b"".join(b"data: " + d + b"\n\n" for d in datas)


def decoded(out: bytes) -> list:
    return [
        e[len(b"data: ") :] if e.endswith(b"[DONE]") else json.loads(e[len(b"data: ") :])
        for e in out.split(b"\n\n")
        if e
    ]


CHAT_BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 10,
    "min_tokens": 4,
    "stream": True,
    "logprobs": True,
    "top_logprobs": 2,
    "stream_options": {"include_usage": True},
}


def test_a_chat_stream_continues_with_the_partial_assistant_message_and_fewer_tokens():
    sent = c.Sent(c.CHAT, json.dumps(CHAT_BODY).encode(), allowed=1)
    out = sse(chat_chunk(0, "", role="assistant"), chat_chunk(1, "Hel"), chat_chunk(2, "lo"))
    assert sent.feed(out) == (out, None)  # the first attempt's bytes go on unchanged
    assert sent.resumable() and not sent.done()
    body = json.loads(sent.continuation())
    assert body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8 and body["min_tokens"] == 2
    assert body["logprobs"] is True and body["top_logprobs"] == 2  # logprobs carry on
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert not sent.resumable()  # max 1, used


def test_a_completion_continues_from_the_prompt_plus_the_text_sent():
    body = {"model": "m", "prompt": ["Once"], "max_tokens": 5, "stream": True}
    sent = c.Sent(c.COMPLETIONS, json.dumps(body).encode(), allowed=2)
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
    out = sse(
        json.dumps({**chunk, "choices": [{"index": 0, "text": " upon"}]}).encode(),
        json.dumps({**chunk, "choices": [{"index": 0, "text": " a"}]}).encode(),
    )
    sent.feed(out)
    again = json.loads(sent.continuation())
    assert again["prompt"] == "Once upon a" and again["max_tokens"] == 3
    # The client did not ask for usage: the router asks, to sum it, and drops it later.
    assert again["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent.resumable()


def test_the_continuation_reads_as_the_first_attempt_and_usage_is_summed():
    sent = c.Sent(c.CHAT, json.dumps(CHAT_BODY).encode(), allowed=1)
    sent.feed(sse(chat_chunk(0, "", role="assistant"), chat_chunk(1, "a"), chat_chunk(2, "b")))
    sent.continuation()
    # The second engine: its own id and created, a role chunk again, usage of its own
    # (its prompt holds the 2 tokens already sent).
    theirs = (
        sse(
            chat_chunk(0, "", role="assistant", cid="chatcmpl-2", created=200),
            chat_chunk(1, "c", cid="chatcmpl-2", created=200),
            chat_chunk(2, None, finish="length", cid="chatcmpl-2", created=200),
            usage_chunk(7, 8, cid="chatcmpl-2", created=200),
        )
        + b"data: [DONE]\n\n"
    )
    out, error = sent.feed(theirs)
    got = decoded(out)
    assert error is None and got[-1] == b"[DONE]"
    chunks = got[:-1]
    assert [ch["id"] for ch in chunks] == ["chatcmpl-1"] * 3  # no second role chunk
    assert {ch["created"] for ch in chunks} == {100}
    assert chunks[0]["choices"][0]["delta"] == {"content": "c"}
    assert chunks[2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
    assert sent.usage == (5, 10)


def test_the_routers_own_usage_chunk_is_dropped_when_the_client_did_not_ask():
    body = {**CHAT_BODY, "stream_options": None}
    sent = c.Sent(c.CHAT, json.dumps(body).encode(), allowed=1)
    sent.feed(sse(chat_chunk(1, "a")))
    sent.continuation()
    out, _ = sent.feed(sse(chat_chunk(1, "b"), usage_chunk(4, 9)) + b"data: [DONE]\n\n")
    assert [e for e in decoded(out) if isinstance(e, dict) and "usage" in e] == []
    assert sent.usage == (3, 10)  # still counted, for the router's metrics and quotas


def test_an_in_band_engine_error_is_held_back_as_a_cut():
    sent = c.Sent(c.CHAT, json.dumps(CHAT_BODY).encode(), allowed=1)
    good = sse(chat_chunk(1, "a"))
    bad = b'data: {"error": {"message": "engine died", "code": 500}}\n\ndata: [DONE]\n\n'
    out, error = sent.feed(good + bad)
    assert out == good and error == bad


def test_a_stream_with_nothing_left_to_generate_is_closed_not_continued():
    body = {**CHAT_BODY, "max_tokens": 2}
    sent = c.Sent(c.CHAT, json.dumps(body).encode(), allowed=1)
    sent.feed(sse(chat_chunk(1, "a"), chat_chunk(2, "b")))
    assert sent.done()
    closing = decoded(sent.closing())
    assert closing[0]["choices"][0]["finish_reason"] == "length"
    assert closing[0]["id"] == "chatcmpl-1" and closing[-1] == b"[DONE]"
    finished = c.Sent(c.CHAT, json.dumps(CHAT_BODY).encode(), allowed=1)
    finished.feed(sse(chat_chunk(1, "a", finish="stop")))
    assert finished.done() and finished.closing() == b"data: [DONE]\n\n"


def test_a_cut_before_any_text_resends_the_request_and_drops_the_second_role_chunk():
    sent = c.Sent(c.CHAT, json.dumps(CHAT_BODY).encode(), allowed=1)
    sent.feed(sse(chat_chunk(0, "", role="assistant")))
    body = json.loads(sent.continuation())
    assert body["messages"] == CHAT_BODY["messages"] and body["max_tokens"] == 10
    out, _ = sent.feed(sse(chat_chunk(0, "", role="assistant", cid="x"), chat_chunk(1, "a")))
    assert [ch["choices"][0]["delta"] for ch in decoded(out)] == [{"content": "a"}]


def test_a_client_continuing_its_own_assistant_prefix_gets_the_text_appended_to_it():
    body = {
        **CHAT_BODY,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Ab"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    sent = c.Sent(c.CHAT, json.dumps(body).encode(), allowed=1)
    sent.feed(sse(chat_chunk(1, "cd")))
    again = json.loads(sent.continuation())
    assert again["messages"][-1] == {"role": "assistant", "content": "Abcd"}
    assert len(again["messages"]) == 2


@pytest.mark.parametrize(
    ("kind", "extra", "why"),
    [
        (c.CHAT, {"n": 2}, "n > 1"),
        (c.CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (c.CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
        (c.CHAT, {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        (c.CHAT, {"guided_json": {"type": "object"}}, "guided_json"),
        (c.COMPLETIONS, {"prompt": [1, 2, 3]}, "prompt"),
        (c.COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
        (c.COMPLETIONS, {"prompt": "x", "best_of": 3}, "best_of"),
        (c.COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix"),
    ],
)
def test_streams_that_cannot_be_spliced_are_refused_naming_the_field(kind, extra, why):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    assert why in c.refusal(kind, json.dumps(body).encode())


def test_plain_streams_and_tools_turned_off_are_migratable():
    chat = {**CHAT_BODY, "tools": [{"type": "function"}], "tool_choice": "none"}
    assert c.refusal(c.CHAT, json.dumps(chat).encode()) is None
    text = {**CHAT_BODY, "response_format": {"type": "text"}}
    assert c.refusal(c.CHAT, json.dumps(text).encode()) is None
    assert c.refusal(c.COMPLETIONS, b'{"model":"m","prompt":"x"}') is None


def test_chat_and_completions_are_the_kinds_with_a_continuation():
    assert {k.name for k in kinds.ALL if k.continuation is not None} == {"chat", "completions"}


def test_a_chunk_with_empty_text_is_a_token_the_role_chunk_is_not():
    # vLLM sends a chunk per decode step, with "" while a character's bytes are held back.
    sent = c.Sent(c.CHAT, json.dumps(CHAT_BODY).encode(), allowed=1)
    sent.feed(sse(chat_chunk(0, "", role="assistant"), chat_chunk(1, ""), chat_chunk(2, "é")))
    body = json.loads(sent.continuation())
    assert body["max_tokens"] == 8 and body["messages"][-1]["content"] == "é"


def with_usage(raw: bytes, prompt: int, completion: int) -> bytes:
    data = json.loads(raw)
    data["usage"] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return json.dumps(data).encode()


def test_usage_on_every_chunk_counts_packed_tokens_and_stays_hidden_unless_asked():
    # vLLM packs several tokens into one chunk when the client reads slower than it
    # decodes: the router asks for usage on every chunk and counts from it.
    body = {**CHAT_BODY, "stream_options": None}
    sent = c.Sent(c.CHAT, json.dumps(body).encode(), allowed=1)
    first = json.loads(sent.upstream_body())
    assert first["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert first["messages"] == body["messages"] and first["max_tokens"] == 10
    out, _ = sent.feed(
        sse(
            with_usage(chat_chunk(0, "", role="assistant"), 5, 0),
            with_usage(chat_chunk(1, "abc"), 5, 3),
        )
    )
    got = decoded(out)
    assert all("usage" not in ch for ch in got)
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(sent.continuation())["max_tokens"] == 7
    # The continuation's prompt holds the 3 tokens sent; the first attempt's 5 are kept.
    out, _ = sent.feed(
        sse(with_usage(chat_chunk(1, "d"), 9, 1), usage_chunk(9, 7)) + b"data: [DONE]\n\n"
    )
    assert [e for e in decoded(out) if isinstance(e, dict) and "usage" in e] == []
    assert sent.usage == (5, 10)


def test_a_client_asking_for_running_usage_gets_it_summed():
    body = {**CHAT_BODY, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    sent = c.Sent(c.CHAT, json.dumps(body).encode(), allowed=1)
    sent.feed(sse(with_usage(chat_chunk(1, "ab"), 5, 2)))
    sent.continuation()
    out, _ = sent.feed(sse(with_usage(chat_chunk(1, "c", cid="x"), 7, 1)))
    [chunk] = decoded(out)
    assert chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert chunk["id"] == "chatcmpl-1"


def test_an_engine_aborting_the_request_at_shutdown_is_a_cut_not_an_end():
    # vLLM at SIGTERM (shutdown_timeout 0) ends what it runs with finish_reason "abort".
    sent = c.Sent(c.CHAT, json.dumps(CHAT_BODY).encode(), allowed=1)
    good = sse(chat_chunk(1, "a"))
    aborted = sse(chat_chunk(2, "", finish="abort")) + b"data: [DONE]\n\n"
    assert sent.feed(good + aborted) == (good, aborted)
    assert sent.finish is None and not sent.done()
