"""Control-plane mode without sockets: config, KV records into the view and admission,
load samples, the live-router count, bands that change, and two routers deciding alike."""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter

import pytest

from llmgw import config as cfg
from llmgw import contracts as c
from llmgw import keys, projection
from llmgw.router import config as rc
from llmgw.router.admission import AdmissionRejected, AdmissionSettings, Controller
from llmgw.router.admission.controller import GRANTED, QUEUED
from llmgw.router.admission.gate import AdmissionGate
from llmgw.router.controlplane.feeds import EndpointFeed, TenantFeed
from llmgw.router.controlplane.presence import LiveRouters
from llmgw.router.controlplane.samples import SampleFeed
from llmgw.router.controlplane.watch import Entry
from llmgw.router.endpoints.view import EndpointView
from llmgw.router.scheduling import pipeline as sc


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def entry(key: str, msg: c.Message | bytes) -> Entry:
    return Entry(key, msg if isinstance(msg, bytes) else c.encode(msg), 0.0)


def model(name: str, *urls: str, **kw) -> c.ModelEndpoints:
    eps = [c.Endpoint(id=f"{name}-{i}", url=u, **kw) for i, u in enumerate(urls)]
    return c.ModelEndpoints(model=name, endpoints=eps)


def ep_entries(*records: c.ModelEndpoints) -> dict[str, Entry]:
    return {projection.model_key(r.model): entry(projection.model_key(r.model), r) for r in records}


# ------------------------------------------------------------------ config


def test_control_plane_config_is_what_llmgw_dev_writes(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(
        "listen: 127.0.0.1:18080\nadmin_listen: 127.0.0.1:19090\n"
        "nats_url: nats://127.0.0.1:4222\nrouter_id: router-1\n"
    )
    config = rc.load(path)
    assert (config.nats_url, config.router_id) == ("nats://127.0.0.1:4222", "router-1")


def test_nats_url_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLMGW_NATS_URL", "nats://10.0.0.1:4222")
    assert rc.load(None).nats_url == "nats://10.0.0.1:4222"


def test_static_entries_are_refused_in_control_plane_mode(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(
        "nats_url: nats://127.0.0.1:4222\n"
        "models: [{name: m}]\n"
        "endpoints: [{id: e1, url: 'http://127.0.0.1:1', models: [m]}]\n"
        "admission: {routers: 3}\n"
    )
    with pytest.raises(cfg.ConfigError) as err:
        rc.load(path)
    text = str(err.value)
    assert "models: not allowed with nats_url" in text
    assert "endpoints: not allowed with nats_url" in text
    assert "admission.routers = 3: not allowed with nats_url" in text


def test_a_missing_nats_ca_is_named(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(f"nats_url: tls://127.0.0.1:4222\nnats_tls: {{ca: {tmp_path}/nope.pem}}\n")
    with pytest.raises(cfg.ConfigError, match=r"nats_tls\.ca = .*no such file"):
        rc.load(path)


def test_router_id_defaults_to_host_and_pid_and_is_kept_when_given():
    assert rc.resolve_router_id(rc.RouterConfig(nats_url="nats://x")).router_id == (
        f"{socket.gethostname()}-{os.getpid()}"
    )
    given = rc.RouterConfig(nats_url="nats://x", router_id="edge-7")
    assert rc.resolve_router_id(given).router_id == "edge-7"


# ------------------------------------------------------------------ endpoints bucket


def test_endpoint_records_feed_the_view_and_a_bad_one_is_skipped(caplog):
    view = EndpointView()
    feed = EndpointFeed(view)
    entries = ep_entries(model("a", "http://a0"), model("b", "http://b0"))
    entries["junk"] = entry("junk", b"{not json")
    with caplog.at_level(logging.ERROR):
        feed.snapshot(entries)
    assert {m for m, _ in view.models()} == {"a", "b"}
    assert "malformed record" in caplog.text and "'junk'" in caplog.text

    # A malformed update keeps the model's last good record.
    feed.put(entry("a", b'{"type": "projection.model", "model": 5}'))
    assert view.resolve("a").endpoints[0].url == "http://a0"
    # A record under another model's key is refused.
    feed.put(entry("a", model("b", "http://elsewhere")))
    assert view.resolve("b").endpoints[0].url == "http://b0"

    feed.put(entry("a", model("a", "http://a1", "http://a2")))
    assert [e.url for e in view.resolve("a").endpoints] == ["http://a1", "http://a2"]
    feed.delete("b")
    assert view.resolve("b") is None


def test_a_fresh_snapshot_replaces_the_view_but_an_empty_one_keeps_it():
    view = EndpointView()
    feed = EndpointFeed(view)
    feed.snapshot(ep_entries(model("a", "http://a0"), model("b", "http://b0")))
    feed.snapshot({})  # a NATS that lost its store, before the reconciler writes again
    assert {m for m, _ in view.models()} == {"a", "b"}
    feed.snapshot(ep_entries(model("b", "http://b1")))  # a was deleted while away
    assert {m for m, _ in view.models()} == {"b"}
    assert view.resolve("b").endpoints[0].url == "http://b1"


# ------------------------------------------------------------------ tenants bucket

KEY = "sk-acme"
BANDS = c.BandsRecord(bands=[c.Band(name="gold", ceiling=1.5), c.Band(name="bronze", ceiling=0.8)])


def tenant(name: str, band: str, key: str | None = None, **quotas) -> c.TenantRecord:
    return c.TenantRecord(
        name=name,
        band=band,
        key_hashes=[keys.hash_key(key or f"sk-{name}")],
        quotas=c.Quotas(**quotas),
    )


def tenant_entries(*tenants: c.TenantRecord, bands=BANDS) -> dict[str, Entry]:
    out = {projection.tenant_key(t.name): entry(projection.tenant_key(t.name), t) for t in tenants}
    if bands is not None:
        out[projection.BANDS_KEY] = entry(projection.BANDS_KEY, bands)
    return out


def gate() -> AdmissionGate:
    return AdmissionGate(AdmissionSettings(), quiet=True)


def who(g: AdmissionGate, key: str | None) -> str:
    try:
        return g.controller.authenticate(None if key is None else f"Bearer {key}").name
    except AdmissionRejected as exc:
        return exc.reason


def test_tenants_and_bands_from_kv_require_keys_and_skip_bad_records(caplog):
    g = gate()
    feed = TenantFeed(g)
    bad = c.TenantRecord(name="oops", band="gold", key_hashes=["sk-pasted-a-key"])
    with caplog.at_level(logging.ERROR):
        feed.snapshot(tenant_entries(tenant("acme", "gold", KEY), bad))
    assert [b.name for b in g.controller.bands] == ["gold", "bronze"]
    assert (who(g, None), who(g, KEY), who(g, "sk-wrong")) == (
        "missing_api_key",
        "acme",
        "invalid_api_key",
    )
    assert "skipped tenant record 'tenant.oops'" in caplog.text
    assert "sk-pasted-a-key" not in caplog.text  # a pasted key is never echoed
    assert g.active

    # An empty bucket after a reconnect does not open the door.
    feed.snapshot({})
    assert who(g, None) == "missing_api_key"
    feed.put(entry(projection.tenant_key("beta"), tenant("beta", "bronze")))
    feed.delete(projection.tenant_key("acme"))
    assert (who(g, KEY), who(g, "sk-beta")) == ("invalid_api_key", "beta")


def test_deleting_the_last_tenant_opens_the_router_as_the_catalog_says_and_warns(caplog):
    g = gate()
    feed = TenantFeed(g)
    feed.snapshot(tenant_entries(tenant("acme", "gold", KEY)))
    with caplog.at_level(logging.WARNING):
        feed.delete(projection.tenant_key("acme"))
    assert who(g, None) == "anonymous"
    assert "no tenants are declared any more" in caplog.text


def test_a_tenant_in_an_undeclared_band_serves_in_the_lowest(caplog):
    g = gate()
    feed = TenantFeed(g)
    with caplog.at_level(logging.WARNING):
        feed.snapshot(tenant_entries(tenant("late", "platinum")))
    t = g.controller.directory.by_name["late"]
    assert g.controller.bands[t.band].name == "bronze"
    assert "names a band that is not declared" in caplog.text


def test_invalid_bands_are_skipped_and_the_previous_ones_kept():
    g = gate()
    feed = TenantFeed(g)
    feed.snapshot(tenant_entries(tenant("acme", "gold")))
    rising = c.BandsRecord(bands=[c.Band(name="a", ceiling=0.5), c.Band(name="b", ceiling=0.9)])
    feed.put(entry(projection.BANDS_KEY, rising))
    assert [b.name for b in g.controller.bands] == ["gold", "bronze"]


def test_a_tenant_named_bands_is_a_tenant_and_unknown_keys_are_skipped(caplog):
    g = gate()
    feed = TenantFeed(g)
    entries = tenant_entries(tenant("bands", "gold"))
    entries["acme"] = entry("acme", tenant("acme", "gold"))  # no key the projection writes
    with caplog.at_level(logging.ERROR):
        feed.snapshot(entries)
    assert [b.name for b in g.controller.bands] == ["gold", "bronze"]
    assert (who(g, "sk-bands"), who(g, "sk-acme")) == ("bands", "invalid_api_key")
    assert "'acme' is not a key of the projection" in caplog.text
    feed.delete(projection.tenant_key("bands"))  # the tenant goes, the bands stay
    assert [b.name for b in g.controller.bands] == ["gold", "bronze"]
    assert who(g, "sk-bands") == "anonymous"


class Ep:
    """The attributes the saturation detector reads, like the router's EndpointRuntime."""

    def __init__(self, max_running: int):
        self.id = "e1"
        self.state = c.EndpointState.READY
        self.inflight = 0
        self.load = None
        self.spec = c.Endpoint(id="e1", url="http://e1", max_running=max_running)
        self.models = frozenset({"m"})


def test_changed_bands_keep_queued_requests_by_band_name():
    clock = Clock()
    bands = [
        c.Band(name="gold", ceiling=1.0),
        c.Band(name="silver", ceiling=0.5),
        c.Band(name="bronze", ceiling=0.5, queue_ttl_seconds=5),
    ]
    tenants = [tenant("g", "gold"), tenant("s", "silver"), tenant("b", "bronze")]
    ctl = Controller(AdmissionSettings(queue_threshold=2.0), bands, tenants, clock=clock)
    ep = Ep(max_running=2)

    def admit(name):
        return ctl.admit(ctl.directory.by_name[name], "m", (ep,), 10)

    running = [admit("g") for _ in range(3)]  # saturation 0.5: silver and bronze held
    assert [t.state for t in running] == [GRANTED] * 3
    clock.t += 1
    silver, bronze = admit("s"), admit("b")
    assert (silver.state, bronze.state) == (QUEUED, QUEUED)

    # Gold and bronze go away, silver may flow whatever the saturation, copper is new.
    ctl.set_bands([c.Band(name="silver", ceiling=2.0), c.Band(name="copper", ceiling=0.4)])
    assert silver.state == GRANTED  # released at once by its band's new ceiling
    assert bronze.state == QUEUED and ctl.bands[bronze.band].name == "copper"  # the lowest
    # A tenant whose band vanished now belongs to the lowest band.
    assert ctl.bands[ctl.directory.by_name["g"].band].name == "copper"
    bronze.release()  # cancel: leaves the queue it was moved to
    assert ctl.queued == 0


# ------------------------------------------------------------------ load samples


def sample(shard: str, url: str, waiting: int = 3) -> bytes:
    return c.encode(
        c.LoadSample(node="n1", shard_id=shard, model="a", url=url, waiting=waiting, running=1)
    )


def test_samples_land_on_the_endpoint_by_shard_id_then_by_url():
    view = EndpointView()
    records = EndpointFeed(view)
    records.snapshot(ep_entries(model("a", "http://a0", "http://a1/")))
    clock = Clock(50.0)
    feed = SampleFeed(view, clock)
    assert feed.handle(sample("a-0", "http://moved")) == "applied"
    assert feed.handle(sample("other-shard", "http://a1", waiting=7)) == "applied"
    assert feed.handle(sample("ghost", "http://nowhere")) == "unknown"
    assert feed.handle(b'{"type": "load.sample"}') == "malformed"
    a0, a1 = view.endpoints["a-0"], view.endpoints["a-1"]
    assert (a0.load.waiting, a0.load.at, a0.load.source, a0.pushed_at) == (3, 50.0, "agent", 50.0)
    assert a1.load.waiting == 7
    records.delete(projection.model_key("a"))  # the model's endpoints leave the view
    assert feed.handle(sample("a-0", "http://moved")) == "unknown"


# ------------------------------------------------------------------ the live-router count


def test_live_routers_age_out_and_hold_through_an_outage():
    live = LiveRouters("me", ttl=10.0)
    live.replace({"me": 100.0, "r2": 95.0, "r3": 91.0})
    assert live.count(100.0) == 3
    assert live.count(101.5) == 2  # r3's last put is over a TTL old
    live.seen("r3", 101.5)
    live.gone("r2")
    assert live.count(102.0) == 2

    live.disconnected(102.0)
    assert live.count(500.0) == 2  # nothing is seen while away: the count holds
    live.reconnected(500.0)
    live.replace({})  # peers' entries expired during the outage
    assert live.count(501.0) == 2  # ...but they announce again within a TTL
    assert live.count(510.5) == 1
    assert LiveRouters("solo").count(0.0) == 1  # itself, even before its put is seen


# ------------------------------------------------------------------ two routers, one view


class Router:
    """What one router decides with: its view (fed from KV records and samples), the
    model's pipeline, and its admission gate (fed from tenant records and presence)."""

    def __init__(self, clock: Clock):
        self.view = EndpointView(observer=None)
        self.endpoints = EndpointFeed(self.view)
        self.samples = SampleFeed(self.view, clock)
        self.gate = AdmissionGate(AdmissionSettings(), quiet=True, clock=clock)
        self.tenants = TenantFeed(self.gate)

    def choose(self, body: bytes) -> str:
        route = self.view.resolve("a")
        ctx = sc.Context(1000.0, "a", key=sc.request_key(body))
        ep = route.pipeline.pick(route.endpoints, ctx)
        ep.inflight += 1  # dispatched: the router's own count moves
        return ep.id

    def admit(self, key: str) -> str:
        g = self.gate.controller
        try:
            t = g.admit(g.authenticate(f"Bearer {key}"), "a", self.view.resolve("a").endpoints, 10)
        except AdmissionRejected as exc:
            return exc.reason
        return t.state


def test_two_routers_fed_the_same_records_and_samples_decide_alike():
    urls = [f"http://10.0.0.{i}" for i in range(6)]
    records = ep_entries(model("a", *urls))
    tenants = tenant_entries(tenant("acme", "gold", KEY, rpm=40))
    clock = Clock()
    r1, r2 = Router(clock), Router(clock)
    for r in (r1, r2):
        r.tenants.snapshot(tenants)
        r.endpoints.snapshot(records)
        r.gate.set_routers(2)
    for i, url in enumerate(urls[:4]):  # two endpoints have no fresh load
        for r in (r1, r2):
            r.samples.handle(sample(f"a-{i}", url, waiting=i % 2))

    picks1, picks2 = [], []
    for n in range(200):
        body = b'{"model": "a", "messages": [{"role": "user", "content": "q%d"}]}' % n
        picks1.append(r1.choose(body))
        picks2.append(r2.choose(body))
        if n % 3 == 0:  # some answers end
            for r, picks in ((r1, picks1), (r2, picks2)):
                r.view.endpoints[picks[-1]].inflight -= 1
    assert picks1 == picks2
    # The default reads no shared sample (its queue and KV usage): every endpoint takes
    # its share by this router's in-flight counts and turns, waiting or not, sampled or not.
    counts = Counter(picks1)
    assert set(counts) == {f"a-{i}" for i in range(6)} and min(counts.values()) > 20

    # Admission: rpm 40 shared by 2 live routers is 20 each, for both alike.
    verdicts1 = [r1.admit(KEY) for _ in range(25)]
    verdicts2 = [r2.admit(KEY) for _ in range(25)]
    assert verdicts1 == verdicts2
    assert verdicts1.count("rate_limit_rpm") == 5
