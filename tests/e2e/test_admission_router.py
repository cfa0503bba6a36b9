"""Admission end to end: a real router process in front of a real sim-engine process.

The engine runs 2 requests at once (max-num-seqs 2). Tenants `flood`, `victim` and
`limited` share band `std` (ceiling 0.5, queue_threshold 1: at most one request queued
in the engine), `low` sits below it. Fairness is measured by order, not by time: for
each victim request we count the flood requests that completed while it was out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from llmgw import keys
from llmgw.dev.routerkit import metric_sum
from llmgw.dev.servers import free_port
from llmgw.dev.simkit import start_sim

pytestmark = pytest.mark.e2e

MODEL = "m"
TENANTS = {
    "flood": ("std", "{}"),
    "victim": ("std", "{}"),
    "limited": ("std", "{rpm: 2}"),
    "single": ("std", "{concurrency: 1}"),
    "low": ("low", "{}"),
}


def key(tenant: str) -> str:
    return f"sk-test-{tenant}"


def router_yaml(port: int, admin: int, sim_url: str) -> str:
    tenants = "\n".join(
        f"  - {{name: {name}, band: {band}, key_hashes: ['{keys.hash_key(key(name))}'], "
        f"quotas: {quotas}}}"
        for name, (band, quotas) in TENANTS.items()
    )
    return f"""
listen: 127.0.0.1:{port}
admin_listen: 127.0.0.1:{admin}
models: [{{name: {MODEL}}}]
endpoints: [{{id: e1, url: "{sim_url}", models: [{MODEL}], engine: sim, max_running: 2}}]
admission: {{queue_threshold: 1, tick_seconds: 0.05}}
bands:
  - {{name: std, ceiling: 0.5}}
  - {{name: low, ceiling: 0.2, queue_ttl_seconds: 1}}
tenants:
{tenants}
"""


class Router:
    def __init__(self, config: Path, port: int, admin: int):
        self.url = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{admin}"
        self.log = config.with_suffix(".log")
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw.cli", "router", "--config", str(config)],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.admin}/readyz", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"router did not become ready:\n{self.log.read_text()[-2000:]}")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the series of `name` whose labels include `labels`."""
        text = httpx.get(f"{self.admin}/metrics", timeout=5).text
        return metric_sum(text, name, **labels)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admission")
    with start_sim(model=MODEL, max_num_seqs=2, itl_ms=5, ttft_ms=2) as sim:
        port, admin = free_port(), free_port()
        config = tmp / "router.yaml"
        config.write_text(router_yaml(port, admin, sim.url))
        router = Router(config, port, admin)
        try:
            router.wait_ready()
            yield router, sim
        finally:
            router.stop()


def body(max_tokens: int = 8) -> dict:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello"}],
    }


def test_keys_and_quotas_reach_the_openai_sdk_as_its_own_errors(cluster):
    router, _ = cluster
    wrong = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.chat.completions.create(**body(2))
    assert err.value.code == "invalid_api_key"

    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=key("limited"), max_retries=0)
    for _ in range(2):
        assert client.chat.completions.create(**body(2)).choices[0].message.content
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(**body(2))
    e = err.value
    assert e.code == "rate_limit_exceeded" and e.type == "requests"
    assert e.response.headers["x-llmgw-reason"] == "rate_limit_rpm"
    assert 1 <= int(e.response.headers["retry-after"]) <= 60
    assert router.metric("llmgw_admission_rejected_total", tenant="limited") == 1


def test_a_bad_key_is_the_same_authentication_error_on_every_public_path(cluster):
    # OpenAI answers a bad key with type invalid_request_error, code invalid_api_key,
    # whatever the path; a client handling one must not meet a server_error on another.
    router, _ = cluster
    wrong = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-nope", max_retries=0)
    errors = []
    for call in (
        wrong.models.list,
        lambda: wrong.models.retrieve(MODEL),
        lambda: wrong.chat.completions.create(**body(2)),
        lambda: wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2),
    ):
        with pytest.raises(openai.AuthenticationError) as err:
            call()
        errors.append(err.value)
    assert {(e.type, e.code) for e in errors} == {("invalid_request_error", "invalid_api_key")}
    assert all(e.response.headers["www-authenticate"] == "Bearer" for e in errors)

    missing = httpx.get(f"{router.url}/v1/models", timeout=5)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "invalid_request_error"


def test_the_openai_sdk_retries_after_the_retry_after_it_is_given(cluster):
    router, _ = cluster
    # Retries to spare: each waits the 1 s Retry-After, and on a loaded box the first
    # request's last tokens may take longer than that.
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=key("single"), max_retries=6)
    long = {**body(60), "stream": True}
    with client.chat.completions.create(**long) as stream:
        next(iter(stream))  # the tenant's one concurrent request is now in flight
        # This one gets 429 with Retry-After: 1; the SDK waits and tries again, and by
        # then the first request has ended.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(client.chat.completions.create, **body(2))
            deadline = time.monotonic() + 10
            while not router.metric(
                "llmgw_admission_rejected_total", tenant="single", reason="rate_limit_concurrency"
            ):
                assert time.monotonic() < deadline, "the second request was never refused"
                time.sleep(0.02)
            for _ in stream:
                pass
            assert second.result(timeout=30).choices[0].message.content


async def test_a_flooding_tenant_cannot_starve_another_of_the_same_band(cluster):
    router, sim = cluster
    flood_done = 0
    flood_waits: list[int] = []  # flood completions while each flood request was out
    stop = asyncio.Event()
    headers = {f: {"Authorization": f"Bearer {key(f)}"} for f in TENANTS}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)

    async with httpx.AsyncClient(base_url=router.url, timeout=60, limits=limits) as http:

        async def flooder() -> None:
            nonlocal flood_done
            while not stop.is_set():
                before = flood_done
                r = await http.post("/v1/chat/completions", json=body(), headers=headers["flood"])
                assert r.status_code == 200, r.text
                flood_done += 1
                flood_waits.append(flood_done - before - 1)

        async def queued(band: str) -> float:
            return await asyncio.to_thread(router.metric, "llmgw_admission_queue_depth", band=band)

        async def backlog_of(n: int, band: str) -> None:
            deadline = time.monotonic() + 20
            while await queued(band) < n:
                assert time.monotonic() < deadline, "the flood never built a queue"
                await asyncio.sleep(0.05)

        floods = [asyncio.create_task(flooder()) for _ in range(60)]
        try:
            await backlog_of(40, "std")
            victim_waits = []
            for _ in range(5):
                before = flood_done
                r = await http.post("/v1/chat/completions", json=body(), headers=headers["victim"])
                assert r.status_code == 200, r.text
                victim_waits.append(flood_done - before)
            backlog_after = await queued("std")

            # A lower band waits behind the flood: it expires (504), and a client that
            # gives up leaves the queue at once, never reaching the engine.
            r = await http.post("/v1/chat/completions", json=body(), headers=headers["low"])
            assert r.status_code == 504
            assert r.headers["x-llmgw-reason"] == "queue_timeout"
            assert r.json()["error"]["code"] == "queue_timeout"
            gone = asyncio.create_task(
                http.post("/v1/chat/completions", json=body(), headers=headers["low"])
            )
            await backlog_of(1, "low")
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            deadline = time.monotonic() + 10
            while await queued("low") > 0:
                assert time.monotonic() < deadline, "the departed request stayed queued"
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*floods, return_exceptions=True), 60)

    # The flood was real: a deep queue throughout, and its own requests waited long.
    assert backlog_after >= 30
    flood_waits.sort()
    flood_median = flood_waits[len(flood_waits) // 2]
    assert flood_median >= 30, flood_median
    # Round-robin: the victim waits for about one turn, not for the flood's backlog.
    assert max(victim_waits) <= 10, (victim_waits, flood_median)
    assert router.metric("llmgw_admission_cancelled_total", tenant="low") == 1
    assert router.metric("llmgw_admission_admitted_total", tenant="low") == 0
    assert router.metric("llmgw_admission_queue_depth") == 0
    state = sim.state()
    assert state["running"] == 0 and state["waiting"] == 0
