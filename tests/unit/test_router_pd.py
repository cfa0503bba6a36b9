"""Prefill/decode disaggregation in the router, its pure parts: each leg's body, which
requests take the prefill leg, and which endpoints each profile picks."""

from __future__ import annotations

import json

from llmgw.contracts import DisaggregationSpec, Endpoint, EndpointState, SchedulingSpec
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointRuntime, EndpointView, ViewSettings
from llmgw.router.relay import continuation, disagg
from llmgw.router.request import body as rq
from llmgw.router.scheduling import pipeline as sc
from llmgw.router.scheduling.prefix import block_hashes
from llmgw.router.scheduling.profiles import DECODE, DEFAULT, PREFILL, decode_spec

NOW = 1000.0
SETTINGS = ViewSettings()


def ep(name: str, role: str = "", *, waiting: int = 0) -> EndpointRuntime:
    e = EndpointRuntime(Endpoint(id=name, url=f"http://{name}", role=role), SETTINGS)
    e.models = frozenset({"m"})
    e.state = EndpointState.READY
    e.load = Load(waiting=waiting, running=0, kv_usage=0.0, at=NOW)
    return e


def pd_pipeline(spec: SchedulingSpec | None = None, min_prompt_tokens: int = 0) -> sc.Pipeline:
    return sc.Pipeline(
        spec or SchedulingSpec(scorers={"queue": 2, "kv": 2, "inflight": 1, "prefix": 3}),
        sc.Settings(stale_after=1.0),
        disaggregation=DisaggregationSpec(min_prompt_tokens=min_prompt_tokens),
    )


def ctx(**kw) -> sc.Context:
    return sc.Context(NOW, "m", **kw)


# ------------------------------------------------------------------ the bodies


def test_prefill_body_asks_for_one_whole_token_and_a_remote_decode():
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 200,
            "max_completion_tokens": 200,
            "min_tokens": 20,
            "temperature": 0.3,
        }
    ).encode()
    out = json.loads(disagg.prefill_body(body))
    assert out["stream"] is False
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert "stream_options" not in out
    assert "min_tokens" not in out  # above the one token asked: vLLM would refuse it
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    # What the prompt is made of goes as the client sent it: the KV must match.
    assert out["messages"] == [{"role": "user", "content": "hi"}]
    assert out["temperature"] == 0.3


def test_prefill_body_adds_no_max_completion_tokens_the_client_did_not_send():
    out = json.loads(disagg.prefill_body(b'{"model":"m","prompt":"x"}'))
    assert out["max_tokens"] == 1 and "max_completion_tokens" not in out


def test_the_prefill_engines_params_pass_to_the_decode_leg_verbatim():
    answer = (
        b'{"id":"c1","choices":[],"kv_transfer_params":{"do_remote_prefill":true,'
        b'"remote_engine_id":"p1","remote_block_ids":[4,5],"remote_port":5600}}'
    )
    params = disagg.transfer_params(answer)
    body = b'{"model":"m","prompt":"x","stream":true,"max_tokens":50}'
    out = json.loads(disagg.decode_body(body, params))
    assert out["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "remote_engine_id": "p1",
        "remote_block_ids": [4, 5],
        "remote_port": 5600,
    }
    # The decode leg is the client's own request: streamed, its own allowance.
    assert out["stream"] is True and out["max_tokens"] == 50


def test_a_release_read_is_the_decode_leg_for_one_whole_token_with_the_params():
    params = b'{"do_remote_prefill":true,"remote_engine_id":"p1","remote_block_ids":[[4,5]]}'
    body = (
        b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,'
        b'"stream_options":{"include_usage":true},"max_completion_tokens":50,"min_tokens":9}'
    )
    out = json.loads(disagg.release_body(body, params))
    assert out["stream"] is False and out["max_tokens"] == 1
    assert out["max_completion_tokens"] == 1
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["kv_transfer_params"] == json.loads(params)
    assert out["messages"] == [{"role": "user", "content": "x"}]


def test_null_or_missing_params_leave_the_decode_body_as_the_client_sent_it():
    # ExampleConnector answers null: the decode engine finds the KV by the prompt.
    for answer in (b'{"kv_transfer_params":null}', b'{"id":"c1"}', b"not json"):
        assert disagg.transfer_params(answer) is None
    legs = disagg.Legs()
    body = b'{"model":"m","prompt":"x"}'
    assert legs.body_for(ep("d1", DECODE), body) is body


def test_only_decode_endpoints_get_the_params_and_every_retry_the_same():
    legs = disagg.Legs()
    legs.params = b'{"remote_engine_id":"p1"}'
    body = b'{"model":"m","prompt":"x"}'
    first = legs.body_for(ep("d1", DECODE), body)
    assert json.loads(first)["kv_transfer_params"] == {"remote_engine_id": "p1"}
    assert legs.body_for(ep("d2", DECODE), body) == first
    # An aggregated engine has no connector: it computes the prompt itself.
    assert legs.body_for(ep("a1"), body) is body


def test_a_continuation_of_a_decode_stream_computes_its_own_prompt():
    body = b'{"model":"m","prompt":"once","stream":true,"kv_transfer_params":{"x":1}}'
    sent = continuation.Sent(continuation.COMPLETIONS, body, 1)
    # The first attempt carries the params; a continuation (another prompt) does not.
    assert json.loads(sent.upstream_body())["kv_transfer_params"] == {"x": 1}
    assert "kv_transfer_params" not in json.loads(sent.continuation())


# ------------------------------------------------------------------ which requests


def route_for(pipeline: sc.Pipeline):
    class Route:
        pass

    r = Route()
    r.pipeline = pipeline  # type: ignore[attr-defined]
    return r


def test_chat_and_completions_with_a_long_enough_prompt_take_the_prefill_leg():
    route = route_for(pd_pipeline(min_prompt_tokens=10))
    long_chat = rq.parse("chat", json.dumps({"model": "m", "messages": "x" * 40}).encode())
    long_prompt = rq.parse("completions", json.dumps({"model": "m", "prompt": "y" * 60}).encode())
    assert disagg.skip_reason(route, long_chat) is None
    assert disagg.skip_reason(route, long_prompt) is None


def test_a_short_prompt_or_another_api_kind_is_served_whole():
    route = route_for(pd_pipeline(min_prompt_tokens=10))
    short = rq.parse("completions", b'{"model":"m","prompt":"hello"}')  # 7 bytes: ~1 token
    assert disagg.skip_reason(route, short) == "short_prompt"
    embed = rq.parse("embeddings", json.dumps({"model": "m", "input": "z" * 400}).encode())
    assert disagg.skip_reason(route, embed) == "api_kind"


# ------------------------------------------------------------------ the profiles


def test_the_decode_profile_drops_the_prefix_scorers_and_keeps_the_load_ones():
    spec = SchedulingSpec(scorers={"queue": 2, "kv": 2, "inflight": 1, "kv_prefix": 6})
    assert decode_spec(spec).scorers == {"queue": 2, "kv": 2, "inflight": 1}
    assert decode_spec(spec).filters == spec.filters
    # Nothing left to rate decode engines by: this router's requests in flight, as the
    # default section (whose decode profile is that section less its kv_prefix).
    assert decode_spec(SchedulingSpec(scorers={"prefix": 1})).scorers == {"inflight": 1.0}
    assert decode_spec(SchedulingSpec()).scorers == {"inflight": 1.0}
    # A section naming only a stale load scorer keeps it: any load scorer counts.
    assert decode_spec(SchedulingSpec(scorers={"kv": 1, "prefix": 1})).scorers == {"kv": 1}


def test_a_disaggregated_pipeline_has_the_two_profiles_and_a_plain_one_keeps_its_one():
    assert set(pd_pipeline().profiles) == {PREFILL, DECODE}
    plain = sc.Pipeline(SchedulingSpec(), sc.Settings())
    assert set(plain.profiles) == {DEFAULT} and plain.disaggregation is None


def test_requests_go_to_decode_endpoints_and_the_prefill_leg_to_prefill_ones():
    p = pd_pipeline()
    p1, p2 = ep("p1", PREFILL), ep("p2", PREFILL, waiting=5)
    d1, d2 = ep("d1", DECODE, waiting=5), ep("d2", DECODE)
    a1 = ep("a1")
    eps = [p1, p2, d1, d2, a1]
    assert p.pick(eps, ctx()) is d2  # the least loaded decode engine
    assert p.pick_prefill(eps, ctx()) is p1  # the least loaded prefill engine
    # Tried ones are not picked again.
    assert p.pick(eps, ctx(exclude=["d2"])) is d1
    assert p.pick_prefill(eps, ctx(exclude=["p1"])) is p2


def test_aggregated_endpoints_take_what_no_decode_endpoint_can():
    p = pd_pipeline()
    p1, d1, a1 = ep("p1", PREFILL), ep("d1", DECODE), ep("a1")
    assert p.pick([p1, d1, a1], ctx(exclude=["d1"])) is a1
    d1.state = EndpointState.DRAINING
    assert p.pick([p1, d1, a1], ctx()) is a1
    # Never a prefill engine for the answer, and no prefill leg without a prefill pool.
    assert p.pick([p1, d1], ctx()) is None
    assert p.pick_prefill([d1, a1], ctx()) is None


def test_the_prefill_profile_follows_the_prompts_prefix_and_the_decode_one_does_not():
    p = pd_pipeline()
    p1, p2, p3 = ep("p1", PREFILL), ep("p2", PREFILL), ep("p3", PREFILL)
    d1, d2, d3 = ep("d1", DECODE), ep("d2", DECODE), ep("d3", DECODE)
    eps = [p1, p2, p3, d1, d2, d3]
    system = b'[{"role":"system","content":"' + b"You are a careful assistant. " * 40
    first = p.pick_prefill(eps, ctx(prefix=block_hashes(system + b'q1"}]', 256, 128)))
    for question in (b"q2", b"q3", b"q4"):
        hashes = block_hashes(system + question + b'"}]', 256, 128)
        assert p.pick_prefill(eps, ctx(prefix=hashes, key=sc.request_key(question))) is first
    # Decode picks spread by ties in turn alone (equal load): the prefix is no reason.
    picked = {p.pick(eps, ctx(prefix=block_hashes(system, 256, 128), key=k)) for k in range(64)}
    assert picked == {d1, d2, d3}


def test_the_view_builds_the_two_profiles_for_a_disaggregated_record_only():
    from llmgw.contracts import ModelEndpoints

    view = EndpointView()
    view.replace(
        [
            ModelEndpoints(
                model="pd",
                endpoints=[
                    Endpoint(id="p1", url="http://p1", role=PREFILL),
                    Endpoint(id="d1", url="http://d1", role=DECODE),
                ],
                disaggregation=DisaggregationSpec(min_prompt_tokens=64),
            ),
            ModelEndpoints(model="plain", endpoints=[Endpoint(id="a1", url="http://a1")]),
        ]
    )
    pd, plain = view.route("pd"), view.route("plain")
    assert pd is not None and plain is not None
    assert set(pd.pipeline.profiles) == {PREFILL, DECODE}
    assert pd.pipeline.disaggregation == DisaggregationSpec(min_prompt_tokens=64)
    assert set(plain.pipeline.profiles) == {DEFAULT}
    # An operator reading /debug/endpoints sees which pool each endpoint is in.
    roles = {ep.id: ep.describe(NOW, 1.0)["role"] for ep in view.endpoints.values()}
    assert roles == {"p1": PREFILL, "d1": DECODE, "a1": ""}


def test_an_adapter_of_a_disaggregated_model_is_never_answered_by_a_prefill_engine():
    from llmgw.contracts import AdapterRoute, ModelEndpoints

    view = EndpointView()
    view.replace(
        [
            ModelEndpoints(
                model="pd",
                endpoints=[
                    Endpoint(id="p1", url="http://p1", role=PREFILL, adapters=["a1"]),
                    Endpoint(id="d1", url="http://d1", role=DECODE, adapters=["a1"]),
                ],
                adapters=[AdapterRoute(name="a1")],
                disaggregation=DisaggregationSpec(),
            )
        ]
    )
    route = view.route("a1")
    assert route is not None and route.pipeline.disaggregation is not None
    for key in range(16):
        c = sc.Context(NOW, "a1", key=key)
        c.adapter = "a1"
        assert route.pipeline.pick(route.endpoints, c).id == "d1"
        assert route.pipeline.pick_prefill(route.endpoints, c).id == "p1"
