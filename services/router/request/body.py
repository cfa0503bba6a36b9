"""What the router reads from a request body, and the 400s for what it cannot read.

The body goes upstream unchanged; the router decodes only the few keys it
routes on (`model`, `stream`, the token allowance admission counts) and keeps
the prompt field raw: its bytes are what the prefix scorer hashes, with no
re-serialisation. Everything else is the engine's to judge: a gateway in front
of vLLM must not refuse what vLLM accepts (validation.py).

Transcriptions are multipart forms: the model is the `model` form field, found
in the raw bytes without parsing the audio part.
"""

from __future__ import annotations

import math
import re

import msgspec

from llmgw.router.http.errors import RouterError
from llmgw.router.request import kinds as k
from llmgw.router.request import validation as v

KINDS = tuple(kind.name for kind in k.ALL)
PATHS = {path: kind.name for path, kind in k.BY_PATH.items()}


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _ResponsesUsage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0


class _UsageHolder(msgspec.Struct):
    usage: Usage | None = None


class _ResponseHolder(msgspec.Struct):
    usage: _ResponsesUsage | None = None


class _ResponseEvent(msgspec.Struct):
    response: _ResponseHolder | None = None


_decode_head = msgspec.json.Decoder(v.RoutedFields).decode
_decode_usage = msgspec.json.Decoder(_UsageHolder).decode
_decode_response_usage = msgspec.json.Decoder(_ResponseHolder).decode
_decode_response_event = msgspec.json.Decoder(_ResponseEvent).decode
_decode_top = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_str = msgspec.json.Decoder(str).decode
_encode = msgspec.json.Encoder().encode


class Parsed:
    __slots__ = (
        "kind",
        "api",
        "model",
        "stream",
        "prompt",
        "body",
        "max_tokens",
        "content_type",
        "model_span",
        "cache_salt",
    )

    def __init__(
        self,
        kind: str,
        model: str,
        stream: bool,
        prompt: bytes,
        body: bytes,
        max_tokens: int | None = None,
        content_type: str | None = None,
        model_span: tuple[int, int] | None = None,
        cache_salt: str | None = None,
    ):
        self.kind = kind
        self.api = k.BY_NAME[kind]
        self.model = model
        self.stream = stream
        self.prompt = prompt  # raw JSON of messages / prompt / input: what prefix affinity hashes
        self.body = body
        self.max_tokens = max_tokens  # the completion allowance admission counts against tpm
        self.content_type = content_type  # a multipart body's, relayed as sent; None: JSON
        self.model_span = model_span  # where a multipart body holds the model's value
        self.cache_salt = cache_salt  # vLLM's cache_salt, when a non-empty string


def _allowance(text: bytes) -> int | None:
    """The token allowance as admission counts it; what it cannot read, the engine judges."""
    if not text or text == b"null":
        return None
    try:
        return max(0, int(text))
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return max(0, int(value)) if math.isfinite(value) else None


def string_of(raw: bytes) -> str | None:
    """The string a raw JSON value holds, or None if it holds none."""
    try:
        return _decode_str(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def _salt(raw: bytes) -> str | None:
    """The cache salt if `raw` is a non-empty JSON string; anything else is the engine's
    to refuse, and hashes as no salt."""
    return string_of(raw) or None


def parse(kind: str, body: bytes, content_type: bytes | None = None) -> Parsed:
    api = k.BY_NAME[kind]
    if api.multipart:
        return _parse_form(kind, body, content_type or b"")
    v.check_depth(body)  # before any decoder recurses into it
    try:
        head = _decode_head(body)
    except msgspec.ValidationError as exc:
        raise v.field_error(exc) from None
    except msgspec.DecodeError as exc:
        raise RouterError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not head.model:
        raise RouterError(400, "missing_model", "you must provide a model parameter", param="model")
    v.check_model(head.model)
    prompt = bytes(getattr(head, api.prompt_key)) if api.prompt_key else b""
    limit = bytes(head.max_completion_tokens) or bytes(head.max_tokens)
    limit = limit or bytes(head.max_output_tokens)
    stream = bool(head.stream) and api.stream is not None
    salt = _salt(bytes(head.cache_salt)) if head.cache_salt else None
    return Parsed(kind, head.model, stream, prompt, body, _allowance(limit), cache_salt=salt)


# ---------------------------------------------------------------- multipart forms

_BOUNDARY = re.compile(rb'boundary="?([^";]+)"?', re.IGNORECASE)
_DISPOSITION = re.compile(rb'content-disposition:[^\r\n]*;\s*name="([^"]*)"', re.IGNORECASE)


def form_fields(
    body: bytes, content_type: bytes, names: tuple[bytes, ...]
) -> dict[bytes, tuple[int, int]]:
    """Where each named text field's value lies in a multipart body: name -> (start, end)."""
    m = _BOUNDARY.search(content_type)
    if m is None:
        return {}
    delim = b"\r\n--" + m.group(1)
    found: dict[bytes, tuple[int, int]] = {}
    pos = body.find(delim[2:])
    while pos >= 0 and len(found) < len(names):
        head_start = pos + len(delim) - 2
        if body.startswith(b"--", head_start):
            break  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", head_start)
        if head_end < 0:
            break
        end = body.find(delim, head_end)
        if end < 0:
            break
        name = _DISPOSITION.search(body, head_start, head_end)
        if name is not None and name.group(1) in names:
            found[name.group(1)] = (head_end + 4, end)
        pos = end + 2
    return found


def _parse_form(kind: str, body: bytes, content_type: bytes) -> Parsed:
    if not content_type.lower().startswith(b"multipart/form-data"):
        raise RouterError(400, "invalid_request", "this endpoint takes a multipart/form-data body")
    fields = form_fields(body, content_type, (b"model", b"stream"))
    span = fields.get(b"model")
    if span is None:
        raise RouterError(400, "missing_model", "you must provide a model parameter", param="model")
    model = body[span[0] : span[1]].decode("utf-8", "replace")
    v.check_model(model)
    if not model:
        raise RouterError(400, "missing_model", "you must provide a model parameter", param="model")
    stream_span = fields.get(b"stream")
    stream = stream_span is not None and body[stream_span[0] : stream_span[1]].strip().lower() in (
        b"true",
        b"1",
    )
    return Parsed(kind, model, stream, b"", body, None, content_type.decode("latin-1"), span)


# ---------------------------------------------------------------- rewriting the model


def with_model(req: Parsed, model: str) -> bytes:
    """The body with `model` replaced: for aliases and fallbacks, which the engine
    knows only by the canonical name.

    Only the top level is decoded, every value kept as raw bytes, so whatever the
    rest of the body holds (numbers no decoder accepts, engine extensions) goes
    upstream byte for byte.
    """
    body = req.body
    if req.model_span is not None:
        start, end = req.model_span
        return body[:start] + model.encode() + body[end:]
    return with_keys(top_keys(body), model=model)


def top_keys(body: bytes) -> dict[str, msgspec.Raw]:
    """A JSON body's top-level keys, every value kept as its raw bytes (a repeated key:
    the last, as engines read it)."""
    return _decode_top(body)


def with_keys(top: dict[str, msgspec.Raw], **values: object) -> bytes:
    """The body of `top` with `values` set (encoded as JSON), every other value as it was."""
    for key, value in values.items():
        top[key] = msgspec.Raw(_encode(value))
    return _encode(top)


# ---------------------------------------------------------------- usage


def usage_of(data: bytes) -> Usage | None:
    """The usage object of a JSON response body or stream chunk, if it has one."""
    try:
        return _decode_usage(data).usage
    except msgspec.DecodeError:
        return None


def response_usage_of(data: bytes) -> Usage | None:
    """The usage of a Responses API answer (`input_tokens` / `output_tokens`), from the
    response object itself or from an event that carries it under `response`."""
    try:
        holder = _decode_response_usage(data)
        usage = holder.usage
        if usage is None:
            event = _decode_response_event(data).response
            usage = event.usage if event is not None else None
    except msgspec.DecodeError:
        return None
    return None if usage is None else Usage(usage.input_tokens, usage.output_tokens)
