"""One attempt at one engine endpoint: connect, triage the status, answer or relay.

Streams are relayed event by event as they arrive: each read from the engine
is cut at the last complete SSE event and forwarded in one ASGI send, so an
event is never split, and a failure after the first byte ends the stream with
one error event in the API kind's own shape (kinds.py) rather than a truncated
or spliced answer. The response headers are held back until the first event,
so an engine that accepts a request and then never produces a token can still
be retried. Whether a stream is complete is the kind's rule: `[DONE]` for chat,
a terminal `event:` for the Responses API.

The request goes out on the proxy's own HTTP/1.1 client (http1.py: aiohttp's
cost per request was the largest left in a router worker). An attempt is `_send`
(the POST and its status: a busy or broken engine is a
`walk.Failure` at once), then `_answer_whole` or `_relay`; whatever it raises
is one `failure_of` table. It gives the circuit breaker its verdict (healthy,
failed, or none when the engine was only busy or the client's budget ran out)
and returns a `walk.Failure` when nothing reached the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp

from llmgw.router.config import DeadlineSpec
from llmgw.router.endpoints.view import EndpointRuntime, ModelRoute
from llmgw.router.metrics import RouterMetrics
from llmgw.router.relay import continuation, http1
from llmgw.router.relay.circuit import Verdict
from llmgw.router.relay.continuation import Sent
from llmgw.router.relay.walk import (
    BROKEN_STATUS,
    BUSY,
    TIMEOUT_STATUS,
    Failure,
    adapter_missing,
    retry_after,
)
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
        # The relay's requests to engines, P/D legs included.
        self.client: http1.Client | None = None
        # The calls off the request path (stored responses, /v1/models, scraping).
        self.session: aiohttp.ClientSession | None = None
        # Called with (response id, endpoint id, exchange) when a Responses API answer
        # names its id.
        self.on_response_id: Callable[[bytes, str, Exchange], None] | None = None

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
        guard = ex.guard
        rule = req.api.stream
        resp: http1.Response | None = None
        tracked = ex.sent  # a continuation's; else this attempt's, kept once its stream starts
        if not ex.started and req.stream:
            tracked = _tracked(route, req, body)
            if tracked is not None:
                body = tracked.upstream_body()
        with ep.circuit.verdict(self.clock) as verdict:
            ep.inflight += 1
            if req.stream:
                ep.prefilling += 1
                ex.prefilling = True
            # An engine sends a non-streamed answer's headers with the answer, when it is
            # complete: only the total deadline can bound that wait.
            guard.arm("headers", route.deadlines.headers if req.stream else _FOREVER)
            try:
                with guard:
                    sent = await self._send(ex, ep, route, req, body, path, verdict)
                    if isinstance(sent, Failure):
                        return sent
                    resp = sent
                    if (
                        rule is not None
                        and req.stream
                        and resp.status == 200
                        and resp.headers.get("Content-Type", "").startswith("text/event-stream")
                    ):
                        return await self._relay(ex, ep, route, req, tracked, resp, rule, verdict)
                    if ex.started:
                        await self._continuation_refused(ex, ep, rule, resp)
                        return None
                    await self._answer_whole(ex, ep, req, resp, verdict)
                    return None
            except (DeadlinePassed, http1.UpstreamError) as exc:
                failure, blames_engine = failure_of(exc, ep.id, route.deadlines)
                if blames_engine:
                    verdict.healthy = False
                if not ex.started:
                    return failure
                return await self._cut(ex, ep, rule, failure)
            finally:
                guard.no_deadline()
                ep.inflight -= 1
                _prefilled(ex, ep)
                if resp is not None:
                    resp.close()  # an answer read whole was released already: this cuts the rest

    async def _send(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        route: ModelRoute,
        req: rq.Parsed,
        body: bytes,
        path: str,
        verdict: Verdict,
    ) -> http1.Response | Failure:
        """POST the request: the engine's response, or the Failure its status says
        (a 5xx, busy: 408 and 429, or a 404 for an adapter it no longer holds), its body
        then read and the connection released."""
        resp = await self.client.post(  # type: ignore[union-attr]
            ep.target(path),
            body,
            ex.upstream_headers(ep.request_headers(route, req.content_type, ex.rid)),
            route.deadlines.connect,
        )
        status = resp.status
        if status == 404 and route.adapter_of:
            return await _adapter_missing(ep, route.name, resp)
        if status < 500 and status not in BUSY:
            return resp
        busy = status < 500
        if not busy:
            verdict.healthy = False
        try:
            detail = (await resp.read())[:300].decode("utf-8", "replace")
        except BaseException:
            resp.close()
            raise
        resp.release()
        return Failure(
            "upstream_overloaded" if busy else f"upstream_{status}",
            f"the engine answered {status}",
            status if busy else BROKEN_STATUS,
            detail=f"endpoint {ep.id} answered {status}: {detail}",
            retry_after=retry_after(resp.headers) if busy else None,
        )

    async def _answer_whole(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        req: rq.Parsed,
        resp: http1.Response,
        verdict: Verdict,
    ) -> None:
        """Pass a non-streamed answer (or any answer not an SSE stream) on whole."""
        ex.guard.arm("total", _FOREVER)
        data = await resp.read()
        resp.release()
        verdict.healthy = True
        status = resp.status
        if status == 200:
            if req.api is RESPONSES:
                ex.usage = rq.response_usage_of(data)
                self._remember(data, ep, ex)
            else:
                ex.usage = rq.usage_of(data)
        await ex.answer(status, resp.headers.get("Content-Type", "").encode(), data, ep.id)

    async def _relay(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        route: ModelRoute,
        req: rq.Parsed,
        sent: Sent | None,
        resp: http1.Response,
        rule: StreamRule,
        verdict: Verdict,
    ) -> Failure | None:
        """Relay an SSE stream; a Failure if it ended before any event, or one to
        `resume` if it broke after (and may be continued)."""
        guard = ex.guard
        dl = route.deadlines
        guard.arm("first_token", dl.first_token)
        idle = dl.idle
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
            chunk = await resp.readany()
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
            _prefilled(ex, ep)
            if not ex.started:
                ep.circuit.success()
                metrics.ttft.observe(key, now - ex.t0)
                if responses:
                    self._remember(out, ep, ex)
                await ex.start_stream(resp.headers.get("Content-Type", "").encode(), ep.id)
                ex.sent = sent
            elif last:  # a continuation's first event follows another engine's last
                metrics.itl.observe(key, now - last)
            last = now
            if sent is not None:
                out, error = sent.feed(out)
                if error is not None:
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                    verdict.healthy = False
                    return await self._cut(ex, ep, rule, _in_band(ep.id), error)
            if _USAGE_MARKERS[0] in out or _USAGE_MARKERS[1] in out:
                ex.usage = _stream_usage(out, responses) or ex.usage
            complete = ended(out)
            await send({"type": "http.response.body", "body": out, "more_body": True})
            guard.arm("idle", idle)
        return await self._stream_ended(ex, ep, rule, resp, verdict, complete and not buf)

    async def _stream_ended(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        rule: StreamRule,
        resp: http1.Response,
        verdict: Verdict,
        complete: bool,
    ) -> Failure | None:
        """The engine closed the stream: end it for the client, whole or cut short."""
        if complete:
            await ex.end_stream()
            verdict.healthy = True
            resp.release()
            if ex.sent is not None and ex.sent.usage is not None:
                ex.usage = rq.Usage(*ex.sent.usage)
            return None
        if not ex.started:
            verdict.healthy = False
            return Failure(
                "upstream_truncated",
                "the engine closed the stream before any event",
                BROKEN_STATUS,
                detail=f"endpoint {ep.id} closed the stream before any event",
            )
        verdict.healthy = False
        return await self._cut(
            ex,
            ep,
            rule,
            Failure(
                "upstream_truncated",
                "the engine ended the stream early",
                BROKEN_STATUS,
                detail=f"endpoint {ep.id} ended the stream early",
            ),
        )

    async def _continuation_refused(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        rule: StreamRule | None,
        resp: http1.Response,
    ) -> None:
        """A continuation answered with anything but a stream (a 400 for a prompt the
        text sent made too long, say): the client's status is long gone, so the stream
        ends in band; another endpoint of the same model would refuse it too."""
        detail = (await resp.read())[:300].decode("utf-8", "replace")
        resp.release()
        await self.end_stream(
            ex,
            ep,
            rule,
            "continuation_refused",
            f"the stream was cut and its continuation refused ({resp.status})",
            BROKEN_STATUS,
            f"endpoint {ep.id} answered the continuation {resp.status}: {detail}",
        )

    async def _cut(
        self,
        ex: Exchange,
        ep: EndpointRuntime,
        rule: StreamRule | None,
        failure: Failure,
        engine_error: bytes | None = None,
    ) -> Failure | None:
        """A stream broke after its first byte: the Failure to `resume` it elsewhere when
        its model allows another migration, else end it in band (with the engine's own
        error event, when it sent one)."""
        sent = ex.sent
        if sent is not None and not failure.final:
            if sent.done():
                await ex.end_stream(sent.closing())
                return None
            if sent.resumable():
                failure.resume = True
                return failure
        if engine_error is None:
            await self.end_stream(
                ex, ep, rule, failure.kind, failure.message, failure.status, failure.detail
            )
        else:
            self.metrics.upstream_errors.inc((ep.id, failure.kind))
            done = engine_error.endswith(b"data: [DONE]\n\n")
            await ex.end_stream(engine_error if done else engine_error + b"data: [DONE]\n\n")
        return None

    def _remember(self, data: bytes, ep: EndpointRuntime, ex: Exchange) -> None:
        if self.on_response_id is not None:
            rid = response_id(data)
            if rid is not None:
                self.on_response_id(rid, ep.id, ex)

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


def failure_of(exc: Exception, endpoint: str, dl: DeadlineSpec) -> tuple[Failure, bool]:
    """What an attempt that raised `exc` failed of, and whether that blames the engine
    (a slow client's total budget says nothing of it)."""
    if isinstance(exc, DeadlinePassed):
        phase = exc.phase
        message = f"the engine's {phase.replace('_', ' ')} deadline of {getattr(dl, phase)}s passed"
        return Failure(
            f"{phase}_timeout",
            message,
            TIMEOUT_STATUS,
            detail=f"endpoint {endpoint}: {message}",
            final=phase == "total",
        ), phase != "total"
    if isinstance(exc, http1.ConnectTimeout):
        return Failure(
            "connect_timeout",
            f"no engine accepted a connection within {dl.connect}s",
            TIMEOUT_STATUS,
            detail=f"endpoint {endpoint} did not accept a connection within {dl.connect}s",
        ), True
    if isinstance(exc, http1.ConnectError):
        return Failure(
            "connect_error",
            "an engine refused the connection",
            BROKEN_STATUS,
            detail=f"endpoint {endpoint} refused the connection: {exc.os_error or exc}",
        ), True
    return Failure(
        "upstream_broken",
        "the engine broke the connection",
        BROKEN_STATUS,
        detail=f"endpoint {endpoint} broke the connection: {exc.__class__.__name__}",
    ), True


async def _adapter_missing(
    ep: EndpointRuntime, adapter: str, resp: http1.Response
) -> http1.Response | Failure:
    """A 404 for an adapter request: the engine unloaded the adapter before its agent's
    report reached us. This router stops sending the adapter there until the projection
    sends the endpoint's record again (endpoints/view.py keeps a record's adapters as
    refuted here); the engine is healthy, so no verdict."""
    try:
        body = await resp.read()  # kept by the response: a 404 of another kind is relayed whole
    except BaseException:
        resp.close()
        raise
    failure = adapter_missing(adapter, ep.id, resp.status, body)
    if failure is None:
        return resp
    resp.release()
    ep.adapters = ep.adapters - {adapter}
    return failure


def _tracked(route: ModelRoute, req: rq.Parsed, body: bytes) -> Sent | None:
    """What a stream just started needs kept to be continued, if its model migrates
    streams and the request can be continued."""
    rule = req.api.continuation
    if route.migrations <= 0 or rule is None:
        return None
    why = continuation.refusal(rule, body)
    if why is not None:
        log.debug("stream not migratable: %s", why, extra={"model": route.name})
        return None
    return Sent(rule, body, route.migrations)


def _prefilled(ex: Exchange, ep: EndpointRuntime) -> None:
    """The attempt's stream had its first event (or ended): its prefill is no longer
    ahead of a request sent to `ep` now."""
    if ex.prefilling:
        ep.prefilling -= 1
        ex.prefilling = False


def _in_band(endpoint: str) -> Failure:
    return Failure(
        "upstream_error_event",
        "the engine reported an error mid-stream",
        BROKEN_STATUS,
        detail=f"endpoint {endpoint} sent an error event or aborted the request mid-stream",
    )


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
