"""The hot path: a raw ASGI endpoint that relays OpenAI requests to engines.

Per request: authenticate (headers only, so a request without a valid key
gets 401 whatever its body), read and parse the body, resolve the model, pass
the admission gate, then schedule and dispatch, retrying on another endpoint (and then down
the model's fallback chain) only while nothing has reached the client.

Streams are relayed event by event as they arrive: each read from the engine
is cut at the last complete SSE event and forwarded in one ASGI send, so an
event is never split, and a failure after the first byte ends the stream with
one OpenAI-shaped error event rather than a truncated or spliced answer. The
response headers are held back until the first event, so an engine that
accepts a request and then never produces a token can still be retried.

Reading the request body has its own deadline (`body_read_seconds`, 408):
uvicorn has none, so a client that declares more bytes than it sends would
otherwise hold a connection and a coroutine forever.

Deadlines (per model): connect (aiohttp's), then response headers, first
token, inter-token idle (the watchdog that tells a wedged engine from a slow
one) and total, enforced by the request's Guard (guard.py). A client
disconnect cancels the request's task, which closes the upstream connection:
the engine aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from llmgw import logs
from llmgw.router import requests as rq
from llmgw.router.errors import RouterError, error_body, error_event
from llmgw.router.guard import Guard
from llmgw.router.metrics import RouterMetrics
from llmgw.router.prefix import block_hashes
from llmgw.router.scheduling import Context, request_key
from llmgw.router.view import EndpointRuntime, EndpointView, ModelRoute

if TYPE_CHECKING:
    # The admission package (issue 5) implements the seam; the proxy only calls it.
    from llmgw.router.admission.seam import Gate, Grant

log = logging.getLogger(__name__)

_RID_OK = re.compile(rb"[\x21-\x7e]{1,128}").fullmatch
_USAGE_MARKERS = (b'"usage":{', b'"usage": {')
_DONE = b"data: [DONE]\n\n"
_NO_CACHE = (b"cache-control", b"no-cache")
_JSON = b"application/json"

# Failure kinds: the x-llmgw-reason a client gets when it is the last one, and
# the label of llmgw_router_upstream_errors_total.
_TIMEOUT_STATUS = 504
_BROKEN_STATUS = 502
_FOREVER = float("inf")

# See guard.py: a client that leaves sooner is noticed this long after arrival.
DISCONNECT_WATCH_AFTER = 0.02


@dataclass(frozen=True, slots=True)
class Settings:
    max_body_bytes: int = 8 * 1024 * 1024
    body_read_seconds: float = 30.0
    attempts_per_model: int = 3
    prefix_block_bytes: int = 256
    prefix_max_blocks: int = 128
    pool_limit: int = 4096
    keepalive_seconds: float = 30.0
    access_log: bool = False


class _Failure:
    """An attempt that failed before anything reached the client."""

    __slots__ = ("kind", "message", "status", "final")

    def __init__(self, kind: str, message: str, status: int, final: bool = False):
        self.kind = kind
        self.message = message
        self.status = status  # what the client gets if no later attempt succeeds
        self.final = final  # no further attempt can help (the total deadline passed)


class _OpenGrant:
    __slots__ = ()

    def release(self, usage: rq.Usage | None) -> None:
        pass


class _OpenGate:
    """No admission: every request proceeds at once (the seam's trivial side)."""

    _grant = _OpenGrant()

    def authenticate(self, headers) -> None:
        return None

    async def admit(self, request, route, who) -> _OpenGrant:
        return self._grant


class _Exchange:
    """The state of one client request."""

    __slots__ = ("rid", "t0", "started", "status", "endpoint", "usage")

    def __init__(self, rid: bytes, t0: float):
        self.rid = rid
        self.t0 = t0
        self.started = False  # bytes reached the client: no more retries
        self.status = 0
        self.endpoint = ""
        self.usage: rq.Usage | None = None


class Proxy:
    def __init__(
        self,
        view: EndpointView,
        metrics: RouterMetrics,
        settings: Settings | None = None,
        gate: Gate | None = None,
    ):
        self.view = view
        self.metrics = metrics
        self.settings = settings or Settings()
        self.gate: Gate = gate or _OpenGate()
        self.session: aiohttp.ClientSession | None = None
        self._rid_prefix = secrets.token_hex(6)
        self._rid_seq = itertools.count(1)
        self._connect_timeouts: dict[float, aiohttp.ClientTimeout] = {}
        # Two clocks: time.monotonic for measurements (uvloop's loop.time() has
        # millisecond resolution), the loop's own for asyncio deadlines.
        self._time = time.monotonic
        self._ltime = time.monotonic

    def set_gate(self, gate: Gate | None) -> None:
        """Swap admission in or out; requests already admitted release to their own gate."""
        self.gate = gate or _OpenGate()

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.settings.pool_limit,
            keepalive_timeout=self.settings.keepalive_seconds,
            ttl_dns_cache=300,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,  # bytes are relayed as the engine sent them
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Accept"),
        )
        self._ltime = asyncio.get_running_loop().time

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def endpoint(self, kind: str) -> _KindEndpoint:
        return _KindEndpoint(self, kind)

    # ------------------------------------------------------------ per request

    def _new_rid(self) -> bytes:
        return f"{self._rid_prefix}{next(self._rid_seq):x}".encode()

    async def handle(self, kind: str, scope, receive, send) -> None:
        t0 = self._time()
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id")
        if rid is None or not _RID_OK(rid):
            rid = self._new_rid()
        logs.request_id.set(rid.decode())
        ex = _Exchange(rid, t0)
        model = ""
        task = asyncio.current_task()
        assert task is not None
        guard = Guard(asyncio.get_running_loop(), task, receive, DISCONNECT_WATCH_AFTER)
        gate = self.gate  # this request's gate, even if another is installed meanwhile
        try:
            if scope["method"] != "POST":
                raise RouterError(405, "method_not_allowed", f"use POST for {scope['path']}")
            # Before the body: whatever it holds, a request without a valid key gets 401.
            who = gate.authenticate(headers)
            body = await self._read_body(receive, headers, guard, task)
            if body is None:  # the client left while sending
                ex.status = 499
                return
            req = rq.parse(kind, body)
            route = self.view.resolve(req.model)
            if route is None:
                raise RouterError(
                    404,
                    "model_not_found",
                    f"The model '{req.model}' does not exist",
                    param="model",
                )
            model = route.name
            await self._serve(req, route, headers, gate, who, ex, send, guard, task)
        except RouterError as err:
            ex.status = err.status
            if ex.started:
                await self._end_stream(send, None, err.reason, err.message, err.status)
            else:
                await self._send_error(send, err, ex)
        except Exception:
            log.exception("request failed inside the router")
            ex.status = 500
            if not ex.started:
                await self._send_error(
                    send, RouterError(500, "internal_error", "internal error"), ex
                )
            else:
                await send(
                    {
                        "type": "http.response.body",
                        "body": error_event("internal_error", "internal error", 500),
                        "more_body": False,
                    }
                )
        finally:
            guard.close()
            self._record(model, ex)

    def _record(self, model: str, ex: _Exchange) -> None:
        m = self.metrics
        m.requests.inc((model, ex.endpoint, str(ex.status)))
        elapsed = self._time() - ex.t0
        m.duration.observe((model,), elapsed)
        usage = ex.usage
        if usage is not None:
            m.prompt_tokens.inc((model,), usage.prompt_tokens)
            m.completion_tokens.inc((model,), usage.completion_tokens)
        if ex.status == 499:
            m.disconnects.inc((model,))
        if self.settings.access_log or ex.status >= 500:
            log.log(
                logging.INFO if ex.status < 500 else logging.WARNING,
                "request done",
                extra={
                    "model": model,
                    "endpoint": ex.endpoint,
                    "status": ex.status,
                    "ms": round(elapsed * 1000, 2),
                },
            )

    async def _read_body(
        self, receive, headers: dict[bytes, bytes], guard: Guard, task: asyncio.Task
    ) -> bytes | None:
        limit = self.settings.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise RouterError(
                    400, "invalid_request", "content-length is not a number"
                ) from None
            if size > limit:
                raise RouterError(
                    413, "body_too_large", f"request body of {size} bytes exceeds {limit} bytes"
                )
        chunks = []
        total = 0
        guard.reading(self.settings.body_read_seconds)
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None
                chunk = message.get("body", b"")
                if chunk:
                    total += len(chunk)
                    if total > limit:
                        raise RouterError(
                            413, "body_too_large", f"request body exceeds {limit} bytes"
                        )
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        except asyncio.CancelledError:
            if guard.fired != "body_read":
                raise
            task.uncancel()
            guard.fired = None
            # The rest of the body may still arrive: the connection cannot be reused.
            raise RouterError(
                408,
                "body_timeout",
                f"request body not received within {self.settings.body_read_seconds}s",
                headers=[(b"connection", b"close")],
            ) from None
        finally:
            guard.read_done()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _serve(
        self,
        req: rq.Parsed,
        route: ModelRoute,
        headers: dict[bytes, bytes],
        gate: Gate,
        who: object,
        ex: _Exchange,
        send,
        guard: Guard,
        task: asyncio.Task,
    ) -> None:
        grant: Grant | None = None
        try:
            grant = await gate.admit(req, route, who)
            await self._dispatch(req, route, headers, ex, send, guard)
        except asyncio.CancelledError:
            if guard.client_gone:
                task.uncancel()
                ex.status = 499
            elif guard.fired is not None:
                # A deadline passed while an attempt was already reporting a failure.
                task.uncancel()
                raise RouterError(
                    _TIMEOUT_STATUS, f"{guard.fired}_timeout", f"{guard.fired} deadline passed"
                ) from None
            else:
                raise
        finally:
            guard.close()
            if grant is not None:
                grant.release(ex.usage)

    async def _dispatch(
        self,
        req: rq.Parsed,
        route: ModelRoute,
        headers: dict[bytes, bytes],
        ex: _Exchange,
        send,
        guard: Guard,
    ) -> None:
        guard.total_at = self._ltime() + route.deadlines.total
        ctx = Context(ex.t0, route.name, exclude=[], key=request_key(req.body))
        tried: list[str] = ctx.exclude  # type: ignore[assignment]
        failure: _Failure | None = None
        attempts = 0
        metrics = self.metrics
        settings = self.settings
        current: ModelRoute | None = route
        chain = route.fallbacks
        hop = 0
        while current is not None:
            if current is not route:
                metrics.fallbacks.inc((route.name, current.name))
                log.warning("falling back", extra={"model": route.name, "fallback": current.name})
            body = req.body if req.model == current.name else rq.with_model(req.body, current.name)
            pipeline = current.pipeline
            ctx.model = current.name
            if pipeline.uses_prefix and not ctx.prefix and req.prompt:
                ctx.prefix = block_hashes(
                    req.prompt, settings.prefix_block_bytes, settings.prefix_max_blocks
                )
            session = headers.get(pipeline.session_header) if pipeline.uses_session else None
            ctx.session = session.decode("latin-1") if session is not None else None
            for _ in range(settings.attempts_per_model):
                ctx.now = self._time()
                if self._ltime() >= guard.total_at:
                    failure = _Failure(
                        "total_timeout",
                        f"no answer within the total deadline of {route.deadlines.total}s",
                        _TIMEOUT_STATUS,
                        final=True,
                    )
                    break
                ep = pipeline.pick(current.endpoints, ctx)
                if ep is None:
                    break
                if attempts:
                    metrics.retries.inc((route.name,))
                attempts += 1
                failure = await self._attempt(ep, current, req, body, ex, send, guard)
                if failure is None:
                    return
                tried.append(ep.id)
                metrics.upstream_errors.inc((ep.id, failure.kind))
                log.warning(
                    "attempt failed: %s",
                    failure.message,
                    extra={"model": current.name, "endpoint": ep.id, "kind": failure.kind},
                )
                if failure.final:
                    break
            if failure is not None and failure.final:
                break
            current = None
            while hop < len(chain) and current is None:
                current = self.view.route(chain[hop])
                hop += 1
        if failure is None:
            raise RouterError(
                503,
                "no_endpoint",
                f"no endpoint is available for model '{route.name}'"
                + (f" or its fallbacks ({', '.join(chain)})" if chain else ""),
            )
        raise RouterError(
            failure.status,
            failure.kind,
            f"{failure.message} (after {attempts} attempt{'s' if attempts != 1 else ''})",
        )

    def _connect_timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        t = self._connect_timeouts.get(seconds)
        if t is None:
            t = self._connect_timeouts[seconds] = aiohttp.ClientTimeout(
                total=None, sock_connect=seconds
            )
        return t

    async def _attempt(
        self,
        ep: EndpointRuntime,
        route: ModelRoute,
        req: rq.Parsed,
        body: bytes,
        ex: _Exchange,
        send,
        guard: Guard,
    ) -> _Failure | None:
        """Send the request to `ep` and relay its answer.

        None: the exchange is over (answered, relayed, or ended with an error
        event after its first byte). A _Failure: nothing reached the client.
        """
        clock = self._time
        dl = route.deadlines
        circuit = ep.circuit
        circuit.dispatched(clock())
        ep.inflight += 1
        verdict: bool | None = None  # for the circuit: True healthy, False failed
        resp: aiohttp.ClientResponse | None = None
        reusable = False
        # An engine sends a non-streamed answer's headers with the answer, when it is
        # complete: only the total deadline can bound that wait.
        guard.arm("headers", dl.headers if req.stream else _FOREVER)
        try:
            resp = await self.session.post(  # type: ignore[union-attr]
                ep.targets[req.kind],
                data=body,
                headers={"Content-Type": "application/json", "X-Request-Id": ex.rid.decode()},
                timeout=self._connect_timeout(dl.connect),
            )
            status = resp.status
            if status >= 500 or status in (408, 429):
                overloaded = status < 500
                verdict = None if overloaded else False
                detail = (await resp.read())[:300].decode("utf-8", "replace")
                reusable = True
                return _Failure(
                    "upstream_overloaded" if overloaded else f"upstream_{status}",
                    f"endpoint {ep.id} answered {status}: {detail}",
                    503 if overloaded else _BROKEN_STATUS,
                )
            ctype = resp.headers.get("Content-Type", "")
            if not (req.stream and status == 200 and ctype.startswith("text/event-stream")):
                guard.arm("total", _FOREVER)
                data = await resp.read()
                reusable = True
                verdict = True
                if status == 200:
                    ex.usage = rq.usage_of(data)
                ex.started = True
                ex.status = status
                ex.endpoint = ep.id
                await send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", ctype.encode() or _JSON),
                            (b"content-length", str(len(data)).encode()),
                            (b"x-request-id", ex.rid),
                            (b"x-llmgw-endpoint", ep.id.encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": data, "more_body": False})
                return None

            guard.arm("first_token", dl.first_token)
            idle = dl.idle
            content = resp.content
            metrics = self.metrics
            key = (route.name,)
            buf = b""
            last = 0.0
            tail_done = False
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                if buf:
                    chunk = buf + chunk
                cut = chunk.rfind(b"\n\n")
                if cut < 0:
                    buf = chunk
                    continue
                cut += 2
                out, buf = chunk[:cut], chunk[cut:]
                now = clock()
                if not ex.started:
                    verdict = True
                    circuit.success()
                    ex.started = True
                    ex.status = 200
                    ex.endpoint = ep.id
                    metrics.ttft.observe(key, now - ex.t0)
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 200,
                            "headers": [
                                (b"content-type", ctype.encode()),
                                _NO_CACHE,
                                (b"x-request-id", ex.rid),
                                (b"x-llmgw-endpoint", ep.id.encode()),
                            ],
                        }
                    )
                else:
                    metrics.itl.observe(key, now - last)
                last = now
                if _USAGE_MARKERS[0] in out or _USAGE_MARKERS[1] in out:
                    ex.usage = _stream_usage(out) or ex.usage
                tail_done = out.endswith(_DONE)
                await send({"type": "http.response.body", "body": out, "more_body": True})
                guard.arm("idle", idle)
            if buf or not tail_done:
                verdict = False
                if not ex.started:
                    return _Failure(
                        "upstream_truncated",
                        f"endpoint {ep.id} closed the stream before any event",
                        _BROKEN_STATUS,
                    )
                await self._end_stream(
                    send, ep, "upstream_truncated", f"endpoint {ep.id} ended the stream early"
                )
                return None
            reusable = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return None
        except asyncio.CancelledError:
            phase = guard.fired
            if phase is None:
                raise  # the client left, or the server is stopping
            guard.fired = None
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            kind = f"{phase}_timeout"
            limit = getattr(dl, phase)
            if phase != "total":
                verdict = False  # a slow client's total budget says nothing of the engine
            message = f"endpoint {ep.id}: {phase.replace('_', ' ')} deadline of {limit}s passed"
            if ex.started:
                await self._end_stream(send, ep, kind, message, _TIMEOUT_STATUS)
                return None
            return _Failure(kind, message, _TIMEOUT_STATUS, final=phase == "total")
        except aiohttp.ConnectionTimeoutError:
            verdict = False
            return _Failure(
                "connect_timeout",
                f"endpoint {ep.id} did not accept a connection within {dl.connect}s",
                _TIMEOUT_STATUS,
            )
        except aiohttp.ClientConnectorError as exc:
            verdict = False
            return _Failure(
                "connect_error", f"endpoint {ep.id} refused the connection: {exc.os_error}", 502
            )
        except aiohttp.ClientError as exc:
            verdict = False
            message = f"endpoint {ep.id} broke the connection: {exc.__class__.__name__}"
            if ex.started:
                await self._end_stream(send, ep, "upstream_broken", message)
                return None
            return _Failure("upstream_broken", message, _BROKEN_STATUS)
        finally:
            guard.no_deadline()
            ep.inflight -= 1
            if verdict is True:
                circuit.success()
            elif verdict is False:
                circuit.failure(clock())
            else:
                circuit.abandoned()
            if resp is not None:
                if reusable:
                    resp.release()
                else:
                    resp.close()

    async def _end_stream(
        self,
        send,
        ep: EndpointRuntime | None,
        kind: str,
        message: str,
        status: int = _BROKEN_STATUS,
    ) -> None:
        """A stream broke after its first byte: say so in-band, then end it."""
        endpoint = ep.id if ep is not None else ""
        self.metrics.upstream_errors.inc((endpoint, kind))
        log.warning(
            "stream ended by error: %s", message, extra={"endpoint": endpoint, "kind": kind}
        )
        await send(
            {
                "type": "http.response.body",
                "body": error_event(kind, message, status),
                "more_body": False,
            }
        )

    async def _send_error(self, send, err: RouterError, ex: _Exchange) -> None:
        body = err.body()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", _JSON),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-llmgw-reason", err.reason.encode()),
                    (b"x-request-id", ex.rid),
                    *err.headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _stream_usage(out: bytes) -> rq.Usage | None:
    for marker in _USAGE_MARKERS:
        pos = out.rfind(marker)
        if pos >= 0:
            start = out.rfind(b"data:", 0, pos)
            end = out.find(b"\n", pos)
            if start >= 0:
                return rq.usage_of(out[start + 5 : end if end >= 0 else len(out)])
    return None


class _KindEndpoint:
    """The ASGI app mounted at one of the POST paths."""

    __slots__ = ("proxy", "kind")

    def __init__(self, proxy: Proxy, kind: str):
        self.proxy = proxy
        self.kind = kind

    async def __call__(self, scope, receive, send) -> None:
        await self.proxy.handle(self.kind, scope, receive, send)


__all__ = ["Proxy", "Settings", "error_body"]
