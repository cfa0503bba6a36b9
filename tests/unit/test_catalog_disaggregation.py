"""A disaggregated model in the catalog file: what it declares, and every refusal naming
the entry and the field."""

from __future__ import annotations

import pytest
import yaml

from llmgw import contracts as c
from llmgw.reconciler.catalog import spec as catalog

LABEL = "models[0] (name=m)"


def parse(body: str) -> catalog.Catalog:
    return catalog.parse(yaml.safe_load(f"models:\n  - name: m\n{body}"))


def problems(body: str) -> list[str]:
    with pytest.raises(catalog.CatalogError) as err:
        parse(body)
    return err.value.problems


POOLS = """
    profile: {engine: vllm, model_ref: tiny}
    disaggregation:
      prefill: {replicas: 2}
      decode: {replicas: 3, profile: {engine: vllm, model_ref: tiny, max_num_seqs: 64}}
      connector: {kind: ExampleConnector, shared_path: /mnt/kv, extra: {a: 1}}
      min_prompt_tokens: 128
"""


def test_a_disaggregated_model_declares_both_pools_and_no_aggregated_replica():
    ev = parse(POOLS).models[0].event()
    d = ev.disaggregation
    assert d is not None
    assert (d.prefill.replicas, d.decode.replicas) == (2, 3)
    assert d.prefill.profile is None and d.decode.profile.max_num_seqs == 64
    assert d.connector == c.ConnectorSpec(
        kind="ExampleConnector", shared_path="/mnt/kv", extra={"a": 1}
    )
    assert d.min_prompt_tokens == 128
    assert ev.replicas == 0


def test_an_aggregated_model_declares_no_pools():
    assert parse("    replicas: 2\n").models[0].event().disaggregation is None


def test_replicas_or_autoscale_next_to_disaggregation_is_a_conflict():
    assert problems(POOLS + "    replicas: 2\n") == [
        f"{LABEL}: replicas: exclusive with disaggregation (each pool has its own count); "
        "set disaggregation.prefill.replicas and disaggregation.decode.replicas instead"
    ]
    out = problems(POOLS + "    autoscale: {min: 1, max: 3}\n")
    assert out == [
        f"{LABEL}: autoscale: exclusive with disaggregation (each pool has its own count); "
        "set disaggregation.prefill.replicas and disaggregation.decode.replicas instead"
    ]


def test_a_pool_needs_at_least_one_replica():
    out = problems("    disaggregation: {prefill: {replicas: 0}, connector: {shared_path: /kv}}\n")
    assert out == [
        f"{LABEL}: disaggregation.prefill.replicas: must be at least 1, got 0 (a "
        "disaggregated model needs both pools; remove disaggregation to serve it aggregated)"
    ]


def test_an_autoscaled_pool_starts_at_its_min_and_the_other_keeps_its_count():
    ev = (
        parse(
            "    disaggregation:\n"
            "      prefill: {replicas: 2}\n"
            "      decode: {autoscale: {min: 2, max: 5, target: 0.7}}\n"
            "      connector: {shared_path: /kv}\n"
        )
        .models[0]
        .event()
    )
    d = ev.disaggregation
    assert d is not None and d.prefill.autoscale is None
    assert d.decode.autoscale == c.AutoscaleSpec(min=2, max=5, target=0.7)
    assert (d.prefill.replicas, d.decode.replicas) == (2, 2)


def test_a_pool_autoscale_is_checked_like_a_model_one_naming_the_pool():
    out = problems(
        "    disaggregation:\n"
        "      prefill: {autoscale: {min: 0, max: 2, target: 0, signal: ttft}}\n"
        "      decode: {autoscale: {min: 3, max: 2, tolerance: 1}}\n"
        "      connector: {shared_path: /kv}\n"
    )
    assert out == [
        f"{LABEL}: disaggregation.prefill.autoscale.signal: 'ttft' is not one of load, queue",
        f"{LABEL}: disaggregation.prefill.autoscale.target: must be positive, got 0.0",
        f"{LABEL}: disaggregation.prefill.autoscale.min: must be at least 1, got 0 (a "
        "disaggregated model needs both pools)",
        f"{LABEL}: disaggregation.decode.autoscale.max: must be at least "
        "disaggregation.decode.autoscale.min (3), got 2",
        f"{LABEL}: disaggregation.decode.autoscale.tolerance: must be in [0, 1), got 1.0",
    ]
    out = problems(
        "    disaggregation: {decode: {replicas: 3, autoscale: {min: 1, max: 4}}, "
        "connector: {shared_path: /kv}}\n"
    )
    assert out == [
        f"{LABEL}: disaggregation.decode.replicas: exclusive with "
        "disaggregation.decode.autoscale (the pool starts at autoscale.min); remove one of them"
    ]


def test_sglang_cannot_serve_a_pool_and_the_message_says_which_profile():
    out = problems(
        "    profile: {engine: sglang, model_ref: x}\n"
        "    disaggregation:\n"
        "      prefill: {profile: {engine: vllm, model_ref: x}}\n"
        "      connector: {shared_path: /kv}\n"
    )
    assert out == [
        f"{LABEL}: profile.engine: sglang cannot serve a disaggregated pool (only vllm, sim "
        "take a KV connector); SGLang's own disaggregation is not supported"
    ]


def test_example_connector_needs_its_shared_folder():
    out = problems("    disaggregation: {}\n")
    assert out == [
        f"{LABEL}: disaggregation.connector.shared_path: required for ExampleConnector (the "
        "folder prefill engines write KV to and decode engines read it from, the same on "
        "every node)"
    ]
    other = parse("    disaggregation: {connector: {kind: NixlConnector}}\n").models[0]
    assert other.event().disaggregation.connector.kind == "NixlConnector"


def test_lora_slots_on_a_disaggregated_model_are_refused():
    out = problems(
        "    profile: {max_loras: 2}\n    disaggregation: {connector: {shared_path: /kv}}\n"
    )
    assert (
        out
        == [
            f"{LABEL}: profile.max_loras: LoRA adapters on a disaggregated model are not "
            "supported (the prefill and decode engines would both need the adapter); set it to 0"
        ]
        * 2
    )  # once per pool: both use the model's profile


def test_a_pools_own_profile_is_checked_as_a_profile_under_its_path():
    out = problems(
        "    disaggregation:\n"
        "      decode: {profile: {engine: vllm, gpus_per_shard: 0}}\n"
        "      connector: {shared_path: /kv}\n"
    )
    assert out == [
        f"{LABEL}: disaggregation.decode.profile.model_ref: required for engine vllm",
        f"{LABEL}: disaggregation.decode.profile.gpus_per_shard: must be at least 1, got 0",
    ]


def test_unknown_fields_inside_disaggregation_are_named():
    out = problems("    disaggregation: {prefil: {replicas: 1}}\n")
    assert out == [
        f"{LABEL}: disaggregation.prefil: unknown field "
        "(known: connector, decode, min_prompt_tokens, prefill)"
    ]


def test_changing_one_pool_is_a_changed_declaration():
    before = parse(POOLS)
    cur = catalog.Current()
    for i, step in enumerate(catalog.plan(before, catalog.Current()), 1):
        cur.add(f"s{i}", i, step.event)
    after = parse(POOLS.replace("prefill: {replicas: 2}", "prefill: {replicas: 1}"))
    steps = catalog.plan(after, cur)
    assert [s.summary for s in steps] == ["model m: changed (disaggregation)"]
    assert catalog.plan(before, cur) == []
