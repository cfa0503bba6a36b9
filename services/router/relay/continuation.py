"""Mid-stream migration: what a stream has sent so far, and the request that continues it.

An engine that dies after a stream's first byte (kill -9, a drain deadline, the idle
watchdog, a 5xx sent in-band, `finish_reason: abort` from an engine shutting down)
used to cost the client its answer. For the same model
that is needless: another replica continues from the prompt plus the text already
sent, as Dynamo's migration does (lib/llm/src/migration.rs), and the client reads one
stream. A continuation is, per API kind (`Continuation`, on `ApiKind`):

- completions: `prompt` + the text sent;
- chat: the messages plus the partial assistant message, with vLLM's
  `continue_final_message: true` and `add_generation_prompt: false`;

and for both `max_tokens` / `max_completion_tokens` (and `min_tokens`) lowered by the
tokens sent, usage always asked for. What a continuation streams is rewritten to read
as the first attempt: its `id` and `created`, no second role chunk, usage summed
(the first attempt's prompt tokens; completion tokens of every attempt). A request
whose answer cannot be spliced is never migrated (`refusal`): n > 1, `echo`, tools,
structured output (the grammar's state is not in the text), a prompt that is not one
string. Its stream ends with the in-band error event, as without migration.

Tokens sent are counted from the usage every chunk carries (the router asks for
vLLM's `continuous_usage_stats` and takes it out again where the client did not ask):
vLLM packs several tokens into one chunk when its API server falls behind. An engine
that sends no such usage is counted one token per chunk, the opening role chunk
aside. So a stream with `max_tokens: K` delivers K in all. Bytes a detokenizer held
back when the engine died are not in the text sent; the continuation makes its own.

Pure: bytes in, bytes out; the relay (upstream.py) decides when to call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

_DONE = b"data: [DONE]"
_encode = msgspec.json.Encoder().encode
_decode_top = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_any = msgspec.json.Decoder().decode

# Keys whose value constrains decoding with state the text does not carry: any of them,
# set, and the request is not migrated (Dynamo does not migrate guided decoding either).
_STRUCTURED = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)


class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None  # completions
    delta: _Delta | None = None  # chat
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    id: str = ""
    object: str = ""
    created: int = 0
    model: str = ""
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None  # an engine's in-band error event


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass(frozen=True, slots=True)
class Continuation:
    """An API kind's rule for continuing a cut stream."""

    # Why a request (its top-level keys) cannot be continued; None: it can.
    refusal: Callable[[dict[str, msgspec.Raw]], str | None]
    # The request that continues it: (top-level keys, text sent) -> the new keys.
    extend: Callable[[dict[str, msgspec.Raw], str], dict[str, object]]
    # A last choice that closes a stream the engine had finished (finish_reason only).
    closing_choice: Callable[[str], dict[str, object]]


def _value(top: dict[str, msgspec.Raw], key: str) -> object:
    raw = top.get(key)
    return None if raw is None else _decode_any(raw)


def _common_refusal(top: dict[str, msgspec.Raw]) -> str | None:
    for key in ("n", "best_of"):
        count = _value(top, key)
        if isinstance(count, int) and count > 1:
            return f"{key} > 1: several answers cannot be continued as one"
    if _value(top, "echo"):
        return "echo: the prompt is part of the text sent"
    for key in _STRUCTURED:
        value = _value(top, key)
        if value is not None and not (key == "response_format" and _is_text_format(value)):
            return f"{key}: structured output cannot be continued from its text"
    return None


def _is_text_format(value: object) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _completions_refusal(top: dict[str, msgspec.Raw]) -> str | None:
    prompt = _value(top, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return "prompt: only a single text prompt can be continued"
    if _value(top, "suffix") is not None:
        return "suffix: an insertion cannot be continued"
    return _common_refusal(top)


def _completions_extend(top: dict[str, msgspec.Raw], text: str) -> dict[str, object]:
    prompt = _value(top, "prompt")
    if isinstance(prompt, list):
        prompt = prompt[0]
    assert isinstance(prompt, str)  # _completions_refusal said so
    return {"prompt": prompt + text}


def _chat_refusal(top: dict[str, msgspec.Raw]) -> str | None:
    if _value(top, "tools") and _value(top, "tool_choice") != "none":
        return "tools: a tool call cannot be continued from its text"
    messages = _value(top, "messages")
    if not isinstance(messages, list) or not messages:
        return "messages: not a list of messages"
    if _value(top, "continue_final_message") and not isinstance(
        messages[-1].get("content") if isinstance(messages[-1], dict) else None, str
    ):
        return "messages: the final message to continue has no text content"
    return _common_refusal(top)


def _chat_extend(top: dict[str, msgspec.Raw], text: str) -> dict[str, object]:
    messages = _value(top, "messages")
    assert isinstance(messages, list)  # _chat_refusal said so
    if _value(top, "continue_final_message"):
        # The client asked to continue its own assistant prefix: the text extends it.
        last = dict(messages[-1])
        last["content"] = last["content"] + text
        messages = [*messages[:-1], last]
    else:
        messages = [*messages, {"role": "assistant", "content": text}]
    return {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}


def _chat_closing(reason: str) -> dict[str, object]:
    return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}


def _completions_closing(reason: str) -> dict[str, object]:
    return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}


CHAT = Continuation(_chat_refusal, _chat_extend, _chat_closing)
COMPLETIONS = Continuation(_completions_refusal, _completions_extend, _completions_closing)


def refusal(rule: Continuation, body: bytes) -> str | None:
    """Why this request body cannot be continued mid-stream; None: it can."""
    try:
        top = _decode_top(body)
    except msgspec.DecodeError:
        return "the body is not a JSON object"
    return rule.refusal(top)


class Sent:
    """What one stream has sent the client so far; the continuations that resume it.

    Every attempt's body is `upstream_body`/`continuation`: it asks for usage on every
    chunk (vLLM's `continuous_usage_stats`), so the tokens sent are counted exactly even
    when an engine packs several into one chunk. `feed` every relayed run of whole
    events through it: it reads them, and rewrites what the client did not ask for
    (that usage) and, on a continuation, what must read as the first attempt.
    """

    __slots__ = (
        "rule",
        "top",
        "allowed",
        "migrations",
        "text",
        "tokens",
        "base",
        "id",
        "object",
        "created",
        "model",
        "finish",
        "wants_usage",
        "wants_running_usage",
        "prompt_tokens",
        "usage",
    )

    def __init__(self, rule: Continuation, body: bytes, allowed: int):
        self.rule = rule
        self.top = _decode_top(body)  # the client's request, for this model
        self.allowed = allowed  # continuations allowed (the model's migration.max)
        self.migrations = 0  # continuations made
        self.text: list[str] = []
        self.tokens = 0  # completion tokens sent, over every attempt
        self.base = 0  # tokens sent before the current attempt began
        self.id = ""
        self.object = ""
        self.created = 0
        self.model = ""
        self.finish: str | None = None  # the finish_reason the client got, if any
        options = _value(self.top, "stream_options")
        options = options if isinstance(options, dict) else {}
        self.wants_usage = bool(options.get("include_usage"))
        self.wants_running_usage = self.wants_usage and bool(options.get("continuous_usage_stats"))
        self.prompt_tokens: int | None = None  # the first attempt's, once an engine says
        self.usage: tuple[int, int] | None = None  # (prompt, completion) summed, once known

    # ------------------------------------------------------------ decisions

    def left(self) -> int | None:
        """The completion tokens still owed; None: the request set no limit."""
        for key in ("max_completion_tokens", "max_tokens"):
            limit = _value(self.top, key)
            if isinstance(limit, int):
                return limit - self.tokens
        return None

    def done(self) -> bool:
        """Nothing is left to generate: the stream only needs closing."""
        left = self.left()
        return self.finish is not None or (left is not None and left <= 0)

    def resumable(self) -> bool:
        return self.migrations < self.allowed

    def upstream_body(self) -> bytes:
        """The first attempt's body: the client's, asking for usage on every chunk."""
        return self._body({})

    def continuation(self) -> bytes:
        """The body of the next attempt; counts it as one migration."""
        self.migrations += 1
        self.base = self.tokens
        values: dict[str, object] = {}
        if self.tokens or self.text:
            values = self.rule.extend(self.top, "".join(self.text))
            for key in ("max_completion_tokens", "max_tokens", "min_tokens"):
                limit = _value(self.top, key)
                if isinstance(limit, int):
                    values[key] = max(0 if key == "min_tokens" else 1, limit - self.tokens)
        # A disaggregated request's KV was handed to the engine that died, for the first
        # attempt's prompt: the continuation's engine computes its own (relay/disagg.py).
        return self._body(values, without="kv_transfer_params")

    def _body(self, values: dict[str, object], without: str = "") -> bytes:
        top = dict(self.top)
        top.pop(without, None)
        options = _value(top, "stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options.update(include_usage=True, continuous_usage_stats=True)
        values["stream_options"] = options
        for key, value in values.items():
            top[key] = msgspec.Raw(_encode(value))
        return _encode(top)

    def closing(self) -> bytes:
        """The end of a stream whose engine had nothing left to send: a finish chunk if
        the client has none yet, then `[DONE]`."""
        out = b""
        if self.finish is None:
            chunk = {
                "id": self.id,
                "object": self.object,
                "created": self.created,
                "model": self.model,
                "choices": [self.rule.closing_choice("length")],
            }
            out = b"data: " + _encode(chunk) + b"\n\n"
        return out + _DONE + b"\n\n"

    # ------------------------------------------------------------ the relayed bytes

    def feed(self, out: bytes) -> tuple[bytes, bytes | None]:
        """(what to send the client, the engine's in-band error or abort and what
        followed it, or None). `out` is whole events."""
        kept: list[bytes] = []
        start = 0
        while start < len(out):
            end = out.find(b"\n\n", start)
            end = len(out) if end < 0 else end + 2
            event = out[start:end]
            data = event.strip()
            chunk = _chunk_of(data)
            if chunk is not None:
                if chunk.error is not None or _aborted(chunk):
                    return b"".join(kept), out[start:]
                self._read(chunk)
                if self.migrations or chunk.usage is not None:
                    event = self._rewrite(data[5:], chunk)
            kept.append(event)
            start = end
        return b"".join(kept), None

    def _read(self, chunk: _Chunk) -> None:
        if not self.id:
            self.id, self.object, self.created, self.model = (
                chunk.id,
                chunk.object,
                chunk.created,
                chunk.model,
            )
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            piece = _token_of(choice)
            if piece is not None:
                self.text.append(piece)
                self.tokens += 1  # one a chunk, unless the engine says (below)
            if choice.finish_reason is not None:
                self.finish = choice.finish_reason
        u = chunk.usage
        if u is not None:
            # Exact: this attempt's completion tokens so far, after those sent before it.
            self.tokens = self.base + u.completion_tokens
            if self.prompt_tokens is None:
                # A continuation's prompt holds the text sent before it: without the first
                # attempt's count, those tokens come off the continuation's.
                self.prompt_tokens = u.prompt_tokens - self.base
            self.usage = (self.prompt_tokens, self.tokens)

    def _rewrite(self, raw: bytes, chunk: _Chunk) -> bytes:
        """The event as the client is to read it (b"": not at all): on a continuation
        with the first attempt's id and created and no second role chunk; usage only
        where the client asked for it, summed over the attempts."""
        data = _decode_any(raw)
        choices = data.get("choices") or []
        if self.migrations:
            data["id"] = self.id
            data["created"] = self.created
            kept = [c for c in map(_without_role, choices) if c is not None]
            if choices and not kept:
                return b""
            data["choices"] = choices = kept
        if chunk.usage is not None and self.usage is not None:
            if not (self.wants_running_usage or (self.wants_usage and not choices)):
                if not choices:
                    return b""  # the usage chunk the router asked for, not the client
                del data["usage"]
            else:
                prompt, completion = self.usage
                data["usage"] = {
                    **data["usage"],
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                }
        return b"data: " + _encode(data) + b"\n\n"


def _aborted(chunk: _Chunk) -> bool:
    """The engine gave the request up (vLLM's `finish_reason: abort`, sent when it shuts
    down mid-request): a cut, not the model's end."""
    return any(c.index == 0 and c.finish_reason == "abort" for c in chunk.choices)


def _token_of(choice: _Choice) -> str | None:
    """The text of the one token a choice carries (maybe empty); None when it carries
    none: a chat stream's opening role chunk, a chunk without content."""
    delta = choice.delta
    if delta is None:
        return choice.text
    if delta.role and not delta.content:
        return None
    return delta.content


def _chunk_of(data: bytes) -> _Chunk | None:
    """The chunk an event carries; None for `[DONE]`, comments, and what is not JSON
    (relayed as it came, untracked)."""
    if not data.startswith(b"data:") or data.startswith(_DONE):
        return None
    try:
        return _decode_chunk(data[5:])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _without_role(choice: dict) -> dict | None:
    """A continuation's choice without the role the client already has; None when
    that was all it said (its opening chunk)."""
    delta = choice.get("delta")
    if not isinstance(delta, dict) or "role" not in delta:
        return choice
    delta = {k: v for k, v in delta.items() if k != "role"}
    if (
        not any(delta.values())
        and choice.get("finish_reason") is None
        and not choice.get("logprobs")
    ):
        return None
    return {**choice, "delta": delta}
