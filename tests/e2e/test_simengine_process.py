"""The sim-engine process lifecycle: startup delay, injected exit, SIGTERM drain, CLI errors."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time

import httpx
import pytest

from llmgw.dev.servers import free_port
from llmgw.dev.simkit import start_sim

pytestmark = pytest.mark.e2e

MODEL = "sim-model"


def port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_startup_delay_keeps_the_port_closed_and_exit_after_requests_kills_the_process():
    port = free_port()
    # 2 s of loading: we may notice the log line late on a busy machine; the port must
    # still be closed then, and stay so for a while after.
    with start_sim(port=port, wait=False, startup_seconds=2.0, exit_after_requests=2) as sim:
        wait_until(lambda: "simulating model load" in sim.log_tail(), 15, "the startup delay")
        loading_since = time.monotonic()
        assert not port_open(port)
        sim.wait_ready()
        assert time.monotonic() - loading_since > 0.5
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        for _ in range(2):
            assert httpx.post(f"{sim.url}/v1/completions", json=body, timeout=5).status_code == 200
        assert sim.wait(15) == 1  # a crash, not a clean stop
        assert not port_open(port)


async def test_sigterm_finishes_in_flight_streams_aborts_wedged_ones_and_exits_zero():
    sim = start_sim(itl_ms=20, drain_seconds=2.0)  # ample for the ~0.5 s of tokens left
    try:
        async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:

            async def stream(max_tokens: int, first: asyncio.Event) -> list[str]:
                body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True}
                events = []
                with contextlib.suppress(httpx.RemoteProtocolError):
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line)
                                first.set()
                return events

            normal_started, wedged_started = asyncio.Event(), asyncio.Event()
            normal = asyncio.create_task(stream(25, normal_started))
            await asyncio.wait_for(normal_started.wait(), 5)
            await asyncio.to_thread(sim.set_faults, hang_after_tokens=1)
            wedged = asyncio.create_task(stream(25, wedged_started))
            await asyncio.wait_for(wedged_started.wait(), 5)

            sim.signal()  # SIGTERM
            await asyncio.to_thread(wait_until, lambda: not port_open(sim.port), 15, "port closed")

            events = await asyncio.wait_for(normal, 15)
            assert events[-1] == "data: [DONE]" and len(events) == 26  # finished in full
            stuck = await asyncio.wait_for(wedged, 15)  # aborted once the drain time ran out
            assert len(stuck) == 1
        assert await asyncio.to_thread(sim.wait, 15) == 0
    finally:
        sim.stop()


def test_bad_flags_and_config_exit_with_a_clear_message(tmp_path):
    cmd = [sys.executable, "-m", "llmgw.cli", "sim-engine"]
    r = subprocess.run([*cmd, "--mode", "random"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--mode" in r.stderr
    bad = tmp_path / "sim.yaml"
    bad.write_text("max_num_seqs: 0\n")
    r = subprocess.run([*cmd, "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "max_num_seqs" in r.stderr
    r = subprocess.run(
        [*cmd, "--kv-blocks", "2", "--block-size", "16"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2 and "kv_blocks" in r.stderr


def test_config_file_env_and_flags_layer(tmp_path):
    cfg = tmp_path / "sim.yaml"
    cfg.write_text("model: from-file\nmax_model_len: 1000\nfaults:\n  error_rate: 1.0\n")
    with start_sim(
        "--config", str(cfg), "--error-status", "418", env={"LLMGW_MAX_MODEL_LEN": "2000"}
    ) as sim:
        models = httpx.get(f"{sim.url}/v1/models", timeout=5).json()["data"]
        assert models[0]["id"] == "from-file" and models[0]["max_model_len"] == 2000
        faults = sim.state()["faults"]
        assert (faults["error_rate"], faults["error_status"]) == (1.0, 418)
        r = httpx.post(
            f"{sim.url}/v1/completions", json={"model": "from-file", "prompt": "x"}, timeout=5
        )
        assert r.status_code == 418 and r.json()["error"]["code"] == "injected_fault"
