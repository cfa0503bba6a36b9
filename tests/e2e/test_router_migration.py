"""Mid-stream migration end to end: real processes over real sockets.

A `llmgw router` in front of two sim engines, one killed with SIGKILL while it
streams; then a whole cluster (`llmgw dev`) whose scale-down stops a draining sim
at its drain deadline while long streams are still running on it. Either way every
stream reaches its client whole, with the tokens it asked for.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmgw.dev.routerkit import start_router
from llmgw.dev.simkit import start_sim
from tests.e2e import clusterkit as ck

pytestmark = pytest.mark.e2e

TOKENS = 300  # at 20 ms a token, a stream lasts six seconds: past any fault below


async def _stream(client: openai.AsyncOpenAI, model: str, i: int) -> dict:
    """One streamed chat: its token chunks, usage, ids and finish, or the error."""
    out = {"chunks": 0, "usage": None, "ids": set(), "finish": None, "error": None}
    try:
        async for chunk in await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        ):
            out["ids"].add(chunk.id)
            out["usage"] = chunk.usage or out["usage"]
            for ch in chunk.choices:
                if ch.delta.content is not None and ch.delta.role is None:
                    out["chunks"] += 1
                out["finish"] = ch.finish_reason or out["finish"]
    except Exception as exc:  # what the test reports, not what it hides
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def streams_during(urls: list[str], api_key: str, model: str, n: int, fault) -> list[dict]:
    """`n` concurrent streams over `urls`; `fault()` runs (in a thread) once they flow."""

    async def main():
        clients = [
            openai.AsyncOpenAI(base_url=u, api_key=api_key, max_retries=0, timeout=60) for u in urls
        ]
        tasks = [
            asyncio.create_task(_stream(clients[i % len(clients)], model, i)) for i in range(n)
        ]
        await asyncio.to_thread(fault)
        results = await asyncio.gather(*tasks)
        for c in clients:
            await c.close()
        return results

    return asyncio.run(main())


def assert_whole(results: list[dict]) -> None:
    bad = [r for r in results if r["error"] or r["chunks"] != TOKENS]
    assert bad == [], bad[:3]
    for r in results:
        assert r["usage"].completion_tokens == TOKENS
        assert len(r["ids"]) == 1 and r["finish"] == "length"


def migrations(admin_url: str) -> float:
    text = httpx.get(admin_url + "/metrics", timeout=5).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "llmgw_router_migrations_total"
    )


def test_a_sim_killed_with_sigkill_mid_stream_loses_no_stream(tmp_path):
    sims = [start_sim(model="m", itl_ms=20, ttft_ms=1, max_num_seqs=32) for _ in range(2)]
    eps = "\n".join(
        f"  - {{id: s{i}, url: '{s.url}', models: [m], engine: sim}}" for i, s in enumerate(sims)
    )
    router = start_router(
        tmp_path,
        "log_level: warning\nadmission: {enabled: false}\n"
        "model_defaults: {deadlines: {idle: 2.0}}\n"
        f"models: [{{name: m, migration: {{max: 1}}}}]\nendpoints:\n{eps}\n",
    )
    victim = sims[0]

    def kill_once_both_stream():
        ck.wait(lambda: all(s.state()["running"] > 0 for s in sims), 30, "both sims streaming")
        time.sleep(0.3)  # some tokens out on each
        victim.signal(signal.SIGKILL)

    try:
        results = streams_during([router.url + "/v1"], "unused", "m", 8, kill_once_both_stream)
        moved = migrations(router.admin_url)
    finally:
        assert router.stop() == 0, router.log_tail()
        for s in sims:
            s.stop()
    assert_whole(results)
    assert moved >= 1  # the victim's streams were continued, not lucky


# ------------------------------------------------------------------ drain

ENV = {
    "LLMGW_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "LLMGW_ACTOR__COMMAND_RETRY_INITIAL": "0.5",
    "LLMGW_ACTOR__DRAIN_DEADLINE": "1",
}


def catalog(replicas: int) -> dict:
    # --drain-seconds 0: at SIGTERM the sim aborts what it runs, as an engine past its
    # grace does; the drain deadline is the agent's (ENV), far shorter than a stream.
    # 60 ms a token: 18 s streams, so they still run when the drained sim is stopped even
    # on a loaded machine, where `llmgw apply` and the leader's drain take seconds (at
    # 20 ms a loaded CI box saw every stream end before the deadline: nothing to move).
    sim = ["--itl-ms", "60", "--ttft-ms", "5", "--drain-seconds", "0"]
    return {
        "models": [
            {
                "name": "long",
                "replicas": replicas,
                "migration": {"max": 2},
                "profile": {"engine": "sim", "model_ref": "sim/long", "engine_args": sim},
            }
        ]
    }


def test_a_scale_down_hands_streams_outliving_the_drain_deadline_over(tmp_path):
    first = tmp_path / "catalog.yaml"
    first.write_text(yaml.safe_dump(catalog(2)))
    (tmp_path / "cluster").mkdir()
    cluster = ck.start_cluster(tmp_path / "cluster", env=ENV, catalog=first)
    try:
        urls = lambda: {e["url"].rstrip("/") for e in ck.ready_endpoints(cluster, "long")}  # noqa: E731
        ck.wait(lambda: len(urls()) == 2, 120, "two replicas ready")
        for admin in cluster.info["router_admin"]:
            ck.wait(lambda a=admin: ck.router_endpoint_urls(a, "long") == urls(), 30, "routers")

        def scale_down():
            time.sleep(0.5)  # streams under way on both replicas
            ck.apply_catalog(cluster, catalog(1))

        results = streams_during(cluster.info["routers"], "unused", "long", 8, scale_down)
        ck.wait(lambda: len(urls()) == 1, 60, "scale down to one replica")
        moved = sum(migrations(a) for a in cluster.info["router_admin"])
    finally:
        cluster.stop()
    assert_whole(results)
    assert moved >= 1  # streams were cut at the deadline and continued
