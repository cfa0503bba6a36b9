"""Prefill/decode disaggregation end to end on simulators: every part of issue #23 together.

The real-vLLM version (tests/realengine/test_pd_vllm.py) runs only with the real_engine
marker; this one runs by default. The local cluster `llmgw dev` runs (NATS, Postgres, a
reconciler, two agents launching sim engines, a router) gets a catalog declaring one
model disaggregated: one prefill and one decode replica, ExampleConnector on a tmp
folder. The reconciler places each pool, the agents launch the sims with their roles,
the projection tells the router which endpoint is which, and the router sends a long
prompt down both legs. The sims speak vLLM's protocol, so their /metrics show where the
prompt was computed: a wrong role, subject or field anywhere on that path shows up as a
decode engine computing a prompt it should have loaded.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest
import yaml

from llmgw.agent.state import StateDir
from llmgw.dev.routerkit import metric_sum
from tests.e2e import clusterkit as ck

pytestmark = pytest.mark.e2e

MODEL = "pd-sim"
MIN_PROMPT_TOKENS = 64  # the router estimates 4 bytes of body a token
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
# Quick start-ups and replacements: the cluster is on a shared 2-core box.
CLUSTER_ENV = {
    "LLMGW_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "LLMGW_ACTOR__UNREACHABLE_AFTER": "5",
    "LLMGW_ACTOR__LOST_AFTER": "15",
    "LLMGW_ACTOR__COMMAND_RETRY_INITIAL": "0.5",
}


def pd_catalog(shared: Path) -> dict:
    return {
        "models": [
            {
                "name": MODEL,
                "profile": {
                    "engine": "sim",
                    "model_ref": "sim/pd",
                    "gpus_per_shard": 1,
                    "engine_args": ["--itl-ms", "5", "--ttft-ms", "20"],
                },
                "disaggregation": {
                    "prefill": {"replicas": 1},
                    "decode": {"replicas": 1},
                    "connector": {"kind": "ExampleConnector", "shared_path": str(shared)},
                    "min_prompt_tokens": MIN_PROMPT_TOKENS,
                },
            }
        ]
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-cluster")
    empty = root / "catalog.yaml"  # no demo models: only the P/D model's sims start
    empty.write_text(yaml.safe_dump({"models": []}))
    c = ck.start_cluster(root / "cluster", env=CLUSTER_ENV, reconcilers=1, routers=1,
                         catalog=empty)  # fmt: skip
    try:
        yield c
    finally:
        c.stop()


def pools(cluster) -> dict[str, dict]:
    """The ready endpoint of each role, as the projection has it."""
    return {e.get("role", ""): e for e in ck.ready_endpoints(cluster, MODEL)}


@pytest.fixture(scope="module")
def applied(cluster, tmp_path_factory):
    ck.apply_catalog(cluster, pd_catalog(tmp_path_factory.mktemp("kv")))
    got = ck.wait(lambda: pools(cluster).keys() >= {"prefill", "decode"} and pools(cluster),
                  90, "a ready prefill and decode endpoint")  # fmt: skip
    urls = {got["prefill"]["url"], got["decode"]["url"]}
    ck.wait(
        lambda: ck.router_endpoint_urls(cluster.info["router_admin"][0], MODEL) >= urls,
        30,
        "the router to see both pools",
    )
    return got


def engine_counter(url: str, name: str, **labels: str) -> float:
    return metric_sum(httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).text, name, **labels)


def router_counter(cluster, name: str, **labels: str) -> float:
    text = httpx.get(cluster.info["router_admin"][0] + "/metrics", timeout=10).text
    return metric_sum(text, name, **labels)


def counters(cluster, got: dict) -> dict[str, float]:
    p, d = got["prefill"]["url"], got["decode"]["url"]
    legs = "llmgw_router_pd_legs_total"
    return {
        "p_prompt": engine_counter(p, "vllm:prompt_tokens_total"),
        "p_generated": engine_counter(p, "vllm:generation_tokens_total"),
        "d_external": engine_counter(d, BY_SOURCE, source="external_kv_transfer"),
        "d_local": engine_counter(d, BY_SOURCE, source="local_compute"),
        "prefill_legs": router_counter(cluster, legs, leg="prefill", outcome="ok"),
        "decode_legs": router_counter(cluster, legs, leg="decode", outcome="ok"),
        "short": router_counter(cluster, "llmgw_router_pd_whole_total", reason="short_prompt"),
        "fallbacks": router_counter(cluster, "llmgw_router_pd_fallbacks_total"),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in after.items() if v != before[k]}


def stream_chat(cluster, text: str, max_tokens: int = 8) -> tuple[httpx.Response, list[dict]]:
    """A streamed chat request through the router: its response and every event."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events = []
    url = f"{cluster.info['routers'][0]}/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp, events
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                events.append({"done": True})
            elif line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    return resp, events


def long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"the prefill engine computes part {i}" for i in range(40))


def check_whole_stream(resp: httpx.Response, events: list[dict], max_tokens: int) -> dict:
    assert resp.status_code == 200, resp.text
    assert events and events[-1] == {"done": True}, events[-3:]
    assert not any("error" in e for e in events), events
    text = "".join(
        ch["delta"].get("content") or "" for e in events[:-1] for ch in e.get("choices", [])
    )
    assert text
    usage = next(e["usage"] for e in events[:-1] if e.get("usage"))
    assert usage["completion_tokens"] == max_tokens
    return usage


def test_a_long_prompt_is_prefilled_on_one_sim_and_decoded_on_the_other(applied, cluster):
    got = applied
    before = counters(cluster, got)
    resp, events = stream_chat(cluster, long_prompt("long"), max_tokens=8)
    usage = check_whole_stream(resp, events, 8)
    assert resp.headers.get("x-llmgw-endpoint") == got["decode"]["shard_id"]
    n = usage["prompt_tokens"]
    assert n >= MIN_PROMPT_TOKENS
    # P computed the prompt and one token; D loaded the whole prompt, computed none of it.
    assert delta(counters(cluster, got), before) == {
        "p_prompt": n,
        "p_generated": 1,
        "d_external": n,
        "prefill_legs": 1,
        "decode_legs": 1,
    }


def test_a_short_prompt_skips_the_prefill_leg(applied, cluster):
    got = applied
    before = counters(cluster, got)
    resp, events = stream_chat(cluster, "hi", max_tokens=4)
    usage = check_whole_stream(resp, events, 4)
    assert resp.headers.get("x-llmgw-endpoint") == got["decode"]["shard_id"]
    # D computed it itself; P never saw it.
    assert delta(counters(cluster, got), before) == {
        "d_local": usage["prompt_tokens"],
        "short": 1,
    }


def test_explain_names_both_pools_and_each_replicas_role(applied, cluster):
    res = ck.cli(cluster, "explain", MODEL)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "disaggregated: a prefill pool computes prompts, a decode pool generates" in out
    for role in ("prefill", "decode"):
        pool = next(ln for ln in out.splitlines() if ln.strip().startswith(role + " "))
        assert "1 wanted, 1 placed, 1 ready" in pool, out
        assert f"{MODEL}-{role}-r1 ({role})" in out, out
    assert "connector ExampleConnector, shared path" in out
    assert f"prompts under {MIN_PROMPT_TOKENS} tokens skip prefill" in out


def engine_pid(cluster, url: str) -> int:
    for name in ("agent-1", "agent-2"):
        for rec in StateDir(Path(cluster.info["data_dir"]) / name).load_all():
            if rec.url.rstrip("/") == url.rstrip("/") and not rec.terminal:
                return rec.pid
    raise AssertionError(f"no live shard record for {url}")


def test_with_the_prefill_sim_killed_a_long_prompt_is_served_whole_on_decode(applied, cluster):
    # Last in the file: the prefill pool is down (and being replaced) afterwards.
    got = applied
    before = counters(cluster, got)
    os.killpg(engine_pid(cluster, got["prefill"]["url"]), signal.SIGKILL)
    resp, events = stream_chat(cluster, long_prompt("killed"), max_tokens=8)
    usage = check_whole_stream(resp, events, 8)
    assert resp.headers.get("x-llmgw-endpoint") == got["decode"]["shard_id"]
    d_local = engine_counter(got["decode"]["url"], BY_SOURCE, source="local_compute")
    assert d_local - before["d_local"] == usage["prompt_tokens"]  # D computed it all
    # The router's view may still list the dead sim (its attempt is refused) or have
    # dropped it already (no prefill endpoint): either way one request served whole.
    fallbacks = {
        reason: router_counter(cluster, "llmgw_router_pd_fallbacks_total", reason=reason)
        for reason in ("prefill_failed", "no_prefill_endpoint")
    }
    assert sum(fallbacks.values()) == before["fallbacks"] + 1, fallbacks
