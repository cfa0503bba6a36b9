"""The seam between "may this request proceed, and when" and "where does it go".

The proxy calls `authenticate` first, from the request's headers alone, before
it reads the body: a request without a valid key gets its 401 whatever its body
says (malformed, unknown model, too large), as OpenAI answers. It calls `admit`
with what `authenticate` returned after the request is parsed and its model
resolved, and before scheduling; both calls go to the gate that was installed
when the request arrived. Authentication, quotas and admission queues live
behind this interface; scheduling and dispatch never see tenants. A gate
rejects by raising `RouterError` (401, 429, 503, 504 ...), and may wait (queue)
before returning. If the client disconnects while it waits, the waiting task is
cancelled: a gate must leave its queue on `CancelledError`. The returned grant
is released exactly once, with the engine's usage when known, however the
request ended; its `headers()` go on the answer. A call about a stored
response names no model: `admit_stored` counts it against the caller's quotas
and nothing else.

What `authenticate` returns is a `Caller` (or None when there are no tenants):
the request path binds stored responses to its `owner` and salts its prefix
cache by its `cache_scope`, and sees nothing else of tenants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import ModelRoute
    from llmgw.router.request.body import Parsed, Usage


class Caller(Protocol):
    # Whom the stored responses it creates belong to; None: no tenants, nothing is bound.
    owner: str | None

    def cache_scope(self, headers: dict[bytes, bytes]) -> bytes | None:
        """What its cache salt is derived from (its tenant, or tenant and key); None:
        its prefix cache is shared."""
        ...


class Grant(Protocol):
    def release(self, usage: Usage | None) -> None: ...

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Headers for every answer to the admitted request (OpenAI's x-ratelimit-*)."""
        ...


class Gate(Protocol):
    def authenticate(self, headers: dict[bytes, bytes]) -> Caller | None: ...

    async def admit(self, request: Parsed, route: ModelRoute, who: Any) -> Grant: ...

    async def admit_stored(self, who: Any) -> Grant: ...
