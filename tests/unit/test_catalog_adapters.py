"""LoRA adapters in the catalog: parsed into AdapterDeclared, checked with errors that name
the entry and the field, and diffed like models (declared, changed, removed)."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from llmgw import contracts as c
from llmgw.reconciler.catalog import spec as catalog
from llmgw.reconciler.catalog.apply import add_folded

BASE = """
bands: [{name: b}]
tenants: [{name: acme, band: b}]
models:
  - name: llama
    aliases: [llama-3]
    replicas: 2
    profile: {engine: sim, max_loras: 4, max_lora_rank: 8}
  - name: qwen
    profile: {engine: sim}
"""


def parse(adapters: str) -> catalog.Catalog:
    return catalog.parse(yaml.safe_load(BASE + "adapters:\n" + adapters))


def problems(adapters: str) -> list[str]:
    with pytest.raises(catalog.CatalogError) as err:
        parse(adapters)
    return err.value.problems


def test_adapters_parse_into_declarations_and_the_profile_takes_its_slots():
    cat = parse(
        "  - {name: sql, base: llama, source: /lora/sql, tenants: [acme], pinned: 1}\n"
        "  - {name: chat, base: llama, source: /lora/chat}\n"
    )
    sql = cat.adapters[0].event()
    assert isinstance(sql, c.AdapterDeclared)
    assert (sql.name, sql.base, sql.source, sql.tenants, sql.pinned) == (
        "sql",
        "llama",
        "/lora/sql",
        ["acme"],
        1,
    )
    assert cat.adapters[1].event().tenants == [] and cat.adapters[1].event().pinned == 0
    profile = cat.models[0].event().profile
    assert (profile.max_loras, profile.max_lora_rank) == (4, 8)


def test_each_mistake_is_named_by_entry_and_field():
    got = problems(
        "  - {name: a, base: nope, source: /x}\n"
        "  - {name: b, base: llama, source: /x}\n"
        "  - {name: b, base: llama, source: /y}\n"
        "  - {name: llama-3, base: llama, source: /x}\n"
        "  - {name: qwen, base: llama, source: /x}\n"
        "  - {name: e, base: llama, source: ' '}\n"
        "  - {name: f, base: qwen, source: /x}\n"
        "  - {name: g, base: llama, source: /x, pinned: 3}\n"
        "  - {name: h, base: llama, source: /x, tenants: [ghost]}\n"
        "  - {name: i, base: llama, sorce: /x}\n"
    )
    assert got == [
        "adapters[9] (name=i): sorce: unknown field (known: base, name, pinned, source, tenants)",
        "adapters[2] (name=b): name: duplicate adapter (also adapters[1] (name=b))",
        "adapters[0] (name=a): base: 'nope' is not a model in this catalog (llama, qwen)",
        "adapters[3] (name=llama-3): name: 'llama-3' is already an alias of 'llama'",
        "adapters[4] (name=qwen): name: 'qwen' is already a model's name",
        "adapters[5] (name=e): source: must not be empty (the path its engines load)",
        "adapters[6] (name=f): base: model 'qwen' has no adapter slots (set its profile.max_loras)",
        "adapters[7] (name=g): pinned: 3 replica(s), but model 'llama' has at most 2",
        "adapters[8] (name=h): tenants: 'ghost' is not a tenant in this catalog",
    ]


def test_adapter_slots_in_a_profile_are_checked():
    bad = "models: [{name: m, profile: {max_loras: -1, max_lora_rank: 0}}]"
    with pytest.raises(catalog.CatalogError) as err:
        catalog.parse(yaml.safe_load(bad))
    assert err.value.problems == [
        "models[0] (name=m): profile.max_loras: must be 0 or more, got -1",
        "models[0] (name=m): profile.max_lora_rank: must be at least 1, got 0",
    ]


def test_apply_declares_after_models_removes_before_and_changes_name_the_field():
    cat = parse("  - {name: sql, base: llama, source: /lora/sql}\n")
    first = catalog.plan(cat, catalog.Current())
    kinds = [type(s.event).__name__ for s in first]
    assert kinds.index("AdapterDeclared") > kinds.index("ModelDeclared")
    current = catalog.Current()
    for i, step in enumerate(first, 1):
        current.add(f"s{i}", i, step.event)
    assert catalog.plan(cat, current) == []  # the same file twice: nothing

    moved = parse("  - {name: sql, base: llama, source: /lora/sql-v2}\n")
    assert [s.summary for s in catalog.plan(moved, current)] == ["adapter sql: changed (source)"]

    gone = catalog.parse(yaml.safe_load(BASE))
    steps = catalog.plan(gone, current)
    assert [s.summary for s in steps] == ["adapter sql: removed"]
    assert steps[0].event == c.AdapterRemoved(
        name="sql", id=steps[0].event.id, ts=steps[0].event.ts
    )


def test_apply_takes_adapters_the_trimmed_log_lost_from_the_folded_catalog():
    current = catalog.Current()
    sql = c.AdapterDeclared(name="sql", base="llama", source="/lora/sql")
    folded = {"models": [], "tenants": [], "bands": [], "adapters": [msgspec.to_builtins(sql)]}
    add_folded(current, folded)
    assert current.adapters["sql"].source == "/lora/sql"
    # An operator API from before adapters answers without them.
    add_folded(catalog.Current(), {"models": [], "tenants": [], "bands": []})
