"""Response bodies in the shapes vLLM's OpenAI server sends (and the openai SDK parses).

Stream chunks are assembled from per-request byte templates, so a token costs one small JSON
string encode and a join rather than a dict build and a full encode.
"""

from __future__ import annotations

import msgspec

from llmgw.simengine import logprobs
from llmgw.simengine.protocol import Job, Output

_encode = msgspec.json.encode

DONE = b"data: [DONE]\n\n"
# vLLM names its build here ("vllm-0.32.0-<hash>"); on the last event of a stream, as vLLM.
FINGERPRINT = "llmgw-sim"
_FP = b',"system_fingerprint":"' + FINGERPRINT.encode() + b'"'


def usage(job: Job, completion_tokens: int, cached_tokens: int) -> dict:
    """Prompt tokens once, completion tokens summed over the choices (as vLLM counts n > 1)."""
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": job.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(out: Output, reason: str) -> str:
    """The engine ends a tool call with "stop"; vLLM names it by the kind of tool_choice."""
    return out.tool.finish_reason if out.tool is not None and reason == "stop" else reason


def _tool_call(out: Output, arguments: str) -> dict:
    return {
        "id": out.tool_call_id,
        "type": "function",
        "function": {"name": out.tool.name, "arguments": arguments},
    }


def _chat_choice(job: Job, index: int, n: int, reason: str) -> dict:
    out = job.outputs[index]
    text = "".join(out.pieces[:n])
    message: dict = {"role": "assistant", "content": text}
    if out.tool is not None:
        # A named or required call comes with empty content, an "auto" one with none.
        message["content"] = "" if out.tool.forced else None
        message["tool_calls"] = [_tool_call(out, text)]
    message.update(refusal=None, annotations=None, audio=None, function_call=None, reasoning=None)
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs.chat_content(out.pieces[:n], 0, job.logprobs)
        if job.logprobs is not None
        else None,
        "finish_reason": finish_reason(out, reason),
        "stop_reason": None,
    }


def _completion_choice(job: Job, index: int, n: int, reason: str) -> dict:
    out = job.outputs[index]
    pieces = out.pieces[:n]
    return {
        "index": index,
        "text": "".join(pieces),
        "logprobs": logprobs.completion(pieces, 0, job.logprobs, 0)
        if job.logprobs is not None
        else None,
        "finish_reason": reason,
        "stop_reason": None,
    }


def full_response(
    job: Job,
    rid: str,
    created: int,
    generated: list[int],
    reasons: list[str],
    cached_tokens: int,
    kv_transfer_params: dict | None = None,
) -> bytes:
    """The whole answer: choice i has generated[i] tokens and ended for reasons[i]. A request
    that carried `kv_transfer_params` gets the engine's answer to them (maybe null)."""
    make = _chat_choice if job.kind == "chat" else _completion_choice
    choices = [make(job, i, generated[i], reasons[i]) for i in range(len(job.outputs))]
    body = {
        "id": rid,
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": created,
        "model": job.model,
        "choices": choices,
        "system_fingerprint": FINGERPRINT,
        "usage": usage(job, sum(generated), cached_tokens),
    }
    if job.kv_transfer is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return _encode(body)


class ChunkEncoder:
    """The `data: ...` events of one streamed text choice without logprobs (the hot path)."""

    __slots__ = ("job", "pieces", "_head", "_mid", "_tail", "_last_tail", "_usage_head")

    def __init__(self, job: Job, rid: str, created: int, index: int = 0):
        self.job = job
        self.pieces = job.outputs[index].pieces
        obj = b"chat.completion.chunk" if job.kind == "chat" else b"text_completion"
        common = b'{"id":"%s","object":"%s","created":%d,"model":%s,' % (
            rid.encode(),
            obj,
            created,
            _encode(job.model),
        )
        field = b'"delta":{"content":' if job.kind == "chat" else b'"text":'
        self._head = b"data: " + common + b'"choices":[{"index":%d,' % index + field
        close = b"}" if job.kind == "chat" else b""
        self._mid = close + b',"logprobs":null,"finish_reason":'
        self._tail = b"}]" + (b',"usage":null' if job.include_usage else b"") + b"}\n\n"
        # The fingerprint rides on the last event: the usage chunk when there is one.
        self._last_tail = self._tail if job.include_usage else b"}]" + _FP + b"}\n\n"
        self._usage_head = b"data: " + common + b'"choices":[],"usage":'

    def role(self) -> bytes:
        """Chat streams open with the assistant role, as vLLM's do."""
        head = self._head.replace(b'"delta":{"content":', b'"delta":{"role":"assistant","content":')
        return head + b'""' + self._mid + b"null" + self._tail

    def tokens(self, start: int, end: int, reason: str | None) -> list[bytes]:
        """Events for pieces [start, end); the last carries `reason` when the request ended."""
        head, mid, tail = self._head, self._mid, self._tail
        pieces = self.pieces[start:end]
        # With no token left to carry it, the finish reason rides on an empty one.
        last = (pieces.pop() if pieces else "") if reason is not None else None
        out = [head + _encode(p) + mid + b"null" + tail for p in pieces]
        if reason is not None:
            out.append(head + _encode(last) + mid + b'"' + reason.encode() + b'"' + self._last_tail)
        return out

    def usage(self, completion_tokens: int, cached_tokens: int) -> bytes:
        body = _encode(usage(self.job, completion_tokens, cached_tokens))
        return self._usage_head + body + _FP + b"}\n\n"


class RichChunkEncoder:
    """Events of a choice with logprobs or a tool call: built as dicts, one per token.

    A tool call streams as vLLM streams it: a first delta with the call's id, type, index and
    function name (arguments empty), then one delta per token carrying an arguments fragment.
    """

    __slots__ = ("job", "index", "out", "_common", "_header_sent", "_offset", "_usage_enc")

    def __init__(self, job: Job, rid: str, created: int, index: int = 0):
        self.job = job
        self.index = index
        self.out = job.outputs[index]
        self._common = {
            "id": rid,
            "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
            "created": created,
            "model": job.model,
        }
        self._header_sent = False
        self._offset = 0
        self._usage_enc = ChunkEncoder(job, rid, created, index)

    def _event(self, choice: dict) -> bytes:
        body = {**self._common, "choices": [choice]}
        if self.job.include_usage:
            body["usage"] = None
        elif choice["finish_reason"] is not None:
            body["system_fingerprint"] = FINGERPRINT
        return b"data: " + _encode(body) + b"\n\n"

    def role(self) -> bytes:
        return self._usage_enc.role()

    def tokens(self, start: int, end: int, reason: str | None) -> list[bytes]:
        job, out = self.job, self.out
        events = []
        if out.tool is not None and not self._header_sent and (end > start or reason):
            self._header_sent = True
            # vLLM's header names the function and carries no arguments yet.
            call = {"index": 0, **_tool_call(out, "")}
            del call["function"]["arguments"]
            delta = {"content": None, "tool_calls": [call]}
            events.append(
                self._event(
                    {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
                )
            )
        stop = max(end, start + 1) if reason is not None else end
        if out.tool is not None and reason is not None:
            # The finish rides on a chunk of its own with an empty delta, as vLLM's does
            # (the parser holds back the closing tokens).
            stop = end + 1
        for i in range(start, stop):
            piece = out.pieces[i] if i < end else ""
            choice: dict = {"index": self.index}
            lp = None
            if job.logprobs is not None and i < end:
                if job.kind == "chat":
                    lp = logprobs.chat_content(out.pieces[: i + 1], i, job.logprobs)
                else:
                    lp = logprobs.completion(out.pieces[: i + 1], i, job.logprobs, self._offset)
                    self._offset += len(piece)
            if job.kind == "chat":
                if out.tool is not None:
                    choice["delta"] = (
                        {
                            "content": None,
                            "tool_calls": [{"index": 0, "function": {"arguments": piece}}],
                        }
                        if piece
                        else {}
                    )
                else:
                    choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            choice["logprobs"] = lp
            last = reason is not None and i == stop - 1
            choice["finish_reason"] = finish_reason(out, reason) if last else None
            if last:
                choice["stop_reason"] = None
            events.append(self._event(choice))
        return events

    def usage(self, completion_tokens: int, cached_tokens: int) -> bytes:
        return self._usage_enc.usage(completion_tokens, cached_tokens)


def encoder(job: Job, rid: str, created: int, index: int = 0) -> ChunkEncoder | RichChunkEncoder:
    out = job.outputs[index]
    if job.logprobs is None and out.tool is None:
        return ChunkEncoder(job, rid, created, index)
    return RichChunkEncoder(job, rid, created, index)
