"""OpenAI request parsing and validation, and the OpenAI-shaped error.

A request body becomes a `Job`: the prompt as bytes and tokens, the output pieces the request
will produce (decided up front: the text is deterministic), why it ends, and how to answer.
Anything wrong with the request raises ApiError with a 400 or 404, never lets a 500 through.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from llmgw import config
from llmgw.chatprompt import message_text
from llmgw.simengine import structured, tokens, tools

_encode = msgspec.json.encode
_MISSING_RE = re.compile(r"missing required field `(?P<field>[^`]+)`")

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class ApiError(Exception):
    """An error answered as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,  # vLLM's own errors carry the status here
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def body(self) -> bytes:
        return _encode(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


# -- request bodies --------------------------------------------------------------------------


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    # An assistant turn's calls; they count as prompt text when the history comes back.
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    seed: int | None = None
    # vLLM's extension: prefix-cache blocks of a salted request are shared only with
    # requests of the same salt (its first block's hash covers the salt).
    cache_salt: str | None = None
    # vLLM's prefill/decode disaggregation parameters (see kvtransfer.py).
    kv_transfer_params: dict[str, Any] | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    # OpenAI's and vLLM's default for completions; an explicit null means "as many as fit".
    max_tokens: int | None = 16
    logprobs: int | None = None
    response_format: dict[str, Any] | None = None


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


# The most choices one request may ask for: each is a running sequence in the engine.
MAX_N = 128


@dataclass(slots=True)
class Output:
    """One choice: its output pieces (one per token) and why it ends once they are out."""

    pieces: list[str]
    # "stop" or "length", as the engine counts it; a tool call's is mapped on the wire.
    final_reason: str
    # Set when this choice is a tool call: the pieces are its arguments' JSON text.
    tool: tools.ToolCall | None = None
    tool_call_id: str = ""


@dataclass(slots=True)
class Job:
    kind: Literal["chat", "completion", "responses"]
    model: str
    prompt: bytes
    prompt_tokens: int
    outputs: list[Output]
    stream: bool
    include_usage: bool
    # Chat: top_logprobs to send (0 = the sampled token only); completions: `logprobs`.
    # None: no logprobs.
    logprobs: int | None = None
    cache_salt: str | None = None
    # The request's kv_transfer_params (None: it sent none).
    kv_transfer: dict[str, Any] | None = None

    @property
    def pieces(self) -> list[str]:
        return self.outputs[0].pieces

    @property
    def final_reason(self) -> str:
        return self.outputs[0].final_reason

    @property
    def plain(self) -> bool:
        """One text choice without logprobs: the encoder's fast path."""
        return len(self.outputs) == 1 and self.logprobs is None and self.outputs[0].tool is None


@dataclass(slots=True)
class Limits:
    served_names: frozenset[str]
    max_model_len: int
    mode: Literal["echo", "lorem"]
    default_output_tokens: int
    # Names served besides served_names: the LoRA adapters the engine serves now.
    serves_adapter: Callable[[str], bool] = lambda name: False


class RequestParser:
    def __init__(self, limits: Limits, seed: int = 0):
        self.limits = limits
        # Requests without a seed draw from one stream: deterministic for a given arrival order.
        self._rng = random.Random(seed)

    def chat(self, body: bytes) -> Job:
        req = decode_body(_chat_decoder, body)
        self.check_common(req)
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        turns = []
        for i, msg in enumerate(req.messages):
            if msg.role not in ROLES:
                raise ApiError(
                    400,
                    f"messages[{i}].role: unknown role {msg.role!r}; expected one of {sorted(ROLES)}",
                    param=f"messages[{i}].role",
                )
            turns.append((msg.role, message_text(msg.content, msg.tool_calls)))
        prompt = tokens.render_chat(turns)
        users = [text for role, text in turns if role == "user"]
        echo = users[-1] if users else turns[-1][1]
        max_tokens = req.max_completion_tokens
        param = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = req.max_tokens, "max_tokens"
        try:
            tool = tools.decide(req.tools, req.tool_choice, req.messages[-1].role)
        except tools.ToolChoiceError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        logprobs = None
        if req.logprobs:
            logprobs = _non_negative(req.top_logprobs or 0, "top_logprobs")
        elif req.top_logprobs:
            raise ApiError(
                400,
                "when using `top_logprobs`, `logprobs` must be set to true.",
                param="top_logprobs",
            )
        shaped = json_answer(req.response_format)
        job = self.build("chat", req, prompt, "messages", echo, max_tokens, param, tool, shaped)
        job.logprobs = logprobs
        return job

    def completion(self, body: bytes) -> Job:
        req = decode_body(_completion_decoder, body)
        self.check_common(req)
        prompt, echo = _completion_prompt(req.prompt)
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        shaped = json_answer(req.response_format)
        job = self.build(
            "completion", req, prompt, "prompt", echo, req.max_tokens, "max_tokens", None, shaped
        )
        if req.logprobs is not None:
            job.logprobs = _non_negative(req.logprobs, "logprobs")
        return job

    def check_common(self, req: _Common) -> None:
        if req.model is None:
            raise ApiError(400, "you must provide a model parameter", param="model")
        if req.model not in self.limits.served_names and not self.limits.serves_adapter(req.model):
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        if req.n is not None and not 1 <= req.n <= MAX_N:
            raise ApiError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
        if req.stream_options is not None and not req.stream:
            raise ApiError(
                400, "stream_options is only allowed with stream = true", param="stream_options"
            )
        check_cache_salt(req.cache_salt)

    def build(
        self,
        kind: Literal["chat", "completion", "responses"],
        req: ChatRequest | CompletionRequest,
        prompt: bytes,
        prompt_param: str,
        echo: str,
        max_tokens: int | None,
        max_tokens_param: str,
        tool: tools.ToolCall | None = None,
        shaped: str | None = None,
    ) -> Job:
        """`shaped`: the JSON text a response_format asks for (json_answer), else None."""
        lim = self.limits
        n_prompt = tokens.count_tokens(prompt)
        room = lim.max_model_len - n_prompt
        if room <= 0:
            raise ApiError(
                400,
                f"This model's maximum context length is {lim.max_model_len} tokens. However, "
                f"your prompt has {n_prompt} tokens. Please reduce the length of the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None:
            if max_tokens < 1:
                raise ApiError(
                    400,
                    f"{max_tokens_param} must be at least 1, got {max_tokens}",
                    param=max_tokens_param,
                )
            if max_tokens > room:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {lim.max_model_len} tokens. However, "
                    f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                    f"{prompt_param}, {max_tokens} in the completion). Please reduce the length "
                    f"of the {prompt_param} or completion.",
                    param=max_tokens_param,
                    code="context_length_exceeded",
                )
        cap = max_tokens if max_tokens is not None else room
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        outputs = [
            self._output(i, req.seed, echo, max_tokens, cap, stops, tool, shaped)
            for i in range(req.n or 1)
        ]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Job(
            kind=kind,
            model=req.model,
            prompt=prompt,
            prompt_tokens=n_prompt,
            outputs=outputs,
            stream=bool(req.stream),
            include_usage=include_usage,
            cache_salt=req.cache_salt,
            kv_transfer=req.kv_transfer_params,
        )

    def _output(
        self,
        index: int,
        seed: int | None,
        echo: str,
        max_tokens: int | None,
        cap: int,
        stops: list[str],
        tool: tools.ToolCall | None,
        shaped: str | None = None,
    ) -> Output:
        lim = self.limits
        if tool is not None:
            # The arguments come out a few bytes a token, and max_tokens cuts them short
            # (invalid JSON then, as a real model's would be).
            pieces = tokens.echo_pieces(tool.arguments)
            reason = "length" if len(pieces) > cap else "stop"
            return Output(pieces[:cap], reason, tool, tools.call_id())
        if shaped is not None:
            # Guided decoding: the JSON ends the answer (end of sequence) unless
            # max_tokens cuts it first, truncated, as vLLM's is.
            pieces = tokens.echo_pieces(shaped)
            reason = "length" if len(pieces) > cap else "stop"
            pieces = pieces[:cap]
        elif lim.mode == "echo":
            pieces = tokens.echo_pieces(echo)
            reason = "length" if len(pieces) > cap else "stop"
            pieces = pieces[:cap]
        else:
            want = max_tokens if max_tokens is not None else lim.default_output_tokens
            if seed is None:
                rng = self._rng
            else:
                # Choices of one seeded request differ from each other, and repeat exactly.
                rng = random.Random(seed if index == 0 else f"{seed}:{index}")
            pieces = tokens.lorem_pieces(min(want, cap), rng)
            # Without max_tokens the simulated model "emits end of sequence" unless cut short.
            reason = "stop" if max_tokens is None and want <= cap else "length"
        if stops:
            cut = tokens.cut_at_stop(pieces, stops)
            if cut is not None:
                pieces, reason = cut, "stop"
        return Output(pieces, reason)


# The response_format types vLLM's chat and completions take that the simulator answers.
_FORMAT_TYPES = ("text", "json_object", "json_schema")


def json_answer(
    fmt: dict[str, Any] | None, param: str = "response_format", nested: bool = True
) -> str | None:
    """The JSON text a chat or completions `response_format` asks for (or the Responses
    API's `text.format`: `nested` False, its schema is not under `json_schema`); None for
    text. A 400 for a format or a schema the simulator cannot answer."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in _FORMAT_TYPES:
        raise ApiError(
            400,
            f"{param}.type {kind!r} is not supported by the simulator: one of "
            f"{', '.join(_FORMAT_TYPES)}",
            param=f"{param}.type",
        )
    if kind == "text":
        return None
    schema = None
    if kind == "json_schema":
        spec = fmt.get("json_schema") if nested else fmt
        if not isinstance(spec, dict):
            raise ApiError(
                400,
                f"{param}.json_schema is required when {param}.type is 'json_schema'",
                param=f"{param}.json_schema",
            )
        schema = spec.get("schema")
    try:
        return structured.answer(kind, schema)
    except structured.Unsatisfiable as exc:
        raise ApiError(
            400, f"{param}: the JSON schema cannot be answered: {exc}", param=param
        ) from None


def _non_negative(value: int, param: str) -> int:
    if value < 0:
        raise ApiError(400, f"`{param}` must be a non-negative value, got {value}", param=param)
    return value


# vLLM's limits on a cache salt (vllm.entrypoints.generate.base.protocol).
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\0")


def check_cache_salt(salt: str | None) -> None:
    if salt is None:
        return
    if not salt:
        raise ApiError(
            400,
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            param="cache_salt",
        )
    if len(salt) > MAX_CACHE_SALT or not _SALT_FORBIDDEN.isdisjoint(salt):
        raise ApiError(
            400,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\', or NUL.",
            param="cache_salt",
        )


def decode_body(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        param = config.split_validation_error(exc)[1]
        param = param.lstrip(".") if param else None
        missing = _MISSING_RE.search(msg)
        if missing:
            param = f"{param}.{missing['field']}" if param else missing["field"]
        raise ApiError(400, f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None


def _completion_prompt(prompt: str | list[Any]) -> tuple[bytes, str]:
    """(prompt bytes, text to echo) for the forms OpenAI allows, one prompt only."""
    if isinstance(prompt, str):
        return prompt.encode(), prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _completion_prompt(prompt[0])
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < 2**32 for t in prompt):
            raise ApiError(400, "prompt: token ids must be in [0, 2**32)", param="prompt")
        return tokens.pack_token_ids(prompt), " ".join(map(str, prompt))
    if not prompt:
        return b"", ""
    raise ApiError(
        400,
        "prompt must be a string, a list of token ids, or a list holding one of those "
        "(batches of several prompts are not supported)",
        param="prompt",
    )
