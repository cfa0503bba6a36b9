"""The simulator's LoRA surface over HTTP, in vLLM 0.32's shapes: load and unload, an
adapter served as a model only while loaded, /v1/models with its parent, the
vllm:lora_requests_info gauge while its request runs, and a load's time in TTFT."""

from __future__ import annotations

import asyncio
import time

import httpx

from llmgw import enginemetrics
from llmgw.dev.simkit import sim_in_process


async def test_an_adapter_is_served_only_while_loaded_and_listed_with_its_parent(tmp_path):
    async with sim_in_process(served_model_name=["base"], max_loras=2, itl_ms=20) as sim:
        async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:
            body = {"model": "t1", "prompt": "hello", "max_tokens": 2}
            before = await http.post("/v1/completions", json=body)
            assert before.status_code == 404 and "`t1` does not exist" in before.text

            load = {"lora_name": "t1", "lora_path": str(tmp_path)}
            r = await http.post("/v1/load_lora_adapter", json=load)
            assert (
                r.status_code == 200 and r.text == "Success: LoRA adapter 't1' added successfully."
            )
            models = (await http.get("/v1/models")).json()["data"]
            assert [(m["id"], m["parent"], m["root"]) for m in models] == [
                ("base", None, "sim-model"),
                ("t1", "base", str(tmp_path)),
            ]
            ok = await http.post("/v1/completions", json=body)
            assert ok.status_code == 200 and ok.json()["model"] == "t1"

            # While its request runs, the gauge names the adapter.
            busy = asyncio.create_task(
                http.post("/v1/completions", json={**body, "max_tokens": 30})
            )
            await asyncio.sleep(0.2)
            load_now = enginemetrics.parse((await http.get("/metrics")).content)
            assert load_now.running_adapters == ("t1",)
            assert (await busy).status_code == 200

            assert (
                await http.post("/v1/unload_lora_adapter", json={"lora_name": "t1"})
            ).status_code == 200
            after = await http.post("/v1/completions", json=body)
            assert after.status_code == 404


async def test_a_request_for_an_adapter_out_of_its_slot_waits_for_the_load():
    async with sim_in_process(
        served_model_name=["base"], max_loras=1, lora_load_seconds=0.3, lora_on_demand=True
    ) as sim:
        async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:

            async def ttft(model: str) -> float:
                t0 = time.monotonic()
                r = await http.post(
                    "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}
                )
                assert r.status_code == 200
                return time.monotonic() - t0

            cold = await ttft("t1")
            warm = await ttft("t1")
            await ttft("t2")  # evicts t1: one slot
            again = await ttft("t1")
            metrics = (await http.get("/metrics")).text
    assert cold > warm and again > warm  # a load is paid; a resident adapter is not
    assert "llmgw_sim_lora_loads_total 3.0" in metrics
    assert "llmgw_sim_lora_evictions_total 2.0" in metrics
