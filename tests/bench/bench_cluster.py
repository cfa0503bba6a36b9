"""Cluster figures: `llmgw apply` to first served token, and failed requests under faults.

Run: .venv/bin/python tests/bench/bench_cluster.py

Starts the same local cluster `llmgw dev` runs (real processes), then:
  1. declares a new model with `llmgw apply` and times until a router streams its
     first token (placement, engine launch, readiness, projection, router view);
  2. for each fault (leader reconciler kill -9, NATS restart, agent kill -9) keeps
     OpenAI clients busy on both routers and counts failed requests (target: zero).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e import clusterkit as ck  # noqa: E402

ENV = {"LLMGW_ACTOR__UNREACHABLE_AFTER": "2", "LLMGW_ACTOR__LOST_AFTER": "4"}


def first_token_after_apply(cluster) -> float:
    catalog = ck.demo_catalog(cluster)
    catalog["models"].append(
        {
            "name": "bench-new",
            "replicas": 1,
            "profile": {"engine": "sim", "model_ref": "sim/new", "gpus_per_shard": 1},
        }
    )
    client = openai.OpenAI(
        base_url=cluster.info["routers"][0],
        api_key=cluster.info["api_key"],
        max_retries=0,
        timeout=10,
    )
    started = time.monotonic()
    ck.apply_catalog(cluster, catalog)
    while time.monotonic() - started < 120:
        try:
            stream = client.chat.completions.create(
                model="bench-new",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    return time.monotonic() - started
        except openai.APIError:
            time.sleep(0.05)
    raise SystemExit("bench-new never served")


def under_traffic(cluster, fault) -> tuple[int, list[str]]:
    with ck.Traffic(
        cluster.info["routers"], cluster.info["api_key"], "demo-chat", concurrency=8
    ) as traffic:
        time.sleep(1)
        fault()
        time.sleep(3)
    return traffic.ok, traffic.failures


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ck.start_cluster(Path(tmp) / "c", env=ENV)
        try:
            t = first_token_after_apply(cluster)
            rows.append(("apply -> first streamed token", f"{t:.2f} s", "informational"))

            def kill_leader():
                leader = ck.wait(lambda: ck.leader_api(cluster), 10, "a leader")
                name = "reconciler-1" if leader == cluster.info["api_urls"][0] else "reconciler-2"
                cluster.group.children[name].kill9()
                survivor = [u for u in cluster.info["api_urls"] if u != leader][0]
                ck.wait(lambda: ck.leader_api(cluster) == survivor, 20, "failover")
                cluster.info["api_url"] = survivor

            def restart_nats():
                cluster.nats.stop()
                time.sleep(2)
                cluster.nats.start()

            def kill_agent():
                cluster.group.children["agent-2"].kill9()
                ck.wait(
                    lambda: (
                        {e["node"] for e in ck.ready_endpoints(cluster, "demo-chat")} == {"node-1"}
                    ),
                    60,
                    "re-placement",
                )

            failed_total = 0
            for name, fault in (
                ("leader reconciler kill -9", kill_leader),
                ("NATS restart", restart_nats),
                ("agent kill -9", kill_agent),
            ):
                ok, failures = under_traffic(cluster, fault)
                failed_total += len(failures)
                rows.append(
                    (
                        f"{name}: requests ok / failed",
                        f"{ok} / {len(failures)}",
                        "PASS" if not failures else "FAIL",
                    )
                )
                for f in failures[:3]:
                    print("   ", f)
        finally:
            cluster.stop()
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, verdict in rows:
        print(f"{name.ljust(width)}  {value:>14}  {verdict}")
    ok = failed_total == 0
    print("\nPASS" if ok else "\nFAIL: requests failed during faults")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
