"""An in-process reconciler (real Postgres fold, leadership, operator API) for fault tests.

Its actor does nothing: these tests are about the fold and leadership, and an
actor publishing decisions would only add events to count around.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx

from llmgw.dev import servers as localservers
from llmgw.reconciler.config import FoldConfig, LeaderConfig, ReconcilerConfig
from llmgw.reconciler.service import Reconciler

DEADLINE = 30.0


class NullActor:
    """The actor seam with nothing behind it (whatever the leader passes it)."""

    async def start(self, *args, **kwargs) -> None:
        pass

    async def on_state_changed(self, *args, **kwargs) -> None:
        pass

    async def stop(self) -> None:
        pass


def config(nats_url: str, database_url: str, **kw) -> ReconcilerConfig:
    kw.setdefault("fold", FoldConfig(fetch_wait_seconds=0.1))
    kw.setdefault("leader", LeaderConfig(retry_interval_seconds=0.2, check_interval_seconds=0.2))
    return ReconcilerConfig(
        nats_url=nats_url,
        database_url=database_url,
        admin_listen=f"127.0.0.1:{localservers.free_port()}",
        api_auth="none",  # loopback, and these tests are about the fold, not API access
        **kw,
    )


@contextlib.asynccontextmanager
async def running(cfg: ReconcilerConfig) -> AsyncIterator[Reconciler]:
    rec = Reconciler(cfg, actor_factory=NullActor)  # type: ignore[arg-type]
    task = asyncio.create_task(rec.run(), name=f"reconciler-{cfg.id}")
    try:
        yield rec
    finally:
        rec.stop.set()
        await asyncio.wait_for(task, timeout=45)


def api_url(rec: Reconciler) -> str:
    return f"http://{rec.cfg.admin_listen}"


async def api_get(rec: Reconciler, path: str):
    """The API's JSON answer; {} while the listener is not up yet."""
    async with httpx.AsyncClient(timeout=5) as client:
        try:
            resp = await client.get(api_url(rec) + path)
        except httpx.TransportError:
            return {}
        return resp.json()


async def until(what: str, pred: Callable[[], object], deadline: float = DEADLINE) -> object:
    """Poll `pred` (sync or async) until it is truthy; AssertionError after `deadline`."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + deadline
    while True:
        got = pred()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if loop.time() > stop_at:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)
