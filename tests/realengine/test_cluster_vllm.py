"""A whole cluster (`llmgw dev --engine vllm`) whose agents launch real vLLM engines.

In order, on one cluster: `llmgw apply` makes the agents launch two real vLLM
replicas (and the time from apply to the first token is measured); a kill -9 of one
engine under SDK traffic through both routers; a scale-down that drains a real vLLM
before stopping it. The model migrates streams (`migration: {max: 2}`): neither the
kill nor the drain deadline, which long streams outlive, may cut one.
"""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmgw.agent import procs as engine_procs
from llmgw.agent.state import StateDir
from llmgw.dev import catalog as devcatalog
from tests.e2e import clusterkit as ck
from tests.realengine import kit

pytestmark = pytest.mark.real_engine

MODEL = devcatalog.VLLM_MODEL
# Short liveness and retry timings, as in the sim cluster test.
ENV = {
    "LLMGW_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "LLMGW_ACTOR__UNREACHABLE_AFTER": "5",
    "LLMGW_ACTOR__LOST_AFTER": "15",
    "LLMGW_ACTOR__COMMAND_RETRY_INITIAL": "0.5",
    "LLMGW_ACTOR__REPLACE_BACKOFF_INITIAL": "0.5",
    # Shorter than the scale-down test's streams: they are stopped mid-way and migrate.
    "LLMGW_ACTOR__DRAIN_DEADLINE": "1",
}
# Prompt plus the text sent, re-tokenized, grows (a random model's bytes decode to
# U+FFFD, three bytes each): long streams stay well inside max_model_len (1024).
LONG_TOKENS = 300
KILL_TOKENS = 160  # long enough that the victim is mid-stream when killed


def catalog(model_path, replicas: int) -> dict:
    # No tenants: requests are served as one anonymous tenant, no key needed.
    return {
        "models": [
            {
                "name": MODEL,
                "replicas": replicas,
                "migration": {"max": 2},
                **_profile(model_path),
            }
        ]
    }


def _profile(model_path) -> dict:
    return {"profile": devcatalog.vllm_profile(str(model_path))}


@pytest.fixture(scope="module")
def cluster(vllm_python, tiny_model, tmp_path_factory):
    first = tmp_path_factory.mktemp("catalog") / "catalog.yaml"
    first.write_text(yaml.safe_dump(catalog(tiny_model, 0)))
    c = ck.start_cluster(
        tmp_path_factory.mktemp("cluster"),
        env=ENV,
        reconcilers=1,
        engine="vllm",
        vllm_python=vllm_python,
        model_path=str(tiny_model),
        catalog=first,
        ready_timeout=60.0,
        # Ports of our own: an engine of another cluster on this machine taking a killed
        # engine's port would answer the routers' stale requests with its own 404.
        engine_port_base=random.randrange(20200, 23000, 200),
    )
    try:
        yield c
    finally:
        c.stop()


def records(cluster) -> list:
    out = []
    for name in ("agent-1", "agent-2"):
        out += StateDir(ck.Path(cluster.info["data_dir"]) / name).load_all()
    return out


def ready_urls(cluster) -> set[str]:
    return {e["url"].rstrip("/") for e in ck.ready_endpoints(cluster, MODEL)}


def wait_routers(cluster, expected: set[str], timeout: float = 60) -> None:
    ck.wait(
        lambda: all(
            ck.router_endpoint_urls(a, MODEL) == expected for a in cluster.info["router_admin"]
        ),
        timeout,
        f"routers to converge on {len(expected)} endpoints",
    )


def generated(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "vllm:generation_tokens_total"
    )


def generating(url: str) -> bool:
    """The engine produced tokens in the last 50 ms: its streams have bytes out.

    Not vllm:num_requests_running: that gauge keeps its last value while the engine is
    idle, so a kill timed by it can land between requests (and migrate nothing)."""
    before = generated(url)
    time.sleep(0.05)
    return generated(url) > before


def migrations(cluster) -> int:
    """Streams the routers continued on another engine, so far."""
    total = 0.0
    for admin in cluster.info["router_admin"]:
        text = httpx.get(admin + "/metrics", timeout=10).text
        total += sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "llmgw_router_migrations_total"
        )
    return int(total)


def test_dev_says_what_the_applied_catalog_serves(cluster):
    assert cluster.info["models"] == [MODEL]
    assert cluster.info["api_key"] is None  # the catalog has no tenants: no key needed


def test_apply_launches_two_real_vllm_replicas_and_the_first_token_follows(
    cluster, tiny_model, capsys
):
    client = openai.OpenAI(
        base_url=cluster.info["routers"][0], api_key="unused", max_retries=0, timeout=60
    )

    def first_token() -> bool:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            extra_body=kit.NO_EOS,
        )
        return any(ch.choices and ch.choices[0].delta.content for ch in stream)

    t0 = time.monotonic()
    ck.apply_catalog(cluster, catalog(tiny_model, 2))
    kit.wait(first_token, 600, "the first token through the router", interval=0.25)
    kit.report(capsys, f"llmgw apply -> first token with real vLLM: {time.monotonic() - t0:.1f}s")
    ck.wait(lambda: len(ready_urls(cluster)) == 2, 600, "both replicas ready")
    kit.report(capsys, f"llmgw apply -> both replicas ready: {time.monotonic() - t0:.1f}s")
    assert {e["node"] for e in ck.ready_endpoints(cluster, MODEL)} == {"node-1", "node-2"}
    engines = [r for r in records(cluster) if r.state.value == "ready"]
    assert len(engines) == 2
    for rec in engines:  # real vLLM processes, launched by the agents from their command
        assert engine_procs.is_alive(rec.pid, rec.proc_start, rec.kernel_boot_id)
        with open(f"/proc/{rec.pid}/cmdline", "rb") as f:
            assert b"vllm.entrypoints.openai.api_server" in f.read()
    wait_routers(cluster, ready_urls(cluster))


def test_kill_9_of_an_engine_under_traffic_is_replaced_and_reported(cluster, capsys):
    wait_routers(cluster, ready_urls(cluster))
    victim = next(r for r in records(cluster) if r.state.value == "ready")
    moved = migrations(cluster)
    with kit.Traffic(
        cluster.info["routers"], "unused", MODEL, concurrency=4, max_tokens=KILL_TOKENS
    ) as traffic:
        kit.wait(lambda: traffic.ok() >= 8, 120, "traffic to flow")
        # Killed while it answers: its streams are the ones that must not be cut.
        kit.wait(lambda: generating(victim.url.rstrip("/")), 120, "the victim generating", 0)
        os.killpg(victim.pid, signal.SIGKILL)

        def failed():
            return next(
                (
                    s
                    for s in ck.events(cluster, "shard.status", MODEL)
                    if s["shard_id"] == victim.shard_id and s["state"] == "failed"
                ),
                None,
            )

        status = ck.wait(failed, 60, "the kill to be reported")
        # By shard, not URL: the replacement may well get the freed port back.
        ck.wait(
            lambda: (
                len(ready := ck.ready_endpoints(cluster, MODEL)) == 2
                and victim.shard_id not in {e["shard_id"] for e in ready}
            ),
            600,
            "a replacement engine",
        )
        wait_routers(cluster, ready_urls(cluster))
        settled = traffic.ok()
        kit.wait(lambda: traffic.ok() >= settled + 8, 120, "traffic through the replacement")
    failures = traffic.failures()
    moved = migrations(cluster) - moved
    kit.report(
        capsys,
        f"kill -9 under traffic: {traffic.ok()} ok, {len(failures)} failed "
        f"({sum(f.stream for f in failures)} streams cut mid-answer), "
        f"{moved} streams migrated",
    )
    assert status["exit_code"] == -9
    tail = "\n".join(status["output_tail"])
    assert "vllm" in tail.lower() or "INFO" in tail, tail  # vLLM's own output, not probes
    assert "GET /metrics" not in tail
    # A request is retried elsewhere while nothing of it has reached the client, and a
    # stream the dying engine had begun continues on the other one: nothing fails, and
    # every stream has its max_tokens tokens (kit.Traffic checks the usage).
    assert failures == [], failures[:5]
    # Not asserted: moved >= 1. Whether the victim had sent a byte of any stream when the
    # kill landed is the real engine's timing (a loaded CI box ran 106 requests through it
    # with 0 migrated and 0 failed: the killed requests were still in prefill and retried).
    # tests/e2e/test_router_migration.py pins the migration itself on sims.


def test_a_scale_down_drains_a_real_vllm_before_stopping_it(cluster, tiny_model, capsys):
    wait_routers(cluster, ready_urls(cluster))
    before = {
        s["shard_id"] for s in ck.events(cluster, "shard.status", MODEL) if s["state"] == "stopped"
    }
    moved = migrations(cluster)
    with kit.Traffic(
        cluster.info["routers"], "unused", MODEL, concurrency=4, max_tokens=LONG_TOKENS
    ) as traffic:
        kit.wait(lambda: traffic.ok() >= 4, 300, "long streams to flow")
        # Whichever replica is retired, it has streams in flight when its drain begins.
        kit.wait(lambda: all(generating(u) for u in ready_urls(cluster)), 120, "both generating")
        t0 = time.monotonic()
        ck.apply_catalog(cluster, catalog(tiny_model, 1))
        ck.wait(lambda: len(ready_urls(cluster)) == 1, 120, "scale down to one replica")
        wait_routers(cluster, ready_urls(cluster))
        stopped = ck.wait(
            lambda: (
                {
                    s["shard_id"]
                    for s in ck.events(cluster, "shard.status", MODEL)
                    if s["state"] == "stopped"
                }
                - before
            ),
            120,
            "the retired engine to stop",
        )
        kit.report(capsys, f"scale-down: drained and stopped in {time.monotonic() - t0:.1f}s")
        settled = traffic.ok()
        kit.wait(lambda: traffic.ok() >= settled + 4, 300, "traffic on the remaining replica")
    moved = migrations(cluster) - moved
    kit.report(
        capsys,
        f"scale-down with {LONG_TOKENS}-token streams, drain deadline "
        f"{ENV['LLMGW_ACTOR__DRAIN_DEADLINE']}s: {traffic.ok()} ok, "
        f"{len(traffic.failures())} failed, {moved} streams migrated",
    )
    assert traffic.failures() == [], traffic.failures()[:5]  # none cut at the deadline
    # Not asserted: moved >= 1 (see the kill test): on a loaded box the retired engine's
    # streams may all end inside its drain; the sim e2e test pins the hand-over itself.
    [sid] = stopped
    seq = [s["state"] for s in ck.events(cluster, "shard.status", MODEL) if s["shard_id"] == sid]
    assert "draining" in seq and seq.index("draining") < seq.index("stopped"), seq
    rec = next(r for r in records(cluster) if r.shard_id == sid)
    assert not engine_procs.group_alive(rec.pid)  # the vLLM process group is gone
