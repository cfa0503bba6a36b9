"""The pipeline asks its plugins what they need, and builds them from their config section."""

from __future__ import annotations

from llmgw.contracts import Endpoint, SchedulingSpec
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointRuntime, ViewSettings
from llmgw.router.scheduling import pipeline as sc
from llmgw.router.scheduling.prefix import PrefixConfig
from llmgw.router.scheduling.profiles import DEFAULT
from llmgw.router.scheduling.scorers import StatelessScorer


class EchoScorer(StatelessScorer):
    """A plugin the pipeline has never heard of, reading the prompt's blocks."""

    name = "echo"
    needs_prompt_blocks = True

    def __init__(self, settings: sc.Settings):
        super().__init__(settings)
        self.configured: SchedulingSpec | None = None

    def configure(self, spec: SchedulingSpec) -> None:
        self.configured = spec

    def score(self, cands, ctx, out) -> None:
        pass


def test_what_a_pipeline_prepares_follows_what_its_scorers_declare(monkeypatch):
    assert not sc.Pipeline(SchedulingSpec(scorers={"queue": 1})).needs_prompt_blocks
    assert sc.Pipeline(SchedulingSpec(scorers={"kv_prefix": 1})).needs_prompt_blocks
    assert sc.Pipeline(SchedulingSpec(scorers={"prefix": 1})).needs_prompt_blocks
    assert not sc.Pipeline(SchedulingSpec(scorers={"prefix": 1})).needs_session
    assert sc.Pipeline(SchedulingSpec(scorers={"session": 1})).needs_session
    # Off (weight 0): nothing to prepare for it.
    assert not sc.Pipeline(SchedulingSpec(scorers={"kv_prefix": 0, "queue": 1})).needs_prompt_blocks
    # A new plugin is asked, not recognised by name.
    monkeypatch.setitem(sc.SCORERS, "echo", EchoScorer)
    spec = SchedulingSpec(scorers={"echo": 1})
    p = sc.Pipeline(spec)
    assert p.needs_prompt_blocks and not p.needs_session
    assert p.profiles[DEFAULT].scorers[0][0].configured is spec


def test_the_prompt_blocks_are_cut_as_the_prefix_section_says():
    spec = SchedulingSpec(scorers={"prefix": 1})
    p = sc.Pipeline(spec, sc.Settings(prefix=PrefixConfig(block_bytes=4, max_blocks=2)))
    blocks = p.prompt_blocks(b"abcdefghijkl", None)
    assert len(blocks) == 2 and blocks.block == 4
    assert p.prompt_blocks(b"abcdefghijkl", "tenant-a") != blocks  # salted: another chain
    assert len(sc.Pipeline(spec).prompt_blocks(b"x" * 1000, None)) == 1000 // 256


def endpoint(name: str, inflight: int) -> EndpointRuntime:
    e = EndpointRuntime(Endpoint(id=name, url=f"http://{name}"), ViewSettings())
    e.models = frozenset({"m"})
    e.inflight = inflight
    return e


class ByQueue:
    """A handler that runs another profile than the default."""

    def pick(self, profiles, endpoints, ctx):
        return profiles["by_queue"].pick(endpoints, ctx)


def test_the_route_runs_the_profiles_its_handler_chooses():
    p = sc.Pipeline(SchedulingSpec(scorers={"inflight": 1}, picker="max_score"))
    assert list(p.profiles) == [DEFAULT]
    eps = [endpoint("idle", 0), endpoint("busy", 5)]
    ctx = sc.Context(0.0, "m", key=1)
    assert p.pick(eps, ctx).id == "idle"  # the default handler runs the one profile
    p.profiles["by_queue"] = sc.Profile(
        SchedulingSpec(scorers={"queue": 1}, picker="max_score", filters=["serves_model"]),
        sc.Settings(),
        None,
    )
    eps[0].load = Load(waiting=9, running=0, kv_usage=0.0, at=0.0)
    eps[1].load = Load(waiting=0, running=5, kv_usage=0.0, at=0.0)
    assert p.pick(eps, ctx).id == "idle"  # the default handler never runs it
    p.handler = ByQueue()
    assert p.pick(eps, ctx).id == "busy"
