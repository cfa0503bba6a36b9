"""The in-process helper other services' tests use: same app, served in the test's event loop."""

from __future__ import annotations

import httpx
import openai
import pytest

from llmgw.dev.simkit import sim_in_process


async def test_in_process_sim_serves_the_async_sdk_and_exposes_its_engine():
    async with sim_in_process(served_model_name=["m"], max_num_seqs=2) as sim:
        client = openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0)
        async with client:
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
        assert chunks[-1].usage.completion_tokens == 4
        state = sim.state()
        assert state["finished"] == 1 and state["running"] == 0
        assert sim.app.engine.stats.generation_tokens == 4


async def test_in_process_exit_fault_stops_serving_and_sets_exited():
    async with sim_in_process(exit_after_requests=1) as sim:
        async with httpx.AsyncClient(base_url=sim.url, timeout=5) as http:
            r = await http.post("/v1/completions", json={"model": "sim-model", "prompt": "x"})
            assert r.status_code == 200
        await sim.exited.wait()


async def test_health_is_200_until_the_engine_loop_dies_then_503():
    async with sim_in_process() as sim:
        async with httpx.AsyncClient(base_url=sim.url, timeout=5) as http:
            assert (await http.get("/health")).status_code == 200

            def broken(now: float) -> list:
                raise RuntimeError("simulated engine bug")

            sim.app.engine.step = broken
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    "/v1/completions", json={"model": "sim-model", "prompt": "x"}, timeout=0.3
                )
            r = await http.get("/health")
            assert r.status_code == 503 and "simulated engine bug" in r.json()["error"]["message"]
