"""NATS with mutual TLS and per-identity permissions, on a real nats-server.

Certificates from `llmgw.certs`, the server config from `llmgw.natsconfig`,
clients connected the way services do (`bus.connect` + `tlsconfig.nats_options`).
A denied publish reaches the publisher only as a timeout; the reason arrives
through the client's error callback, which `bus.connect` logs: the tests
assert on that line and on what the stream did (not) store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from types import SimpleNamespace

import nats
import pytest
from nats.js.errors import NotFoundError

from llmgw import bus, certs, natsconfig, projection, tlsconfig
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.dev import servers as localservers

DENIED_WAIT = 0.5  # a denied request never gets an answer: wait this long for it


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtls")
    cert_dir = root / "certs"
    certs.init(cert_dir, ["node-a", "node-b"], routers=2)
    port = localservers.free_port()
    conf = root / "nats.conf"
    conf.write_text(
        natsconfig.render(
            certs.read_identities(cert_dir), str(cert_dir), port=port, store_dir=str(root / "js")
        )
    )
    server = localservers.ConfiguredNatsServer(root / "server", port=port, config_file=conf).start()
    try:
        yield SimpleNamespace(url=server.url, certs=cert_dir, root=root)
    finally:
        server.stop()


async def _connect(secure, name: str):
    opts = tlsconfig.nats_options(tlsconfig.from_certs_dir(secure.certs, name))
    return await bus.connect(secure.url, name, wait_for_server=False, **opts)


@pytest.fixture
async def reconciler(secure):
    nc = await _connect(secure, "reconciler")
    js = nc.jetstream()
    await bus.provision(js)  # the reconciler is the identity allowed to provision
    try:
        yield nc
    finally:
        await bus.close_quietly(nc)


@pytest.fixture
async def clients(secure):
    opened = []

    async def open_as(name: str):
        nc = await _connect(secure, name)
        opened.append(nc)
        return nc

    try:
        yield open_as
    finally:
        for nc in opened:
            await bus.close_quietly(nc)


@pytest.fixture
def violations(caplog):
    """Wait for the server's 'permissions violation' report about `what`."""
    caplog.set_level(logging.WARNING, logger="llmgw.bus")

    async def wait_for(what: str, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        needle = f"permissions violation for {what}".lower()
        while time.monotonic() < deadline:
            for rec in caplog.records:
                if needle in rec.getMessage().lower():
                    return rec.getMessage()
            await asyncio.sleep(0.02)
        seen = [r.getMessage() for r in caplog.records]
        raise AssertionError(f"no {needle!r} reported; saw {seen}")

    return wait_for


async def test_agent_publishes_its_own_heartbeat_events_and_load(reconciler, clients):
    agent = await clients("agent-node-a")
    router = await clients("router-1")
    ajs = agent.jetstream()

    hb = await bus.publish(ajs, c.Heartbeat(node="node-a", seq=7), deadline=5)
    reg = await bus.publish(ajs, c.NodeRegistered(node="node-a"), deadline=5)
    assert hb.stream == s.HEARTBEATS_STREAM and reg.stream == s.EVENTS_STREAM

    rjs = reconciler.jetstream()
    stored = await rjs.get_last_msg(s.HEARTBEATS_STREAM, s.heartbeat("node-a"))
    assert c.decode(stored.data).seq == 7

    samples: asyncio.Queue = asyncio.Queue()

    async def on_sample(msg):
        await samples.put(msg)

    await router.subscribe(s.LOAD_ALL, cb=on_sample)
    await router.flush()
    sample = c.LoadSample(node="node-a", shard_id="sh1", model="m", url="http://x", waiting=3)
    # Core NATS delivers at most once (an agent sends a sample every interval): send
    # until one arrives. A suite run on a loaded box once saw a single one never arrive.
    deadline = time.monotonic() + 15
    got = None
    while got is None and time.monotonic() < deadline:
        await agent.publish(s.subject_for(sample), c.encode(sample))
        await agent.flush()
        with contextlib.suppress(TimeoutError):
            got = await asyncio.wait_for(samples.get(), 1)
    assert got is not None, "no load sample reached the router"
    assert got.subject == s.load("node-a") and c.decode(got.data).waiting == 3


async def test_agent_is_refused_when_publishing_as_another_node(reconciler, clients, violations):
    agent = await clients("agent-node-a")
    ajs = agent.jetstream()

    forged_hb = c.Heartbeat(node="node-b", seq=1)
    with pytest.raises(TimeoutError):
        await ajs.publish(s.heartbeat("node-b"), c.encode(forged_hb), timeout=DENIED_WAIT)
    await violations('publish to "llmgw.hb.node-b"')

    forged_reg = c.NodeRegistered(node="node-b")
    with pytest.raises(TimeoutError):
        await ajs.publish(s.subject_for(forged_reg), c.encode(forged_reg), timeout=DENIED_WAIT)
    await violations('publish to "llmgw.evt.agent.node-b.registered"')

    # Nothing of it was stored: node-b's subjects are empty.
    rjs = reconciler.jetstream()
    with pytest.raises(NotFoundError):
        await rjs.get_last_msg(s.HEARTBEATS_STREAM, s.heartbeat("node-b"))
    with pytest.raises(NotFoundError):
        await rjs.get_last_msg(s.EVENTS_STREAM, s.subject_for(forged_reg))


async def test_agent_consumes_only_its_own_commands(reconciler, clients, violations):
    rjs = reconciler.jetstream()
    for node in ("node-a", "node-b"):
        await bus.publish(rjs, c.StopShard(key=f"k-{node}", node=node, shard_id=f"sh-{node}"))
    # node-b's durable exists, as it would once node-b's agent has run.
    await bus.ensure_pull_consumer(rjs, s.COMMANDS_STREAM, "agent-node-b", s.commands("node-b"))

    agent = await clients("agent-node-a")
    ajs = agent.jetstream()
    own = await bus.ensure_pull_consumer(
        ajs, s.COMMANDS_STREAM, "agent-node-a", s.commands("node-a")
    )
    msgs = await own.fetch(10, timeout=2)
    assert [c.decode(m.data).node for m in msgs] == ["node-a"]
    for m in msgs:
        await m.ack()

    # Pulling from node-b's durable is denied.
    theirs = await ajs.pull_subscribe_bind(durable="agent-node-b", stream=s.COMMANDS_STREAM)
    with pytest.raises(TimeoutError):
        await theirs.fetch(1, timeout=DENIED_WAIT)
    await violations('publish to "$js.api.consumer.msg.next.llmgw_commands.agent-node-b"')

    # Re-pointing its own durable at node-b's subject: the create subject names the
    # filter, so the permissions refuse it...
    with pytest.raises(TimeoutError):
        await ajs.add_consumer(
            s.COMMANDS_STREAM,
            name="agent-node-a",
            durable_name="agent-node-a",
            filter_subject=s.commands("node-b"),
            timeout=DENIED_WAIT,
        )
    await violations(
        'publish to "$js.api.consumer.create.llmgw_commands.agent-node-a.llmgw.cmd.node-b"'
    )
    # ...and a request on the allowed subject with node-b's filter in the body is
    # refused by the server, which checks that the two match.
    allowed = f"$JS.API.CONSUMER.CREATE.{s.COMMANDS_STREAM}.agent-node-a.{s.commands('node-a')}"
    body = {
        "stream_name": s.COMMANDS_STREAM,
        "config": {
            "name": "agent-node-a",
            "durable_name": "agent-node-a",
            "ack_policy": "explicit",
            "filter_subject": s.commands("node-b"),
        },
    }
    reply = await agent.request(allowed, json.dumps(body).encode(), timeout=5)
    assert json.loads(reply.data)["error"]["err_code"] == 10131

    # So is a plain subscription to node-b's command subject.
    await agent.subscribe(s.commands("node-b"))
    await violations('subscription to "llmgw.cmd.node-b"')

    # node-b's command is still there for node-b.
    info = await rjs.consumer_info(s.COMMANDS_STREAM, "agent-node-b")
    assert info.num_pending == 1


async def test_one_identity_cannot_read_anothers_replies(secure, reconciler, clients, violations):
    agent = await clients("agent-node-a")
    await agent.subscribe("_INBOX.router-1.>")
    await violations('subscription to "_inbox.router-1.>"')

    # A client with a valid certificate but the default inbox prefix cannot even get
    # JetStream answers: its replies would land where others could listen.
    opts = tlsconfig.nats_options(tlsconfig.from_certs_dir(secure.certs, "agent-node-a"))
    opts.pop("inbox_prefix")
    plain_inbox = await bus.connect(secure.url, "agent-a-default-inbox", **opts)
    try:
        with pytest.raises(TimeoutError):
            await plain_inbox.jetstream().publish(s.heartbeat("node-a"), b"{}", timeout=DENIED_WAIT)
        await violations('subscription to "_inbox.')
    finally:
        await bus.close_quietly(plain_inbox)


async def test_router_reads_endpoints_but_cannot_write_them_or_publish_events(
    reconciler, clients, violations
):
    rjs = reconciler.jetstream()
    rkv = await rjs.key_value(s.ENDPOINTS_BUCKET)
    await rkv.put(projection.model_key("m1"), b"endpoints-of-m1")

    router = await clients("router-1")
    js = router.jetstream()
    kv = await js.key_value(s.ENDPOINTS_BUCKET)
    assert (await kv.get(projection.model_key("m1"))).value == b"endpoints-of-m1"

    watcher = await kv.watchall()
    first = await watcher.updates(timeout=30)  # returns at once; a loaded box was slow
    assert first is not None and first.value == b"endpoints-of-m1"
    await watcher.stop()

    presence = await js.key_value(s.ROUTERS_BUCKET)
    await presence.put(s.router_key("router-1"), b"alive")

    with pytest.raises(TimeoutError):
        await js.publish(f"$KV.{s.ENDPOINTS_BUCKET}.m1", b"forged", timeout=DENIED_WAIT)
    await violations(f'publish to "$kv.{s.ENDPOINTS_BUCKET}.m1"')
    assert (await rkv.get(projection.model_key("m1"))).value == b"endpoints-of-m1"

    event = c.NodeRegistered(node="node-a")
    with pytest.raises(TimeoutError):
        await js.publish(s.subject_for(event), c.encode(event), timeout=DENIED_WAIT)
    await violations('publish to "llmgw.evt.agent.node-a.registered"')


def _summary(router_id: str, in_flight: int) -> c.DemandSummary:
    return c.DemandSummary(router_id=router_id, models={"m": c.ModelDemand(in_flight=in_flight)})


async def test_a_router_publishes_demand_only_as_itself(reconciler, clients, violations):
    """The autoscaler sums demand per router: router-1 must not speak for router-2."""
    router = await clients("router-1")
    received: asyncio.Queue = asyncio.Queue()

    async def on_summary(msg):
        await received.put(msg)

    await reconciler.subscribe(s.DEMAND_ALL, cb=on_summary)  # where the autoscaler listens
    await reconciler.flush()

    forged = _summary("router-2", in_flight=1000)
    await router.publish(s.subject_for(forged), c.encode(forged))
    await router.flush()
    await violations('publish to "llmgw.demand.router-2"')

    # Its own summary goes through. One connection keeps its order, so had the forged one
    # been let through it would have arrived first. Core NATS delivers at most once: send
    # until one arrives.
    own = _summary("router-1", in_flight=3)
    deadline = time.monotonic() + 15
    got = []
    while not got and time.monotonic() < deadline:
        await router.publish(s.subject_for(own), c.encode(own))
        await router.flush()
        with contextlib.suppress(TimeoutError):
            got.append(await asyncio.wait_for(received.get(), 1))
    while not received.empty():
        got.append(received.get_nowait())
    assert got, "router-1's own summary never arrived"
    assert {m.subject for m in got} == {s.demand("router-1")}
    assert {c.decode(m.data, c.DemandSummary).router_id for m in got} == {"router-1"}


async def test_a_router_writes_and_deletes_only_its_own_presence(
    reconciler, clients, violations, caplog
):
    """The live-router count divides every quota: router-1 must not add, change or remove
    router-2's entry. nats-py puts, deletes and purges a key by publishing on
    `$KV.<bucket>.<key>` (a delete or purge carries a KV-Operation header)."""
    theirs, mine = s.router_key("router-2"), s.router_key("router-1")
    other = await clients("router-2")
    other_kv = await other.jetstream().key_value(s.ROUTERS_BUCKET)
    their_rev = await other_kv.put(theirs, b"router-2 alive")

    router = await clients("router-1")
    kv = await router.jetstream(timeout=DENIED_WAIT).key_value(s.ROUTERS_BUCKET)
    refused = f'permissions violation for publish to "$kv.{s.ROUTERS_BUCKET}.{theirs}"'

    def refusals() -> int:
        return sum(refused in r.getMessage().lower() for r in caplog.records)

    for attempt in (
        lambda: kv.put(theirs, b"forged"),
        lambda: kv.delete(theirs),
        lambda: kv.purge(theirs),
    ):
        before = refusals()
        with pytest.raises(TimeoutError):
            await attempt()
        deadline = time.monotonic() + 15
        while refusals() == before and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert refusals() > before, f"no {refused!r} reported"

    # router-2's entry is as router-2 left it.
    stored = await (await reconciler.jetstream().key_value(s.ROUTERS_BUCKET)).get(theirs)
    assert (stored.value, stored.revision) == (b"router-2 alive", their_rev)

    # Its own key: put, then deleted as a draining router does (Presence.stop), and purged.
    own_kv = await router.jetstream().key_value(s.ROUTERS_BUCKET)
    await own_kv.put(mine, b"router-1 alive")
    assert (await own_kv.get(mine)).value == b"router-1 alive"
    await router.jetstream().publish(
        s.router_presence("router-1"), b"", headers={"KV-Operation": "DEL"}, timeout=5
    )
    with pytest.raises(NotFoundError):
        await own_kv.get(mine)
    await own_kv.put(mine, b"router-1 back")
    await own_kv.purge(mine)
    with pytest.raises(NotFoundError):
        await own_kv.get(mine)


async def _handshake(url: str, ctx: ssl.SSLContext | None) -> None:
    async def quiet(_exc: Exception) -> None:
        pass

    nc = await nats.connect(
        url,
        tls=ctx,
        allow_reconnect=False,
        connect_timeout=10,  # the genuine handshake, on a busy box
        error_cb=quiet,
        max_reconnect_attempts=0,
    )
    await nc.close()


async def test_clients_without_a_certificate_from_our_ca_cannot_connect(secure, tmp_path):
    ca = str(secure.certs / "ca.crt")
    # Without a client certificate the handshake fails (seen as the TLS alert
    # "certificate required" or as a broken pipe, depending on timing).
    with pytest.raises(OSError):
        await _handshake(secure.url, ssl.create_default_context(cafile=ca))
    # Without TLS at all, too (the server requires it).
    with pytest.raises(OSError):
        await _handshake(secure.url, None)
    # A certificate claiming to be the reconciler, signed by another CA, is refused.
    rogue = tmp_path / "rogue"
    certs.init(rogue, [], routers=0)
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(str(rogue / "reconciler.crt"), str(rogue / "reconciler.key"))
    with pytest.raises(OSError):
        await _handshake(secure.url, ctx)
    # The genuine one connects.
    await _handshake(
        secure.url, tlsconfig.ssl_context(tlsconfig.from_certs_dir(secure.certs, "reconciler"))
    )


async def test_a_command_without_tls_settings_fails_fast_instead_of_hanging(secure):
    # nats-py's own first-connect loop kept a plain client busy 20 s+ against a
    # TLS-only server; a CLI command (wait_for_server=False) must answer instead.
    task = asyncio.ensure_future(
        bus.connect(secure.url, "plain-cli", wait_for_server=False, connect_timeout=1)
    )
    try:
        done, _ = await asyncio.wait({task}, timeout=15)  # only to catch the hang
        assert task in done, "connect kept trying past its bound"
        assert task.exception() is not None
    finally:
        task.cancel()


async def test_kv_events_flow_agent_to_router_and_snapshots_answer_under_mtls(
    reconciler, clients, violations, tmp_path
):
    """An agent relays its own engines' KV events and answers snapshot requests on the
    router's inbox; it cannot publish events as another node."""
    from llmgw.agent.kvrelay import KvRelays

    agent = await clients("agent-node-a")
    router = await clients("router-1")
    relays = KvRelays("node-a", tmp_path)
    await relays.attach(agent)
    relay = relays.open("sh1")
    try:
        events: asyncio.Queue = asyncio.Queue()

        async def on_event(msg):
            await events.put(msg)

        await router.subscribe(s.KV_EVENTS_ALL, cb=on_event)
        await router.flush()
        batch = c.KvEvents(node="node-a", shard_id="sh1", epoch="e", seq_first=0, seq_last=0)
        deadline = time.monotonic() + 15
        got = None
        while got is None and time.monotonic() < deadline:
            await agent.publish(s.subject_for(batch), c.encode(batch))
            await agent.flush()
            with contextlib.suppress(TimeoutError):
                got = await asyncio.wait_for(events.get(), 1)
        assert got is not None and got.subject == s.kv_events("node-a", "sh1")

        req = c.KvSnapshotRequest(node="node-a", shard_id="sh1")
        reply = await router.request(s.subject_for(req), c.encode(req), timeout=10)
        snap = c.decode(reply.data, c.KvSnapshot)
        assert (snap.shard_id, snap.epoch) == ("sh1", relay.epoch)

        forged = c.KvEvents(node="node-b", shard_id="x", epoch="e", seq_first=0, seq_last=0)
        await agent.publish(s.subject_for(forged), c.encode(forged))
        await violations('publish to "llmgw.kv.node-b.x"')
    finally:
        await relays.stop()
