"""LoRA adapters on a real vLLM CPU engine, loaded at run time by the agent.

An in-process agent on real NATS launches vLLM with adapter slots (its launch adapter's
--enable-lora flags and VLLM_ALLOW_RUNTIME_LORA_UPDATING); SetShardAdapters commands
make it load two tiny random adapters (services/dev/tinylora.py) through vLLM's
/v1/load_lora_adapter, the shard status reports them, vLLM answers model=<adapter>
(each adapter differently from the base model), the agent's load samples carry
vllm:lora_requests_info's running adapters, an adapter dropped from the set is
unloaded (vLLM's 404 after), and a bad path's failure carries vLLM's answer. Figures
(engine ready, adapter loaded, first answers) are printed.

On the same engine, the simulator's runtime LoRA API is checked against vLLM's: the same
calls to both, the same status codes, error types and messages, /v1/models entries and
gauge labels.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.dev import catalog as devcatalog
from llmgw.dev import tinylora
from llmgw.dev.simkit import sim_in_process
from tests.integration.test_agent_lifecycle import Watch, agent_config, running_agent, status
from tests.realengine import kit

pytestmark = pytest.mark.real_engine

S = c.ShardState
NODE = "n-lora-vllm"
SLOW = 600.0  # vLLM's start on two shared cores


@pytest.fixture
async def watch(nats) -> AsyncIterator[Watch]:
    await bus.provision(nats.jetstream())
    yield await Watch().start(nats, "llmgw.evt.agent.>", subjects.LOAD_ALL)


def adapters_cmd(key: str, boot_id: str, **sources) -> c.SetShardAdapters:
    return c.SetShardAdapters(
        key=key,
        node=NODE,
        shard_id="v",
        adapters=[c.AdapterSource(name=n, source=str(p)) for n, p in sources.items()],
        boot_id=boot_id,
    )


def holding(adapters: list[str]):
    return lambda m: isinstance(m, c.ShardStatus) and m.shard_id == "v" and m.adapters == adapters


async def greedy(url: str, model: str, max_tokens: int = 8) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(
            f"{url}/v1/completions",
            json={
                "model": model,
                "prompt": "hello world model engine token",
                "max_tokens": max_tokens,
                "temperature": 0,
                **kit.NO_EOS,
            },
        )


def _answer(resp: httpx.Response) -> tuple:
    """What a client of the runtime API reads: the status, and the error's type and
    message (or the success text)."""
    try:
        err = resp.json()["error"]
        return resp.status_code, err["type"], err["message"]
    except (ValueError, KeyError, TypeError):
        return resp.status_code, "text", resp.text


async def lora_api_mismatches(
    vllm_url: str, sim_url: str, path: str
) -> tuple[list[str], dict[str, float]]:
    """The same runtime-LoRA calls to vLLM and to the simulator; what they answered apart,
    and how long each call took vLLM."""
    calls = [
        ("load", "/v1/load_lora_adapter", {"lora_name": "p1", "lora_path": path}),
        ("load again", "/v1/load_lora_adapter", {"lora_name": "p1", "lora_path": path}),
        ("bad path", "/v1/load_lora_adapter", {"lora_name": "pb", "lora_path": "/nonexistent/p"}),
        ("in place", "/v1/load_lora_adapter", {"lora_name": "p1", "lora_path": path, "load_inplace": True}),
        ("unload", "/v1/unload_lora_adapter", {"lora_name": "p1"}),
        ("unload again", "/v1/unload_lora_adapter", {"lora_name": "p1"}),
    ]  # fmt: skip
    out = []
    took: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for what, path_, body in calls:
            if what == "unload":  # while loaded: listed with its parent, served as a model
                listed = []
                for url in (vllm_url, sim_url):
                    models = (await http.get(f"{url}/v1/models")).json()["data"]
                    listed.append(
                        [(m["id"], m["parent"], m["root"]) for m in models if m["id"] == "p1"]
                    )
                if listed[0] != listed[1]:
                    out.append(f"/v1/models: vLLM {listed[0]}, sim {listed[1]}")
            t0 = time.monotonic()
            got = [_answer(await http.post(f"{vllm_url}{path_}", json=body))]
            took[what] = time.monotonic() - t0
            got.append(_answer(await http.post(f"{sim_url}{path_}", json=body)))
            if got[0] != got[1]:
                out.append(f"{what}: vLLM {got[0]}, sim {got[1]}")
        gone = [
            (
                await http.post(f"{u}/v1/completions", json={"model": "p1", "prompt": "x"})
            ).status_code
            for u in (vllm_url, sim_url)
        ]
        if gone != [404, 404]:
            out.append(f"an unloaded adapter as model: vLLM {gone[0]}, sim {gone[1]}")
    return out, took


async def test_the_agent_loads_adapters_into_a_real_vllm_at_run_time(
    nats, nats_url, watch, vllm_python, tiny_model, tmp_path, monkeypatch, capsys
):
    for name, value in devcatalog.VLLM_CPU_ENV.items():
        monkeypatch.setenv(name, value)
    a1 = tinylora.make(tiny_model, tmp_path / "adapters", seed=1)
    a2 = tinylora.make(tiny_model, tmp_path / "adapters", seed=2)
    js = nats.jetstream()
    cfg = agent_config(
        NODE,
        nats_url,
        tmp_path / "state",
        fake_gpus="1x80GiB",
        vllm_command=devcatalog.vllm_command(vllm_python),
        ready_timeout_seconds=SLOW,
        adapter_backoff_seconds=0.05,
    )
    profile = {**devcatalog.vllm_profile(str(tiny_model)), "max_loras": 2, "max_lora_rank": 8}
    async with running_agent(cfg) as agent:
        t0 = time.monotonic()
        start = c.StartShard(
            key="start-v",
            node=NODE,
            shard_id="v",
            model=kit.MODEL,
            replica_id="rv",
            profile=c.ServingProfile(**profile),
            gpus=[f"GPU-fake-{NODE}-0"],
        )
        await bus.publish(js, start)
        ready = await watch.wait_for(status("v", S.READY), timeout=SLOW)
        kit.report(capsys, f"vLLM with --enable-lora ready after {time.monotonic() - t0:.1f}s")
        assert ready.adapters == []
        argv = agent.shards["v"].rec.argv
        assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "2"

        t0 = time.monotonic()
        await bus.publish(js, adapters_cmd("ad-1", agent.boot_id, a1=a1))
        await watch.wait_for(holding(["a1"]), timeout=60)
        loaded_in = time.monotonic() - t0
        await bus.publish(js, adapters_cmd("ad-2", agent.boot_id, a1=a1, a2=a2))
        both = await watch.wait_for(holding(["a1", "a2"]), timeout=60)
        assert both.adapter_errors == {}
        kit.report(capsys, f"SetShardAdapters -> status holding a1: {loaded_in * 1000:.0f} ms")

        answers = {}
        for model in (kit.MODEL, "a1", "a2"):
            took = []
            for _ in range(2):  # the first use of an adapter activates it; the second does not
                t0 = time.monotonic()
                resp = await greedy(ready.url, model)
                took.append(time.monotonic() - t0)
                assert resp.status_code == 200, resp.text
                assert resp.json()["model"] == model
            answers[model] = resp.json()["choices"][0]["text"]
            kit.report(
                capsys,
                f"8-token greedy answer as {model}: first {took[0]:.2f}s, then {took[1]:.2f}s",
            )
        assert len(set(answers.values())) == 3, answers  # each adapter changes the model

        # vllm:lora_requests_info, read by the agent into its load samples.
        seen = len(watch.messages)
        busy = asyncio.create_task(greedy(ready.url, "a2", max_tokens=400))
        sample = await watch.wait_for(
            lambda m: isinstance(m, c.LoadSample) and "a2" in m.running_adapters,
            after=seen,
            timeout=60,
        )
        assert sample.shard_id == "v" and sample.url == ready.url
        assert (await busy).status_code == 200

        # a1 leaves the set, a bad path joins it: a1 unloaded, the failure is vLLM's answer.
        seen = len(watch.messages)
        await bus.publish(js, adapters_cmd("ad-3", agent.boot_id, a2=a2, bad="/nonexistent/lora"))
        failed = await watch.wait_for(
            lambda m: holding(["a2"])(m) and "bad" in m.adapter_errors, after=seen, timeout=60
        )
        kit.report(capsys, f"bad path: {failed.adapter_errors['bad']}")
        assert failed.adapter_errors["bad"].startswith("HTTP 404: Loading lora bad failed")
        gone = await greedy(ready.url, "a1")
        assert gone.status_code == 404 and "does not exist" in gone.json()["error"]["message"]

        wide = tinylora.make(tiny_model, tmp_path / "adapters", seed=3, rank=16)
        async with sim_in_process(
            served_model_name=[kit.MODEL], max_loras=2, max_lora_rank=8
        ) as sim:
            mismatches, took = await lora_api_mismatches(ready.url, sim.url, str(a1))
            sim_page = (await metrics_page(sim.url)).decode()
            # A rank above --max-lora-rank: vLLM passes its loader's error on as a 500.
            too_wide = {"lora_name": "wide", "lora_path": str(wide)}
            async with httpx.AsyncClient(timeout=60) as http:
                answers = [
                    _answer(await http.post(f"{u}/v1/load_lora_adapter", json=too_wide))
                    for u in (ready.url, sim.url)
                ]
        kit.report(capsys, f"rank 16 into --max-lora-rank 8: vLLM {answers[0]}")
        assert answers[0][:2] == answers[1][:2] == (500, "InternalServerError")
        assert answers[1][2] in answers[0][2], answers
        vllm_page = (await metrics_page(ready.url)).decode()
        kit.report(
            capsys,
            "vLLM's runtime API: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in took.items()),
        )
        assert mismatches == [], mismatches
        assert (
            gauge_labels(sim_page)
            == gauge_labels(vllm_page)
            == {
                "max_lora",
                "running_lora_adapters",
                "waiting_lora_adapters",
            }
        )


async def metrics_page(url: str) -> bytes:
    async with httpx.AsyncClient(timeout=30) as http:
        return (await http.get(f"{url}/metrics")).content


def gauge_labels(page: str) -> set[str]:
    """The label names of vllm:lora_requests_info on a /metrics page."""
    line = next(ln for ln in page.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    return {
        pair.split("=", 1)[0] for pair in line[line.index("{") + 1 : line.index("}")].split(",")
    }
