"""The router's proxy over real sockets, against upstreams the tests control.

Each test starts fake engines (aiohttp servers that stream, hang, fail or drop
the connection on demand) and a router in the same event loop.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from llmgw.contracts import DeadlineSpec
from llmgw.dev.routerkit import FakeEngine, chat_chunks, config_for, fake_engines, running_router
from llmgw.router import config as rc

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as s:
        yield s


async def post(client, url, body, path="/v1/chat/completions", headers=None):
    async with client.post(url + path, json=body, headers=headers) as resp:
        return resp.status, resp.headers, await resp.read()


def events(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


# ------------------------------------------------------------------ relay


async def test_the_client_receives_the_upstream_event_sequence_unchanged(client):
    upstream = chat_chunks("m", 12, usage=True)
    async with fake_engines("a", events=upstream, delay=0.001) as (a,):
        async with running_router(config_for([a])) as r:
            status, headers, body = await post(client, r.url, {**CHAT, "stream": True})
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert events(body) == upstream
    assert a.seen[0].body == {**CHAT, "stream": True}  # the body went upstream as sent


async def test_request_ids_are_propagated_or_generated(client):
    async with fake_engines("a") as (a,):
        async with running_router(config_for([a])) as r:
            _, h1, _ = await post(client, r.url, CHAT, headers={"x-request-id": "req-42"})
            _, h2, _ = await post(client, r.url, CHAT)
            _, h3, _ = await post(client, r.url, {"model": "nope", "messages": []})
    assert h1["x-request-id"] == "req-42" and a.seen[0].headers["x-request-id"] == "req-42"
    assert h2["x-request-id"] and h2["x-request-id"] == a.seen[1].headers["x-request-id"]
    assert h3["x-request-id"] and h3["x-request-id"] != h2["x-request-id"]


async def test_aliases_reach_the_engine_under_the_canonical_name(client):
    async with fake_engines("a") as (a,):
        cfg = config_for([a], models=[rc.ModelConfig(name="m", aliases=["m-latest"])])
        async with running_router(cfg) as r:
            status, _, _ = await post(client, r.url, {**CHAT, "model": "m-latest"})
            async with client.get(r.url + "/v1/models") as resp:
                listed = [m["id"] for m in (await resp.json())["data"]]
    assert status == 200 and a.seen[0].body["model"] == "m"
    assert listed == ["m", "m-latest"]


async def test_completions_and_embeddings_are_routed_too(client):
    async with fake_engines("a") as (a,):
        async with running_router(config_for([a])) as r:
            s1, _, b1 = await post(client, r.url, {"model": "m", "prompt": "hi"}, "/v1/completions")
            s2, _, b2 = await post(client, r.url, {"model": "m", "input": "hi"}, "/v1/embeddings")
    assert (s1, s2) == (200, 200)
    assert json.loads(b2)["data"][0]["embedding"] == [0.1, 0.2]
    assert [s.path for s in a.seen] == ["/v1/completions", "/v1/embeddings"]


# ------------------------------------------------------------------ retries and fallbacks


async def test_a_failure_before_the_first_byte_is_retried_on_another_endpoint(client):
    async with fake_engines("a", "b") as (a, b):
        a.status = 500
        cfg = config_for(
            [a, b],
            model_defaults=rc.ModelDefaults(
                scheduling=rc.SchedulingSpec(scorers={"inflight": 1}, picker="max_score")
            ),
        )
        async with running_router(cfg) as r:
            # Ties between equal endpoints go in turn, so a is tried.
            results = [
                await post(client, r.url, {**CHAT, "stream": True, "user": f"u{i}"})
                for i in range(6)
            ]
            metrics = await (await client.get(r.admin_url + "/metrics")).text()
    assert all(s == 200 and h["x-llmgw-endpoint"] == "b" for s, h, _ in results)
    assert len(a.seen) >= 1  # a was tried and failed at least once
    assert 'llmgw_router_retries_total{model="m"}' in metrics
    assert 'llmgw_router_upstream_errors_total{endpoint="a",kind="upstream_500"}' in metrics


async def test_a_connection_refused_is_retried_elsewhere(client):
    async with fake_engines("b") as (b,):
        dead = FakeEngine(name="dead")  # never started: nothing listens on its port
        dead.port = 1
        async with running_router(config_for([dead, b])) as r:
            results = [await post(client, r.url, CHAT) for _ in range(4)]
    assert [s for s, _, _ in results] == [200] * 4


async def test_no_retry_after_the_first_byte_the_stream_ends_with_an_error_event(client):
    async with fake_engines("a", "b") as (a, b):
        a.drop_after = b.drop_after = 3
        async with running_router(config_for([a, b])) as r:
            status, headers, body = await post(client, r.url, {**CHAT, "stream": True})
    served = a if headers["x-llmgw-endpoint"] == "a" else b
    other = b if served is a else a
    assert status == 200 and other.seen == []  # never spliced onto another answer
    got = events(body)
    assert got[:3] == chat_chunks("m", 4)[:3]
    err = json.loads(got[3][len(b"data: ") :])
    assert err["error"]["code"] in ("upstream_broken", "upstream_truncated")
    assert got[4] == b"data: [DONE]\n\n" and len(got) == 5


async def test_the_fallback_chain_is_walked_when_every_endpoint_of_a_model_fails(client):
    async with fake_engines("a1", "a2", "small") as (a1, a2, small):
        a1.status = a2.status = 503
        cfg = config_for(
            [a1, a2],
            models=[
                rc.ModelConfig(name="m", fallbacks=["m-small"]),
                rc.ModelConfig(name="m-small"),
            ],
            endpoints=[
                rc.EndpointConfig(id="a1", url=a1.url, models=["m"]),
                rc.EndpointConfig(id="a2", url=a2.url, models=["m"]),
                rc.EndpointConfig(id="small", url=small.url, models=["m-small"]),
            ],
        )
        async with running_router(cfg) as r:
            status, headers, body = await post(client, r.url, CHAT)
            metrics = await (await client.get(r.admin_url + "/metrics")).text()
    assert status == 200 and headers["x-llmgw-endpoint"] == "small"
    assert len(a1.seen) == len(a2.seen) == 1
    assert small.seen[0].body["model"] == "m-small"
    assert 'llmgw_router_fallbacks_total{fallback="m-small",model="m"} 1.0' in metrics


async def test_every_endpoint_failing_gives_502_with_the_reason(client):
    async with fake_engines("a", "b") as (a, b):
        a.status = b.status = 500
        async with running_router(config_for([a, b])) as r:
            status, headers, body = await post(client, r.url, CHAT)
    assert status == 502 and headers["x-llmgw-reason"] == "upstream_500"
    err = json.loads(body)["error"]
    assert "answered 500" in err["message"] and "2 attempts" in err["message"]


# ------------------------------------------------------------------ deadlines


async def test_the_idle_watchdog_cuts_a_hanging_engine_and_the_client_gets_an_error_event(client):
    async with fake_engines("a", hang_after=2) as (a,):
        cfg = config_for([a], model_defaults=rc.ModelDefaults(deadlines=DeadlineSpec(idle=0.15)))
        async with running_router(cfg) as r:
            status, _, body = await post(client, r.url, {**CHAT, "stream": True})
            await asyncio.sleep(0.05)
    got = events(body)
    assert status == 200 and len(got) == 4
    err = json.loads(got[2][len(b"data: ") :])["error"]
    assert err["code"] == "idle_timeout" and err["type"] == "timeout"
    assert got[3] == b"data: [DONE]\n\n"
    assert a.cancelled == 1  # the wedged request was cut upstream too


async def test_an_engine_silent_before_its_first_token_is_retried_then_504(client):
    async with fake_engines("a", "b", hang_after=0) as (a, b):
        cfg = config_for(
            [a, b], model_defaults=rc.ModelDefaults(deadlines=DeadlineSpec(first_token=0.1))
        )
        async with running_router(cfg) as r:
            status, headers, body = await post(client, r.url, {**CHAT, "stream": True})
    assert status == 504 and headers["x-llmgw-reason"] == "first_token_timeout"
    assert len(a.seen) == len(b.seen) == 1  # each tried once: headers are held until a token


async def test_headers_and_total_deadlines_give_504(client):
    async with fake_engines("a", hang_before_headers=True) as (a,):
        short = DeadlineSpec(headers=0.1, total=0.4)
        async with running_router(
            config_for([a], model_defaults=rc.ModelDefaults(deadlines=short))
        ) as r:
            status, headers, _ = await post(client, r.url, {**CHAT, "stream": True})
            assert (status, headers["x-llmgw-reason"]) == (504, "headers_timeout")
            # a non-streamed answer's headers come with the answer: only the total bounds it
            status, headers, _ = await post(client, r.url, CHAT)
            assert (status, headers["x-llmgw-reason"]) == (504, "total_timeout")
    assert len(a.seen) == 2  # one attempt each: no endpoint is tried twice for one request


# ------------------------------------------------------------------ client disconnect


async def test_a_client_disconnect_cancels_the_upstream_request(client):
    async with fake_engines("a", tokens=1000, delay=0.01) as (a,):
        async with running_router(config_for([a])) as r:
            async with client.post(
                r.url + "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as resp:
                await resp.content.readline()
                assert a.active == 1
            # leaving the block closes the connection mid-stream
            deadline = time.monotonic() + 15
            while not a.cancelled and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            metrics = await (await client.get(r.admin_url + "/metrics")).text()
    assert a.cancelled == 1 and a.active == 0
    assert 'llmgw_router_requests_total{endpoint="a",model="m",status="499"} 1.0' in metrics


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("path", "body", "status", "reason"),
    [
        ("/v1/chat/completions", b"{oops", 400, "invalid_json"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "missing_model"),
        (
            "/v1/chat/completions",
            b'{"model": "m", "stream": 1, "messages": []}',
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "ghost", "messages": [{"role": "user", "content": "hi"}]}',
            404,
            "model_not_found",
        ),
        ("/v1/nothing", b"{}", 404, "not_found"),
    ],
)
async def test_bad_input_gets_an_openai_error_with_a_reason(client, path, body, status, reason):
    async with fake_engines("a") as (a,):
        async with running_router(config_for([a])) as r:
            async with client.post(r.url + path, data=body) as resp:
                got = await resp.json()
                assert resp.status == status
                assert resp.headers["x-llmgw-reason"] == reason
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in got["error"]["message"]
    assert a.seen == []


async def test_bodies_over_the_limit_get_413_declared_or_streamed(client):
    async with fake_engines("a") as (a,):
        async with running_router(config_for([a], max_body_bytes=2048)) as r:
            big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 4000}]})
            async with client.post(r.url + "/v1/chat/completions", data=big) as resp:
                assert (resp.status, resp.headers["x-llmgw-reason"]) == (413, "body_too_large")

            async def chunks():
                for _ in range(4):
                    yield b"x" * 1000

            async with client.post(r.url + "/v1/chat/completions", data=chunks()) as resp:
                assert resp.status == 413
    assert a.seen == []


async def _raw_exchange(url: str, head: bytes, parts: list[bytes], gap: float = 0.0) -> bytes:
    """Send a request by hand, in parts, and read the whole answer until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(gap)
        return await asyncio.wait_for(reader.read(), 10)  # EOF: the server closed
    finally:
        writer.close()


async def test_a_client_that_sends_less_body_than_declared_gets_408_and_is_closed(client):
    async with fake_engines("a") as (a,):
        async with running_router(config_for([a], body_read_timeout_seconds=0.5)) as r:
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
            )
            raw = await _raw_exchange(r.url, head, [b'{"model":"'])
            # The router still serves others, and a body split in parts that arrives in
            # time is read whole (the disconnect watcher does not steal its chunks).
            status, _, _ = await post(client, r.url, CHAT)
            body = json.dumps(CHAT).encode()
            split = await _raw_exchange(
                r.url,
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n",
                [body[:10], body[10:]],
                gap=0.05,
            )
    status_line, _, rest = raw.partition(b"\r\n")
    head_part, _, payload = rest.partition(b"\r\n\r\n")
    assert status_line.startswith(b"HTTP/1.1 408")
    assert b"x-llmgw-reason: body_timeout" in head_part
    assert json.loads(payload)["error"]["type"] == "timeout"
    assert status == 200
    assert split.startswith(b"HTTP/1.1 200")
    assert [s.body for s in a.seen] == [CHAT, CHAT]


async def test_no_available_endpoint_gives_503(client):
    async with fake_engines("a") as (a,):
        cfg = config_for([a])
        cfg.endpoints[0].state = rc.EndpointState.DRAINING
        async with running_router(cfg) as r:
            status, headers, body = await post(client, r.url, CHAT)
            async with client.get(r.admin_url + "/readyz") as resp:
                ready = resp.status
    assert (status, headers["x-llmgw-reason"]) == (503, "no_endpoint")
    assert ready == 503
    assert a.seen == []
