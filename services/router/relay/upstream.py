"""One attempt at one engine endpoint: connect, triage the status, answer or relay.

Streams are relayed event by event as they arrive: each read from the engine
is cut at the last complete SSE event and forwarded in one ASGI send, so an
event is never split, and a failure after the first byte ends the stream with
one error event in the API kind's own shape (kinds.py) rather than a truncated
or spliced answer. The response headers are held back until the first event,
so an engine that accepts a request and then never produces a token can still
be retried. Whether a stream is complete is the kind's rule: `[DONE]` for chat,
a terminal `event:` for the Responses API.

The attempt gives the circuit breaker its verdict (healthy, failed, or
abandoned when the engine was only busy or the client's budget ran out) and
returns a `dispatch.Failure` when nothing reached the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp

from llmgw.router.endpoints.view import EndpointRuntime, ModelRoute
from llmgw.router.metrics import RouterMetrics
from llmgw.router.relay.walk import BROKEN_STATUS, BUSY, TIMEOUT_STATUS, Failure, retry_after
from llmgw.router.request import body as rq
from llmgw.router.request.exchange import Exchange
from llmgw.router.request.guard import DeadlinePassed
from llmgw.router.request.kinds import RESPONSES, StreamRule

log = logging.getLogger(__name__)

_USAGE_MARKERS = (b'"usage":{', b'"usage": {')
_FOREVER = float("inf")


class Upstream:
    def __init__(self, metrics: RouterMetrics, clock: Callable[[], float]):
        self.metrics = metrics
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None
        self._connect_timeouts: dict[float, aiohttp.ClientTimeout] = {}
        # Called with (response id, endpoint id) when a Responses API answer names its id.
        self.on_response_id: Callable[[bytes, str], None] | None = None

    def connect_timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        t = self._connect_timeouts.get(seconds)
        if t is None:
            t = self._connect_timeouts[seconds] = aiohttp.ClientTimeout(
                total=None, sock_connect=seconds
            )
        return t

    async def attempt(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        route: ModelRoute,
        req: rq.Parsed,
        body: bytes,
        path: str,
    ) -> Failure | None:
        """Send the request to `ep` and relay its answer.

        None: the exchange is over (answered, relayed, or ended with an error
        event after its first byte). A Failure: nothing reached the client.
        """
        clock = self.clock
        dl = route.deadlines
        guard = ex.guard
        circuit = ep.circuit
        circuit.dispatched(clock())
        ep.inflight += 1
        verdict: bool | None = None  # for the circuit: True healthy, False failed
        resp: aiohttp.ClientResponse | None = None
        reusable = False
        rule = req.api.stream
        # An engine sends a non-streamed answer's headers with the answer, when it is
        # complete: only the total deadline can bound that wait.
        guard.arm("headers", dl.headers if req.stream else _FOREVER)
        try:
            with guard:
                resp = await self.session.post(  # type: ignore[union-attr]
                    ep.target(path),
                    data=body,
                    headers=ex.upstream_headers(
                        ep.request_headers(route, req.content_type, ex.rid)
                    ),
                    timeout=self.connect_timeout(dl.connect),
                )
                status = resp.status
                if status >= 500 or status in BUSY:
                    busy = status < 500
                    verdict = None if busy else False
                    detail = (await resp.read())[:300].decode("utf-8", "replace")
                    reusable = True
                    return Failure(
                        "upstream_overloaded" if busy else f"upstream_{status}",
                        f"the engine answered {status}",
                        status if busy else BROKEN_STATUS,
                        detail=f"endpoint {ep.id} answered {status}: {detail}",
                        retry_after=retry_after(resp.headers) if busy else None,
                    )
                ctype = resp.headers.get("Content-Type", "")
                if not (
                    rule is not None
                    and req.stream
                    and status == 200
                    and ctype.startswith("text/event-stream")
                ):
                    guard.arm("total", _FOREVER)
                    data = await resp.read()
                    reusable = True
                    verdict = True
                    if status == 200:
                        if req.api is RESPONSES:
                            ex.usage = rq.response_usage_of(data)
                            self._remember(data, ep)
                        else:
                            ex.usage = rq.usage_of(data)
                    await ex.answer(status, ctype.encode(), data, ep.id)
                    return None
                verdict, reusable, failure = await self._relay(ex, ep, route, req, resp, rule)
                return failure
        except DeadlinePassed as passed:
            phase = passed.phase
            kind = f"{phase}_timeout"
            limit = getattr(dl, phase)
            if phase != "total":
                verdict = False  # a slow client's total budget says nothing of the engine
            message = f"the engine's {phase.replace('_', ' ')} deadline of {limit}s passed"
            if ex.started:
                await self.end_stream(ex, ep, rule, kind, message, TIMEOUT_STATUS)
                return None
            return Failure(
                kind,
                message,
                TIMEOUT_STATUS,
                detail=f"endpoint {ep.id}: {message}",
                final=phase == "total",
            )
        except aiohttp.ConnectionTimeoutError:
            verdict = False
            return Failure(
                "connect_timeout",
                f"no engine accepted a connection within {dl.connect}s",
                TIMEOUT_STATUS,
                detail=f"endpoint {ep.id} did not accept a connection within {dl.connect}s",
            )
        except aiohttp.ClientConnectorError as exc:
            verdict = False
            return Failure(
                "connect_error",
                "an engine refused the connection",
                BROKEN_STATUS,
                detail=f"endpoint {ep.id} refused the connection: {exc.os_error}",
            )
        except aiohttp.ClientError as exc:
            verdict = False
            detail = f"endpoint {ep.id} broke the connection: {exc.__class__.__name__}"
            if ex.started:
                await self.end_stream(
                    ex,
                    ep,
                    rule,
                    "upstream_broken",
                    "the engine broke the connection",
                    detail=detail,
                )
                return None
            return Failure(
                "upstream_broken", "the engine broke the connection", BROKEN_STATUS, detail=detail
            )
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

    async def _relay(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        route: ModelRoute,
        req: rq.Parsed,
        resp: aiohttp.ClientResponse,
        rule: StreamRule,
    ) -> tuple[bool, bool, Failure | None]:
        """Relay an SSE stream: (circuit verdict, connection reusable, failure)."""
        guard = ex.guard
        dl = route.deadlines
        guard.arm("first_token", dl.first_token)
        idle = dl.idle
        content = resp.content
        metrics = self.metrics
        clock = self.clock
        send = ex.send
        ended = rule.ended
        responses = req.api is RESPONSES
        key = (route.name,)
        buf = b""
        last = 0.0
        complete = False
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
                ep.circuit.success()
                metrics.ttft.observe(key, now - ex.t0)
                if responses:
                    self._remember(out, ep)
                await ex.start_stream(resp.headers.get("Content-Type", "").encode(), ep.id)
            else:
                metrics.itl.observe(key, now - last)
            last = now
            if _USAGE_MARKERS[0] in out or _USAGE_MARKERS[1] in out:
                ex.usage = _stream_usage(out, responses) or ex.usage
            complete = ended(out)
            await send({"type": "http.response.body", "body": out, "more_body": True})
            guard.arm("idle", idle)
        if buf or not complete:
            if not ex.started:
                return (
                    False,
                    False,
                    Failure(
                        "upstream_truncated",
                        "the engine closed the stream before any event",
                        BROKEN_STATUS,
                        detail=f"endpoint {ep.id} closed the stream before any event",
                    ),
                )
            await self.end_stream(
                ex,
                ep,
                rule,
                "upstream_truncated",
                "the engine ended the stream early",
                detail=f"endpoint {ep.id} ended the stream early",
            )
            return False, False, None
        await ex.end_stream()
        return True, True, None

    def _remember(self, data: bytes, ep: EndpointRuntime) -> None:
        if self.on_response_id is not None:
            rid = response_id(data)
            if rid is not None:
                self.on_response_id(rid, ep.id)

    async def end_stream(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        rule: StreamRule | None,
        kind: str,
        message: str,
        status: int = BROKEN_STATUS,
        detail: str = "",
    ) -> None:
        """A stream broke after its first byte: say so in-band, then end it."""
        self.metrics.upstream_errors.inc((ep.id, kind))
        log.warning(
            "stream ended by error: %s", detail or message, extra={"endpoint": ep.id, "kind": kind}
        )
        assert rule is not None
        await ex.end_stream(rule.error_event(kind, message, status))


def _stream_usage(out: bytes, responses: bool) -> rq.Usage | None:
    for marker in _USAGE_MARKERS:
        pos = out.rfind(marker)
        if pos >= 0:
            start = out.rfind(b"data:", 0, pos)
            end = out.find(b"\n", pos)
            if start >= 0:
                data = out[start + 5 : end if end >= 0 else len(out)]
                return rq.response_usage_of(data) if responses else rq.usage_of(data)
    return None


def response_id(data: bytes) -> bytes | None:
    """The first `resp_...` id in a Responses API body or its first events."""
    pos = data.find(b'"resp_')
    if pos < 0:
        return None
    end = data.find(b'"', pos + 1)
    return data[pos + 1 : end] if end > 0 else None
