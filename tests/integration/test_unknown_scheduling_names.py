"""A model whose scheduling names a plugin no router has, as a user meets it (review §5.1).

`llmgw apply` refuses it and publishes nothing. A router that finds such a record in
the projection bucket anyway (an older reconciler, a hand edit) skips that model and
goes on: it keeps serving the others and taking every later change, whether the
record arrived while it ran or was already there when it started. Real NATS, real
sim engines, real routers; the projection is written by hand, as the reconciler would.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time

import httpx
import msgspec
import pytest

from llmgw import bus, procs, projection
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.dev.routerkit import running_router
from llmgw.dev.simkit import start_sim
from llmgw.router import config as rc

UNKNOWN = "scheduling: {scorers: {kv_prefx: 6}, picker: max_scor}"


async def test_apply_refuses_unknown_scheduling_plugins_and_publishes_nothing(
    js, nats_url, tmp_path
):
    await bus.provision(js)
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "models:\n"
        "  - {name: good, profile: {engine: sim}}\n"
        f"  - {{name: bad, profile: {{engine: sim}}, {UNKNOWN}}}\n"
    )
    res = await asyncio.to_thread(
        subprocess.run,
        procs.llmgw_argv("apply", "-f", str(path), "--nats", nats_url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res
    assert res.stderr.splitlines() == [
        f"{path}: models[1] (name=bad): scheduling.scorers: unknown scorer 'kv_prefx' "
        "(known: queue, kv, inflight, prefix, kv_prefix, session, lora_affinity)",
        f"{path}: models[1] (name=bad): scheduling.picker: unknown picker 'max_scor' "
        "(known: max_score, p2c, weighted_random)",
    ]
    assert (await js.stream_info(s.EVENTS_STREAM)).state.last_seq == 0


# ------------------------------------------------------------------ a router fed directly


@pytest.fixture(scope="module")
def sims():
    started = []
    try:
        for _ in range(2):
            started.append(start_sim(model="m", served_model_name=["m", "late"], itl_ms=1))
        yield started
    finally:
        for sim in started:
            sim.stop()


def record(model: str, sim, scheduling: c.SchedulingSpec | None = None) -> c.ModelEndpoints:
    return c.ModelEndpoints(
        model=model,
        endpoints=[c.Endpoint(id=f"shard-{sim.port}", url=sim.url, node="n1")],
        scheduling=scheduling or c.SchedulingSpec(),
    )


async def put(js, rec: c.ModelEndpoints) -> None:
    """Write a record where the reconciler would."""
    bucket, key = projection.key_of(rec).target
    await (await js.key_value(bucket)).put(key, projection.encode(rec))


async def served_by(http: httpx.AsyncClient, url: str, model: str) -> str | None:
    """The endpoint that answered a chat for `model`, or None when none did."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with contextlib.suppress(httpx.HTTPError):
        resp = await http.post(url + "/v1/chat/completions", json=body)
        if resp.status_code == 200:
            return resp.headers["x-llmgw-endpoint"]
    return None


async def wait_until_served(http, url: str, model: str, endpoint: str, timeout: float = 20.0):
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if await served_by(http, url, model) == endpoint:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url}: model {model!r} never served by {endpoint}")


async def test_a_router_skips_a_record_naming_unknown_plugins_and_takes_every_later_change(
    nats, sims
):
    js = nats.jetstream()
    await bus.provision(js)
    a, b = sims
    bad = c.SchedulingSpec(scorers={"kv_prefx": 6.0}, picker="max_scor")
    cfg = rc.RouterConfig(nats_url=nats.connected_url.geturl(), router_id="r1")
    await put(js, record("m", a))
    async with running_router(cfg) as r1, httpx.AsyncClient(timeout=10) as http:
        await wait_until_served(http, r1.url, "m", f"shard-{a.port}")
        await put(js, record("bad", b, bad))  # reaches r1 live
        async with running_router(
            msgspec.structs.replace(cfg, router_id="r2")
        ) as r2:  # finds it in its first snapshot
            await wait_until_served(http, r2.url, "m", f"shard-{a.port}")
            await put(js, record("late", b))  # a model declared after the bad record
            await put(js, record("m", b))  # a replica moved
            for r in (r1, r2):
                await wait_until_served(http, r.url, "late", f"shard-{b.port}")
                await wait_until_served(http, r.url, "m", f"shard-{b.port}")
                assert await served_by(http, r.url, "bad") is None
                assert (await http.get(r.admin_url + "/readyz")).status_code == 200
