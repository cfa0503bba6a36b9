"""LoRA adapters end to end: every part of issue #22 together, on real processes.

The local cluster `llmgw dev` runs (NATS, Postgres, reconcilers, agents launching sim
engines, routers) gets a catalog with a base model whose sim engines have two adapter
slots and two adapters on it, one only for the demo tenant. A request naming an adapter
no engine holds waits in a router's admission while the leader places the adapter from
the router's demand, the agent loads it into the sim through its runtime LoRA API and
reports it, and the projection tells the routers; then the adapter answers it (the sim
answers with the adapter's name as the response's model, and serves it only once
loaded). Nothing is faked between the parts, so a wrong subject, field or name anywhere
on that path leaves the request waiting until its queue TTL and fails the test.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e import clusterkit as ck

pytestmark = pytest.mark.e2e

BASE = "lora-base"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ck.start_cluster(tmp_path_factory.mktemp("lora-cluster"))
    try:
        yield c
    finally:
        c.stop()


def adapter_source(cluster, name: str) -> str:
    """A directory the sim accepts as an adapter (it checks the path and the rank)."""
    path = ck.Path(cluster.info["data_dir"]) / "adapters" / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    return str(path)


def lora_catalog(cluster) -> dict:
    catalog = ck.demo_catalog(cluster)
    catalog["models"].append(
        {
            "name": BASE,
            "replicas": 1,
            "profile": {
                "engine": "sim",
                "model_ref": "sim/lora-base",
                "gpus_per_shard": 1,
                "engine_args": ["--itl-ms", "5", "--ttft-ms", "20"],
                "max_loras": 2,
            },
        }
    )
    catalog["adapters"] = [
        {"name": "sql-demo", "base": BASE, "source": adapter_source(cluster, "sql-demo"),
         "tenants": ["demo"]},
        {"name": "chat-any", "base": BASE, "source": adapter_source(cluster, "chat-any")},
    ]  # fmt: skip
    return catalog


def client(cluster, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=cluster.info["routers"][0],
        api_key=key or cluster.info["api_key"],
        max_retries=0,
        timeout=60,
    )


def held_on(cluster) -> dict[str, list[str]]:
    """Each declared adapter's replicas whose engines report holding it (the operator API)."""
    return {a["name"]: a.get("held_on") or [] for a in ck.api(cluster, "/api/adapters")}


@pytest.fixture(scope="module")
def applied(cluster):
    ck.apply_catalog(cluster, lora_catalog(cluster))
    ck.wait(lambda: ck.ready_endpoints(cluster, BASE), 90, f"a ready replica of {BASE}")
    ck.wait(
        lambda: BASE in {m.id for m in client(cluster).models.list().data},
        30,
        f"the routers to list {BASE}",
    )
    return cluster


def test_a_request_for_an_unheld_adapter_waits_while_it_is_placed_and_loaded(applied):
    cluster = applied
    # Nothing holds it yet: no engine was asked to load anything before demand.
    assert held_on(cluster) == {"sql-demo": [], "chat-any": []}
    resp = client(cluster).chat.completions.create(
        model="sql-demo", messages=[{"role": "user", "content": "select"}], max_tokens=4
    )
    assert resp.model == "sql-demo"  # the engine served it under the adapter
    assert resp.choices[0].message.content
    assert held_on(cluster)["sql-demo"]


def test_the_other_adapter_streams_once_loaded_beside_the_first(applied):
    chunks = list(
        client(applied).chat.completions.create(
            model="chat-any",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            stream=True,
        )
    )
    assert {ch.model for ch in chunks} == {"chat-any"}
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # Two slots: both adapters held on the one replica, neither evicted for the other.
    held = held_on(applied)
    assert held["chat-any"] and held["sql-demo"] == held["chat-any"], held


def test_models_list_adapters_with_their_parent_for_their_tenants_only(applied):
    demo = {m.id: m for m in client(applied).models.list().data}
    assert {"sql-demo", "chat-any"} <= set(demo)
    assert all(getattr(demo[a], "parent", None) == BASE for a in ("sql-demo", "chat-any"))
    batch = client(applied, applied.info["api_keys"]["bronze"])
    assert "sql-demo" not in {m.id for m in batch.models.list().data}
    with pytest.raises(openai.NotFoundError):
        batch.chat.completions.create(
            model="sql-demo", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )


def test_an_undeclared_adapter_is_an_unknown_model(applied):
    with pytest.raises(openai.NotFoundError) as err:
        client(applied).chat.completions.create(
            model="never-declared", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert err.value.body["code"] == "model_not_found"


def test_explain_shows_where_the_leader_placed_the_adapters(applied):
    res = ck.cli(applied, "explain", BASE)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "adapters (2 slot(s) per replica):" in out
    for name in ("sql-demo", "chat-any"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name))
        assert "placed on -" not in line and "held on -" not in line, out
    assert "last placement seq" in out
