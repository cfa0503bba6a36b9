"""`llmgw explain` shows a base model's adapters: placed where, held where, and why."""

from __future__ import annotations

from llmgw.opcli import explain


def answer(**adapters) -> dict:
    return {
        "model": "m",
        "declared": True,
        "desired_replicas": 2,
        "profile": {"engine": "sim", "max_loras": 2},
        "decisions": [],
        "replicas": [],
        "adapters": adapters,
    }


def test_adapters_are_shown_with_placement_reports_failures_and_the_last_decision():
    data = answer(
        declared=[
            {"name": "sql", "pinned": 1, "placed_on": ["m-r1"], "held_on": ["m-r1"], "errors": {}},
            {
                "name": "chat",
                "pinned": 0,
                "placed_on": ["m-r2"],
                "held_on": [],
                "errors": {"m-r2": "404 NotFoundError: /l/chat"},
            },
        ],
        decided_seq=12,
        decided_at=1_800_000_000.0,
        explanation="chat loaded on m-r2: requests waiting and held nowhere",
    )
    lines = explain.render(data)
    assert "adapters (2 slot(s) per replica):" in lines
    assert "  sql   pinned on 1; placed on m-r1; held on m-r1" in lines
    assert "  chat  placed on m-r2; held on -" in lines
    assert "        ! m-r2 failed to load it: 404 NotFoundError: /l/chat" in lines
    assert lines[
        lines.index("        ! m-r2 failed to load it: 404 NotFoundError: /l/chat") + 1
    ] == (
        "  last placement seq 12, 2027-01-15 08:00:00 UTC: "
        "chat loaded on m-r2: requests waiting and held nowhere"
    )


def test_asked_by_adapter_name_it_says_whose_adapter_it_is():
    data = answer(declared=[{"name": "sql", "placed_on": [], "held_on": []}])
    lines = explain.render({**data, "asked_as": "sql", "asked_kind": "adapter"})
    assert lines[0] == "sql is an adapter of m"
    assert lines[-1] != "" and any("no adapter placement yet" in x for x in lines)
