"""The agent's adapter plan (pure): what to unload and load to go from what an engine
holds to the set asked for; and how an engine's refusal reads in the status."""

import httpx

from llmgw.agent.lora import Plan, engine_answer, plan


def test_missing_adapters_are_loaded_and_extras_unloaded():
    assert plan({"a": "/p/a", "b": "/p/b"}, {"b": "/p/b", "c": "/p/c"}) == Plan(
        unload=["c"], load=[("a", "/p/a", False)]
    )


def test_an_adapter_held_from_another_path_is_loaded_in_place():
    assert plan({"a": "/p/a2"}, {"a": "/p/a1"}) == Plan(load=[("a", "/p/a2", True)])


def test_the_held_set_asked_for_again_needs_nothing():
    assert plan({"a": "/p/a"}, {"a": "/p/a"}) == Plan()
    assert plan({}, {}) == Plan()


def test_an_empty_set_unloads_everything():
    assert plan({}, {"a": "/p/a", "b": "/p/b"}) == Plan(unload=["a", "b"])


def test_the_engines_answer_keeps_its_status_and_message():
    body = {"error": {"message": "Loading lora x failed: No adapter found for /nope", "code": 404}}
    resp = httpx.Response(404, json=body)
    assert engine_answer(resp) == "HTTP 404: Loading lora x failed: No adapter found for /nope"
    assert engine_answer(httpx.Response(500, text="boom\n")) == "HTTP 500: boom"
