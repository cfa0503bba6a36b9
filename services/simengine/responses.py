"""The Responses API (`/v1/responses`) as vLLM serves it: request parsing, the response
object, its stream of typed events, and the store behind retrieve and cancel.

A request becomes the same `Job` a chat request does: `instructions` is a system turn, `input`
(a string, or a list of message, function_call and function_call_output items) the rest of
the conversation, `previous_response_id` prepends a stored response's conversation, and
`max_output_tokens` caps the answer. Tools and `tool_choice` decide as for chat (tools are
the Responses API's flat `{"type": "function", "name", "parameters"}`), and `text.format`
(`json_object`, or `json_schema` with its schema flat in the format) shapes the text as a
chat `response_format` does (structured.py).

The stream is `event: TYPE\\ndata: JSON\\n\\n` per event, numbered by `sequence_number`, and
ends with `response.completed` (also when the status is "incomplete", as vLLM does) and no
`data: [DONE]`. A text answer streams `response.output_item.added`,
`response.content_part.added`, one `response.output_text.delta` per token,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`; a
function call streams `response.output_item.added`, `response.function_call_arguments.delta`
per token, `response.function_call_arguments.done`, `response.output_item.done`.

The store is what vLLM keeps with `VLLM_ENABLE_RESPONSES_API_STORE=1` (stored unless the
request says `store: false`), bounded: the oldest responses are forgotten first.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmgw.chatprompt import content_text
from llmgw.simengine import logprobs, tokens, tools
from llmgw.simengine.protocol import (
    ROLES,
    ApiError,
    ChatRequest,
    Job,
    RequestParser,
    decode_body,
    json_answer,
)

_encode = msgspec.json.encode


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    cache_salt: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "auto"
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, Any] | None = None
    previous_response_id: str | None = None
    # vLLM's extension: the caller names the response (a router binding it to a tenant).
    request_id: str | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    truncation: str | None = "disabled"
    service_tier: str | None = "auto"
    max_tool_calls: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None


_decoder = msgspec.json.Decoder(ResponsesRequest)

Turns = list[tuple[str, str]]


def _hex() -> str:
    return secrets.token_hex(8)


def _text_of(content: Any) -> str:
    text = content_text(content)
    if text is None:
        raise ApiError(400, "input: a message's content must be a string or a list of parts")
    return text


def input_turns(value: str | list[Any] | None) -> Turns:
    """The conversation an `input` adds, as (role, text) turns."""
    if value is None:
        raise ApiError(400, "input is required", param="input")
    if isinstance(value, str):
        return [("user", value)]
    turns: Turns = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message" or "role" in item:
            role = item.get("role")
            if role not in ROLES:
                raise ApiError(
                    400,
                    f"input[{i}].role: unknown role {role!r}; expected one of {sorted(ROLES)}",
                    param=f"input[{i}].role",
                )
            turns.append((role, _text_of(item.get("content"))))
        elif kind == "function_call":
            turns.append(("assistant", f"{item.get('name')}({item.get('arguments', '')})"))
        elif kind == "function_call_output":
            output = item.get("output")
            turns.append(("tool", output if isinstance(output, str) else _encode(output).decode()))
        elif kind == "reasoning":
            continue
        else:
            # Other item kinds (tool results of built-in tools, ...) count as their JSON.
            turns.append(("user", _encode(item).decode()))
    if not turns:
        raise ApiError(400, "input must not be empty", param="input")
    return turns


@dataclass(slots=True)
class Parsed:
    req: ResponsesRequest
    job: Job
    turns: Turns


def parse(body: bytes, parser: RequestParser, previous: ResponseStore) -> Parsed:
    req = decode_body(_decoder, body)
    shim = ChatRequest(
        model=req.model,
        messages=[],
        stream=req.stream,
        seed=req.seed,
        stop=req.stop,
        cache_salt=req.cache_salt,
    )
    parser.check_common(shim)
    if req.background and req.stream:
        raise ApiError(
            400, "background responses are not streamed by the simulator", param="background"
        )
    if req.background and not req.store:
        raise ApiError(400, "background responses need store = true", param="background")
    history: Turns = []
    if req.previous_response_id is not None:
        prev = previous.get(req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = list(prev.turns)
    turns = history + input_turns(req.input)
    rendered = ([("system", req.instructions)] if req.instructions else []) + turns
    prompt = tokens.render_chat(rendered)
    users = [text for role, text in rendered if role == "user"]
    echo = users[-1] if users else rendered[-1][1]
    try:
        choice = req.tool_choice if req.tools else None
        tool = tools.decide(req.tools or None, choice, rendered[-1][0])
    except tools.ToolChoiceError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    fmt = (req.text or {}).get("format")
    shaped = json_answer(fmt, "text.format", nested=False)
    job = parser.build(
        "responses",
        shim,
        prompt,
        "input",
        echo,
        req.max_output_tokens,
        "max_output_tokens",
        tool,
        shaped,
    )
    if req.include and "message.output_text.logprobs" in req.include:
        if req.top_logprobs is not None and req.top_logprobs < 0:
            raise ApiError(400, "top_logprobs must be non-negative", param="top_logprobs")
        job.logprobs = req.top_logprobs or 0
    return Parsed(req, job, turns)


def not_found(response_id: str, param: str = "response_id") -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param=param)


# -- the response object and its events -------------------------------------------------------


@dataclass(slots=True, eq=False)
class Response:
    """One response's state: what the store keeps and what its events are built from."""

    parsed: Parsed
    id: str = field(default_factory=lambda: f"resp_{_hex()}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    item_id: str = ""
    status: str = "in_progress"
    generated: int = 0
    reason: str | None = None
    cached_tokens: int = 0
    # Engine requests while it runs (for cancel); a background response's task.
    engine_requests: list[Any] = field(default_factory=list)
    task: Any = None

    def __post_init__(self) -> None:
        if self.parsed.req.request_id:
            self.id = self.parsed.req.request_id
        tool = self.parsed.job.outputs[0].tool
        self.item_id = f"fc_{_hex()}" if tool is not None else f"msg_{_hex()}"

    @property
    def turns(self) -> Turns:
        """The conversation including this answer, for a later previous_response_id."""
        return [*self.parsed.turns, ("assistant", self.text())]

    def text(self) -> str:
        return "".join(self.parsed.job.outputs[0].pieces[: self.generated])

    def logprobs(self, start: int, end: int) -> list | None:
        """Output-text logprobs of tokens [start, end), or None unless the request
        `include`s them."""
        job = self.parsed.job
        if job.logprobs is None:
            return None
        return logprobs.chat_content(job.outputs[0].pieces[:end], start, job.logprobs)["content"]

    def finish(self, generated: int, reason: str, cached_tokens: int) -> None:
        self.generated, self.reason, self.cached_tokens = generated, reason, cached_tokens
        self.status = "incomplete" if reason == "length" else "completed"

    def _item(self, done: bool) -> dict:
        out = self.parsed.job.outputs[0]
        text = self.text() if done else ""
        if out.tool is not None:
            return {
                "arguments": text,
                "call_id": out.tool_call_id,
                "name": out.tool.name,
                "type": "function_call",
                "id": self.item_id,
                "namespace": None,
                "status": "completed" if done else "in_progress",
            }
        return {
            "id": self.item_id,
            "content": [_part(text, self.logprobs(0, self.generated))] if done else [],
            "role": "assistant",
            "status": "completed" if done else "in_progress",
            "type": "message",
            "phase": None,
        }

    def to_dict(self) -> dict:
        req, job = self.parsed.req, self.parsed.job
        finished = self.reason is not None
        usage = None
        if finished:
            usage = {
                "input_tokens": job.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": self.cached_tokens,
                    "cache_write_tokens": 0,
                    "input_tokens_per_turn": [],
                    "cached_tokens_per_turn": [],
                },
                "output_tokens": self.generated,
                "output_tokens_details": {
                    "reasoning_tokens": 0,
                    "tool_output_tokens": 0,
                    "output_tokens_per_turn": [],
                    "tool_output_tokens_per_turn": [],
                },
                "total_tokens": job.prompt_tokens + self.generated,
            }
        return {
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self.status == "incomplete"
            else None,
            "instructions": req.instructions,
            "metadata": req.metadata,
            "model": job.model,
            "object": "response",
            "output": [self._item(True)] if finished and self.generated else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "tool_choice": req.tool_choice if req.tools else "none",
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "background": bool(req.background),
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "previous_response_id": req.previous_response_id,
            "prompt": None,
            "reasoning": req.reasoning,
            "service_tier": req.service_tier or "auto",
            "status": self.status,
            "text": req.text,
            "top_logprobs": job.logprobs,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
            "presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
        }

    def body(self) -> bytes:
        return _encode(self.to_dict())


def _part(text: str, logprobs: list | None) -> dict:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _stream_logprobs(entries: list | None) -> list:
    """A delta's logprobs are the delta event's type: no `bytes`, as vLLM sends them."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]
            ],
        }
        for e in entries or ()
    ]


class EventEncoder:
    """The typed events of one streamed response, numbered in order."""

    __slots__ = ("resp", "_seq", "_opened")

    def __init__(self, resp: Response):
        self.resp = resp
        self._seq = 0
        self._opened = False

    def _event(self, kind: str, body: dict) -> bytes:
        body["sequence_number"] = self._seq
        body["type"] = kind
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"

    def start(self) -> list[bytes]:
        snapshot = self.resp.to_dict()
        return [
            self._event("response.created", {"response": snapshot}),
            self._event("response.in_progress", {"response": snapshot}),
        ]

    def tokens(self, start: int, end: int) -> list[bytes]:
        resp = self.resp
        out = resp.parsed.job.outputs[0]
        events = []
        if end > start and not self._opened:
            self._opened = True
            events.append(
                self._event(
                    "response.output_item.added", {"item": resp._item(False), "output_index": 0}
                )
            )
            if out.tool is None:
                events.append(
                    self._event(
                        "response.content_part.added",
                        {
                            "content_index": 0,
                            "item_id": resp.item_id,
                            "output_index": 0,
                            "part": _part("", []),
                        },
                    )
                )
        for i, piece in enumerate(out.pieces[start:end], start):
            if out.tool is not None:
                body = {"delta": piece, "item_id": resp.item_id, "output_index": 0}
                events.append(self._event("response.function_call_arguments.delta", body))
            else:
                body = {
                    "content_index": 0,
                    "delta": piece,
                    "item_id": resp.item_id,
                    "logprobs": _stream_logprobs(resp.logprobs(i, i + 1)),
                    "output_index": 0,
                }
                events.append(self._event("response.output_text.delta", body))
        return events

    def end(self) -> list[bytes]:
        """The closing events; call after `resp.finish(...)`."""
        resp = self.resp
        out = resp.parsed.job.outputs[0]
        events = []
        if self._opened:
            text = resp.text()
            if out.tool is not None:
                body = {
                    "arguments": text,
                    "item_id": resp.item_id,
                    "name": out.tool.name,
                    "output_index": 0,
                }
                events.append(self._event("response.function_call_arguments.done", body))
            else:
                ids = {"content_index": 0, "item_id": resp.item_id}
                lps = resp.logprobs(0, resp.generated)
                events.append(
                    self._event(
                        "response.output_text.done",
                        # vLLM leaves these empty; the part below carries them.
                        {**ids, "logprobs": [], "output_index": 0, "text": text},
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.done",
                        {**ids, "output_index": 0, "part": _part(text, lps)},
                    )
                )
            events.append(
                self._event(
                    "response.output_item.done", {"item": resp._item(True), "output_index": 0}
                )
            )
        events.append(self._event("response.completed", {"response": resp.to_dict()}))
        return events


class ResponseStore:
    """Stored responses by id, the oldest forgotten first beyond `size`."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, Response] = OrderedDict()

    def put(self, resp: Response) -> None:
        if self.size == 0:
            return
        self._items[resp.id] = resp
        self._items.move_to_end(resp.id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Response | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> Response | None:
        return self._items.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._items)
