"""The catalog file: validation errors that name entry and field, and a minimal diff."""

from __future__ import annotations

import pytest
import yaml

from llmgw import contracts as c
from llmgw.reconciler.catalog import spec as catalog

KEY = "sha256:" + "ab" * 32

GOOD = f"""
bands:
  - {{name: interactive, ceiling: 1.5}}
  - {{name: batch, ceiling: 0.8, queue_capacity: 50}}
models:
  - name: llama
    aliases: [llama-3]
    fallbacks: [qwen]
    replicas: 2
    profile: {{engine: vllm, model_ref: meta/llama, gpus_per_shard: 2, selector: {{fabric: ib}}}}
  - name: qwen
    profile: {{engine: sim}}
    deadlines: {{idle: 5}}
tenants:
  - {{name: acme, band: interactive, key_hashes: ["{KEY}"], quotas: {{rpm: 600}}}}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(catalog.CatalogError) as err:
        catalog.parse(yaml.safe_load(text))
    return err.value.problems


def current_of(cat: catalog.Catalog) -> catalog.Current:
    """The log's view after the catalog was applied once (events folded in order)."""
    cur = catalog.Current()
    for i, step in enumerate(catalog.plan(cat, catalog.Current()), 1):
        cur.add(f"s{i}", i, step.event)
    return cur


def test_good_catalog_parses_into_contract_types():
    cat = catalog.parse(yaml.safe_load(GOOD))
    assert [b.name for b in cat.bands] == ["interactive", "batch"]
    llama = cat.models[0].event()
    assert isinstance(llama, c.ModelDeclared)
    assert llama.profile.gpus_per_shard == 2 and llama.profile.selector == {"fabric": "ib"}
    assert cat.models[1].deadlines.idle == 5.0 and cat.models[1].event().replicas == 1
    assert cat.tenants[0].event().quotas.rpm == 600
    assert cat.tenants[0].event().cache_isolation == "none"


def test_a_tenants_cache_isolation_is_carried_and_checked():
    tenant = "{name: t, band: b, cache_isolation: %s}"
    cat = catalog.parse(yaml.safe_load(f"bands: [{{name: b}}]\ntenants: [{tenant % 'key'}]"))
    assert cat.tenants[0].event().cache_isolation == "key"
    assert problems(f"bands: [{{name: b}}]\ntenants: [{tenant % 'user'}]") == [
        "tenants[0] (name=t): cache_isolation: unknown value 'user' (known: none, tenant, key)"
    ]


def test_type_errors_name_the_entry_and_the_field():
    out = problems(
        """
models:
  - name: qwen
  - name: llama
    profile: {gpus_per_shard: two}
"""
    )
    assert out == ["models[1] (name=llama): profile.gpus_per_shard: expected int, got 'two'"]


def test_unknown_fields_and_sections_are_errors_not_silently_ignored():
    out = problems(
        """
model: []
models:
  - name: llama
    profile: {gpu_per_shard: 2}
"""
    )
    assert any(p.startswith("model: unknown section") for p in out)
    assert any(
        p.startswith("models[0] (name=llama): profile.gpu_per_shard: unknown field") for p in out
    )


def test_semantic_errors_are_all_reported():
    out = problems(
        f"""
bands: [{{name: gold}}, {{name: gold}}]
models:
  - {{name: a, aliases: [b], fallbacks: [nope]}}
  - {{name: b, aliases: [x], fallbacks: [c]}}
  - {{name: c, aliases: [x], fallbacks: [b], replicas: -1}}
  - {{name: a}}
  - {{name: d, profile: {{engine: tgi}}}}
  - {{name: e, profile: {{engine: vllm, gpu_memory_utilization: 1.5}}}}
  - {{name: f, api_kinds: [chat, speech]}}
tenants:
  - {{name: t1, band: silver, key_hashes: [nothex]}}
  - {{name: t2, band: gold, key_hashes: ["{KEY}"]}}
  - {{name: t3, band: gold, key_hashes: ["{KEY}"]}}
"""
    )
    expected = [
        "bands[1] (name=gold): name: duplicate band (also bands[0] (name=gold))",
        "models[3] (name=a): name: duplicate model (also models[0] (name=a))",
        "models[0] (name=a): aliases: 'b' shadows the model of that name",
        "models[0] (name=a): fallbacks: 'nope' is not a model in this catalog",
        "models[2] (name=c): aliases: 'x' is already an alias of 'b'",
        "models[2] (name=c): replicas: must be 0 or more, got -1",
        "models[4] (name=d): profile.engine: 'tgi' is not one of vllm, sglang, sim",
        "models[5] (name=e): profile.model_ref: required for engine vllm",
        "models[5] (name=e): profile.gpu_memory_utilization: must be in (0, 1]",
        "models[6] (name=f): api_kinds: unknown kind 'speech' (known: chat, completions, "
        "embeddings, responses, transcriptions, tokenize, detokenize, rerank, score, pooling, "
        "classify)",
        "tenants[0] (name=t1): band: 'silver' is not a declared band (gold)",
        "tenants[2] (name=t3): key_hashes[0]: the same key already belongs to tenant 't2'",
    ]
    for line in expected:
        assert line in out, (line, out)
    assert any("fallbacks: cycle b -> c -> b" in p for p in out), out
    assert any(p.startswith("tenants[0] (name=t1): key_hashes[0]: expected 'sha256:'") for p in out)


def test_names_that_collide_as_subject_tokens_are_rejected():
    out = problems("models: [{name: 'org/m'}, {name: 'org_m'}]")
    assert out == [
        "models[1] (name=org_m): name: 'org_m' and 'org/m' map to the same subject token "
        "'org_m'; rename one"
    ]


def test_an_unparseable_entry_is_still_a_known_name_for_references():
    out = problems("models: [{name: a, fallbacks: [b]}, {name: b, replicas: many}]")
    assert out == ["models[1] (name=b): replicas: expected int or null, got 'many'"]


def test_plan_publishes_everything_once_then_nothing():
    cat = catalog.parse(yaml.safe_load(GOOD))
    first = catalog.plan(cat, catalog.Current())
    kinds = [type(s.event).__name__ for s in first]
    assert kinds == ["BandsDeclared", "ModelDeclared", "ModelDeclared", "TenantDeclared"]
    assert catalog.plan(cat, current_of(cat)) == []


def test_plan_publishes_only_what_changed_and_removes_what_is_gone():
    cat = catalog.parse(yaml.safe_load(GOOD))
    cur = current_of(cat)
    edited = yaml.safe_load(GOOD)
    edited["models"][0]["replicas"] = 3
    del edited["models"][1]
    edited["models"][0]["fallbacks"] = []
    edited["tenants"] = []
    steps = catalog.plan(catalog.parse(edited), cur)
    assert [s.summary for s in steps] == [
        "model llama: changed (fallbacks, replicas)",
        "tenant acme: removed",
        "model qwen: removed",
    ]
    assert isinstance(steps[0].event, c.ModelDeclared) and steps[0].event.replicas == 3
    assert isinstance(steps[2].event, c.ModelRemoved) and steps[2].event.name == "qwen"


def test_a_removed_then_redeclared_model_counts_as_new():
    cat = catalog.parse(yaml.safe_load(GOOD))
    cur = current_of(cat)
    cur.add("x", 99, c.ModelRemoved(name="qwen"))
    assert [s.summary for s in catalog.plan(cat, cur)] == ["model qwen: declared"]


def test_autoscale_is_validated_field_by_field_and_exclusive_with_replicas():
    out = problems(
        """
models:
  - {name: a, replicas: 2, autoscale: {min: 1, max: 3}}
  - {name: b, autoscale: {min: 4, max: 2, target: 0, tolerance: 1.5}}
  - {name: c, autoscale: {min: -1, max: 0, scale_up_after_seconds: -5}}
  - {name: d, autoscale: {min: 1, max: 2, taget: 0.7}}
  - {name: e, autoscale: {min: 1, max: 2, signal: saturation}}
"""
    )
    assert out == [
        "models[3] (name=d): autoscale.taget: unknown field (known: max, min, "
        "scale_down_after_seconds, scale_up_after_seconds, signal, target, tolerance)",
        "models[0] (name=a): autoscale: exclusive with replicas (a fixed count); remove one of them",
        "models[1] (name=b): autoscale.max: must be at least autoscale.min (4), got 2",
        "models[1] (name=b): autoscale.target: must be positive, got 0.0",
        "models[1] (name=b): autoscale.tolerance: must be in [0, 1), got 1.5",
        "models[2] (name=c): autoscale.min: must be 0 or more, got -1",
        "models[2] (name=c): autoscale.max: must be at least 1, got 0",
        "models[2] (name=c): autoscale.scale_up_after_seconds: must be 0 or more seconds",
        "models[4] (name=e): autoscale.signal: 'saturation' is not one of load, queue",
    ]


def test_autoscale_signal_defaults_to_load_and_takes_queue():
    cat = catalog.parse(
        yaml.safe_load(
            "models: [{name: a, autoscale: {max: 3}}, "
            "{name: b, autoscale: {max: 3, signal: queue, target: 2}}]"
        )
    )
    assert [m.event().autoscale.signal for m in cat.models] == ["load", "queue"]


def test_an_autoscaled_model_starts_at_min():
    cat = catalog.parse(yaml.safe_load("models: [{name: a, autoscale: {min: 0, max: 3}}]"))
    ev = cat.models[0].event()
    assert ev.replicas == 0 and ev.autoscale == c.AutoscaleSpec(min=0, max=3)


def test_scheduling_may_name_only_plugins_the_router_has():
    # A name no router knows used to be accepted, and froze every router's view (§5.1 of
    # the structure review): the catalog refuses it, naming the field and the known names.
    out = problems(
        """
models:
  - name: m
    profile: {engine: sim}
    scheduling: {filters: [ready, warm], scorers: {kv_prefx: 6, kv: -1}, picker: max_scor}
  - {name: ok, scheduling: {filters: [ready], scorers: {session: 0}, picker: p2c}}
"""
    )
    assert out == [
        "models[0] (name=m): scheduling.filters: unknown filter 'warm' "
        "(known: serves_model, ready, circuit, adapter)",
        "models[0] (name=m): scheduling.scorers: unknown scorer 'kv_prefx' "
        "(known: queue, kv, inflight, prefix, kv_prefix, session, lora_affinity)",
        "models[0] (name=m): scheduling.scorers.kv: must be 0 or more, got -1.0",
        "models[0] (name=m): scheduling.picker: unknown picker 'max_scor' "
        "(known: max_score, p2c, weighted_random)",
    ]


def test_migration_is_off_by_default_carried_when_set_and_checked_by_field():
    cat = catalog.parse(yaml.safe_load("models: [{name: a}, {name: b, migration: {max: 2}}]"))
    assert [m.event().migration.max for m in cat.models] == [0, 2]
    out = problems(
        "models: [{name: a, migration: {max: -1}}, {name: b, migration: {max: 9}},"
        " {name: c, migration: {times: 1}}]"
    )
    assert out == [
        "models[2] (name=c): migration.times: unknown field (known: max)",
        "models[0] (name=a): migration.max: must be between 0 (off) and 8, got -1",
        "models[1] (name=b): migration.max: must be between 0 (off) and 8, got 9",
    ]
