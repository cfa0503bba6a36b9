"""Scheduling profiles: which runs of filters, scorers and a picker a request gets.

After llm-d's ProfileHandler. A model route's pipeline holds named profiles, each one
run of filters, scorers and a picker (`pipeline.Profile`), and a handler that decides
which of them run for a request and which endpoint their results send it to. Every
route has one profile today, `default`, run by `SingleProfile`. Disaggregated prefill
and decode adds a handler here (run the decode profile, then the prefill profile when
a decider says the prompt is worth a separate prefill) and a second profile in the
route's pipeline, not a change in the request path, which only ever asks the pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.scheduling.pipeline import Context, Profile

DEFAULT = "default"  # the profile every route has, built from its scheduling section


class ProfileHandler(Protocol):
    def pick(
        self,
        profiles: Mapping[str, Profile],
        endpoints: Sequence[EndpointRuntime],
        ctx: Context,
    ) -> EndpointRuntime | None:
        """Run the profiles this request needs, in order, and return the endpoint it
        goes to (None: every candidate was filtered out)."""


class SingleProfile:
    """Every request runs the one default profile."""

    def pick(
        self,
        profiles: Mapping[str, Profile],
        endpoints: Sequence[EndpointRuntime],
        ctx: Context,
    ) -> EndpointRuntime | None:
        return profiles[DEFAULT].pick(endpoints, ctx)
