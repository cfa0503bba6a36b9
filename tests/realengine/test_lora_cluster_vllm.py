"""LoRA adapters through the whole cluster on a real vLLM CPU engine.

The local cluster (`llmgw dev --engine vllm`: NATS, Postgres, a reconciler, an agent, a
router) serves the tiny Llama on one replica with two adapter slots, and its catalog
declares two tiny random adapters (llmgw.dev.tinylora) that no engine holds at first.
An OpenAI SDK client asks the router for model=<adapter>: the request waits in admission
while the leader places the adapter from the router's demand and the agent loads it into
vLLM at run time, then it is answered. Checked on the way: chat and completions,
streamed and not, under vLLM's naming and SGLang's <base>:<adapter>; each adapter's
greedy answer differs from the base model's; the API and `llmgw explain` show the
adapter held; each adapter was loaded once and never moved; /v1/models lists both
adapters with their parent; an undeclared adapter is a 404; vLLM's KV events of an
adapter request reach the bus rooted at the adapter, where routers hash its prompts
from. One engine keeps the wall time small. Printed: the first adapter request's time to
first token (placement and load included, with when each happened), then the steady
TTFT of an adapter against the base model's.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time

import httpx
import msgspec
import nats as nats_client
import openai
import pytest
import yaml

from llmgw import contracts as c
from llmgw import kvblocks, subjects
from llmgw.dev import catalog as devcatalog
from llmgw.dev import tinylora
from llmgw.router.kvcache.tokens import HfTokens
from tests.e2e import clusterkit as ck
from tests.realengine import kit

pytestmark = pytest.mark.real_engine

BASE = devcatalog.VLLM_MODEL
ADAPTERS = ("tenant-sql", "tenant-chat")
PROMPT = "hello world model engine token"
ENV = {"LLMGW_HEARTBEAT_INTERVAL_SECONDS": "0.5", "LLMGW_ACTOR__COMMAND_RETRY_INITIAL": "0.5"}


def catalog(model_path, adapter_dir) -> dict:
    profile = {**devcatalog.vllm_profile(str(model_path)), "max_loras": 2, "max_lora_rank": 8}
    return {
        "models": [{"name": BASE, "replicas": 1, "profile": profile}],
        "adapters": [
            {
                "name": name,
                "base": BASE,
                "source": str(tinylora.make(model_path, adapter_dir, seed)),
            }
            for seed, name in enumerate(ADAPTERS, start=1)
        ],
    }


@pytest.fixture(scope="module")
def cluster(vllm_python, tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("catalog") / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog(tiny_model, tmp_path_factory.mktemp("adapters"))))
    c = ck.start_cluster(
        tmp_path_factory.mktemp("cluster"),
        env=ENV,
        reconcilers=1,
        agents=1,
        routers=1,
        engine="vllm",
        vllm_python=vllm_python,
        model_path=str(tiny_model),
        catalog=path,
        ready_timeout=600.0,
        engine_port_base=random.randrange(20200, 23000, 200),
    )
    try:
        ck.wait(lambda: len(ck.ready_endpoints(c, BASE)) == 1, 600, "the base model's engine")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    # max_retries=0: a 503 while the adapter loads must show, not be retried away.
    return openai.OpenAI(
        base_url=cluster.info["routers"][0], api_key="unused", max_retries=0, timeout=120
    )


def adapter_view(cluster, name: str) -> dict:
    return next(a for a in ck.api(cluster, "/api/adapters") if a["name"] == name)


class RouterSeesAdapter(threading.Thread):
    """When (wall clock) a router's view first has an endpoint holding `adapter`."""

    def __init__(self, admin: str, adapter: str):
        super().__init__(daemon=True)
        self.admin, self.adapter, self.at = admin, adapter, float("nan")

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                body = httpx.get(f"{self.admin}/debug/endpoints", timeout=2).json()
            except httpx.HTTPError:  # a busy router's slow answer: ask again
                continue
            if any(self.adapter in ep.get("adapters", []) for ep in body["endpoints"]):
                self.at = time.time()
                return
            time.sleep(0.05)


def first_token_seconds(client: openai.OpenAI, model: str, prompt: str = PROMPT) -> float:
    """Seconds from sending a streamed completion to its first token's chunk."""
    t0 = time.monotonic()
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True, extra_body=kit.NO_EOS
    )
    took = None
    for chunk in stream:
        if took is None and chunk.choices:
            took = time.monotonic() - t0
    assert took is not None, f"{model}: a stream without a token"
    return took


def greedy_text(client: openai.OpenAI, model: str) -> str:
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=kit.NO_EOS
    )
    assert resp.model == model
    return resp.choices[0].text


def test_an_adapter_request_waits_for_its_load_then_is_answered(cluster, client, capsys):
    name = ADAPTERS[0]
    assert adapter_view(cluster, name)["held_on"] == []  # declared, loaded nowhere yet
    seen = RouterSeesAdapter(cluster.info["router_admin"][0], name)
    seen.start()
    sent_at = time.time()  # wall clock, as events are stamped
    t0 = time.monotonic()
    stream = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=kit.NO_EOS,
    )
    first = None
    usage = None
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.monotonic() - t0
        assert chunk.model == name
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 4
    seen.join(10)
    view = adapter_view(cluster, name)
    assert view["held_on"] == view["placed_on"] and len(view["held_on"]) == 1, view
    # Placed because the router's demand summary said its request was waiting for it.
    decisions = ck.events(cluster, "control.adapters.placed")
    placed = next((e for e in decisions if name in e["waiting"]), None)
    assert placed is not None, decisions
    statuses = ck.events(cluster, "shard.status")
    held = next(
        (s for s in statuses if name in (s.get("adapters") or []) and s["ts"] >= placed["ts"]),
        None,
    )
    assert held is not None, statuses  # the agent reported the load
    kit.report(
        capsys,
        f"first {name} request -> first token: {first:.2f}s (placed after "
        f"{placed['ts'] - sent_at:.2f}s, held per the agent after {held['ts'] - sent_at:.2f}s, "
        f"held in the router's view after {seen.at - sent_at:.2f}s)",
    )

    # Taken in turns, so the shared machine's load weighs on both alike.
    steady: dict[str, list[float]] = {BASE: [], name: []}
    for model in (BASE, name):
        first_token_seconds(client, model)  # warm: the adapter's first use activates it
    for _ in range(10):
        for model in (BASE, name):
            steady[model].append(first_token_seconds(client, model))
    ttft = {model: statistics.median(took) for model, took in steady.items()}
    kit.report(
        capsys,
        f"steady TTFT (median of 10, in turns): {BASE} {ttft[BASE] * 1000:.0f} ms, "
        f"{name} {ttft[name] * 1000:.0f} ms ({ttft[name] / ttft[BASE]:.2f}x)",
    )


def test_each_adapter_answers_as_itself_in_every_api_shape(cluster, client):
    answers = {model: greedy_text(client, model) for model in (BASE, *ADAPTERS)}
    assert len(set(answers.values())) == 3, answers  # the adapters' weights act
    for name in ADAPTERS:  # chat, not streamed
        resp = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body=kit.NO_EOS,
        )
        assert resp.model == name and resp.usage.completion_tokens == 4
        # completions, streamed: the same greedy text as unstreamed
        stream = client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body=kit.NO_EOS,
        )
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == answers[name]
        # SGLang's <base>:<adapter> naming reaches vLLM as the adapter's own name
        resp = client.completions.create(
            model=f"{BASE}:{name}",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body=kit.NO_EOS,
        )
        assert resp.choices[0].text == answers[name]


def test_the_operator_sees_both_adapters_held(cluster):
    for name in ADAPTERS:
        view = adapter_view(cluster, name)
        assert view["held_on"] and view["errors"] == {}, view
    [replica] = adapter_view(cluster, ADAPTERS[0])["held_on"]
    res = ck.cli(cluster, "explain", ADAPTERS[1], "--api", cluster.info["api_url"])
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if " placed on " in ln and ADAPTERS[1] in ln)
    assert f"held on {replica}" in line, res.stdout


def test_each_adapter_was_loaded_once_and_never_moved(cluster):
    changes = [
        (ch["adapter"], ch["action"])
        for e in ck.events(cluster, "control.adapters.placed")
        for ch in e["changes"]
    ]
    assert sorted(changes) == sorted((name, "load") for name in ADAPTERS), changes


def test_models_lists_the_adapters_with_their_parent(client):
    listed = {m.id: m.model_dump() for m in client.models.list()}
    for name in ADAPTERS:
        assert listed[name]["parent"] == BASE, listed
    assert listed[BASE].get("parent") is None


def test_an_undeclared_adapter_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="tenant-nobody", prompt=PROMPT, max_tokens=2)
    assert err.value.code == "model_not_found"


def test_an_adapter_requests_kv_blocks_are_rooted_at_the_adapter(cluster, client, tiny_model):
    """vLLM's events name the adapter; the relay roots the stored blocks' hashes at it,
    where the router hashes the adapter's prompts from (kvblocks.root_for)."""
    name = ADAPTERS[1]
    # Long enough for full blocks, new so the engine has cached none of it.
    prompt = " ".join(f"word{i}" for i in range(40))
    [endpoint] = ck.ready_endpoints(cluster, BASE)
    subject = subjects.kv_events(endpoint["node"], endpoint["shard_id"])
    block_size, stored = asyncio.run(
        _stored_during(cluster.info["nats_url"], subject, lambda: greedy(client, name, prompt))
    )
    assert block_size, "no KV event of the adapter's request reached the bus"
    tokens = HfTokens(str(tiny_model)).tokens(msgspec.json.encode(prompt))
    full = len(tokens) // block_size
    expected = kvblocks.prompt_hashes(tokens, block_size, full, root=kvblocks.root_for(name))
    assert expected and set(expected) <= stored, (block_size, expected[:3], sorted(stored)[:3])
    assert not set(kvblocks.prompt_hashes(tokens, block_size, full)) & stored


def greedy(client: openai.OpenAI, model: str, prompt: str) -> None:
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)


async def _stored_during(nats_url: str, subject: str, request) -> tuple[int, set[int]]:
    """The block size and the hashes an engine's relayed KV events stored while `request`
    ran (and up to 10 s after, until some arrived)."""
    events: list[c.KvEvents] = []

    async def on_msg(msg) -> None:
        events.append(c.decode(msg.data, c.KvEvents))

    nc = await nats_client.connect(nats_url)
    try:
        await nc.subscribe(subject, cb=on_msg)
        await nc.flush()
        await asyncio.to_thread(request)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.block_size for e in events):
            await asyncio.sleep(0.1)
    finally:
        await nc.close()
    stored = {h for e in events for op in e.ops if op.op is c.KvOp.STORED for h in op.hashes}
    return max((e.block_size for e in events), default=0), stored
