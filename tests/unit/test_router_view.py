"""The in-memory endpoint view: resolution, fallback chains and live updates."""

from llmgw.contracts import Endpoint, EndpointState, ModelEndpoints
from llmgw.router.endpoints import routes
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointView


def rec(model, *eps, aliases=(), fallbacks=()):
    return ModelEndpoints(
        model=model,
        endpoints=[Endpoint(id=e, url=f"http://{e}:1") for e in eps],
        aliases=list(aliases),
        fallbacks=list(fallbacks),
    )


def test_names_and_aliases_resolve_to_one_route():
    view = EndpointView()
    view.replace([rec("m", "e1", aliases=["m-latest"]), rec("n", "e2")])
    assert view.resolve("m-latest") is view.resolve("m")
    assert view.resolve("ghost") is None
    assert ("m-latest", "m") in view.models()


def test_fallback_chains_are_walked_depth_first_without_repeats():
    table, problems = routes.build(
        [
            rec("a", fallbacks=["b", "c"]),
            rec("b", fallbacks=["d"]),
            rec("c", fallbacks=["d"]),
            rec("d"),
        ]
    )
    assert problems == []
    assert table.chains["a"] == ("a", "b", "d", "c")


def test_a_live_update_with_problems_keeps_the_valid_rest():
    view = EndpointView()
    problems = view.replace([rec("m", "e1", aliases=["n"]), rec("n", "e2", fallbacks=["ghost"])])
    assert len(problems) == 2
    assert view.resolve("n").name == "n"  # the shadowing alias was dropped, not the model
    assert view.resolve("n").fallbacks == ()


def test_endpoint_state_survives_updates_by_id_and_is_shared_between_models():
    view = EndpointView()
    view.replace([rec("m", "e1")])
    e1 = view.endpoints["e1"]
    e1.inflight = 3
    view.update_load("e1", Load(1, 2, 0.5, at=1.0))
    view.apply(rec("n", "e1", "e2"))
    assert view.endpoints["e1"] is e1
    assert e1.models == {"m", "n"}
    assert view.resolve("n").endpoints[0] is e1 and e1.load.waiting == 1
    view.remove("m")
    assert view.resolve("m") is None and view.endpoints["e1"].models == {"n"}
    view.remove("n")
    assert view.endpoints == {}


def test_listeners_hear_every_change_and_readiness_needs_a_ready_endpoint():
    view = EndpointView()
    calls = []
    view.subscribe(lambda: calls.append(view.version))
    assert not view.ready()
    draining = ModelEndpoints(
        model="m", endpoints=[Endpoint(id="e1", url="http://e1:1", state=EndpointState.DRAINING)]
    )
    view.apply(draining)
    assert not view.ready()
    view.apply(rec("m", "e1"))
    assert view.ready()
    assert calls == [1, 2]
