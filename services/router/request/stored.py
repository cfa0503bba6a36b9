"""Stored Responses API answers: GET, DELETE and cancel go to the engine that made them.

An engine keeps the responses it made (`store: true`), so a later call about
one must reach that engine. This router process remembers the endpoint of
every Responses API answer it relayed (the relay reports each id it sees);
an id made elsewhere (another router, another worker) is looked for by asking
the ready endpoints in turn until one does not answer 404.

With tenants declared, a stored response is its tenant's alone: a call from
another tenant gets the 404 an unknown id gets, before any engine is asked.
The router tells the owner from the id (ownership.py: the router chose it), or,
for an engine that chose its own id, from what this process remembers of the
answer; an id neither vouches for is nobody's. Each call counts against the
caller's quotas (requests per minute, concurrency) like any other request.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import TYPE_CHECKING

import aiohttp
from starlette.types import Receive, Scope, Send

from llmgw.router.http.errors import RouterError
from llmgw.router.relay.walk import TIMEOUT_STATUS
from llmgw.router.request import kinds, ownership
from llmgw.router.request.exchange import Exchange
from llmgw.router.request.guard import ClientGone, DeadlinePassed
from llmgw.router.request.tenancy import not_found

if TYPE_CHECKING:
    from llmgw.router.request.handler import Proxy

log = logging.getLogger(__name__)

# The only paths about a stored response: its id (GET, DELETE), then `/cancel` or
# `/input_items`. Anything else (`..` segments, more segments, a `%2F` that the server
# decoded into `/`) is refused before it can name another engine path, or another
# tenant's response, than the one checked.
STORED_PATH = re.compile(
    re.escape(kinds.RESPONSES_PREFIX) + r"([A-Za-z0-9_-]{1,256})(/cancel|/input_items)?"
)

# Stored Responses API answers this router process remembers the endpoint and owner of.
RESPONSE_IDS_KEPT = 100_000
STORED_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=2)


class StoredResponses:
    """The ASGI app mounted at a stored response's paths, and the ids it remembers."""

    __slots__ = ("proxy", "endpoints")

    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        # response id -> (endpoint id, owning tenant or None when there are no tenants)
        self.endpoints: OrderedDict[bytes, tuple[str, str | None]] = OrderedDict()

    def remember(self, response_id: bytes, endpoint_id: str, ex: Exchange) -> None:
        kept = self.endpoints
        kept[response_id] = (endpoint_id, ex.owner)
        if len(kept) > RESPONSE_IDS_KEPT:
            kept.popitem(last=False)

    def owns(self, response_id: bytes, owner: str) -> bool:
        """Whether the stored response `response_id` is tenant `owner`'s."""
        if ownership.minted_for(owner, response_id):
            return True
        known = self.endpoints.get(response_id)
        return known is not None and known[1] == owner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET / DELETE / cancel of a stored response: to the endpoint that made it."""
        proxy = self.proxy
        ex = proxy.exchange(scope, receive, send)
        path = scope["path"]
        query = scope.get("query_string", b"")
        gate = proxy.gate
        try:
            with ex.guard:
                who = gate.authenticate(ex.headers)
                body = await ex.read_body(
                    proxy.settings.max_body_bytes, proxy.settings.body_read_seconds
                )
                if body is None:
                    ex.status = 499
                    return
                grant = await gate.admit_stored(who)
                try:
                    ex.extra = grant.headers()
                    owner = None if who is None else who.owner
                    await self._relay(ex, owner, scope["method"], path, query, body)
                finally:
                    grant.release(None)
        except RouterError as err:
            await ex.fail(err)
        except ClientGone:
            ex.status = 499
        except DeadlinePassed as passed:
            await ex.fail(RouterError(TIMEOUT_STATUS, f"{passed.phase}_timeout", "deadline passed"))
        finally:
            ex.guard.close()
            proxy.record(ex)

    async def _relay(
        self, ex: Exchange, owner: str | None, method: str, path: str, query: bytes, body: bytes
    ) -> None:
        """Answer with the engine that has the response, if the caller may see it."""
        stored = STORED_PATH.fullmatch(path)
        if stored is None:
            raise not_found()
        response_id = stored.group(1).encode()
        if owner is not None and not self.owns(response_id, owner):
            raise not_found()
        known = self.endpoints.get(response_id)
        made_by = None if known is None else known[0]
        candidates = list(self.proxy.view.endpoints.values())
        candidates.sort(key=lambda ep: ep.id != made_by)
        answered = None
        for ep in candidates:
            got = await self._ask(ex, ep, method, path, query, body)
            if got is not None:
                answered = (ep, got)
                if got[0] != 404:
                    break
        if answered is not None:
            ep, (status, ctype, data) = answered
            await ex.answer(status, ctype, data, ep.id)
            return
        if candidates:
            raise RouterError(502, "upstream_broken", "no engine answered")
        raise not_found()

    async def _ask(
        self, ex: Exchange, ep, method: str, path: str, query: bytes, body: bytes
    ) -> tuple[int, bytes, bytes] | None:
        """One endpoint's answer about a stored response, or None if it did not give one."""
        url = ep.target(path)
        if query:
            url = url.with_query(query.decode("latin-1"))
        try:
            async with self.proxy.upstream.session.request(  # type: ignore[union-attr]
                method,
                url,
                data=body or None,
                headers=ex.upstream_headers(ep.request_headers(None, None, ex.rid)),
                timeout=STORED_TIMEOUT,
            ) as resp:
                data = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json").encode()
                return resp.status, ctype, data
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("endpoint %s did not answer about a stored response: %r", ep.id, exc)
            return None
