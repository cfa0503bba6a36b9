"""Retention must not silently lose events, nor make the catalog unchangeable.

With `bus.events_max_age_seconds` set, events leave the stream after that age.

- Events that expire before the fold reaches them (a reconciler down longer
  than the retention) used to be skipped with a log line only. The fold now
  records the hole as a dead letter, in the transaction that moves the
  position past it.
- `llmgw apply` read the current catalog from the stream alone: once a
  tenant's declaration expired, apply no longer knew the tenant, so it could
  never be removed and its keys kept working. Apply now completes the catalog
  from the folded one (the operator API) when the stream's history is trimmed.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import select

from llmgw import bus
from llmgw import subjects as s
from llmgw.reconciler.catalog import apply as apply_cli
from llmgw.reconciler.intake import consumer
from llmgw.reconciler.intake.batch import Folder
from llmgw.reconciler.store import store
from llmgw.reconciler.store import tables as t

from . import inproc
from .test_reconciler_store import registered

SHORT = bus.BusConfig(events_max_age_seconds=1.0)  # the duplicate window follows
# Long enough for a running reconciler to fold an event first, even on a loaded box.
FOLDED_FIRST = bus.BusConfig(events_max_age_seconds=3.0)
KEY = "sha256:" + "ab" * 32


async def expired(js) -> bool:
    return (await js.stream_info(s.EVENTS_STREAM)).state.messages == 0


async def test_events_that_expired_unfolded_are_recorded_not_passed_silently(js, engine):
    await bus.provision(js, SHORT)
    for i in range(3):
        await bus.publish(js, registered(f"gone-{i}"))  # seqs 1..3: expire unfolded
    await inproc.until("the first events to expire", lambda: expired(js))
    for i in range(2):
        await bus.publish(js, registered(f"kept-{i}"))  # seqs 4, 5

    folder = Folder(engine, await store.load_state(engine))

    async def subscribe(start_seq: int):
        return await bus.ensure_pull_consumer(
            js, s.EVENTS_STREAM, "retention-fold", s.EVENTS_ALL,
            start_seq=start_seq, recreate=True,
        )  # fmt: skip

    done = asyncio.Event()
    results = []

    async def on_batch(result, pending: int) -> None:
        results.append(result)
        if result.last_seq >= 5:
            done.set()

    psub = await subscribe(1)
    loop = asyncio.create_task(
        consumer.consume(
            psub,
            folder,
            batch_size=10,
            fetch_wait=0.2,
            on_batch=on_batch,
            resubscribe=subscribe,
        )  # fmt: skip
    )
    try:
        await asyncio.wait_for(done.wait(), timeout=20)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await psub.unsubscribe()
    assert set(folder.state.nodes) == {"kept-0", "kept-1"}
    async with engine.connect() as conn:
        dead = [dict(r) for r in (await conn.execute(select(t.DeadLetter.__table__))).mappings()]
    assert [(d["seq"], d["raw"]) for d in dead] == [(1, b"")]
    assert "never folded: events 1..3 were gone from the stream" in dead[0]["reason"]
    assert sum(r.never_folded for r in results) == 3


async def test_a_tenant_whose_declaration_expired_can_still_be_removed(
    nats, database_url, engine, tmp_path, capsys
):
    js = nats.jetstream()
    await bus.provision(js, FOLDED_FIRST)
    nats_url = nats.connected_url.geturl()
    cfg = inproc.config(nats_url, database_url, id="rec", bus=FOLDED_FIRST)
    catalog = tmp_path / "catalog.yaml"

    async def apply(text: str, api: str | None) -> int:
        catalog.write_text(text)
        cat = apply_cli.load_file(str(catalog))
        return await apply_cli._apply(cat, nats_url, False, api)

    with_acme = f"""
bands: [{{name: gold}}]
tenants:
  - {{name: acme, band: gold, key_hashes: ["{KEY}"]}}
"""
    without_acme = "bands: [{name: gold}]\n"
    async with inproc.running(cfg) as rec:
        api = inproc.api_url(rec)
        assert await apply(with_acme, api) == 0
        await inproc.until("acme folded", lambda: _tenants(engine, {"acme"}))
        await inproc.until("its declaration to expire", lambda: expired(js))
        capsys.readouterr()

        # Without acme: its removal is published and folded; its keys stop working.
        assert await apply(without_acme, api) == 0
        assert "tenant acme: removed" in capsys.readouterr().out
        await inproc.until("acme removed", lambda: _tenants(engine, set()), deadline=20)
        # The same catalog again: nothing to do (the folded catalog has the expired bands).
        await inproc.until("the removal to expire too", lambda: expired(js))
        assert await apply(without_acme, api) == 0
        assert "no changes" in capsys.readouterr().out

        # Without the API, apply refuses rather than diff against half a catalog.
        try:
            await apply(with_acme, "http://127.0.0.1:1")
        except apply_cli.ApplyError as exc:
            assert "no longer holds every catalog declaration" in str(exc)
        else:
            raise AssertionError("apply diffed against the stream's half of the catalog")


async def _tenants(engine, want: set[str]) -> bool:
    async with engine.connect() as conn:
        return set((await conn.execute(select(t.Tenant.name))).scalars()) == want
