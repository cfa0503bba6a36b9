"""Stored Responses API answers: GET, DELETE and cancel go to the engine that made them.

An engine keeps the responses it made (`store: true`), so a later call about
one must reach that engine. This router process remembers the endpoint of
every Responses API answer it relayed (the relay reports each id it sees);
an id made elsewhere (another router, another worker) is looked for by asking
the ready endpoints in turn until one does not answer 404. Only
authentication applies: these calls cost an engine nothing worth a quota.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import aiohttp
from starlette.types import Receive, Scope, Send

from llmgw.router.http.errors import RouterError
from llmgw.router.relay.walk import TIMEOUT_STATUS
from llmgw.router.request import kinds
from llmgw.router.request.exchange import Exchange
from llmgw.router.request.guard import ClientGone, DeadlinePassed

if TYPE_CHECKING:
    from llmgw.router.request.handler import Proxy

log = logging.getLogger(__name__)

# Stored Responses API answers this router process remembers the endpoint of.
RESPONSE_IDS_KEPT = 100_000
STORED_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=2)


class StoredResponses:
    """The ASGI app mounted at a stored response's paths, and the ids it remembers."""

    __slots__ = ("proxy", "endpoints")

    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.endpoints: OrderedDict[bytes, str] = OrderedDict()  # response id -> endpoint id

    def remember(self, response_id: bytes, endpoint_id: str) -> None:
        kept = self.endpoints
        kept[response_id] = endpoint_id
        if len(kept) > RESPONSE_IDS_KEPT:
            kept.popitem(last=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET / DELETE / cancel of a stored response: to the endpoint that made it."""
        proxy = self.proxy
        ex = proxy.exchange(scope, receive, send)
        path = scope["path"]
        query = scope.get("query_string", b"")
        try:
            with ex.guard:
                proxy.gate.authenticate(ex.headers)
                body = await ex.read_body(
                    proxy.settings.max_body_bytes, proxy.settings.body_read_seconds
                )
                if body is None:
                    ex.status = 499
                    return
                response_id = path[len(kinds.RESPONSES_PREFIX) :].split("/", 1)[0].encode()
                known = self.endpoints.get(response_id)
                candidates = list(proxy.view.endpoints.values())
                candidates.sort(key=lambda ep: ep.id != known)
                answered = None
                for ep in candidates:
                    got = await self._ask(ex, ep, scope["method"], path, query, body)
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
                raise RouterError(
                    404, "response_not_found", "no stored response with that id", param="id"
                )
        except RouterError as err:
            await ex.fail(err)
        except ClientGone:
            ex.status = 499
        except DeadlinePassed as passed:
            await ex.fail(RouterError(TIMEOUT_STATUS, f"{passed.phase}_timeout", "deadline passed"))
        finally:
            ex.guard.close()
            proxy.record(ex)

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
