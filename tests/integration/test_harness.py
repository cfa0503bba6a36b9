"""The harness gives a working JetStream and PostgreSQL, isolated per test."""

import asyncio

import asyncpg
from nats.js import api

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s


async def test_jetstream_stream_dedupe_consume_ack(js):
    await bus.ensure_stream(js, api.StreamConfig(name="T", subjects=["t.>"], duplicate_window=60))
    first = await js.publish("t.a", b"one", headers={"Nats-Msg-Id": "id-1"})
    again = await js.publish("t.a", b"one", headers={"Nats-Msg-Id": "id-1"})
    assert not first.duplicate and again.duplicate and again.seq == first.seq
    await js.publish("t.b", b"two", headers={"Nats-Msg-Id": "id-2"})
    sub = await bus.ensure_pull_consumer(js, "T", "reader")
    msgs = await sub.fetch(10, timeout=2)
    assert [m.data for m in msgs] == [b"one", b"two"]
    for m in msgs:
        await m.ack()
    info = await js.consumer_info("T", "reader")
    await asyncio.sleep(0.05)
    info = await js.consumer_info("T", "reader")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_provision_is_idempotent_and_publish_dedupes(js):
    await bus.provision(js)
    await asyncio.gather(bus.provision(js), bus.provision(js))  # concurrent starts
    msg = c.ModelRemoved(name="m")
    a = await bus.publish(js, msg)
    b = await bus.publish(js, msg)  # a retried publish of the same message
    assert a.stream == s.EVENTS_STREAM and b.duplicate
    info = await js.stream_info(s.EVENTS_STREAM)
    assert info.state.messages == 1
    for bucket in (s.ENDPOINTS_BUCKET, s.TENANTS_BUCKET, s.ROUTERS_BUCKET):
        await js.key_value(bucket)


async def test_previous_test_left_nothing_behind(js):
    assert [si.config.name for si in await js.streams_info()] == []


async def test_postgres_without_migrations(database_dsn):
    conn = await asyncpg.connect(database_dsn)
    try:
        assert await conn.fetchval("select 40 + 2") == 42
        await conn.execute("create table t (x int)")
        await conn.execute("insert into t values (1)")
        assert await conn.fetchval("select count(*) from t") == 1
    finally:
        await conn.close()


async def test_each_test_gets_its_own_database(database_dsn):
    conn = await asyncpg.connect(database_dsn)
    try:
        assert await conn.fetchval("select to_regclass('public.t')") is None
    finally:
        await conn.close()


def test_a_server_whose_port_is_taken_fails_instead_of_using_the_other_one(tmp_path):
    """Something else answering on the port is not our server having started."""
    import socket

    import pytest

    from llmgw.dev import servers as localservers

    with socket.socket() as other:
        other.bind(("127.0.0.1", localservers.free_port()))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(localservers.ServerError, match="exited with"):
            localservers.NatsServer(tmp_path / "nats", port=port).start()
        with pytest.raises(localservers.ServerError, match="exited with"):
            localservers.PostgresServer(tmp_path / "pg", port=port).start()
    # The same servers start once the port is theirs.
    nats_server = localservers.NatsServer(tmp_path / "nats", port=port).start()
    nats_server.stop()
