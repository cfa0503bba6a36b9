"""The in-memory endpoint view: resolution, fallback chains and live updates."""

from llmgw.contracts import Endpoint, EndpointState, ModelEndpoints, SchedulingSpec
from llmgw.router.endpoints import routes
from llmgw.router.endpoints import view as view_module
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointView


def rec(model, *eps, aliases=(), fallbacks=(), scheduling=None):
    return ModelEndpoints(
        model=model,
        endpoints=[Endpoint(id=e, url=f"http://{e}:1") for e in eps],
        aliases=list(aliases),
        fallbacks=list(fallbacks),
        scheduling=scheduling or SchedulingSpec(),
    )


# What an older reconciler or a hand edit of the projection bucket can hold: plugin
# names no router has (the catalog refuses them now).
UNKNOWN = SchedulingSpec(scorers={"kv_prefx": 6.0}, picker="max_scor")


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


def test_a_record_naming_unknown_scheduling_plugins_is_dropped_and_the_rest_kept():
    table, problems = routes.build(
        [rec("bad", "e1", aliases=["b"], scheduling=UNKNOWN), rec("m", "e2", fallbacks=["bad"])]
    )
    assert list(table.records) == ["m"] and "b" not in table.names
    assert table.chains["m"] == ("m",)
    assert "model 'bad': scheduling.scorers: unknown scorer 'kv_prefx'" in problems[0]
    assert "model 'bad': scheduling.picker: unknown picker 'max_scor'" in problems[1]
    assert problems[2] == "model 'm': fallback 'bad' is not a declared model or alias"


def test_a_record_naming_unknown_plugins_never_stops_the_view_taking_changes():
    view = EndpointView()
    view.replace([rec("bad", "e1", scheduling=UNKNOWN), rec("m", "e1")])  # a router starting
    assert view.resolve("bad") is None and view.resolve("m").endpoints[0].id == "e1"
    assert view.ready()
    view.apply(rec("late", "e2"))  # a model declared after the bad record
    view.apply(rec("m", "e3"))  # a moved replica
    assert view.resolve("late").endpoints[0].id == "e2"
    assert view.resolve("m").endpoints[0].id == "e3"
    assert set(view.endpoints) == {"e2", "e3"}  # nothing kept for the dropped record
    view.apply(rec("bad", "e1"))  # fixed: served from then on
    assert view.resolve("bad").endpoints[0].id == "e1"


def test_a_pipeline_that_cannot_be_built_drops_only_its_own_model(monkeypatch):
    class Refusing(view_module.scheduling.Pipeline):
        def __init__(self, spec, *args, **kw):
            if spec.session_header == "x-broken":
                raise ValueError("cannot load it")
            super().__init__(spec, *args, **kw)

    monkeypatch.setattr(view_module.scheduling, "Pipeline", Refusing)
    view = EndpointView()
    problems = view.replace([rec("m", "e1")])
    assert problems == []
    problems = view.apply(rec("x", "e2", scheduling=SchedulingSpec(session_header="x-broken")))
    assert problems == ["model 'x': scheduling: cannot build its pipeline: cannot load it"]
    assert view.resolve("x") is None and set(view.endpoints) == {"e1"}
    view.apply(rec("late", "e3"))
    assert view.resolve("late") is not None and view.resolve("m") is not None


def test_a_view_whose_only_record_is_unservable_serves_nothing_and_is_not_ready():
    view = EndpointView()
    problems = view.replace([rec("bad", "e1", scheduling=UNKNOWN)])
    assert len(problems) == 2
    assert view.resolve("bad") is None and view.endpoints == {} and not view.ready()


def test_a_missing_fallback_is_pending_for_the_grace_then_warned_about_once(caplog):
    from llmgw.router.endpoints import problemlog

    now = [0.0]
    plog = problemlog.ProblemLog(clock=lambda: now[0])
    missing = "model 'chat': fallback 'small' is not a declared model or alias"
    other = "model 'x': alias 'y' shadows model 'y'"
    with caplog.at_level("DEBUG", logger=problemlog.__name__):
        assert plog.report([missing, other], {missing}) == problemlog.GRACE_SECONDS
        assert plog.report([missing, other], {missing}) == problemlog.GRACE_SECONDS
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warned == [f"endpoint view: skipped: {other}"]
        now[0] = 4.0
        assert plog.report([missing], {missing}) == problemlog.GRACE_SECONDS - 4.0
        now[0] = problemlog.GRACE_SECONDS
        assert plog.judge() is None
        assert plog.report([missing], {missing}) is None
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 2 and missing in warned[1]
        # Its record arrived in time: nothing is said, nothing waits.
        late = "model 'b': fallback 'c' is not a declared model or alias"
        plog.report([late], {late})
        assert plog.report([], set()) is None and not plog.pending
        assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2
