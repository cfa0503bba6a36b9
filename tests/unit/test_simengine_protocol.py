"""Request validation, token counting and output text: pure functions, no sockets."""

from __future__ import annotations

import json

import pytest

from llmgw.simengine import tokens
from llmgw.simengine.protocol import ApiError, Limits, RequestParser


def parser(mode: str = "lorem", max_model_len: int = 100) -> RequestParser:
    return RequestParser(Limits(frozenset({"m", "alias"}), max_model_len, mode, 8), seed=1)


def chat(**kw) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi there"}]}
    body.update(kw)
    return json.dumps(body).encode()


def completion(**kw) -> bytes:
    body = {"model": "m", "prompt": "hello"}
    body.update(kw)
    return json.dumps(body).encode()


def error_of(fn, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body)
    return info.value


def test_token_count_is_bytes_over_four_rounded_up():
    assert tokens.count_tokens(b"") == 0
    assert tokens.count_tokens(b"abcd") == 1
    assert tokens.count_tokens(b"abcde") == 2
    assert tokens.count_tokens("é".encode() * 4) == 2  # 8 bytes
    assert tokens.count_tokens(tokens.pack_token_ids([1, 2, 3])) == 3


def test_block_hashes_are_chained_over_full_blocks():
    block = 4 * tokens.BYTES_PER_TOKEN  # bytes in a block of 4 tokens
    a = b"x" * block + b"y" * block + b"z" * 3
    b = b"x" * block + b"q" * block
    ha, hb = tokens.block_hashes(a, 4), tokens.block_hashes(b, 4)
    assert len(ha) == 2 and len(hb) == 2  # the partial tail block is not hashed
    assert ha[0] == hb[0] and ha[1] != hb[1]
    # The same block after a different prefix hashes differently.
    c = b"w" * block + b"y" * block
    assert tokens.block_hashes(c, 4)[1] != ha[1]


def test_chat_template_makes_a_shared_system_prompt_a_shared_prefix():
    sys_prompt = ("system", "You are terse. " * 20)
    one = tokens.render_chat([sys_prompt, ("user", "first question")])
    two = tokens.render_chat([sys_prompt, ("user", "another one")])
    h1, h2 = tokens.block_hashes(one, 4), tokens.block_hashes(two, 4)
    shared = sum(1 for x, y in zip(h1, h2, strict=False) if x == y)
    assert shared >= 15 and h1 != h2


def test_echo_pieces_keep_characters_whole():
    assert tokens.echo_pieces("abcdefghij") == ["abcd", "efgh", "ij"]
    pieces = tokens.echo_pieces("héllo wörld")
    assert "".join(pieces) == "héllo wörld"
    assert all(len(p.encode()) >= 4 for p in pieces[:-1])


def test_stop_string_cuts_the_output_before_it():
    pieces = ["one", " two", " three", " four"]
    assert tokens.cut_at_stop(pieces, [" thr", "four"]) == ["one", " two"]
    assert tokens.cut_at_stop(pieces, ["wo t"]) == ["one", " t"]
    assert tokens.cut_at_stop(pieces, ["nope"]) is None


def test_chat_lorem_with_max_tokens_gives_exactly_that_many_and_length():
    job = parser().chat(chat(max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert len(job.pieces) == 5 and job.final_reason == "length"
    assert job.kind == "chat" and job.stream and job.include_usage
    assert job.prompt_tokens == tokens.count_tokens(job.prompt)


def test_max_completion_tokens_wins_over_max_tokens():
    job = parser().chat(chat(max_tokens=5, max_completion_tokens=3))
    assert len(job.pieces) == 3


def test_lorem_without_max_tokens_ends_with_stop_after_the_default_length():
    job = parser().chat(chat())
    assert len(job.pieces) == 8 and job.final_reason == "stop"


def test_completions_default_to_sixteen_tokens_like_openai():
    job = parser().completion(completion())
    assert len(job.pieces) == 16 and job.final_reason == "length"


def test_seeded_requests_repeat_their_text():
    p = parser()
    a = p.completion(completion(seed=7, max_tokens=6)).pieces
    b = p.completion(completion(seed=7, max_tokens=6)).pieces
    c = p.completion(completion(seed=8, max_tokens=6)).pieces
    assert a == b != c


def test_echo_mode_returns_the_last_user_message():
    p = parser(mode="echo")
    body = json.dumps(
        {
            "model": "alias",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "say this back"}]},
            ],
        }
    ).encode()
    job = p.chat(body)
    assert "".join(job.pieces) == "say this back" and job.final_reason == "stop"
    cut = p.chat(chat(max_tokens=1))
    assert cut.pieces == ["hi t"] and cut.final_reason == "length"


def test_stop_strings_end_with_stop():
    job = parser(mode="echo").completion(completion(prompt="alpha beta gamma", stop=["gam"]))
    assert "".join(job.pieces) == "alpha beta " and job.final_reason == "stop"


def test_token_id_prompts_count_one_token_per_id():
    job = parser().completion(completion(prompt=[5, 6, 7, 8, 9]))
    assert job.prompt_tokens == 5
    assert parser().completion(completion(prompt=[[1, 2]])).prompt_tokens == 2


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[]", 400, None),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
        (chat(model="nope"), 404, "model"),
        (chat(messages="hello"), 400, "messages"),
        (chat(messages=[]), 400, "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
        (chat(max_tokens="5"), 400, "max_tokens"),
        (chat(max_tokens=0), 400, "max_tokens"),
        (chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
        (chat(n=0), 400, "n"),
        (chat(n=129), 400, "n"),
        (chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
        (chat(stream="yes"), 400, "stream"),
        (chat(stream_options={"include_usage": True}), 400, "stream_options"),
        (chat(max_tokens=99), 400, "max_tokens"),  # prompt + output over max_model_len
        (chat(messages=[{"role": "user", "content": "x" * 400}]), 400, "messages"),
    ],
)
def test_bad_chat_requests_are_400_or_404_naming_the_field(body, status, param):
    err = error_of(parser().chat, body)
    assert err.status == status
    assert err.param == param
    payload = json.loads(err.body())["error"]
    assert set(payload) == {"message", "type", "param", "code"} and payload["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        (completion(prompt=""), "prompt"),
        (completion(prompt=["a", "b"]), "prompt"),
        (completion(prompt=[1, "a"]), "prompt"),
        (completion(prompt=[-1]), "prompt"),
        (completion(prompt={"text": "x"}), "prompt"),
        (completion(max_tokens=0), "max_tokens"),
        (json.dumps({"model": "m"}).encode(), "prompt"),
    ],
)
def test_bad_completion_requests_are_400(body, param):
    err = error_of(parser().completion, body)
    assert err.status == 400 and err.param == param


def test_context_length_error_reads_like_vllms():
    err = error_of(parser().chat, chat(max_tokens=99))
    assert err.code == "context_length_exceeded"
    assert "maximum context length is 100 tokens" in err.message
