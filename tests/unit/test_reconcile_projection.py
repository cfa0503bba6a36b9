"""The router projection records, computed from the state (the KV writer is integration-tested)."""

from llmgw import contracts as c
from llmgw import projection
from llmgw.projection import Key
from llmgw.reconciler.controllers.projection import records as p
from llmgw.reconciler.controllers.projection import writer
from llmgw.reconciler.controllers.replicas import plan as reconcile

from ._cluster import Log, model, node, status

S = c.ShardState


def placed(log: Log) -> Log:
    log.append(*reconcile.decide(log.state).events)
    return log


def test_only_serving_replicas_are_endpoints_and_retired_ones_drain():
    log = placed(
        Log().append(
            node("a", 2),
            c.ModelDeclared(
                name="m",
                replicas=2,
                aliases=["mm"],
                fallbacks=["other"],
                profile=c.ServingProfile(max_num_seqs=64, max_model_len=4096),
                owned_by="acme",
                api_kinds=["chat"],
                upstream=c.UpstreamSpec(secret_headers={"Authorization": "KEY_ENV"}),
            ),
        )
    )
    assert p.model_record(log.state, "m").endpoints == []  # pending shards serve nothing
    log.append(status(log.state, "m-r1-s0", S.LOADING))
    log.append(status(log.state, "m-r2-s0", S.READY, url="http://a:8001", max_running=32))
    rec = p.model_record(log.state, "m")
    assert [(e.id, e.url, e.state, e.max_running) for e in rec.endpoints] == [
        ("m-r2-s0", "http://a:8001", c.EndpointState.READY, 32)
    ]
    assert rec.aliases == ["mm"] and rec.fallbacks == ["other"]
    # What the routers' /v1/models and upstream requests need (the secret by name only).
    assert (rec.owned_by, rec.api_kinds, rec.max_model_len) == ("acme", ["chat"], 4096)
    assert rec.upstream.secret_headers == {"Authorization": "KEY_ENV"}
    log.append(status(log.state, "m-r1-s0", S.READY, url="http://a:8000"))
    assert p.model_record(log.state, "m").endpoints[0].max_running == 64  # profile hint
    log.append(c.ModelDeclared(name="m", replicas=1, profile=c.ServingProfile()))
    log.append(*reconcile.decide(log.state).events)  # retires m-r2, the newest
    states = {e.id: e.state for e in p.model_record(log.state, "m").endpoints}
    assert states == {"m-r1-s0": c.EndpointState.READY, "m-r2-s0": c.EndpointState.DRAINING}
    log.append(status(log.state, "m-r2-s0", S.STOPPED))
    assert [e.id for e in p.model_record(log.state, "m").endpoints] == ["m-r1-s0"]


def test_multi_node_replica_is_one_endpoint_once_every_shard_is_ready():
    fab = {"fabric": "ib"}
    log = placed(
        Log().append(
            node("a", 1, labels=fab), node("b", 1, labels=fab), model("w", shards_per_replica=2)
        )
    )
    log.append(status(log.state, "w-r1-s0", S.READY))
    assert p.model_record(log.state, "w").endpoints == []
    log.append(status(log.state, "w-r1-s1", S.READY))
    eps = p.model_record(log.state, "w").endpoints
    assert [(e.id, e.node) for e in eps] == [("w-r1-s0", "a")]


def test_affected_keys_and_comparison_ignore_the_envelope():
    log = placed(Log().append(node("a", 1), model("m"), c.TenantDeclared(name="t", band="gold")))
    keys = p.affected(log.state, {("shard", "m-r1-s0"), ("tenant", "t"), ("node", "a")})
    assert keys == {Key.model("m"), Key.tenant("t")}
    one = p.model_record(log.state, "m")
    log.append(c.ModelDeclared(name="m2"))  # unrelated: only based_on_seq moves
    two = p.model_record(log.state, "m")
    assert one.based_on_seq != two.based_on_seq and one.id != two.id
    assert p.comparable(one) == p.comparable(two)
    assert p.record_for(log.state, Key.tenant("t")).band == "gold"
    assert Key.tenant("t").target == (projection.TENANTS_BUCKET, projection.tenant_key("t"))
    assert p.record_for(log.state, Key.model("gone")) is None


def test_a_model_scaled_to_zero_keeps_its_record_and_says_why_it_cannot_start():
    spec = c.AutoscaleSpec(min=0, max=2)
    log = Log().append(node("a", 1), c.ModelDeclared(name="z", replicas=0, autoscale=spec))
    log.append(*reconcile.decide(log.state).events)
    rec = p.model_record(log.state, "z")
    assert rec.endpoints == [] and rec.scale_from_zero and rec.unplaceable == ""
    # Another model takes the only GPU; then the autoscaler asks for a replica of z.
    log.append(c.ModelDeclared(name="big", replicas=1))
    log.append(*reconcile.decide(log.state).events)
    log.append(c.ModelScaled(model="z", from_replicas=0, to_replicas=1, rule="from_zero", ts=5.0))
    assert p.affected(log.state, {("scaled", ("z", ""))}) == {Key.model("z")}
    log.append(*reconcile.decide(log.state).events)
    rec = p.model_record(log.state, "z")
    assert "z-r1 cannot be placed" in rec.unplaceable
    # Scaled back to zero: the stale failure no longer speaks for the model.
    log.append(c.ModelScaled(model="z", from_replicas=1, to_replicas=0, rule="scale_down", ts=9.0))
    assert p.model_record(log.state, "z").unplaceable == ""
    # A fixed count is never scale-from-zero.
    assert not p.model_record(log.state, "big").scale_from_zero


def test_a_tenant_named_like_the_bands_key_gets_its_own_record():
    log = Log().append(
        c.BandsDeclared(bands=[c.Band(name="gold")]), c.TenantDeclared(name="bands", band="gold")
    )
    kv = writer.KvProjection(js=None)
    written = {target: record for target, record in kv.full_plan(log.state)}
    assert set(written) == {
        (projection.TENANTS_BUCKET, projection.BANDS_KEY),
        (projection.TENANTS_BUCKET, projection.tenant_key("bands")),
    }
    assert [b.name for b in written[(projection.TENANTS_BUCKET, projection.BANDS_KEY)].bands] == [
        "gold"
    ]
    tenant = written[(projection.TENANTS_BUCKET, projection.tenant_key("bands"))]
    assert isinstance(tenant, c.TenantRecord) and (tenant.name, tenant.band) == ("bands", "gold")
    # A change to that tenant rewrites the tenant, not the bands.
    [(target, record)] = kv.plan(log.state, {("tenant", "bands")})
    assert target == (projection.TENANTS_BUCKET, projection.tenant_key("bands"))
    assert isinstance(record, c.TenantRecord) and record.name == "bands"


def test_a_tenants_record_carries_its_cache_isolation():
    log = Log().append(
        c.BandsDeclared(bands=[c.Band(name="gold")]),
        c.TenantDeclared(name="acme", band="gold", cache_isolation="key"),
    )
    assert p.tenant_record(log.state, "acme").cache_isolation == "key"


def test_a_base_models_record_lists_its_adapters_and_what_each_endpoint_holds():
    log = placed(Log().append(node("a", 2), model("m", replicas=2, max_loras=2)))
    log.append(c.AdapterDeclared(name="sql", base="m", source="/l/sql", tenants=["acme"]))
    log.append(c.AdapterDeclared(name="chat", base="m", source="/l/chat"))
    log.append(c.AdapterDeclared(name="other", base="x", source="/l/o"))
    log.append(status(log.state, "m-r1-s0", S.READY, url="http://a:8000"))
    log.append(status(log.state, "m-r2-s0", S.READY, url="http://a:8001"))
    log.append(status(log.state, "m-r2-s0", S.READY, adapters=["sql"]))
    rec = p.model_record(log.state, "m")
    assert [(a.name, a.tenants) for a in rec.adapters] == [("chat", []), ("sql", ["acme"])]
    assert [(e.id, e.max_loras, e.adapters) for e in rec.endpoints] == [
        ("m-r1-s0", 2, []),
        ("m-r2-s0", 2, ["sql"]),
    ]
    # A declaration touches its base's record; a removal, whose base the state no longer
    # knows, every model's (the writer writes only those that differ).
    assert p.affected(log.state, [("adapter", "sql")]) == {Key.model("m")}
    log.append(c.ModelDeclared(name="n"), c.AdapterRemoved(name="sql"))
    assert p.affected(log.state, [("adapter", "sql")]) == {Key.model("m"), Key.model("n")}


def test_the_models_migration_reaches_its_record_and_the_routers_route():
    from llmgw.router.endpoints.view import EndpointView

    log = placed(
        Log().append(node("a", 1), c.ModelDeclared(name="m", migration=c.MigrationSpec(max=2)))
    )
    rec = p.model_record(log.state, "m")
    assert rec.migration.max == 2
    view = EndpointView()
    view.replace([rec])
    assert view.route("m").migrations == 2
