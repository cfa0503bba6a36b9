"""Waiting for a LoRA adapter's holder when every replica listed as holding it said no.

An agent unloads an adapter before its report reaches the routers, and the leader may
load it elsewhere at the same moment: a request whose every listed holder answered 404
for the adapter (relay/walk.py: `adapter_missing`) would otherwise fail although a holder
is only a projection away. It waits here, as it would have in admission had the
projection been current, until the view lists an endpoint that holds the adapter and
has not refuted it, or its wait runs out (then the client gets 503 `adapter_not_loaded`
with Retry-After). One future per view change, shared by every waiter: the view calls
its listeners on the event loop.
"""

from __future__ import annotations

import asyncio

from llmgw.router.endpoints.view import EndpointView, ModelRoute

# At most this long a request waits for its adapter's next holder (less if its total
# deadline is nearer): a placement takes a demand summary, a decision, a load (a few
# hundred ms on vLLM) and the agent's report, seconds in all.
HOLDER_WAIT_SECONDS = 30.0


class HolderWait:
    def __init__(self, view: EndpointView):
        self.view = view
        self._changed: asyncio.Future[None] | None = None
        view.subscribe(self._on_change)

    def _on_change(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)

    async def holder(self, adapter: str, seconds: float) -> ModelRoute | None:
        """The adapter's route once a change of the view lists an endpoint holding it, or
        None after `seconds`. Only a change counts: the caller found none to try in the
        view as it is (a holder whose circuit is open, say), and would again at once."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while True:
            left = until - loop.time()
            if left <= 0:
                return None
            if self._changed is None:
                self._changed = loop.create_future()
            try:
                # Shielded: a waiter that gives up must not cancel the others' future.
                await asyncio.wait_for(asyncio.shield(self._changed), left)
            except TimeoutError:
                return None
            route = self.view.route(adapter)
            if route is not None and any(adapter in ep.adapters for ep in route.endpoints):
                return route
