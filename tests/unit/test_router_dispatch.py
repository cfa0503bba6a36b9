"""The dispatch walk: which endpoints and fallbacks a request tries, and what the
client hears when none answered. Pure: no sockets, no clock."""

import asyncio

from llmgw.contracts import AdapterRoute, Endpoint, ModelEndpoints
from llmgw.router.endpoints.view import EndpointView
from llmgw.router.relay.walk import Failure, Walk, adapter_missing, retry_after
from llmgw.router.request.holder import HolderWait
from llmgw.router.scheduling.pipeline import Context

BUSY = Failure("upstream_overloaded", "the engine answered 429", 429, retry_after=7)


def view() -> EndpointView:
    v = EndpointView()
    v.replace(
        [
            ModelEndpoints(
                model="m",
                endpoints=[Endpoint(id=f"e{i}", url=f"http://e{i}") for i in range(3)],
                fallbacks=["small"],
            ),
            ModelEndpoints(model="small", endpoints=[Endpoint(id="s0", url="http://s0")]),
        ]
    )
    return v


def walk(v: EndpointView, per_model: int = 2) -> tuple[Walk, Context, list[str]]:
    route = v.route("m")
    ctx = Context(0.0, "m", exclude=[], key=1)
    prepared: list[str] = []

    def prepare(c: Context, r) -> None:
        c.model = r.name
        prepared.append(r.name)

    w = Walk(route, v.route, per_model, ctx.exclude, prepare)
    return w, ctx, prepared


def test_the_walk_tries_distinct_endpoints_then_the_fallbacks_then_stops():
    v = view()
    w, ctx, prepared = walk(v)
    tried = []
    while (ep := w.next(ctx, past_total=False)) is not None:
        tried.append((w.current.name, ep.id))
        w.failed(ep, Failure("upstream_500", "the engine answered 500", 502))
    assert [m for m, _ in tried] == ["m", "m", "small"]
    assert len({e for _, e in tried}) == 3
    assert prepared == ["small"]
    err = w.outcome()
    assert (err.status, err.reason) == (502, "upstream_500")
    assert err.message == "the engine answered 500 (after 3 attempts)"


def test_when_every_engine_was_busy_the_client_gets_429_and_the_soonest_retry_after():
    v = view()
    w, ctx, _ = walk(v)
    waits = iter([7, 2, None])
    while (ep := w.next(ctx, past_total=False)) is not None:
        w.failed(ep, Failure("upstream_overloaded", "busy", 429, retry_after=next(waits)))
    err = w.outcome()
    assert err.status == 429
    assert dict(err.headers)[b"retry-after"] == b"2"


def test_one_broken_engine_among_busy_ones_is_not_a_rate_limit():
    v = view()
    w, ctx, _ = walk(v)
    ep = w.next(ctx, False)
    w.failed(ep, BUSY)
    ep = w.next(ctx, False)
    w.failed(ep, Failure("connect_error", "an engine refused the connection", 502))
    assert w.outcome().status == 502


def test_past_the_total_deadline_nothing_more_is_tried():
    v = view()
    w, ctx, _ = walk(v)
    ep = w.next(ctx, False)
    w.failed(ep, BUSY)
    assert w.next(ctx, past_total=True) is None
    assert w.outcome().status == 504


def test_nothing_to_try_is_503_naming_the_fallbacks():
    v = EndpointView()
    v.replace([ModelEndpoints(model="m", fallbacks=["small"]), ModelEndpoints(model="small")])
    w, ctx, _ = walk(v)
    assert w.next(ctx, False) is None
    err = w.outcome()
    assert (err.status, err.reason) == (503, "no_endpoint") and "small" in err.message


def test_retry_after_reads_seconds_and_milliseconds():
    assert retry_after({"retry-after": "3"}) == 3.0
    assert retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert retry_after({}) is None


# ------------------------------------------------------------------ an adapter unloaded


def holders_of_a1() -> ModelEndpoints:
    """The record as the projection sends it: each one decoded afresh."""
    return ModelEndpoints(
        model="m",
        endpoints=[Endpoint(id=f"e{i}", url=f"http://e{i}", adapters=["a1"]) for i in range(2)],
        adapters=[AdapterRoute(name="a1")],
    )


def adapter_view() -> tuple[EndpointView, ModelEndpoints]:
    record = holders_of_a1()
    v = EndpointView()
    v.replace([record])
    return v, record


VLLM_404 = b'{"error":{"message":"The model `a1` does not exist.","code":404}}'


def test_only_a_404_naming_the_adapter_says_the_engine_does_not_hold_it():
    failure = adapter_missing("a1", "e0", 404, VLLM_404)
    assert failure is not None and failure.kind == "adapter_not_loaded"
    assert failure.status == 503 and not failure.final
    assert adapter_missing("a1", "e0", 404, b'{"error":"no route for /v1/x"}') is None
    assert adapter_missing("a1", "e0", 400, VLLM_404) is None


def test_an_adapter_unloaded_under_a_request_sends_it_to_the_other_holder_and_no_further():
    v, record = adapter_view()
    route = v.route("a1")
    ctx = Context(0.0, "a1", exclude=[], key=1)
    ctx.adapter = "a1"
    w = Walk(route, v.route, 2, ctx.exclude, lambda c, r: None)
    first = w.next(ctx, past_total=False)
    # What the relay does on the engine's 404 (upstream.py): drop the adapter there.
    first.adapters = first.adapters - {"a1"}
    assert w.failed(first, adapter_missing("a1", first.id, 404, VLLM_404))
    second = w.next(ctx, past_total=False)
    assert second is not None and second.id != first.id
    # The next request does not go to the replica that said it no longer holds a1 ...
    fresh = Context(0.0, "a1", exclude=[], key=2)
    fresh.adapter = "a1"
    assert [route.pipeline.pick(route.endpoints, fresh).id for _ in range(5)] == [second.id] * 5
    # ... even when the view is rebuilt from the same (stale) record, until a new one comes.
    v.replace([record])
    assert "a1" not in v.endpoints[first.id].adapters
    v.replace([holders_of_a1()])
    assert "a1" in v.endpoints[first.id].adapters


def test_when_every_holder_had_unloaded_it_the_client_gets_503_with_retry_after_not_404():
    v, _ = adapter_view()
    route = v.route("a1")
    ctx = Context(0.0, "a1", exclude=[], key=1)
    ctx.adapter = "a1"
    w = Walk(route, v.route, 3, ctx.exclude, lambda c, r: None)
    while (ep := w.next(ctx, past_total=False)) is not None:
        ep.adapters = ep.adapters - {"a1"}
        w.failed(ep, adapter_missing("a1", ep.id, 404, VLLM_404))
    assert w.attempts == 2
    err = w.outcome()
    assert (err.status, err.reason) == (503, "adapter_not_loaded")
    assert dict(err.headers)[b"retry-after"] == b"5"
    # The next request finds no holder to try: the same answer, not a bare no_endpoint.
    again = Context(0.0, "a1", exclude=[], key=2)
    again.adapter = "a1"
    w = Walk(route, v.route, 3, again.exclude, lambda c, r: None)
    assert w.next(again, past_total=False) is None
    err = w.outcome()
    assert (err.status, err.reason) == (503, "adapter_not_loaded")
    assert dict(err.headers)[b"retry-after"] == b"5"


async def test_a_request_waits_for_the_adapters_next_holder_or_gives_up_after_its_wait():
    v, _ = adapter_view()
    for ep in v.endpoints.values():
        ep.adapters = frozenset()  # both said they unloaded a1
    holders = HolderWait(v)
    assert await holders.holder("a1", 0.05) is None
    # A holder listed already is no reason to walk again: only a change of the view is.
    v.replace([holders_of_a1()])
    assert await holders.holder("a1", 0.05) is None
    for ep in v.endpoints.values():
        ep.adapters = frozenset()
    waiting = asyncio.create_task(holders.holder("a1", 30))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    v.replace([holders_of_a1()])  # a new record: the projection lists them again
    route = await asyncio.wait_for(waiting, 5)
    assert route is not None and route.name == "a1"
