"""The proxy's HTTP/1.1 client: a keep-alive connection pool to engine endpoints,
and one request/response exchange on it.

Why not aiohttp: profiled under load (docs/router.md, "Against vllm-router, per
core"), aiohttp's client was 37-40% of a router worker, about 130 µs a request,
the largest cost left: a request object, a writer, a payload object, a timer
context and a stream reader per request, most of it for features the relay never
uses (cookies, redirects, decompression, multipart). The relay needs only this:
one POST written in one `transport.write`, a response parsed by httptools (the C
parser uvicorn already uses), its body handed over as it arrives, and the
connection kept for the next request.

A connection is an `asyncio.Protocol`; the response read from it buffers at most
`HIGH_WATER` unread bytes before it pauses the transport, so a slow client makes
the engine wait (TCP back-pressure) instead of the router buffering its stream.
Connections are pooled per (scheme, host, port), most recently used first; one
limit bounds the connections in use across all endpoints (a request waits for a
slot at most its connect deadline); an idle connection is closed after
`keepalive` seconds, and one the server closed while idle is never reused. A
request on a reused connection that fails before any response byte is sent again
once on a fresh connection: the server closed it as we wrote (what urllib3 and
httpx do).

Errors are three classes the relay maps to its failures: `ConnectTimeout`,
`ConnectError` (carrying the OS error) and `Broken` (anything after the
connection was made). Deadlines on the exchange itself (headers, first token,
idle, total) are the request guard's, which cancels the task: a cancelled
exchange closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque

import httptools
from yarl import URL

HIGH_WATER = 256 * 1024  # unread response bytes before the engine's socket is paused
_SCHEMES = {"http": 80, "https": 443}
_FOREVER = float("inf")
# A reused connection lost this soon after the request was written was closed by the
# engine while idle, as the request went out: only then is it sent again. Lost later,
# the engine may be dead or busy with the request; the walk decides where next.
STALE_SECONDS = 0.25


class UpstreamError(Exception):
    """An exchange with an engine failed."""


class ConnectTimeout(UpstreamError):
    """No connection (or no free slot for one) within the connect deadline."""


class ConnectError(UpstreamError):
    """The engine could not be reached: refused, unreachable, TLS refused."""

    def __init__(self, message: str, os_error: OSError | None = None):
        super().__init__(message)
        self.os_error = os_error


class Broken(UpstreamError):
    """The connection failed or the engine sent something unparseable after the
    connection was made; `answered` says whether any response byte had arrived."""

    def __init__(self, message: str, answered: bool = True):
        super().__init__(message)
        self.answered = answered


class Headers(dict):
    """Response headers, looked up by any case of the name (stored lower-case)."""

    def get(self, name: str, default=None):  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection to an engine, parsing the response to the request
    last written on it."""

    __slots__ = (
        "pool",
        "transport",
        "parser",
        "headers",
        "status",
        "chunks",
        "buffered",
        "paused",
        "waiter",
        "answered",
        "headed",
        "complete",
        "keep_alive",
        "until_eof",
        "error",
        "lost",
        "idle_since",
    )

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers = Headers()
        self.status = 0
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future | None = None
        self.answered = False  # any byte of this response arrived
        self.headed = False
        self.complete = False
        self.keep_alive = False
        self.until_eof = False  # a body without length or chunking: it ends with the connection
        self.error: Broken | None = None

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.pool.client.opened(self)

    def data_received(self, data: bytes) -> None:
        if self.idle_since or self.complete:
            # Bytes after the answer, or on an idle connection, answer no request of
            # ours: the connection is not to be trusted again.
            self._fail(Broken("the engine sent data after its answer"))
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Broken(f"the engine's response did not parse: {exc}"))
            return
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.lost = True  # before connection_lost comes: not to be reused meanwhile
        return False  # close the transport: a half-closed engine connection is useless

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.client.closed(self)
        if self.headed and self.until_eof and not self.complete and exc is None:
            self.complete = True  # a close-delimited body ends here
        elif not self.complete and self.error is None:
            why = f": {exc}" if exc is not None else ""
            self.error = Broken(f"the engine closed the connection{why}", self.answered)
        self._wake()

    # ------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: not to be trusted again
            self._fail(Broken("the engine sent data after its answer"))

    # After _fail (a second answer began) the rest of the segment is still parsed:
    # none of it may land in the answer already taken.

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.error is not None:
            return
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = dict.get(self.headers, key)
        self.headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        if self.error is not None:
            return
        self.status = self.parser.get_status_code()
        self.headed = True
        h = self.headers
        self.until_eof = (
            "content-length" not in h
            and "transfer-encoding" not in h
            and self.status >= 200
            and self.status not in (204, 304)
        )

    def on_body(self, body: bytes) -> None:
        if self.error is not None:
            return
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.error is not None:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it after this

    # ------------------------------------------------------------ the exchange

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Broken) -> None:
        self.error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self.waiter = waiter = self.pool.loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None
        if self.error is not None and not self.chunks:
            raise self.error

    async def exchange(self, request: bytes) -> Response:
        """Write `request`, wait for the response's headers. Any failure closes the
        connection."""
        self._reset()
        self.idle_since = 0.0
        try:
            self.transport.write(request)  # type: ignore[union-attr]
            while not self.headed:
                await self._wait()
        except BaseException:
            self.close()
            raise
        return Response(self)

    def take(self) -> bytes:
        """Everything buffered, the transport resumed if it was paused for it."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        if self.paused:
            self.paused = False
            if not self.lost:
                self.transport.resume_reading()  # type: ignore[union-attr]
        return data

    def reusable(self) -> bool:
        return (
            self.complete
            and not self.lost
            and self.error is None
            and not self.until_eof
            and self.keep_alive
        )

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """An engine's response: status and headers at once, the body read whole (`read`)
    or as it arrives (`readany`). The connection goes back to the pool on `release`
    only when the body was read to its end and the engine keeps the connection
    open; `close` drops it. Either may be called more than once."""

    __slots__ = ("status", "headers", "_conn", "_body")

    def __init__(self, conn: _Connection):
        self.status = conn.status
        self.headers = conn.headers
        self._conn: _Connection | None = conn
        self._body: bytes | None = None

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some), or b""
        at the end of the body. Raises `Broken` if the body was cut short."""
        conn = self._conn
        if conn is None:
            return b""
        while not conn.chunks:
            if conn.complete:
                return b""
            await conn._wait()
        return conn.take()

    async def read(self) -> bytes:
        """The rest of the body, whole; kept, so a second call returns it again."""
        if self._body is None:
            conn = self._conn
            if conn is None:
                return b""
            parts = []
            while not conn.complete:
                if conn.buffered > HIGH_WATER:
                    parts.append(conn.take())  # resumes the socket paused for it
                await conn._wait()
            parts.append(conn.take())
            self._body = parts[0] if len(parts) == 1 else b"".join(parts)
        return self._body

    def release(self) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if conn.reusable() and not conn.chunks and not conn.pool.client.closing:
            conn.pool.put(conn)
        else:
            conn.close()
            conn.pool.client.free_slot()

    def close(self) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        conn.close()
        conn.pool.client.free_slot()


class _Pool:
    """The idle connections to one (scheme, host, port), most recently used last."""

    __slots__ = ("client", "loop", "scheme", "host", "port", "ssl", "idle")

    def __init__(self, client: Client, scheme: str, host: str, port: int):
        self.client = client
        self.loop = client.loop
        self.scheme = scheme
        self.host = host
        self.port = port
        self.ssl = client.ssl_context() if scheme == "https" else None
        self.idle: list[_Connection] = []

    def pop_idle(self, now: float) -> _Connection | None:
        """The most recently used idle connection still open and fresh, if any."""
        idle = self.idle
        keepalive = self.client.keepalive
        while idle:
            conn = idle.pop()
            if conn.lost or conn.error is not None or now - conn.idle_since >= keepalive:
                conn.close()
                continue
            return conn
        return None

    def put(self, conn: _Connection) -> None:
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        self.client.free_slot()
        self.client.sweep_later()

    async def connect(self, seconds: float) -> _Connection:
        conn = _Connection(self)
        try:
            async with asyncio.timeout(seconds):
                await self.loop.create_connection(
                    lambda: conn,
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                )
        except TimeoutError:
            raise ConnectTimeout(
                f"{self.host}:{self.port} did not accept a connection within {seconds}s"
            ) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}", exc) from exc
        return conn


class Client:
    """Connection pools to every engine endpoint, with one limit on connections in
    use across them. `close` closes every connection."""

    def __init__(self, limit: int, keepalive: float):
        self.loop = asyncio.get_running_loop()
        self.limit = limit
        self.keepalive = keepalive
        self.in_use = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        self._ssl: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._open: set[_Connection] = set()
        self.closing = False

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def post(
        self, url: URL, body: bytes, headers: dict[str, str], connect_timeout: float
    ) -> Response:
        """POST `body` to `url` with `headers` (Host and Content-Length added), and the
        response once its headers arrived."""
        if self.closing:
            raise ConnectError("the client is closed")
        pool = self._pool(url)
        request = _request(url, body, headers)
        await self._acquire(connect_timeout)
        try:
            now = self.loop.time()
            conn = pool.pop_idle(now)
            if conn is not None:
                try:
                    return await conn.exchange(request)
                except Broken as exc:
                    if exc.answered or self.loop.time() - now > STALE_SECONDS:
                        raise
                    # The engine closed the idle connection as we wrote: once more, fresh.
            conn = await pool.connect(connect_timeout)
            return await conn.exchange(request)
        except BaseException:
            self.free_slot()
            raise

    def _pool(self, url: URL) -> _Pool:
        scheme = url.scheme
        host = url.raw_host or ""
        default = _SCHEMES.get(scheme)
        if default is None:
            raise ConnectError(f"{url}: the scheme {scheme!r} is not http or https")
        key = (scheme, host, url.port or default)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(self, *key)
        return pool

    async def _acquire(self, seconds: float) -> None:
        if self.in_use < self.limit:
            self.in_use += 1
            return
        waiter = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(seconds):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.free_slot()  # handed a slot as we gave up: pass it on
            else:
                waiter.cancel()
                # free_slot may have popped it already, between its cancel and now
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise ConnectTimeout(
                    f"no free upstream connection (limit {self.limit}) within {seconds}s"
                ) from None
            raise

    def free_slot(self) -> None:
        """A connection in use is done with: hand its slot to the next waiter."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes over, in_use unchanged
                return
        self.in_use -= 1

    def sweep_later(self) -> None:
        if self._sweep is None and not self.closing:
            self._sweep = self.loop.call_later(self.keepalive, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Close connections idle longer than `keepalive` (or closed by the engine)."""
        self._sweep = None
        now = self.loop.time()
        keepalive = self.keepalive
        oldest = _FOREVER
        for pool in self._pools.values():
            keep = []
            for conn in pool.idle:
                if conn.lost or conn.error is not None or now - conn.idle_since >= keepalive:
                    conn.close()
                else:
                    keep.append(conn)
                    oldest = min(oldest, conn.idle_since)
            pool.idle = keep
        if oldest < _FOREVER and not self.closing:
            self._sweep = self.loop.call_at(oldest + keepalive, self._sweep_idle)

    def opened(self, conn: _Connection) -> None:
        self._open.add(conn)

    def closed(self, conn: _Connection) -> None:
        self._open.discard(conn)

    def idle_count(self) -> int:
        return sum(len(pool.idle) for pool in self._pools.values())

    def open_count(self) -> int:
        return len(self._open)

    async def close(self) -> None:
        """Close every connection, idle or in use (a response still being read then
        fails as `Broken`)."""
        self.closing = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectError("the client is closed"))
        for conn in list(self._open):
            conn.close()
        for pool in self._pools.values():
            pool.idle = []
        self._pools.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run


def _request(url: URL, body: bytes, headers: dict[str, str]) -> bytes:
    """The request's bytes: request line, Host (unless `headers` names one, as aiohttp
    let it), Content-Length (always this body's), `headers`, body."""
    lines = [f"POST {url.raw_path_qs} HTTP/1.1", f"Content-Length: {len(body)}"]
    host = True
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise ValueError(f"upstream header {name!r} holds a line break")
        lower = name.lower()
        if lower == "content-length":
            continue
        if lower == "host":
            host = False
        lines.append(f"{name}: {value}")
    if host:
        lines.insert(1, f"Host: {url.host_port_subcomponent}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode() + body  # UTF-8, as aiohttp encodes header values
