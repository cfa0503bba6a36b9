"""The benchmarks' fast upstream: what it answers decides what a router comparison means.

Paced, each event must reach the reader on its own, as an engine's tokens do; and the
render call vllm-router's cache_aware makes before each chat request must get vLLM's
own answer (403 unless the engine runs with --enable-scale-out), not a whole stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from llmgw.dev.routerkit import FAST_EVENTS, fast_upstream
from llmgw.dev.servers import free_port

pytestmark = pytest.mark.asyncio

BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}


async def _reads(port: int) -> list[tuple[float, bytes]]:
    """Each socket read of one streamed answer, with when it came: a raw socket, since
    an HTTP client hands over chunks, not reads."""
    body = json.dumps(BODY).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    began = time.monotonic()
    reads, seen = [], b""
    try:
        while not seen.endswith(b"0\r\n\r\n"):
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, "the upstream closed before its answer ended"
            reads.append((time.monotonic() - began, data))
            seen += data
    finally:
        writer.close()
    return reads


def _events(reads: list[tuple[float, bytes]]) -> list[bytes]:
    return [e + b"\n\n" for e in re.findall(rb"data: [^\n]*", b"".join(c for _, c in reads))]


async def test_paced_events_arrive_one_at_a_time_and_render_is_refused_as_vllm_does():
    port = free_port()
    server = await fast_upstream(port, gap=0.02)
    url = f"http://127.0.0.1:{port}"
    try:
        reads = await _reads(port)
        assert _events(reads) == FAST_EVENTS
        assert [len(_events([r])) for r in reads] == [1] * len(FAST_EVENTS)  # one a read
        # 15 gaps of 20 ms between the first event and the last
        assert reads[-1][0] - reads[0][0] >= 15 * 0.02 * 0.9

        async with httpx.AsyncClient(timeout=10) as http:
            resp = await http.post(url + "/v1/chat/completions/render", json=BODY)
        assert resp.status_code == 403
        assert resp.json()["error"]["type"] == "PermissionDeniedError"
    finally:
        server.close()
        await server.wait_closed()


async def test_unpaced_events_come_in_one_write():
    port = free_port()
    server = await fast_upstream(port)
    try:
        reads = await _reads(port)
        assert _events(reads) == FAST_EVENTS
        assert json.loads(FAST_EVENTS[0][6:])["object"] == "chat.completion.chunk"
        assert len(reads) == 1  # head and every event in one write
    finally:
        server.close()
        await server.wait_closed()


async def test_a_paced_connection_answers_requests_in_turn_and_a_split_render_url():
    port = free_port()
    server = await fast_upstream(port, gap=0.005)
    try:
        # Two requests in turn on one connection: two whole answers.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps(BODY).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        for _ in range(2):
            writer.write(request)
            seen = b""
            while not seen.endswith(b"0\r\n\r\n"):
                data = await asyncio.wait_for(reader.read(65536), 5)
                assert data
                seen += data
            assert seen.count(b"HTTP/1.1 200") == 1 and seen.count(b"data: ") == len(FAST_EVENTS)
        # The render path, its URL arriving in two reads.
        writer.write(b"POST /v1/chat/completions/ren")
        await asyncio.sleep(0.05)
        writer.write(b"der HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 403")
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
