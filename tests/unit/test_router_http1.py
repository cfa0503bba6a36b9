"""The proxy's HTTP/1.1 client (relay/http1.py) against real local servers over real
sockets: the request it writes, the three ways a response body ends, keep-alive and
its limits, flow control, and the errors the relay maps to failures."""

from __future__ import annotations

import asyncio
import socket
import ssl

import pytest
from cryptography.hazmat.primitives import serialization
from yarl import URL

from llmgw import certs  # the development CA the NATS mTLS tests use
from llmgw.contracts import DeadlineSpec
from llmgw.dev.servers import free_port
from llmgw.router.relay import http1
from llmgw.router.relay.upstream import failure_of


class Server:
    """A raw asyncio server: each connection's request bytes are recorded and
    `answer(conn_no, request)` says what to write back (None: close at once)."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        for w in self.writers:
            w.close()
        self.server.close()  # type: ignore[union-attr]
        await asyncio.sleep(0.01)  # the handlers see their connections closed and return

    def url(self, path: str = "/v1/chat/completions") -> URL:
        return URL(f"http://127.0.0.1:{self.port}{path}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        no = self.connections
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                reply = self.answer(no, request)
                if reply is None:
                    writer.close()
                    return
                if isinstance(reply, list):
                    for part in reply:
                        if isinstance(part, float):
                            await asyncio.sleep(part)
                        else:
                            writer.write(part)
                            await writer.drain()
                else:
                    writer.write(reply)
                    await writer.drain()
                if b"Connection: close" in (reply[0] if isinstance(reply, list) else reply):
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def sized(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


async def post(client: http1.Client, server: Server, body: bytes = b"{}", **headers: str):
    return await client.post(server.url(), body, headers, 2.0)


async def test_one_post_writes_host_length_and_our_headers_and_nothing_else():
    async with Server(lambda no, req: sized(b'{"ok":1}')) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await client.post(
            server.url("/v1/chat/completions?x=1"),
            b'{"model":"m"}',
            {"Content-Type": "application/json", "X-Request-Id": "abc"},
            2.0,
        )
        assert resp.status == 200
        assert await resp.read() == b'{"ok":1}'
        resp.release()
        await client.close()
    assert server.requests == [
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n"
        b"Host: 127.0.0.1:" + str(server.port).encode() + b"\r\n"
        b"Content-Length: 13\r\nContent-Type: application/json\r\nX-Request-Id: abc\r\n\r\n"
        b'{"model":"m"}'
    ]


async def test_headers_are_found_by_any_case():
    reply = sized(b"{}", b"Retry-After: 3\r\nX-Thing: a\r\nx-thing: b\r\n")
    async with Server(lambda no, req: reply) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        assert resp.headers.get("Content-Type") == "application/json"
        assert resp.headers.get("content-type") == "application/json"
        assert resp.headers.get("retry-after") == "3"
        assert resp.headers.get("X-THING") == "a, b"
        assert resp.headers.get("Absent", "") == ""
        resp.close()
        await client.close()


async def test_a_chunked_stream_is_read_as_it_arrives_and_ends_with_empty_bytes():
    parts = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"7\r\ndata: 1\r\n",
        0.05,
        b"7\r\ndata: 2\r\n0\r\n\r\n",
    ]
    async with Server(lambda no, req: parts) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        assert resp.headers.get("Content-Type") == "text/event-stream"
        got = [await resp.readany()]
        got.append(await resp.readany())
        assert got == [b"data: 1", b"data: 2"]
        assert await resp.readany() == b""
        resp.release()
        assert client.idle_count() == 1  # read to its end: kept for the next request
        await client.close()


async def test_a_close_delimited_body_ends_with_the_connection_and_is_not_reused():
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nall of it"
    async with Server(lambda no, req: reply) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        assert await resp.read() == b"all of it"
        resp.release()
        assert client.idle_count() == 0
        await client.close()


async def test_a_body_larger_than_the_high_water_mark_is_read_whole():
    body = bytes(range(256)) * (4 * http1.HIGH_WATER // 256)
    async with Server(lambda no, req: sized(body)) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        assert await resp.read() == body
        assert await resp.read() == body  # kept: a second read returns it again
        resp.release()
        assert client.idle_count() == 1
        await client.close()


async def test_connections_are_reused_for_sequential_requests():
    async with Server(lambda no, req: sized(b"x")) as server:
        client = http1.Client(limit=8, keepalive=30)
        for _ in range(5):
            resp = await post(client, server)
            assert await resp.read() == b"x"
            resp.release()
        assert server.connections == 1
        await client.close()


async def test_a_response_not_read_to_its_end_is_not_reused():
    parts = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"1\r\na\r\n",
        0.05,
        b"1\r\nb\r\n0\r\n\r\n",
    ]
    async with Server(lambda no, req: parts) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        assert await resp.readany() == b"a"
        resp.release()
        assert client.idle_count() == 0
        resp = await post(client, server)
        await resp.read()
        resp.release()
        assert server.connections == 2
        await client.close()


async def test_connection_close_from_the_server_is_honoured():
    async with Server(lambda no, req: sized(b"x", b"Connection: close\r\n")) as server:
        client = http1.Client(limit=8, keepalive=30)
        for _ in range(2):
            resp = await post(client, server)
            assert await resp.read() == b"x"
            resp.release()
            assert client.idle_count() == 0
        assert server.connections == 2
        await client.close()


async def test_an_idle_connection_the_server_closed_is_not_reused():
    async with Server(lambda no, req: sized(b"x")) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        await resp.read()
        resp.release()
        for w in server.writers:
            w.close()
        await asyncio.sleep(0.05)
        resp = await post(client, server)
        assert await resp.read() == b"x"
        resp.release()
        assert server.connections == 2
        await client.close()


async def test_a_reused_connection_closed_before_any_answer_is_retried_once_fresh():
    # The server answers a connection's first request and closes it on the second,
    # unanswered: as if its keep-alive ran out just as the request was written.
    seen: set[int] = set()

    def answer(no, req):
        if no in seen:
            return None
        seen.add(no)
        return sized(b"x")

    async with Server(answer) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        await resp.read()
        resp.release()
        resp = await post(client, server, b'{"again":1}')
        assert await resp.read() == b"x"
        resp.release()
        assert server.connections == 2
        assert server.requests[-1].endswith(b'{"again":1}')
        await client.close()


async def test_a_fresh_connection_closed_before_any_answer_is_broken():
    async with Server(lambda no, req: None) as server:
        client = http1.Client(limit=8, keepalive=30)
        with pytest.raises(http1.Broken):
            await post(client, server)
        assert server.connections == 1  # no retry on a fresh connection
        assert client.in_use == 0
        await client.close()


async def test_a_stream_cut_mid_body_raises_broken():
    parts = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\na\r\n"]

    def answer(no, req):
        asyncio.get_running_loop().call_later(0.05, server.writers[-1].close)
        return parts

    async with Server(answer) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        assert await resp.readany() == b"a"
        with pytest.raises(http1.Broken):
            await resp.readany()
        resp.close()
        await client.close()


async def test_a_response_that_does_not_parse_is_broken():
    async with Server(lambda no, req: b"HTTP/1.1 2x0 nope\r\n\r\n") as server:
        client = http1.Client(limit=8, keepalive=30)
        with pytest.raises(http1.Broken):
            await post(client, server)
        await client.close()


async def test_refused_is_a_connect_error_naming_the_os_error():
    client = http1.Client(limit=8, keepalive=30)
    url = URL(f"http://127.0.0.1:{free_port()}/v1/chat/completions")
    with pytest.raises(http1.ConnectError) as err:
        await client.post(url, b"{}", {}, 2.0)
    assert isinstance(err.value.os_error, ConnectionRefusedError)
    assert client.in_use == 0
    await client.close()


async def test_no_connection_within_the_deadline_is_a_connect_timeout():
    # A listener that never accepts, its backlog full: the kernel drops further SYNs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    client = http1.Client(limit=8, keepalive=30)
    try:
        with pytest.raises(http1.ConnectTimeout):
            await client.post(URL(f"http://127.0.0.1:{port}/v1/x"), b"{}", {}, 0.2)
        assert client.in_use == 0
    finally:
        await client.close()
        for s in [*fillers, listener]:
            s.close()


async def test_an_unknown_scheme_is_a_clear_connect_error():
    client = http1.Client(limit=8, keepalive=30)
    with pytest.raises(http1.ConnectError, match="'ftp' is not http or https"):
        await client.post(URL("ftp://127.0.0.1:21/x"), b"{}", {}, 1.0)
    await client.close()


async def test_the_limit_makes_requests_wait_for_a_slot_within_the_connect_deadline():
    async with Server(lambda no, req: sized(b"x")) as server:
        client = http1.Client(limit=1, keepalive=30)
        first = await post(client, server)
        with pytest.raises(http1.ConnectTimeout, match="limit 1"):
            await client.post(server.url(), b"{}", {}, 0.1)
        waiting = asyncio.ensure_future(post(client, server))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await first.read()
        first.release()  # its slot goes to the waiter
        second = await asyncio.wait_for(waiting, 2)
        assert await second.read() == b"x"
        second.release()
        assert client.in_use == 0
        assert server.connections == 1
        await client.close()


async def test_idle_connections_are_closed_after_keepalive():
    async with Server(lambda no, req: sized(b"x")) as server:
        client = http1.Client(limit=8, keepalive=0.1)
        resp = await post(client, server)
        await resp.read()
        resp.release()
        assert client.open_count() == 1
        await asyncio.sleep(0.3)
        assert client.idle_count() == 0
        assert client.open_count() == 0
        await client.close()


async def test_close_closes_every_connection_in_use_too():
    parts = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\na\r\n"]
    async with Server(lambda no, req: parts) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        await resp.readany()
        await client.close()
        with pytest.raises(http1.Broken):
            await resp.readany()
        assert client.open_count() == 0
        with pytest.raises(http1.ConnectError, match="closed"):
            await post(client, server)


async def test_a_slow_reader_pauses_the_engine_instead_of_buffering_its_stream():
    """An engine streaming 16 MiB to a reader that takes nothing: the client holds
    about HIGH_WATER plus the socket buffers, and the engine's writes block."""
    total = 16 * 1024 * 1024
    sent = 0
    blocked = asyncio.Event()

    async def serve(reader, writer):
        nonlocal sent
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * 65536
        while sent < total:
            writer.write(block)
            sent += len(block)
            try:
                await asyncio.wait_for(writer.drain(), 0.5)
            except TimeoutError:
                blocked.set()
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = http1.Client(limit=8, keepalive=30)
    resp = await client.post(URL(f"http://127.0.0.1:{port}/"), b"", {}, 2.0)
    await asyncio.wait_for(blocked.wait(), 10)
    conn = resp._conn
    assert conn is not None and conn.paused
    assert conn.buffered < http1.HIGH_WATER + 256 * 1024
    assert sent < total
    got = 0
    while chunk := await resp.readany():
        got += len(chunk)
    assert got == total  # resumed as it was drained, nothing lost
    resp.release()
    await client.close()
    server.close()


async def test_https_upstreams_use_tls(tmp_path):
    ca_key, ca_cert = certs.make_ca(1)
    key, cert = certs.make_leaf(ca_key, ca_cert, "engine", 1, server_hosts=["127.0.0.1"])
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.crt").write_bytes(ca_cert.public_bytes(pem))
    (tmp_path / "e.crt").write_bytes(cert.public_bytes(pem))
    (tmp_path / "e.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp_path / "e.crt", tmp_path / "e.key")

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(sized(b"secure"))
        await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    client = http1.Client(limit=8, keepalive=30)
    client.ssl_context().load_verify_locations(tmp_path / "ca.crt")
    resp = await client.post(URL(f"https://127.0.0.1:{port}/v1/x"), b"", {}, 2.0)
    assert await resp.read() == b"secure"
    resp.release()
    await client.close()
    server.close()


def test_a_header_with_a_line_break_is_refused():
    with pytest.raises(ValueError, match="X-Evil"):
        http1._request(URL("http://h/x"), b"", {"X-Evil": "a\r\nInjected: 1"})


def test_the_relay_maps_the_clients_errors_to_the_same_failures_as_before():
    dl = DeadlineSpec(connect=2)
    timeout, blames = failure_of(http1.ConnectTimeout("slow"), "e1", dl)
    assert (timeout.kind, timeout.status, blames) == ("connect_timeout", 504, True)
    refused = ConnectionRefusedError(111, "Connection refused")
    error, blames = failure_of(http1.ConnectError("no", refused), "e1", dl)
    assert (error.kind, error.status, blames) == ("connect_error", 502, True)
    assert "Connection refused" in error.detail
    broken, blames = failure_of(http1.Broken("cut"), "e1", dl)
    assert (broken.kind, broken.status, blames) == ("upstream_broken", 502, True)


async def test_bytes_after_the_answer_make_the_connection_unusable():
    async with Server(lambda no, req: sized(b"x") + b"HTTP/1.1 200 OK\r\n") as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        assert await resp.read() == b"x"
        await asyncio.sleep(0.05)  # the stray bytes arrive
        resp.release()
        assert client.idle_count() == 0
        await client.close()


async def test_a_second_answer_in_the_same_segment_does_not_touch_the_first():
    second = b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\nEVIL"
    async with Server(lambda no, req: sized(b"x") + second) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        assert resp.status == 200
        assert await resp.read() == b"x"
        assert resp.headers.get("Content-Length") == "1"
        resp.release()
        assert client.idle_count() == 0
        await client.close()


async def test_a_reused_connection_lost_after_the_engine_had_the_request_is_not_resent():
    # The engine takes the second request and dies after working on it a while: the
    # request is not sent again (to a dead or restarted engine); the walk picks where next.
    def answer(no, req):
        if b"slow" in req:
            return [0.4, b""]  # then the handler returns and the connection closes
        return sized(b"x")

    async with Server(answer) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await post(client, server)
        await resp.read()
        resp.release()

        async def kill_later():
            await asyncio.sleep(http1.STALE_SECONDS + 0.2)
            for w in server.writers:
                w.transport.abort()

        killer = asyncio.ensure_future(kill_later())
        with pytest.raises(http1.Broken):
            await post(client, server, b'{"slow":1}')
        await killer
        assert [r.endswith(b'{"slow":1}') for r in server.requests] == [False, True]
        await client.close()


async def test_a_waiter_cancelled_as_a_slot_frees_gets_its_own_error_not_a_crash():
    async with Server(lambda no, req: sized(b"x")) as server:
        client = http1.Client(limit=1, keepalive=30)
        first = await post(client, server)
        waiting = asyncio.ensure_future(post(client, server))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client left; its task resumes only on the next loop turn
        await first.read()
        first.release()  # pops the cancelled waiter before that task resumes
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert client.in_use == 0
        await client.close()


async def test_a_configured_host_header_replaces_ours_and_values_are_utf8():
    async with Server(lambda no, req: sized(b"x")) as server:
        client = http1.Client(limit=8, keepalive=30)
        resp = await client.post(
            server.url(), b"{}", {"host": "engine.internal", "X-Team": "équipe"}, 2.0
        )
        await resp.read()
        resp.release()
        await client.close()
    [request] = server.requests
    assert request.count(b"ost: ") == 1 and b"host: engine.internal\r\n" in request
    assert "X-Team: équipe\r\n".encode() in request


async def test_after_close_waiters_fail_and_a_released_connection_is_not_pooled():
    async with Server(lambda no, req: sized(b"x")) as server:
        client = http1.Client(limit=1, keepalive=30)
        first = await post(client, server)
        waiting = asyncio.ensure_future(post(client, server))
        await asyncio.sleep(0.01)
        await client.close()
        with pytest.raises(http1.ConnectError, match="closed"):
            await waiting
        first.release()
        assert client.idle_count() == 0 and client.open_count() == 0
