"""LoRA adapters in scheduling: only engines holding the adapter, and those running it first.

An engine serves an adapter only once it is loaded there (vLLM answers 404 for any other
name), and ours load adapters only when the control plane's placement tells their agent
to, never on demand. So the `adapter` filter keeps the endpoints that hold the request's
adapter per the agents' reports (`Endpoint.adapters`); a request for an adapter nobody
holds never reaches here: it waits in admission while one is loaded. It reads the
endpoint's live state rather than trusting the route the request resolved, so a retry
after the adapter moved does not go where it was unloaded.

`lora_affinity` follows llm-d's lora_affinity scorer. An engine runs requests of at most
`max_loras` adapters in one batch (vLLM's vllm:lora_requests_info lists the adapters of
its running and of its waiting requests): a request for an adapter already running joins
the batch at once (1.0); one held where the batch has a free adapter slot starts without
waiting for another adapter's requests to finish (0.8); one whose adapter is only queued
there waits behind them, but in good company (0.6); anything else waits for a slot (0).

Both are neutral for a request naming a base model: a model's adapter requests run a
pipeline with them added (`adapter_spec`), its own requests the model's pipeline as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from llmgw.contracts import SchedulingSpec
from llmgw.router.scheduling.scorers import StatelessScorer

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.scheduling.pipeline import Context, Settings

# What lora_affinity weighs unless the model's scheduling section names it: as much as the
# `queue` scorer weighed in the default before issue #21, since a request that must wait
# for an adapter slot is a request in a queue.
DEFAULT_AFFINITY_WEIGHT = 2.0

RUNNING, ROOM, WAITING = 1.0, 0.8, 0.6


class HoldsAdapter:
    name = "adapter"

    def __init__(self, settings: Settings):
        pass

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        adapter = ctx.adapter
        if adapter is None:
            return cands
        return [ep for ep in cands if adapter in ep.adapters]


class LoraAffinityScorer(StatelessScorer):
    name = "lora_affinity"

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        adapter = ctx.adapter
        if adapter is None:
            return
        limit = ctx.now - self.stale_after
        for i, ep in enumerate(cands):
            load = ep.load
            if load is None or load.at < limit:
                # Nothing fresh says what its batch runs: a holder may well have room.
                out[i] = ROOM if adapter in ep.adapters else 0.0
                continue
            running, waiting = load.running_adapters, load.waiting_adapters
            if adapter in running:
                out[i] = RUNNING
            elif adapter in ep.adapters and len(running | waiting) < ep.spec.max_loras:
                out[i] = ROOM
            elif adapter in waiting:
                out[i] = WAITING
            else:
                out[i] = 0.0


def adapter_spec(spec: SchedulingSpec) -> SchedulingSpec:
    """A model's scheduling section as its adapters' requests run it: the `adapter` filter
    and the `lora_affinity` scorer added where the section does not name them (a weight it
    gives, 0 included, is kept)."""
    filters = spec.filters if HoldsAdapter.name in spec.filters else [*spec.filters, "adapter"]
    scorers = dict(spec.scorers)
    scorers.setdefault(LoraAffinityScorer.name, DEFAULT_AFFINITY_WEIGHT)
    return msgspec.structs.replace(spec, filters=filters, scorers=scorers)
