"""Scheduling profiles: which runs of filters, scorers and a picker a request gets.

After llm-d's ProfileHandler. A model route's pipeline holds named profiles, each one
run of filters, scorers and a picker (`pipeline.Profile`), and a handler that decides
which of them run for a request and which endpoint their results send it to. A route
has one profile, `default`, run by `SingleProfile`, unless its model is disaggregated
(docs/disaggregation.md): then it has two, and `Disaggregated` runs them.

- `prefill`: the model's own scheduling section (its filters, the prefix scorers, the
  load scorers). Prefill engines compute prompts, so the prompt's cached prefix is
  what makes one cheaper than another. Aggregated endpoints of the model (role "")
  compute prompts too, and are picked by it when they serve a request whole.
- `decode`: the same filters and the load scorers only (`inflight` when the section
  names none; the default section's one load scorer is `inflight` too). A decode engine loads the
  prompt's KV from the prefill engine whichever it is, so what tells decode engines
  apart is how busy they are (llm-d's decode profile drops the prefix scorer too).

The request path asks the pipeline for the endpoint of each attempt as for any model
(`pick`: a decode endpoint, else an aggregated one), and the two-leg relay
(relay/disagg.py) asks for the prefill leg's (`pick_prefill`). Which requests take the
prefill leg at all (chat and completions with a long enough prompt) is the relay's
decision, not a profile's: it depends on the request, not on the endpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from llmgw.contracts import SchedulingSpec

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.scheduling.pipeline import Context, Profile

DEFAULT = "default"  # the profile every route has, built from its scheduling section
PREFILL = "prefill"  # a disaggregated model's profiles (and its endpoints' roles)
DECODE = "decode"

# Scorers that rate what an endpoint has cached of the prompt: the prefill profile's.
PREFIX_SCORERS = frozenset({"kv_prefix", "prefix"})
# The load scorers, and what the decode profile scores by when the model's section names
# none of them: the default section's own load scorers (derived, so the two never part).
LOAD_SCORERS = frozenset({"queue", "kv", "inflight"})
DEFAULT_DECODE_SCORERS = {n: w for n, w in SchedulingSpec().scorers.items() if n in LOAD_SCORERS}


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


def decode_spec(spec: SchedulingSpec) -> SchedulingSpec:
    """The decode profile's section: the model's, less its prefix scorers (and with the
    default load scorers when nothing else is left to rate decode engines by)."""
    scorers = {name: w for name, w in spec.scorers.items() if name not in PREFIX_SCORERS}
    if not any(name in LOAD_SCORERS and w > 0 for name, w in scorers.items()):
        scorers.update(DEFAULT_DECODE_SCORERS)
    return msgspec.structs.replace(spec, scorers=scorers)


class Disaggregated:
    """A disaggregated model's handler: decode engines take requests (the decode leg,
    or a request served whole), prefill engines only the prefill leg, and aggregated
    engines whatever no decode engine can take."""

    def pick(
        self,
        profiles: Mapping[str, Profile],
        endpoints: Sequence[EndpointRuntime],
        ctx: Context,
    ) -> EndpointRuntime | None:
        """The endpoint that answers the client: a decode one, else an aggregated one
        (which computes the prompt itself), never a prefill one."""
        decode = [ep for ep in endpoints if ep.spec.role == DECODE]
        ep = profiles[DECODE].pick(decode, ctx) if decode else None
        if ep is None:
            whole = [ep for ep in endpoints if not ep.spec.role]
            ep = profiles[PREFILL].pick(whole, ctx) if whole else None
        return ep

    def pick_prefill(
        self,
        profiles: Mapping[str, Profile],
        endpoints: Sequence[EndpointRuntime],
        ctx: Context,
    ) -> EndpointRuntime | None:
        """The endpoint for the prefill leg; None: the prefill pool is empty, or every
        one of it filtered out (or tried already)."""
        prefill = [ep for ep in endpoints if ep.spec.role == PREFILL]
        return profiles[PREFILL].pick(prefill, ctx) if prefill else None
