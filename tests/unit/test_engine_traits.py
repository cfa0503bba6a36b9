"""The engine traits table (llmgw.engines) is the one statement of each engine's facts:
every engine the catalog accepts has traits, and each reader follows the table."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmgw import enginemetrics, kvblocks
from llmgw.agent import engines as agent_engines
from llmgw.agent.config import AgentConfig
from llmgw.agent.launch import ADAPTERS
from llmgw.engines import ENGINES
from llmgw.reconciler.catalog import spec
from llmgw.router.kvcache.feed import KvEventFeed
from llmgw.router.kvcache.index import BlockIndex
from llmgw.router.kvcache.tokens import tokens_for

from .test_router_kvfeed import SnapshotAsker, view_with


def catalog_with(engine: str) -> dict:
    profile = {"engine": engine, "model_ref": "org/m"}
    return {"models": [{"name": "m", "profile": profile}]}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_catalog_accepts_every_engine_of_the_table(engine):
    assert spec.parse(catalog_with(engine)).models[0].profile.engine == engine


def test_the_catalog_refuses_an_engine_the_table_does_not_name():
    with pytest.raises(spec.CatalogError, match="profile.engine"):
        spec.parse(catalog_with("tgi"))


def test_every_engine_has_a_name_a_launch_adapter_and_a_command_setting():
    assert all(t.name == name for name, t in ENGINES.items())
    assert set(ADAPTERS) == set(ENGINES)
    cfg = AgentConfig()
    assert cfg.engine_commands() == {n: list(t.default_command) for n, t in ENGINES.items()}
    assert set(agent_engines.detect(cfg)) == set(ENGINES)


def test_the_facts_as_read_from_the_engines():
    assert {n for n, t in ENGINES.items() if t.kv_events} == {"vllm", "sglang", "sim"}
    assert kvblocks.EVENTS_WITHOUT_EXTRA_KEYS == {"sglang"}
    assert {n: t.metrics.name for n, t in ENGINES.items()} == {
        "vllm": "vllm",
        "sglang": "sglang",
        "sim": "vllm",  # the simulator speaks vLLM's metric names
    }


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_metrics_parser_reads_every_engines_family(engine):
    family = ENGINES[engine].metrics
    page = f"{family.running} 3\n{family.waiting} 2\n{family.kv_usage[0]} 0.5\n".encode()
    load = enginemetrics.parse(page)
    assert (load.running, load.waiting, load.kv_usage, load.source) == (3, 2, 0.5, family.name)


@pytest.mark.parametrize("engine", sorted(ENGINES))
async def test_the_kv_feed_asks_a_snapshot_of_every_engine_with_events(engine):
    nc = SnapshotAsker()
    feed = KvEventFeed(
        view_with("n1", engine=engine), BlockIndex(), nc, request_timeout=0.1, retry_seconds=60
    )
    feed.endpoints_changed()  # the endpoint appears, as on start
    for _ in range(10):
        await asyncio.sleep(0)
    await feed.stop()
    assert bool(nc.asked) is ENGINES[engine].kv_events


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_router_tokenizes_the_sim_way_only_where_the_table_says(engine):
    raw = json.dumps("hello").encode()  # the request's prompt, as JSON
    tokens = tokens_for(engine, "", raw, raw)  # no catalog tokenizer
    assert (tokens is not None) is ENGINES[engine].sim_tokens
