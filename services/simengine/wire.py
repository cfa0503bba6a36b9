"""Response bodies in the shapes vLLM's OpenAI server sends (and the openai SDK parses).

Stream chunks are assembled from per-request byte templates, so a token costs one small JSON
string encode and a join rather than a dict build and a full encode.
"""

from __future__ import annotations

import msgspec

from llmgw.simengine.protocol import Job

_encode = msgspec.json.encode

DONE = b"data: [DONE]\n\n"


def usage(job: Job, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": job.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(
    job: Job, rid: str, created: int, n: int, reason: str, cached_tokens: int
) -> bytes:
    text = "".join(job.pieces[:n])
    if job.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return _encode(
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": job.model,
            "choices": [choice],
            "usage": usage(job, n, cached_tokens),
        }
    )


class ChunkEncoder:
    """The `data: ...` events of one streamed response."""

    __slots__ = ("job", "_head", "_mid", "_tail", "_usage_head")

    def __init__(self, job: Job, rid: str, created: int):
        self.job = job
        obj = b"chat.completion.chunk" if job.kind == "chat" else b"text_completion"
        common = b'{"id":"%s","object":"%s","created":%d,"model":%s,' % (
            rid.encode(),
            obj,
            created,
            _encode(job.model),
        )
        field = b'"delta":{"content":' if job.kind == "chat" else b'"text":'
        self._head = b"data: " + common + b'"choices":[{"index":0,' + field
        close = b"}" if job.kind == "chat" else b""
        self._mid = close + b',"logprobs":null,"finish_reason":'
        self._tail = b"}]" + (b',"usage":null' if job.include_usage else b"") + b"}\n\n"
        self._usage_head = b"data: " + common + b'"choices":[],"usage":'

    def role(self) -> bytes:
        """Chat streams open with the assistant role, as vLLM's do."""
        head = self._head.replace(b'"delta":{"content":', b'"delta":{"role":"assistant","content":')
        return head + b'""' + self._mid + b"null" + self._tail

    def tokens(self, start: int, end: int, reason: str | None) -> list[bytes]:
        """Events for pieces [start, end); the last carries `reason` when the request ended."""
        head, mid, tail = self._head, self._mid, self._tail
        pieces = self.job.pieces[start:end]
        # With no token left to carry it, the finish reason rides on an empty one.
        last = (pieces.pop() if pieces else "") if reason is not None else None
        out = [head + _encode(p) + mid + b"null" + tail for p in pieces]
        if reason is not None:
            out.append(head + _encode(last) + mid + b'"' + reason.encode() + b'"' + tail)
        return out

    def usage(self, completion_tokens: int, cached_tokens: int) -> bytes:
        return (
            self._usage_head + _encode(usage(self.job, completion_tokens, cached_tokens)) + b"}\n\n"
        )
