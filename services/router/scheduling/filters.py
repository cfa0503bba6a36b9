"""Filters: drop the endpoints that must not get a request.

Each takes the whole candidate list at once (one comprehension is much cheaper per
request than a call per endpoint) and keeps those that may get it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.contracts import EndpointState
from llmgw.router.relay.circuit import CLOSED

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.scheduling.pipeline import Context, Settings


class ServesModel:
    name = "serves_model"

    def __init__(self, settings: Settings):
        pass

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        model = ctx.model
        return [ep for ep in cands if model in ep.models]


class Ready:
    """Ready and not draining: a draining engine finishes what it has, takes nothing new."""

    name = "ready"

    def __init__(self, settings: Settings):
        pass

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        ready = EndpointState.READY
        return [ep for ep in cands if ep.state is ready]


class CircuitClosed:
    """Circuit not open; after the cool-down, one probe may pass."""

    name = "circuit"

    def __init__(self, settings: Settings):
        pass

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        now = ctx.now
        return [ep for ep in cands if ep.circuit.state is CLOSED or ep.circuit.allows(now)]
