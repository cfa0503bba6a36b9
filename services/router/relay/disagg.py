"""Prefill/decode disaggregation: a request's prefill leg, and the decode leg's body.

A disaggregated model's prompts are computed by prefill engines and its tokens by
decode engines, so a long prompt stops stalling other requests' decoding (see
docs/disaggregation.md). The protocol is vLLM's own (its disaggregated_serving proxy):

1. the prefill leg: the client's body with `stream: false`, `max_tokens: 1` (and
   `max_completion_tokens: 1` when set), no `stream_options` or `min_tokens`, and
   `kv_transfer_params` asking for remote decode (`REMOTE_DECODE`), to a prefill
   endpoint;
2. the prefill engine answers with the `kv_transfer_params` that locate the prompt's KV
   (NixlConnector: engine, blocks, host, port) or null (ExampleConnector finds the KV
   by the prompt's content);
3. the decode leg: the client's own body, with those params when not null, to a decode
   endpoint, relayed to the client as any request is (relay/upstream.py: streaming,
   usage, deadlines, retries before the first byte, migration).

Only chat and completions take the prefill leg; a prompt estimated shorter than the
model's `min_prompt_tokens` skips it (a decode engine computes a short prompt sooner
than a prefill engine and a transfer would). A request that skips it, or whose prefill
leg has nowhere to go (the pool empty, every endpoint filtered out or failing, an
engine refusing the request), is served whole by a decode endpoint, which computes
the prompt itself: slower, never lost. Every router decides this from the request and
its own view alone.

The prefill leg is one attempt after another on the prefill pool (never the same
endpoint twice, at most the request's `attempts_per_model`), each under the
`first_token` deadline: the client sees no token before the prefill is done. The
request's total deadline and its client leaving interrupt it as any attempt: the
prefill request's connection is closed (vLLM then aborts it and frees its KV), and the
decode leg is never sent.

`Legs` is pure (bodies and decisions); `prefill` does the leg's I/O.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from yarl import URL

from llmgw.router.endpoints.view import EndpointRuntime, ModelRoute
from llmgw.router.metrics import RouterMetrics
from llmgw.router.relay import http1
from llmgw.router.relay.upstream import Upstream, failure_of
from llmgw.router.relay.walk import BUSY, Failure
from llmgw.router.request import body as rq
from llmgw.router.request.exchange import Exchange
from llmgw.router.request.guard import DeadlinePassed
from llmgw.router.scheduling.pipeline import Context
from llmgw.router.scheduling.profiles import DECODE

log = logging.getLogger(__name__)

DISAGGREGATED_KINDS = frozenset({"chat", "completions"})
# What the prefill leg asks of the prefill engine: keep the prompt's KV for a decode
# engine to fetch (the fields vLLM's proxy sends).
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Prompt bytes per token, as admission estimates a request's tokens (admission/gate.py).
BYTES_PER_TOKEN = 4
# How long a release read may take (connect, the KV read, one token) before it is let go.
RELEASE_SECONDS = 30.0
_NULL = b"null"

_decode_top = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def prompt_tokens(req: rq.Parsed) -> int:
    """The prompt's tokens, estimated from its raw JSON as admission estimates them."""
    return len(req.prompt) // BYTES_PER_TOKEN


def skip_reason(route: ModelRoute, req: rq.Parsed) -> str | None:
    """Why this request of a disaggregated model skips the prefill leg; None: it takes it."""
    spec = route.pipeline.disaggregation
    assert spec is not None
    if req.kind not in DISAGGREGATED_KINDS:
        return "api_kind"
    if prompt_tokens(req) < spec.min_prompt_tokens:
        return "short_prompt"
    return None


def prefill_body(body: bytes) -> bytes:
    """The prefill leg's body: the client's, answered whole after one token, asking the
    engine to keep the prompt's KV for a remote decode."""
    top = rq.top_keys(body)
    top.pop("stream_options", None)
    top.pop("min_tokens", None)  # vLLM refuses a min_tokens above max_tokens
    values: dict[str, object] = {"stream": False, "max_tokens": 1}
    if "max_completion_tokens" in top:
        values["max_completion_tokens"] = 1
    values["kv_transfer_params"] = REMOTE_DECODE
    return rq.with_keys(top, **values)


def transfer_params(answer: bytes) -> bytes | None:
    """The raw `kv_transfer_params` of a prefill engine's answer; None when it has none
    (null or absent: the connector finds the KV by the prompt, as ExampleConnector)."""
    try:
        raw = _decode_top(answer).get("kv_transfer_params")
    except msgspec.DecodeError:
        return None
    if raw is None or bytes(raw).strip() == _NULL:
        return None
    return bytes(raw)


def decode_body(body: bytes, params: bytes) -> bytes:
    """The decode leg's body: the client's, with the prefill engine's params."""
    top = rq.top_keys(body)
    top["kv_transfer_params"] = msgspec.Raw(params)
    return msgspec.json.encode(top)


def release_body(body: bytes, params: bytes) -> bytes:
    """A decode leg no client waits for: answered whole after one token, with the
    prefill engine's params, so the decode engine reads the KV kept for it."""
    top = rq.top_keys(body)
    top.pop("stream_options", None)
    top.pop("min_tokens", None)
    values: dict[str, object] = {"stream": False, "max_tokens": 1}
    if "max_completion_tokens" in top:
        values["max_completion_tokens"] = 1
    values["kv_transfer_params"] = msgspec.Raw(params)
    return rq.with_keys(top, **values)


class Legs:
    """One request's legs: what its prefill leg returned, the body each decode attempt
    sends, and the decode endpoint last sent one."""

    __slots__ = ("params", "decode_ep", "_plain", "_decode")

    def __init__(self) -> None:
        self.params: bytes | None = None  # the prefill engine's kv_transfer_params
        self.decode_ep: EndpointRuntime | None = None
        self._plain = b""
        self._decode = b""

    def body_for(self, ep: EndpointRuntime, body: bytes) -> bytes:
        """What to send `ep` for an attempt whose body is `body`: with the params to a
        decode endpoint (every retry the same), as it is to an aggregated one, which
        has no connector and computes the prompt itself."""
        if self.params is None or ep.spec.role != DECODE:
            return body
        self.decode_ep = ep
        if body is not self._plain:
            self._plain = body
            self._decode = decode_body(body, self.params)
        return self._decode

    def count(
        self,
        metrics: RouterMetrics,
        route: ModelRoute,
        ep: EndpointRuntime,
        failure: Failure | None,
    ) -> None:
        """A decode leg's attempt ended (an aggregated endpoint's is no leg)."""
        if ep.spec.role == DECODE:
            outcome = "ok" if failure is None else "failed"
            metrics.pd_legs.inc((route.name, "decode", outcome))


class Releases:
    """Release reads: the decode legs a prefill engine's KV still waits for when the
    client left before the decode leg answered.

    NixlConnector keeps a prompt's KV on the prefill engine until a decode engine reads
    it, and vLLM 0.32 has no call that frees it otherwise: left alone, it is stranded for
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s). So the decode leg is sent anyway, one token,
    its answer dropped: the decode engine reads the KV and the prefill engine frees it.
    Only with params (ExampleConnector returns none: its files are not the engine's
    cache). The proxy owns the reads and cancels those still running when it stops."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self._reads: set[asyncio.Task] = set()

    def release(
        self, legs: Legs, ex: Exchange, route: ModelRoute, req: rq.Parsed, body: bytes, path: str
    ) -> bool:
        """Start the release read of `legs` (False: nothing to release)."""
        ep = legs.decode_ep
        client = self.upstream.client
        if legs.params is None or ep is None or client is None:
            return False
        headers = ex.upstream_headers(ep.request_headers(route, req.content_type, ex.rid))
        data = release_body(body, legs.params)
        read = asyncio.ensure_future(
            self._read(client, ep.target(path), data, headers, route, route.deadlines.connect)
        )
        self._reads.add(read)
        read.add_done_callback(self._reads.discard)
        return True

    async def _read(
        self,
        client: http1.Client,
        url: URL,
        data: bytes,
        headers: dict[str, str],
        route: ModelRoute,
        connect: float,
    ) -> None:
        outcome = "failed"
        try:
            async with asyncio.timeout(RELEASE_SECONDS):
                status, _ = await post_whole(client, url, data, headers, connect)
                if status == 200:
                    outcome = "ok"
        except (http1.UpstreamError, TimeoutError) as exc:
            log.warning("release read failed: %s", exc, extra={"model": route.name})
        self.upstream.metrics.pd_legs.inc((route.name, "release", outcome))

    async def stop(self) -> None:
        for read in list(self._reads):
            read.cancel()
        if self._reads:
            await asyncio.wait(self._reads, timeout=RELEASE_SECONDS)


class _Outcome:
    """How one prefill attempt ended: `params` on success; else whether the request is
    the engine's to refuse (`refused`: a 4xx other than busy), which no other prefill
    engine would take either."""

    __slots__ = ("ok", "params", "refused", "detail")

    def __init__(self, ok: bool, params: bytes | None = None, refused: bool = False, detail=""):
        self.ok = ok
        self.params = params
        self.refused = refused
        self.detail = detail


async def prefill(
    upstream: Upstream,
    ex: Exchange,
    route: ModelRoute,
    req: rq.Parsed,
    body: bytes,
    path: str,
    ctx: Context,
    attempts: int,
) -> tuple[Legs, str | None]:
    """Run the prefill leg: the request's legs, and why it is served whole instead
    (None: the decode leg has what it needs). Raises what interrupts the request (its
    total deadline, its client leaving) as any attempt does."""
    metrics = upstream.metrics
    clock = upstream.clock
    legs = Legs()
    pctx = ctx.for_leg()
    leg_body = prefill_body(body)
    started = clock()
    tried = 0
    while tried < attempts:
        pctx.now = clock()
        ep = route.pipeline.pick_prefill(route.endpoints, pctx)
        if ep is None:
            break
        tried += 1
        outcome = await _attempt(upstream, ex, ep, route, req, leg_body, path)
        pctx.exclude.append(ep.id)  # type: ignore[attr-defined]
        if outcome.ok:
            metrics.pd_legs.inc((route.name, "prefill", "ok"))
            metrics.pd_prefill_duration.observe((route.name,), clock() - started)
            legs.params = outcome.params
            return legs, None
        kind = "refused" if outcome.refused else "failed"
        metrics.pd_legs.inc((route.name, "prefill", kind))
        log.warning(
            "prefill attempt failed: %s",
            outcome.detail,
            extra={"model": route.name, "endpoint": ep.id},
        )
        if outcome.refused:
            return legs, fallback(metrics, route, "prefill_refused")
    return legs, fallback(metrics, route, "prefill_failed" if tried else "no_prefill_endpoint")


def fallback(metrics: RouterMetrics, route: ModelRoute, reason: str) -> str:
    metrics.pd_fallbacks.inc((route.name, reason))
    log.warning(
        "serving a disaggregated request whole on a decode endpoint",
        extra={"model": route.name, "reason": reason},
    )
    return reason


async def _attempt(
    upstream: Upstream,
    ex: Exchange,
    ep: EndpointRuntime,
    route: ModelRoute,
    req: rq.Parsed,
    body: bytes,
    path: str,
) -> _Outcome:
    """One prefill attempt: POST the leg's body to `ep` and read its answer whole,
    within the first_token deadline."""
    guard = ex.guard
    dl = route.deadlines
    with ep.circuit.verdict(upstream.clock) as verdict:
        ep.inflight += 1
        ep.prefilling += 1  # the whole leg is prefill (max_tokens 1)
        guard.arm("first_token", dl.first_token)
        try:
            with guard:
                status, data = await post_whole(
                    upstream.client,  # type: ignore[arg-type]
                    ep.target(path),
                    body,
                    ex.upstream_headers(ep.request_headers(route, req.content_type, ex.rid)),
                    dl.connect,
                )
        except (DeadlinePassed, http1.UpstreamError) as exc:
            if isinstance(exc, DeadlinePassed) and exc.phase == "total":
                raise
            failure, _ = failure_of(exc, ep.id, dl)
            verdict.healthy = False
            return _Outcome(False, detail=failure.detail)
        finally:
            guard.no_deadline()
            ep.inflight -= 1
            ep.prefilling -= 1
        if status == 200:
            verdict.healthy = True
            return _Outcome(True, transfer_params(data))
        detail = f"endpoint {ep.id} answered the prefill leg {status}: {data[:300]!r}"
        if status >= 500:
            verdict.healthy = False
            return _Outcome(False, detail=detail)
        # Busy is the engine's state, any other 4xx the request's: the decode engine
        # answers it whole and the client hears its own status.
        return _Outcome(False, refused=status not in BUSY, detail=detail)


async def post_whole(
    client: http1.Client, url: URL, body: bytes, headers: dict[str, str], connect: float
) -> tuple[int, bytes]:
    """POST `body` and read the answer whole: its status and body. Interrupted (a
    deadline, the client gone), the connection is closed, so the engine aborts the
    request and frees what it held for it."""
    resp = await client.post(url, body, headers, connect)
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()  # back to the pool only when read to its end
