"""LoRA adapters on one engine: what it should hold, what it holds, and the calls between.

The leader's SetShardAdapters names the whole set an engine should hold (level-triggered),
so a missed or repeated command heals: the agent compares that set with what the engine
itself lists in /v1/models (an adapter's entry has a `parent`), unloads the extras, loads
what is missing through the engine's runtime API (engines.RuntimeLora), and reports
what the engine holds and each failed load's answer in the shard's status.

What the engine holds is read from the engine, never assumed: a relaunched engine holds
nothing, an engine adopted after an agent restart holds what it held. A failed call is
retried with backoff a bounded number of times, every call under a deadline; after the
last try its answer stays in the status until a new set is asked for.

`plan` is pure; `AdapterSync` is the I/O, one task per engine, owned by the shard's
supervision (shard.py), which cancels it before the engine stops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx

from llmgw import contracts as c
from llmgw.engines import RuntimeLora

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    unload: list[str] = field(default_factory=list)
    # (name, source, in place): in place when the engine holds the name from another path.
    load: list[tuple[str, str, bool]] = field(default_factory=list)


def plan(desired: Mapping[str, str], held: Mapping[str, str]) -> Plan:
    """The calls that take an engine holding `held` to `desired` (both name -> source)."""
    return Plan(
        unload=sorted(name for name in held if name not in desired),
        load=[
            (name, source, name in held)
            for name, source in sorted(desired.items())
            if held.get(name) != source
        ],
    )


@dataclass(frozen=True)
class Retry:
    attempts: int = 4  # calls per adapter before its failure is reported as final
    first_backoff: float = 0.5  # seconds, doubled after each failure, jittered
    call_timeout: float = 120.0  # one call's deadline: loading reads the adapter from disk


def engine_answer(resp: httpx.Response) -> str:
    """An engine's refusal as the status reports it: the status code and its message."""
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text.strip()[:500]
    return f"HTTP {resp.status_code}: {message}"


class EngineAdapters:
    """One engine's runtime adapter API; each call returns None or the engine's answer."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, api: RuntimeLora, timeout: float):
        self.http = http
        self.base_url = base_url
        self.api = api
        self.timeout = timeout

    async def held(self) -> dict[str, str]:
        """The adapters the engine lists (name -> path); raises httpx.HTTPError."""
        resp = await self.http.get(f"{self.base_url}/v1/models", timeout=self.timeout)
        resp.raise_for_status()
        return {m["id"]: m.get("root") or "" for m in resp.json()["data"] if m.get("parent")}

    async def load(self, name: str, source: str, inplace: bool) -> str | None:
        body: dict[str, object] = {"lora_name": name, "lora_path": source}
        if inplace:
            body["load_inplace"] = True
        return await self._post(self.api.load_path, body)

    async def unload(self, name: str) -> str | None:
        error = await self._post(self.api.unload_path, {"lora_name": name})
        # Not there is what an unload wants (vLLM: 404 "cannot be found").
        return None if error is not None and error.startswith("HTTP 404") else error

    async def _post(self, path: str, body: dict) -> str | None:
        try:
            resp = await self.http.post(f"{self.base_url}{path}", json=body, timeout=self.timeout)
        except httpx.HTTPError as exc:
            return f"no answer from the engine: {type(exc).__name__}: {exc}"
        return None if resp.status_code == 200 else engine_answer(resp)


class AdapterSync:
    """Keeps one engine's adapters at the set last asked for; `run` is its task."""

    def __init__(
        self,
        shard_id: str,
        engine: EngineAdapters,
        report: Callable[[list[str] | None, dict[str, str]], None],
        count: Callable[[str, str], None],
        retry: Retry,
        desired: list[c.AdapterSource] | None = None,
    ):
        self.shard_id = shard_id
        self.engine = engine
        # (held names, None when unknown; errors) -> the shard's status, when changed
        self._report = report
        self._count = count  # (op, outcome) -> the agent's metric
        self.retry = retry
        self.desired = {a.name: a.source for a in desired or []}
        self.held: dict[str, str] | None = None  # None until read from the engine
        self.errors: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._wake.set()  # the first pass reads what the engine holds

    def want(self, adapters: list[c.AdapterSource]) -> None:
        """A new set to hold: failures are tried afresh."""
        self.desired = {a.name: a.source for a in adapters}
        self.errors = {}
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._converge()

    async def _converge(self) -> None:
        if self.held is None:
            self.held, why = await self._read_held()
            if self.held is None:
                # What it holds is unknown, so nothing is changed; tried again with the next set.
                self.errors = {
                    name: f"the engine's adapters could not be listed: {why}"
                    for name in self.desired
                }
                self._report(None, dict(self.errors))
                return
        steps = plan(self.desired, self.held)
        for name in steps.unload:
            if await self._attempt("unload", name, functools.partial(self.engine.unload, name)):
                del self.held[name]
        self._report_now()
        for name, source, inplace in steps.load:
            if name in self.errors:
                continue  # failed for this set already; a new set tries again
            call = functools.partial(self.engine.load, name, source, inplace)
            if await self._attempt("load", name, call):
                self.held[name] = source
            self._report_now()

    async def _read_held(self) -> tuple[dict[str, str] | None, str]:
        """What the engine holds, or None and why not after the last try."""
        why = ""
        for attempt in range(self.retry.attempts):
            try:
                return await self.engine.held(), ""
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "shard %s: listing the engine's adapters failed: %s", self.shard_id, why
                )
                if attempt + 1 < self.retry.attempts:
                    await self._backoff(attempt)
        return None, why

    async def _attempt(self, op: str, name: str, call) -> bool:
        """One adapter's load or unload, retried; True once the engine did it."""
        error = None
        for attempt in range(self.retry.attempts):
            error = await call()
            if error is None:
                self._count(op, "ok")
                self.errors.pop(name, None)
                log.info("shard %s: adapter %s %sed", self.shard_id, name, op)
                return True
            log.warning(
                "shard %s: %s of adapter %s failed (try %d of %d): %s",
                self.shard_id, op, name, attempt + 1, self.retry.attempts, error,
            )  # fmt: skip
            if attempt + 1 < self.retry.attempts:
                self._count(op, "retried")
                await self._backoff(attempt)
        self._count(op, "failed")
        self.errors[name] = error or ""
        return False

    async def _backoff(self, attempt: int) -> None:
        await asyncio.sleep(self.retry.first_backoff * 2**attempt * (0.5 + random.random()))

    def _report_now(self) -> None:
        held = sorted(self.held or {})
        # Errors only for adapters still wanted or still held: a dropped one is no news.
        wanted = {n: e for n, e in self.errors.items() if n in self.desired or n in held}
        self._report(held, wanted)
