"""What GET /v1/models says of each model: OpenAI's fields, plus `max_model_len`.

A LoRA adapter is listed as vLLM lists it, with `parent`, its base model (and that
model's `max_model_len`: an adapter does not change the context length).

`max_model_len` comes from the catalog's serving profile when it sets one,
else from the engines themselves (vLLM lists it in its own /v1/models). An
engine is asked at most once a minute and for at most a second; one that does
not answer leaves the field out rather than delaying the list.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import msgspec

from llmgw.router.endpoints.view import EndpointRuntime, ModelRoute

log = logging.getLogger(__name__)

ASK_EVERY = 60.0
ASK_TIMEOUT = aiohttp.ClientTimeout(total=1.0)


class _EngineModel(msgspec.Struct):
    id: str = ""
    root: str | None = None
    max_model_len: int | None = None


class _EngineModels(msgspec.Struct):
    data: list[_EngineModel] = msgspec.field(default_factory=list)


_decode = msgspec.json.Decoder(_EngineModels).decode


class EngineModels:
    def __init__(self) -> None:
        self._asked: dict[str, tuple[float, dict[str, int]]] = {}  # endpoint id -> (at, lens)

    async def _ask(self, session: aiohttp.ClientSession, ep: EndpointRuntime) -> dict[str, int]:
        now = time.monotonic()
        cached = self._asked.get(ep.id)
        if cached is not None and now - cached[0] < ASK_EVERY:
            return cached[1]
        lens: dict[str, int] = {}
        try:
            headers = ep.request_headers(None, None, b"models")
            async with session.get(
                ep.url + "/v1/models", headers=headers, timeout=ASK_TIMEOUT
            ) as resp:
                if resp.status == 200:
                    for m in _decode(await resp.read()).data:
                        if m.max_model_len:
                            lens[m.id] = m.max_model_len
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            log.info("could not ask endpoint %s for its models: %r", ep.id, exc)
        self._asked[ep.id] = (now, lens)
        return lens

    async def max_model_len(
        self, session: aiohttp.ClientSession | None, route: ModelRoute
    ) -> int | None:
        record = route.record
        if record is not None and record.max_model_len:
            return record.max_model_len
        if session is None:
            return None
        for ep in route.endpoints:
            lens = await self._ask(session, ep)
            if route.name in lens:
                return lens[route.name]
            if len(lens) == 1:
                return next(iter(lens.values()))
        return None

    async def describe(
        self,
        session: aiohttp.ClientSession | None,
        names: list[tuple[str, str | None]],
        resolve,
    ) -> list[dict[str, Any]]:
        """The OpenAI model objects for (name, canonical or None) pairs."""
        routes = {name: resolve(name) for name, _ in names}
        # Whose max_model_len each route has: a model's own, an adapter's model's.
        owner = {r.name: r.adapter_of or r.name for r in routes.values() if r is not None}
        canon = {m: r for m in set(owner.values()) if (r := resolve(m)) is not None}
        lens = dict(
            zip(
                canon,
                await asyncio.gather(*(self.max_model_len(session, r) for r in canon.values())),
                strict=True,
            )
        )
        out = []
        for name, canonical in names:
            route = routes[name]
            if route is None:
                continue
            record = route.record
            item: dict[str, Any] = {
                "id": name,
                "object": "model",
                # Stable: when the model's record was written, the same on every router.
                "created": int(record.ts) if record is not None else 0,
                "owned_by": (record.owned_by if record is not None else "") or "llmgw",
            }
            if canonical:
                item["root"] = canonical
            if route.adapter_of:
                item["parent"] = route.adapter_of
            length = lens.get(owner[route.name])
            if length:
                item["max_model_len"] = length
            out.append(item)
        return out
