"""Mid-stream migration over real sockets: a stream its engine cut after the first
byte continues on the other engine, and the client reads one whole stream.

Both fake engines start faulty; the test mends the one that did not get the request
as soon as the other has it, so which engine goes first does not matter.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from llmgw.contracts import DeadlineSpec, MigrationSpec
from llmgw.dev.routerkit import FakeEngine, config_for, fake_engines, running_router
from llmgw.router import config as rc

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
    "max_tokens": 10,
}
FAST = DeadlineSpec(connect=1.0, headers=1.0, first_token=1.0, idle=0.5, total=10.0)


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as s:
        yield s


def migrating(engines: list[FakeEngine], times: int = 1):
    return config_for(
        engines,
        models=[rc.ModelConfig(name="m", migration=MigrationSpec(max=times))],
        model_defaults=rc.ModelDefaults(deadlines=FAST),
    )


async def stream_and_mend(client, url: str, body: dict, engines: list[FakeEngine], **mended):
    """POST a stream; once an engine has it, set `mended` on the others."""
    task = asyncio.create_task(_post(client, url, body))
    async with asyncio.timeout(5):
        while not any(e.seen for e in engines):
            await asyncio.sleep(0.002)
    first = next(e for e in engines if e.seen)
    for e in engines:
        if e is not first:
            for key, value in mended.items():
                setattr(e, key, value)
    return first, await task


async def _post(client, url, body):
    async with client.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.read()


def chunks(raw: bytes) -> tuple[list[dict], bytes]:
    """The JSON chunks of a stream, and its last event."""
    events = [e for e in raw.split(b"\n\n") if e]
    return [json.loads(e[len(b"data: ") :]) for e in events[:-1]], events[-1]


def text_of(got: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in got if c["choices"])


async def test_a_wedged_engine_is_left_and_the_stream_continues_on_the_other(client):
    async with fake_engines("a", "b", tokens=6, hang_after=2) as engines:
        async with running_router(migrating(engines)) as r:
            body = {**CHAT, "stream_options": {"include_usage": True}}
            first, (status, raw) = await stream_and_mend(
                client, r.url, body, engines, hang_after=None
            )
            metrics = await (await client.get(r.admin_url + "/metrics")).text()
    other = next(e for e in engines if e is not first)
    got, last = chunks(raw)
    assert status == 200 and last == b"data: [DONE]"
    assert "error" not in raw.decode()
    # two tokens from the first engine, then the other's six, as one answer
    assert text_of(got) == "t0 t1 " + "t0 t1 t2 t3 t4 t5 "
    assert [c["choices"][0]["delta"].get("role") for c in got if c["choices"]].count(
        "assistant"
    ) == 1
    continued = other.seen[0].body
    assert continued["messages"][-1] == {"role": "assistant", "content": "t0 t1 "}
    assert continued["continue_final_message"] is True
    assert continued["add_generation_prompt"] is False
    assert continued["max_tokens"] == 8
    assert first.cancelled == 1  # the wedged request was cut upstream
    assert 'llmgw_router_migrations_total{model="m"} 1.0' in metrics


async def test_a_dropped_connection_is_continued_on_the_other_engine(client):
    async with fake_engines("a", "b", tokens=4, drop_after=2, delay=0.2) as engines:
        async with running_router(migrating(engines)) as r:
            first, (status, raw) = await stream_and_mend(
                client, r.url, CHAT, engines, drop_after=None, delay=0.0
            )
    got, last = chunks(raw)
    assert status == 200 and last == b"data: [DONE]" and "error" not in raw.decode()
    assert text_of(got) == "t0 t1 t0 t1 t2 t3 "
    assert got[-1]["choices"][0]["finish_reason"] == "length"


async def test_an_error_event_from_the_engine_is_continued_not_relayed(client):
    from llmgw.dev.routerkit import chat_chunks

    broken = chat_chunks("m", 3)[:2] + [
        b'data: {"error": {"message": "engine core died", "code": 500}}\n\n',
        b"data: [DONE]\n\n",
    ]
    # the delay gives the test time to mend the other engine before the cut: sent at
    # once, the continuation could reach the other engine while it is still broken
    async with fake_engines("a", "b", events=broken, delay=0.2) as engines:
        async with running_router(migrating(engines)) as r:
            _, (status, raw) = await stream_and_mend(
                client, r.url, CHAT, engines, events=None, delay=0.0
            )
    got, last = chunks(raw)
    assert status == 200 and last == b"data: [DONE]" and "error" not in raw.decode()
    assert text_of(got).startswith("t0 t1 t0 ")


async def test_after_max_migrations_the_stream_ends_with_an_error_event(client):
    async with fake_engines("a", "b", "c", tokens=6, drop_after=2) as engines:
        async with running_router(migrating(engines, times=1)) as r:
            status, raw = await _post(client, r.url, CHAT)
    got, last = chunks(raw)
    assert status == 200 and last == b"data: [DONE]"
    assert got[-1]["error"]["code"] in ("upstream_broken", "upstream_truncated")
    assert text_of(got[:-1]) == "t0 t1 t0 t1 "  # one continuation, then the honest error
    assert sorted(len(e.seen) for e in engines) == [0, 1, 1]


async def test_a_stream_with_tools_is_not_migrated_and_ends_with_an_error_event(client):
    async with fake_engines("a", "b", tokens=6, drop_after=2) as engines:
        async with running_router(migrating(engines)) as r:
            body = {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}
            status, raw = await _post(client, r.url, body)
    got, last = chunks(raw)
    assert status == 200 and "error" in got[-1]
    assert sorted(len(e.seen) for e in engines) == [0, 1]  # never spliced


async def test_migration_is_off_unless_the_model_asks_for_it(client):
    async with fake_engines("a", "b", tokens=6, drop_after=2) as engines:
        async with running_router(config_for(engines)) as r:
            status, raw = await _post(client, r.url, CHAT)
    got, _ = chunks(raw)
    assert "error" in got[-1] and sorted(len(e.seen) for e in engines) == [0, 1]


async def test_a_continuation_the_engine_refuses_ends_the_stream_in_band(client):
    async with fake_engines("a", "b", tokens=6, drop_after=2, delay=0.2) as engines:
        async with running_router(migrating(engines)) as r:
            _, (status, raw) = await stream_and_mend(client, r.url, CHAT, engines, status=400)
    got, last = chunks(raw)
    assert status == 200 and last == b"data: [DONE]"
    assert text_of(got[:-1]) == "t0 t1 "
    assert got[-1]["error"]["code"] == "continuation_refused"
    assert "400" in got[-1]["error"]["message"]
