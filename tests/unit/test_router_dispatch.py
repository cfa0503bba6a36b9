"""The dispatch walk: which endpoints and fallbacks a request tries, and what the
client hears when none answered. Pure: no sockets, no clock."""

from llmgw.contracts import Endpoint, ModelEndpoints
from llmgw.router.endpoints.view import EndpointView
from llmgw.router.relay.walk import Failure, Walk, retry_after
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
