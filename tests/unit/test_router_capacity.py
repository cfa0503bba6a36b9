"""One learned batch capacity per endpoint, read by admission and the affinity limit alike."""

from __future__ import annotations

from llmgw.contracts import Endpoint, SchedulingSpec
from llmgw.router import config as rc
from llmgw.router.admission.config import BandConfig
from llmgw.router.admission.saturation import Detector
from llmgw.router.endpoints.capacity import BatchCapacities
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointRuntime, ViewSettings
from llmgw.router.scheduling import pipeline as sc
from llmgw.router.scheduling.cached import CachedPrefixScorer
from llmgw.router.service import RouterService

NOW = 1000.0


def endpoint(max_running: int | None = None) -> EndpointRuntime:
    e = EndpointRuntime(
        Endpoint(id="e", url="http://e", engine="sim", max_running=max_running), ViewSettings()
    )
    e.models = frozenset({"m"})
    return e


def sample(batches: BatchCapacities, ep: EndpointRuntime, at: float, running: int, waiting: int):
    ep.load = Load(waiting=waiting, running=running, kv_usage=0.0, at=at)
    batches.observed(ep)


def test_the_affinity_limit_counts_beyond_the_capacity_admission_reads():
    batches = BatchCapacities()
    detector = Detector(batches=batches, assumed_capacity=1)
    scorer = CachedPrefixScorer(sc.Settings(batches=batches))
    ep = endpoint(max_running=4)  # the catalog's hint is low: the engine runs 8
    sample(batches, ep, NOW - 5, running=8, waiting=2)
    assert detector.capacity(ep) == 8
    ep.inflight = 10
    assert scorer.pending(ep, NOW) == 10 - 8  # the larger of hint and learned, as admission
    assert batches.of(ep) == 8  # the scorer read it and wrote nothing


def test_a_capacity_relearned_lower_tightens_the_affinity_limit_too():
    batches = BatchCapacities(stale_after=1.0, relearn_after=5.0)
    scorer = CachedPrefixScorer(sc.Settings(batches=batches))
    ep = endpoint()
    sample(batches, ep, 100.0, running=16, waiting=0)
    ep.inflight = 12
    assert scorer.pending(ep, 200.0) == 0
    # Restarted with max-num-seqs 8: requests wait there, it never runs more than 8.
    for i in range(25):
        sample(batches, ep, 100.5 + i * 0.25, running=8, waiting=4)
    assert batches.of(ep) == 8
    assert scorer.pending(ep, 200.0) == 12 - 8


def test_the_router_learns_from_its_views_samples_once_for_admission_and_scheduling():
    config = rc.RouterConfig(
        models=[rc.ModelConfig(name="m", scheduling=SchedulingSpec(scorers={"kv_prefix": 1}))],
        endpoints=[rc.EndpointConfig(id="e", url="http://e", models=["m"], engine="sim")],
        bands=[BandConfig(name="b", ceiling=0.9)],  # a band that can be held: admission on
    )
    service = RouterService(config)
    service.view.replace(rc.projection(config))
    service.view.update_load("e", Load(waiting=3, running=6, kv_usage=0.1, at=NOW))
    ep = service.view.endpoints["e"]
    assert service.batches.of(ep) == 6
    assert service.admission is not None
    assert service.admission.controller.detector.capacity(ep) == 6
    # Endpoints the view no longer routes to are forgotten.
    service.view.replace([])
    assert service.batches.learned == {}
