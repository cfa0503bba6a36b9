"""The router projection's keys and codec (llmgw.projection), shared by its writer and readers."""

from __future__ import annotations

import pytest

from llmgw import contracts as c
from llmgw import projection as pj
from llmgw.projection import Key

MODEL = c.ModelEndpoints(
    model="org/model:v1",
    endpoints=[c.Endpoint(id="m-r1-s0", url="http://a:8000", node="a", replica_id="m-r1")],
    aliases=["m"],
    based_on_seq=7,
    term=2,
)
TENANT = c.TenantRecord(name="acme.eu", band="gold", key_hashes=["h1"], term=2)
BANDS = c.BandsRecord(bands=[c.Band(name="gold", ceiling=1.5)], term=2)


def test_each_record_round_trips_through_its_own_key():
    for record in (MODEL, TENANT, BANDS):
        bucket, key = pj.key_of(record).target
        assert pj.decode(bucket, key, pj.encode(record)) == record


def test_keys_and_bytes_are_what_stored_projections_hold():
    # Routers and reconcilers of earlier versions wrote and read exactly these.
    assert (pj.ENDPOINTS_BUCKET, pj.TENANTS_BUCKET) == ("llmgw-endpoints", "llmgw-tenants")
    assert pj.key_of(MODEL).target == ("llmgw-endpoints", "org_model_v1")
    assert pj.key_of(TENANT).target == ("llmgw-tenants", "tenant.acme_eu")
    assert pj.key_of(BANDS).target == ("llmgw-tenants", "bands")
    for record in (MODEL, TENANT, BANDS):
        assert pj.encode(record) == c.encode(record)
    raw = b'{"type":"projection.bands","v":1,"id":"x","ts":1.0,"bands":[{"name":"gold"}]}'
    assert [b.name for b in pj.decode("llmgw-tenants", "bands", raw).bands] == ["gold"]


def test_a_tenant_named_like_the_bands_key_has_a_key_of_its_own():
    named_bands = c.TenantRecord(name="bands", band="gold")
    bucket, key = pj.key_of(named_bands).target
    assert key == "tenant.bands" != pj.BANDS_KEY
    assert pj.kind_of(bucket, key) == pj.TENANT
    assert pj.kind_of(bucket, pj.BANDS_KEY) == pj.BANDS_KIND
    assert pj.decode(bucket, key, pj.encode(named_bands)) == named_bands
    # Neither record is read from the other's key.
    with pytest.raises(pj.Misplaced, match="whose key is 'tenant.bands'"):
        pj.decode(bucket, pj.BANDS_KEY, pj.encode(named_bands))
    with pytest.raises(pj.Misplaced, match="it is for the bands, whose key is 'bands'"):
        pj.decode(bucket, key, pj.encode(BANDS))


def test_unknown_keys_and_misplaced_records_are_refused_with_the_reason():
    assert pj.kind_of(pj.TENANTS_BUCKET, "acme") is None  # no tenant. prefix
    assert pj.kind_of(pj.TENANTS_BUCKET, "tenant.") is None
    assert pj.kind_of(pj.ENDPOINTS_BUCKET, "a.b") is None  # a model key is one token
    assert pj.kind_of("llmgw-routers", "router-1") is None
    with pytest.raises(pj.Misplaced, match="'acme' is not a key of the projection"):
        pj.decode(pj.TENANTS_BUCKET, "acme", pj.encode(TENANT))
    with pytest.raises(pj.Misplaced, match="it is for model 'org/model:v1', whose key is"):
        pj.decode(pj.ENDPOINTS_BUCKET, "other", pj.encode(MODEL))
    with pytest.raises(pj.Misplaced, match="whose key is 'tenant.acme_eu' in llmgw-tenants"):
        pj.decode(pj.ENDPOINTS_BUCKET, "acme_eu", pj.encode(TENANT))
    for raw in (b"{not json", c.encode(c.NodeRegistered(node="a"))):
        with pytest.raises(c.ContractError) as err:
            pj.decode(pj.ENDPOINTS_BUCKET, "m", raw)
        assert not isinstance(err.value, pj.Misplaced)  # not a projection record at all
    with pytest.raises(TypeError):
        pj.key_of(c.NodeRegistered(node="a"))


def test_keys_name_what_they_are_for():
    assert Key.model("m") == (pj.MODEL, "m") and Key.tenant("t") == (pj.TENANT, "t")
    assert Key.model("m").target == (pj.ENDPOINTS_BUCKET, pj.model_key("m"))
    assert Key.tenant("t").target == (pj.TENANTS_BUCKET, pj.tenant_key("t"))
    assert pj.BANDS.target == (pj.TENANTS_BUCKET, pj.BANDS_KEY)
    # A tenant and a model of the same name are different records.
    assert Key.tenant("bands") != pj.BANDS != Key.model("bands")


def test_an_endpoint_is_named_after_its_serving_shard_and_back():
    assert pj.endpoint_id("m-r1-s0") == "m-r1-s0"
    assert pj.serving_shard(pj.endpoint_id("m-r1-s0")) == "m-r1-s0"
