"""Prefill/decode disaggregation on real vLLM CPU engines, launched by the agent.

An in-process agent on real NATS launches a prefill vLLM (kv_producer) and a decode
vLLM (kv_consumer) on the tiny model with vLLM's ExampleConnector and a shared folder
the agent makes. The test sends the protocol's two legs as a router does: the prompt to
P with max_tokens 1 and kv_transfer_params asking for remote decode, then the request
to D. D's /metrics prove it loaded the prompt's full blocks from the folder instead of
computing them (vllm:external_prefix_cache_hits_total and
vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}), and its greedy text
equals what P computes alone for the same request (the aggregated answer). A prompt
sent to D with no prefill loads nothing. The simulator, sent the same two legs, answers
with vLLM's keys and counts on D's counters under vLLM's names and sources.

Then the failures, each measured and printed (docs/disaggregation.md, "Real engines on
CPU", records them): a StartShard whose folder cannot be written, the prefill engine
killed mid-request and relaunched by a new StartShard (its connector flags kept), a
prompt folder missing a layer (a prefill engine killed mid-write) sent to the decode
engine, the decode engine killed mid-answer, and the shared folder made unwritable under the
running prefill engine.

The second test runs a whole cluster (`llmgw dev --engine vllm`'s processes) with the
model declared disaggregated: a request sent to the router is served by the decode
engine, which loaded the prompt's blocks from the prefill engine; then the same failures
through the router, and the agents refusing the replacements of engines a broken folder
took down.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.agent import procs
from llmgw.agent.state import StateDir
from llmgw.dev import catalog as devcatalog
from llmgw.dev.routerkit import metric_sum
from llmgw.dev.simkit import sim_in_process
from llmgw.router.relay.disagg import REMOTE_DECODE
from tests.e2e import clusterkit as ck
from tests.integration.test_agent_lifecycle import Watch, agent_config, running_agent, status
from tests.realengine import kit, parity

pytestmark = pytest.mark.real_engine

S = c.ShardState
NODE = "n-pd-vllm"
SLOW = 600.0  # two vLLM starts at once on two shared cores
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


@pytest.fixture
async def watch(nats) -> AsyncIterator[Watch]:
    await bus.provision(nats.jetstream())
    yield await Watch().start(nats, "llmgw.evt.agent.>", subjects.LOAD_ALL)


def prompt(tag: str) -> str:
    """About 350 tokens of the tiny model (its blocks are 128 tokens on CPU); the tag
    first, so no two prompts share a block."""
    body = " ".join(
        f"the prefill engine computes prompt {i} and hands its blocks to the decode engine"
        for i in range(8)
    )
    return f"{tag}: {body}"


async def complete(url: str, text: str, max_tokens: int, **extra) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as http:
        return await http.post(
            f"{url}/v1/completions",
            json={
                "model": kit.MODEL,
                "prompt": text,
                "max_tokens": max_tokens,
                "temperature": 0,
                **kit.NO_EOS,
                **extra,
            },
        )


async def prefill_leg(url: str, text: str) -> httpx.Response:
    return await complete(url, text, 1, kv_transfer_params=REMOTE_DECODE)


async def sources(url: str) -> dict[str, float]:
    """D's prompt tokens by where they came from, and its external hits ("hits")."""
    by = await asyncio.to_thread(kit.samples_by, url, BY_SOURCE, "source")
    return {**by, "hits": await asyncio.to_thread(kit.total, url, EXTERNAL_HITS)}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def pd_start(model: Path, shared: Path, shard_id: str, role: str, gpu: int, key: str = ""):
    return c.StartShard(
        key=key or f"start-{shard_id}",
        node=NODE,
        shard_id=shard_id,
        model=kit.MODEL,
        replica_id=f"r-{shard_id}",
        profile=c.ServingProfile(**devcatalog.vllm_profile(str(model))),
        gpus=[f"GPU-fake-{NODE}-{gpu}"],
        role=role,
        connector=c.ConnectorSpec(shared_path=str(shared)),
    )


def kv_transfer_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


async def test_a_decode_vllm_loads_the_prompt_a_prefill_vllm_computed(
    nats, nats_url, watch, vllm_python, tiny_model, tmp_path, monkeypatch, capsys
):
    for name, value in devcatalog.VLLM_CPU_ENV.items():
        monkeypatch.setenv(name, value)
    shared = tmp_path / "kv"  # missing: the agent makes it
    js = nats.jetstream()
    cfg = agent_config(
        NODE,
        nats_url,
        tmp_path / "state",
        fake_gpus="3x80GiB",
        vllm_command=devcatalog.vllm_command(vllm_python),
        ready_timeout_seconds=SLOW,
    )
    async with running_agent(cfg) as agent:
        t0 = time.monotonic()
        await bus.publish(js, pd_start(tiny_model, shared, "p", "prefill", 0))
        await bus.publish(js, pd_start(tiny_model, shared, "d", "decode", 1))
        p = (await watch.wait_for(status("p", S.READY), timeout=SLOW)).url
        d = (await watch.wait_for(status("d", S.READY), timeout=SLOW)).url
        kit.report(
            capsys, f"prefill and decode vLLM ready {time.monotonic() - t0:.1f}s after start"
        )
        assert shared.is_dir()
        roles = {s: kv_transfer_config(agent.shards[s].rec.argv)["kv_role"] for s in "pd"}
        assert roles == {"p": "kv_producer", "d": "kv_consumer"}

        await _two_legs(p, d, shared, capsys)
        await _sim_answers_as_vllm(p, d, capsys)
        await _unwritable_at_start(js, watch, tiny_model, tmp_path)
        p = await _prefill_killed(js, watch, agent, tiny_model, shared, p, d, capsys)
        d = await _partial_folder(js, watch, tiny_model, shared, p, d, capsys)
        await _decode_killed(watch, agent, p, d, capsys)
        await _folder_unwritable_while_serving(watch, shared, p, capsys)


async def _two_legs(p: str, d: str, shared: Path, capsys) -> None:
    block = int(
        next(
            iter(await asyncio.to_thread(kit.samples_by, d, "vllm:cache_config_info", "block_size"))
        )
    )
    text = prompt("pd")
    before = await sources(d)
    t0 = time.monotonic()
    first = await prefill_leg(p, text)
    prefill_s = time.monotonic() - t0
    assert first.status_code == 200, first.text
    n = first.json()["usage"]["prompt_tokens"]
    # ExampleConnector finds the KV by prompt content: it returns no parameters.
    kit.report(
        capsys,
        f"prefill leg: {prefill_s * 1000:.0f} ms, kv_transfer_params "
        f"{first.json().get('kv_transfer_params')!r}, {len(os.listdir(shared))} folder(s)",
    )
    t0 = time.monotonic()
    second = await complete(d, text, 16)
    decode_s = time.monotonic() - t0
    assert second.status_code == 200, second.text
    got = delta(await sources(d), before)
    # Only full blocks of the prompt less its last token are saved and loaded.
    full = (n - 2) // block * block
    kit.report(
        capsys, f"{n}-token prompt, block {block}: D's {got} (decode leg {decode_s * 1000:.0f} ms)"
    )
    assert full > 0
    assert got == {"hits": full, "external_kv_transfer": full, "local_compute": n - full}
    alone = await complete(p, text, 16)
    assert second.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]

    before = await sources(d)
    control = await complete(d, prompt("no prefill"), 16)
    assert control.status_code == 200
    got = delta(await sources(d), before)
    assert "hits" not in got and "external_kv_transfer" not in got, got


# The differences the simulator means to have on these two legs, with why.
KNOWN = {
    "prefill:$.kv_transfer_params": "the sim answers as NixlConnector does (where the "
    "prompt's blocks are); ExampleConnector answers null and finds them by content",
    "*usage.prompt_tokens_details": "the sim reports cached prompt tokens, as vLLM does with "
    "--enable-prompt-tokens-details",
}


def _counter_shape(page: str) -> dict[str, list[str]]:
    """D's P/D counters on a /metrics page: each one's label names, and the sources."""
    out: dict[str, list[str]] = {}
    for fam in text_string_to_metric_families(page):
        for smp in fam.samples:
            if smp.name in (EXTERNAL_HITS, EXTERNAL_QUERIES, BY_SOURCE):
                names = sorted(set(smp.labels) - {"model_name", "engine"})
                out[smp.name] = names
                if smp.name == BY_SOURCE:
                    out.setdefault("sources", []).append(smp.labels["source"])
    out["sources"] = sorted(out.get("sources", []))
    return out


async def _sim_answers_as_vllm(p: str, d: str, capsys) -> None:
    """The same two legs to the simulator (its prefill answer passed on, as a router
    does): the answers and the decode engine's counters have vLLM's shape."""
    text = prompt("shapes")
    legs = {}
    pages = {}
    async with sim_in_process(served_model_name=[kit.MODEL]) as sim:
        for name, (pre, dec) in {"vllm": (p, d), "sim": (sim.url, sim.url)}.items():
            first = (await prefill_leg(pre, text)).json()
            params = first.get("kv_transfer_params")
            extra = {"kv_transfer_params": params} if params else {}
            second = (await complete(dec, text, 16, **extra)).json()
            legs[name] = (first, second)
            async with httpx.AsyncClient(timeout=30) as http:
                pages[name] = (await http.get(f"{dec}/metrics")).text
    diffs = []
    for i, leg in enumerate(("prefill", "decode")):
        sim_shape, vllm_shape = (parity.shape(legs[n][i]) for n in ("sim", "vllm"))
        diffs += parity.diff_shapes(leg, sim_shape, vllm_shape)
    nulls, expected, unexpected = parity.classify(diffs, KNOWN)
    kit.report(
        capsys,
        f"sim vs vLLM on the two legs: {len(nulls)} null-only fields, known "
        f"{[str(d) for d, _ in expected]}",
    )
    assert unexpected == [], [str(d) for d in unexpected]
    assert "kv_transfer_params" in legs["vllm"][0] and legs["sim"][0]["kv_transfer_params"]
    shapes = {name: _counter_shape(page) for name, page in pages.items()}
    kit.report(capsys, f"D's P/D counters: vLLM {shapes['vllm']}, sim {shapes['sim']}")
    assert shapes["sim"] == shapes["vllm"], shapes


async def _unwritable_at_start(js, watch: Watch, model: Path, tmp_path: Path) -> None:
    """A shard whose folder cannot be made fails before launch, with the reason."""
    (tmp_path / "file").write_text("")
    bad = pd_start(model, tmp_path / "file" / "kv", "u", "prefill", 2)
    await bus.publish(js, bad)
    failed = await watch.wait_for(status("u", S.FAILED))
    assert "shared folder" in failed.reason and "Not a directory" in failed.reason
    assert watch.states("u") == [S.FAILED]  # nothing was launched


async def _prefill_killed(js, watch, agent, model, shared, p, d, capsys) -> str:
    """P dies during a prefill leg: the leg fails at the client (reported, not asserted: a
    leg that beat the 50 ms to the kill answers 200); D, sent the request next, computes
    what the folder does not hold. Then a new StartShard relaunches P with
    its connector; its new URL is returned."""
    text = prompt("killed")
    folders = set(os.listdir(shared))
    leg = asyncio.create_task(prefill_leg(p, text))
    await asyncio.sleep(0.05)
    seen = len(watch.messages)
    procs.signal_group(agent.shards["p"].rec.pid, signal.SIGKILL)
    try:
        answer = await leg
        outcome = f"HTTP {answer.status_code}"
    except httpx.HTTPError as exc:
        outcome = f"{type(exc).__name__}"
    failed = await watch.wait_for(status("p", S.FAILED), after=seen, timeout=60)
    # A P killed mid-write leaves a folder missing a layer, or holding a torn one, that D
    # would take as a hit and die loading (_partial_folder below measures that): whatever
    # the killed leg left is removed here, so D computes the prompt itself.
    left = sorted(set(os.listdir(shared)) - folders)
    for name in left:
        shutil.rmtree(shared / name)
    before = await sources(d)
    after_kill = await complete(d, text, 16)
    assert after_kill.status_code == 200, after_kill.text
    kit.report(
        capsys,
        f"P killed mid-leg: client saw {outcome}; agent: {failed.reason!r}; "
        f"{len(left)} folder(s) the killed leg left removed; "
        f"D then served it with {delta(await sources(d), before)}",
    )

    seen = len(watch.messages)
    t0 = time.monotonic()
    await bus.publish(js, pd_start(model, shared, "p", "prefill", 0, key="start-p-again"))
    ready = await watch.wait_for(status("p", S.READY), after=seen, timeout=SLOW)
    kit.report(capsys, f"P relaunched by a new StartShard, ready in {time.monotonic() - t0:.1f}s")
    assert kv_transfer_config(agent.shards["p"].rec.argv)["kv_role"] == "kv_producer"
    return ready.url  # the port may be another


async def _partial_folder(js, watch, model, shared, p, d, capsys) -> str:
    """What the decode engine does with the folder of a prefill engine killed between two
    layers' writes (ExampleConnector writes one file per layer as the forward pass goes):
    made here by removing the last layer's file after a whole prefill leg. D dies of it;
    a new StartShard relaunches it, and its URL is returned."""
    text = prompt("partial")
    before = set(os.listdir(shared))
    assert (await prefill_leg(p, text)).status_code == 200
    (folder,) = set(os.listdir(shared)) - before
    layers = sorted(os.listdir(shared / folder))
    os.remove(shared / folder / layers[-1])
    seen = len(watch.messages)
    try:
        got = await complete(d, text, 16)
        outcome = f"HTTP {got.status_code} {got.text[:200]}"
    except httpx.HTTPError as exc:
        outcome = type(exc).__name__
    # D finds the prompt's folder, its worker fails to load the missing layer, its engine
    # core dies and the server exits (status 0): the agent reports the shard failed.
    failed = await watch.wait_for(status("d", S.FAILED), after=seen, timeout=60)
    kit.report(
        capsys, f"a folder missing {layers[-1]}: D answered {outcome}; agent: {failed.reason!r}"
    )
    assert outcome.startswith("HTTP 500") and "EngineCore" in outcome, outcome
    seen = len(watch.messages)
    await bus.publish(js, pd_start(model, shared, "d", "decode", 1, key="start-d-again"))
    t0 = time.monotonic()
    ready = await watch.wait_for(status("d", S.READY), after=seen, timeout=SLOW)
    kit.report(capsys, f"D relaunched by a new StartShard, ready in {time.monotonic() - t0:.1f}s")
    return ready.url


async def _folder_unwritable_while_serving(watch, shared, p, capsys) -> None:
    """The folder becomes a file under a running prefill engine: its next prefill leg
    cannot save the prompt's KV. (ExampleConnector saves every prompt it computes whatever
    its kv_role, so a decode engine computing a prompt fares the same.)"""
    moved = shared.with_name("kv.moved")
    os.rename(shared, moved)
    shared.write_text("")
    seen = len(watch.messages)
    t0 = time.monotonic()
    try:
        leg = await prefill_leg(p, prompt("unwritable"))
        outcome = f"HTTP {leg.status_code} {leg.text[:300]}"
    except httpx.HTTPError as exc:
        outcome = type(exc).__name__
    took = time.monotonic() - t0
    # vLLM's worker raises in the forward pass (NotADirectoryError), its engine core dies
    # and the server exits (with status 0): the agent reports the shard failed.
    failed = await watch.wait_for(status("p", S.FAILED), after=seen, timeout=60)
    kit.report(
        capsys,
        f"folder unwritable under P: its prefill leg {outcome} in {took:.1f}s; "
        f"agent: {failed.reason!r}",
    )
    shared.unlink()
    os.rename(moved, shared)
    assert outcome.startswith("HTTP 500") and "EngineCore" in outcome, outcome


async def _decode_killed(watch, agent, p, d, capsys) -> None:
    """D dies mid-answer: the client's stream ends without a finish_reason; P keeps
    serving. Streamed, and killed at the first token: on a fast machine the tiny model
    writes all 600 tokens in under a second, so a kill on a timer can come too late."""
    body = {"model": kit.MODEL, "prompt": prompt("decode killed"), "max_tokens": 600,
            "temperature": 0, "stream": True, **kit.NO_EOS}  # fmt: skip
    events: list[str] = []
    seen = len(watch.messages)
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", f"{d}/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if not events:
                        assert procs.signal_group(agent.shards["d"].rec.pid, signal.SIGKILL)
                    events.append(line)
        outcome = f"HTTP {resp.status_code}, {len(events)} events"
    except httpx.HTTPError as exc:
        outcome = f"{type(exc).__name__} after {len(events)} events"
    failed = await watch.wait_for(status("d", S.FAILED), after=seen, timeout=60)
    kit.report(capsys, f"D killed mid-answer: client saw {outcome}; agent: {failed.reason!r}")
    assert events, outcome
    finished = [e for e in events if '"finish_reason":"length"' in e.replace(" ", "")]
    done = [e for e in events if e.replace(" ", "") == "data:[DONE]"]
    assert not finished and not done, (outcome, events[-2:])
    still = await prefill_leg(p, prompt("after decode killed"))
    assert still.status_code == 200


# ---------------------------------------------------------------- the whole cluster

PD_MODEL = devcatalog.VLLM_MODEL
# Short liveness and retry timings, as in test_cluster_vllm.
CLUSTER_ENV = {
    "LLMGW_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "LLMGW_ACTOR__UNREACHABLE_AFTER": "5",
    "LLMGW_ACTOR__LOST_AFTER": "15",
    "LLMGW_ACTOR__COMMAND_RETRY_INITIAL": "0.5",
    "LLMGW_ACTOR__REPLACE_BACKOFF_INITIAL": "0.5",
}


def pd_catalog(model: Path, shared: Path) -> dict:
    return {
        "models": [
            {
                "name": PD_MODEL,
                "profile": devcatalog.vllm_profile(str(model)),
                "disaggregation": {
                    "prefill": {"replicas": 1},
                    "decode": {"replicas": 1},
                    "connector": {"kind": "ExampleConnector", "shared_path": str(shared)},
                },
            }
        ]
    }


def pools(cluster) -> dict[str, dict]:
    """The ready endpoint of each role, as the projection has it."""
    return {e.get("role", ""): e for e in ck.ready_endpoints(cluster, PD_MODEL)}


def engine_pid(cluster, url: str) -> int:
    for name in ("agent-1", "agent-2"):
        for rec in StateDir(Path(cluster.info["data_dir"]) / name).load_all():
            if rec.url.rstrip("/") == url.rstrip("/") and not rec.terminal:
                return rec.pid
    raise AssertionError(f"no live shard record for {url}")


def router_counter(cluster, name: str, **labels: str) -> float:
    text = httpx.get(cluster.info["router_admin"][0] + "/metrics", timeout=10).text
    return metric_sum(text, name, **labels)


def wait_pools(cluster, gone: frozenset[str] = frozenset()) -> dict[str, dict]:
    """Until one endpoint of each pool, of no replica in `gone`, is ready and the router
    has both."""

    def ready():
        p = pools(cluster)
        fresh = all(e["replica_id"] not in gone for e in p.values())
        return p.keys() >= {"prefill", "decode"} and fresh and p

    got = ck.wait(ready, SLOW, "a ready prefill and decode endpoint")
    urls = {got["prefill"]["url"], got["decode"]["url"]}
    ck.wait(
        lambda: ck.router_endpoint_urls(cluster.info["router_admin"][0], PD_MODEL) >= urls,
        60,
        "the router to see both pools",
    )
    return got


def routed(cluster, text: str, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(
        f"{cluster.info['routers'][0]}/completions",
        json={
            "model": PD_MODEL,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0,
            **kit.NO_EOS,
        },
        timeout=120,
    )


@pytest.fixture
def pd_cluster(vllm_python, tiny_model, tmp_path):
    first = tmp_path / "catalog.yaml"
    first.write_text(yaml.safe_dump({"models": []}))
    cluster = ck.start_cluster(
        tmp_path / "cluster", env=CLUSTER_ENV, reconcilers=1, routers=1, engine="vllm",
        vllm_python=vllm_python, model_path=str(tiny_model), catalog=first,
        ready_timeout=60.0, engine_port_base=random.randrange(20200, 23000, 200),
    )  # fmt: skip
    try:
        yield cluster
    finally:
        cluster.stop()


def test_through_the_router_the_decode_engine_skips_the_prefill(
    pd_cluster, tiny_model, tmp_path, capsys
):
    shared = tmp_path / "kv"
    t0 = time.monotonic()
    ck.apply_catalog(pd_cluster, pd_catalog(tiny_model, shared))
    got = wait_pools(pd_cluster)
    kit.report(capsys, f"llmgw apply -> both pools ready, routed: {time.monotonic() - t0:.1f}s")
    d = got["decode"]["url"].rstrip("/")
    block = int(next(iter(kit.samples_by(d, "vllm:cache_config_info", "block_size"))))
    before = kit.total(d, EXTERNAL_HITS)
    legs = router_counter(pd_cluster, "llmgw_router_pd_legs_total", leg="prefill", outcome="ok")
    answer = routed(pd_cluster, prompt("routed"))
    assert answer.status_code == 200, answer.text
    assert answer.headers.get("x-llmgw-endpoint") == got["decode"]["shard_id"]
    n = answer.json()["usage"]["prompt_tokens"]
    hits = kit.total(d, EXTERNAL_HITS) - before
    kit.report(capsys, f"through the router: a {n}-token prompt, {hits:.0f} tokens loaded by D")
    assert hits == (n - 2) // block * block > 0
    after = router_counter(pd_cluster, "llmgw_router_pd_legs_total", leg="prefill", outcome="ok")
    assert after == legs + 1

    _routed_prefill_killed(pd_cluster, got, shared, capsys)
    got = wait_pools(pd_cluster)
    _routed_decode_killed(pd_cluster, got, capsys)
    got = wait_pools(pd_cluster)
    _routed_folder_unwritable(pd_cluster, got, shared, capsys)


def _counters(cluster) -> dict[str, float]:
    out = {}
    for reason in ("prefill_failed", "no_prefill_endpoint", "prefill_refused"):
        out[reason] = router_counter(cluster, "llmgw_router_pd_fallbacks_total", reason=reason)
    return out


def _half_written(shared: Path, before: set[str]) -> list[str]:
    """The prompt folders made since `before` that hold fewer layer files than the
    others: what a prefill engine killed between two layers' writes leaves."""
    layers = max(len(os.listdir(shared / f)) for f in before)
    return [f for f in set(os.listdir(shared)) - before if len(os.listdir(shared / f)) < layers]


def _routed_prefill_killed(cluster, got: dict, shared: Path, capsys) -> None:
    """P killed as a routed request reaches it. The router serves the request whole on
    the decode engine, and so every request until P's replacement is ready; but a P
    killed between two layers' writes leaves a half-written folder, and D, computing the
    prompt, finds it, takes it as a hit and dies loading it: then the client gets a 502."""
    folders = set(os.listdir(shared))
    before = _counters(cluster)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(routed, cluster, prompt("router, P killed"))
        time.sleep(0.1)
        os.killpg(engine_pid(cluster, got["prefill"]["url"]), signal.SIGKILL)
        first = answer.result()
    t0 = time.monotonic()
    gap = routed(cluster, prompt("router, no P"))
    half = _half_written(shared, folders)
    kit.report(
        capsys,
        f"router, P killed mid-request: HTTP {first.status_code}; the next request HTTP "
        f"{gap.status_code}; fallbacks {delta(_counters(cluster), before)}; "
        f"{len(half)} half-written folder(s)",
    )
    gone = {got["prefill"]["replica_id"]}
    # Sent after the kill, the second request cannot have a prefill leg answered, whatever
    # the kill's timing against the first: at least one request was served whole on D.
    fell_back = delta(_counters(cluster), before)
    assert sum(fell_back.values()) >= 1, fell_back
    if half:
        assert first.status_code == 502 and "upstream_500" in first.text, first.text
        # D died of the folder: refused by the dead endpoint, or none left to try
        assert gap.status_code in (502, 503), gap.text
        ck.wait(lambda: _failed(cluster, {got["decode"]["shard_id"]}), 60, "D's failure")
        gone.add(got["decode"]["replica_id"])
    else:
        assert first.status_code == 200 and gap.status_code == 200, (first.text, gap.text)
    wait_pools(cluster, gone=frozenset(gone))
    kit.report(capsys, f"a new prefill replica routed {time.monotonic() - t0:.1f}s after the kill")


def _routed_decode_killed(cluster, got: dict, capsys) -> None:
    """D killed mid-stream: what the client's stream ends with, and a request while no
    decode engine is ready."""
    body = {"model": PD_MODEL, "prompt": prompt("router, D killed"), "max_tokens": 600,
            "stream": True, **kit.NO_EOS}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{cluster.info['routers'][0]}/completions", json=body,
                      timeout=120) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                if len(events) == 3:
                    os.killpg(engine_pid(cluster, got["decode"]["url"]), signal.SIGKILL)
    t0 = time.monotonic()
    gap = routed(cluster, prompt("router, no D"))
    kit.report(
        capsys,
        f"router, D killed mid-stream: {len(events)} events, the last two "
        f"{[e[:200] for e in events[-2:]]}; a request with no decode engine: "
        f"HTTP {gap.status_code} {gap.text[:200]}",
    )
    # No migration on this model: the router ends the stream with its in-band error.
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]", events[-2:]
    # 502 while the router's view still lists the dead engine (its connection refused),
    # 503 once the projection has dropped it: a prefill engine never answers a client.
    assert gap.status_code in (502, 503), gap.text
    wait_pools(cluster, gone=frozenset({got["decode"]["replica_id"]}))
    kit.report(capsys, f"a new decode replica routed {time.monotonic() - t0:.1f}s after the kill")


def _routed_folder_unwritable(cluster, got: dict, shared: Path, capsys) -> None:
    """The folder becomes a file: a routed request, and what the agents say of the
    engines started to replace those it took down."""
    moved = shared.with_name("kv.moved")
    os.rename(shared, moved)
    shared.write_text("")
    try:
        before = _counters(cluster)
        answer = routed(cluster, prompt("router, folder unwritable"))
        kit.report(
            capsys,
            f"router, folder unwritable: HTTP {answer.status_code} "
            f"{answer.text[:200]}; fallbacks {delta(_counters(cluster), before)}",
        )
        assert answer.status_code == 502, answer.text
        # P's prefill leg failed (its engine died of it), so the router served the
        # request whole on D, which computed the prompt, could not save it either, and died.
        dead = {got[r]["shard_id"] for r in ("prefill", "decode")}
        gone = ck.wait(
            lambda: (r := _failed(cluster, dead)).keys() == dead and r, 60, "both engines' end"
        )
        kit.report(capsys, f"both engines went: {gone}")
        assert set(gone.values()) == {"the engine exited with code 0"}, gone
        refused = ck.wait(lambda: next((s for s in ck.events(cluster, "shard.status", PD_MODEL)
                                        if "not writable" in s.get("reason", "")), None),
                          120, "a replacement refused for its folder")  # fmt: skip
        kit.report(capsys, f"a replacement's status: {refused['state']} {refused['reason']!r}")
        assert refused["state"] == "failed"
        assert refused["reason"].endswith(
            "is not writable on node " + refused["node"] + ": it is a file, not a folder"
        )
    finally:
        shared.unlink()
        os.rename(moved, shared)


def _failed(cluster, shard_ids: set[str]) -> dict[str, str]:
    """The reason each of these shards failed, of those that did."""
    return {
        s["shard_id"]: s["reason"]
        for s in ck.events(cluster, "shard.status", PD_MODEL)
        if s["shard_id"] in shard_ids and s["state"] == "failed"
    }
