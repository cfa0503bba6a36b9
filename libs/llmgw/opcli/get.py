"""`llmgw get nodes|models|replicas|endpoints|adapters|tenants|bands`: what the control
plane knows.

Reads the reconciler's operator API (leader or standby: both serve from
Postgres). `-o json` prints the API's answer as is; the table is for people.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from . import apiclient, output

Rows = tuple[list[str], list[list[Any]]]


def _nodes(items: list[dict[str, Any]]) -> Rows:
    rows = []
    for n in items:
        kinds = Counter(
            f"{g.get('name', '?')} {output.gib(g.get('memory_bytes', 0))}" for g in n["gpus"]
        )
        gpus = ", ".join(f"{count}x {kind}" for kind, count in sorted(kinds.items()))
        labels = output.csv(f"{k}={v}" for k, v in sorted(n["labels"].items()))
        rows.append(
            [
                n["node"],
                n["liveness"],
                gpus or "0",
                len(n["busy_gpus"]),
                n["active_shards"],
                n["address"],
                labels,
            ]
        )
    return ["NODE", "LIVENESS", "GPUS", "BUSY", "SHARDS", "ADDRESS", "LABELS"], rows


def _models(items: list[dict[str, Any]]) -> Rows:
    rows = [
        [
            m["name"],
            m["engine"],
            f"{m['ready_replicas']}/{m['replicas']}",
            m["profile"].get("gpus_per_shard", 1),
            m["profile"].get("shards_per_replica", 1),
            output.csv(m["aliases"]),
            output.csv(m["fallbacks"]),
        ]
        for m in items
    ]
    return ["NAME", "ENGINE", "READY", "GPUS/SHARD", "SHARDS/REPLICA", "ALIASES", "FALLBACKS"], rows


def _profile(r: dict[str, Any]) -> str:
    """Outdated: placed with an earlier profile of its model, so a rolling update replaces it."""
    if r.get("outdated"):
        return "outdated"
    # Retired, not placed yet, or placed before digests were recorded: nothing to say.
    return "current" if r.get("profile_digest") and not r["retired"] else ""


def _replicas(items: list[dict[str, Any]]) -> Rows:
    rows = []
    for r in items:
        nodes = output.csv(sorted({s["node"] for s in r["shards"]}))
        urls = output.csv(s["url"] for s in r["shards"] if s["url"])
        info = r.get("explanation") or r.get("retired_reason") or ""
        rows.append([r["replica_id"], r["model"], r["state"], _profile(r), nodes, urls, info])
    return ["REPLICA", "MODEL", "STATE", "PROFILE", "NODES", "URLS", "INFO"], rows


def _endpoints(items: list[dict[str, Any]]) -> Rows:
    rows = []
    for m in items:
        if not m["endpoints"]:
            rows.append([m["model"], "", "none", "", ""])
        for e in m["endpoints"]:
            rows.append([m["model"], e["shard_id"], e["state"], e["node"], e["url"]])
    return ["MODEL", "SHARD", "STATE", "NODE", "URL"], rows


def _adapters(items: list[dict[str, Any]]) -> Rows:
    rows = []
    for a in items:
        failed = output.csv(f"{rid}: {answer}" for rid, answer in sorted(a["errors"].items()))
        rows.append(
            [
                a["name"],
                a["base"],
                a["pinned"] or "",
                output.csv(a["placed_on"]),
                output.csv(a["held_on"]),
                output.csv(a["tenants"]),
                failed,
            ]
        )
    return ["NAME", "BASE", "PINNED", "PLACED", "HELD", "TENANTS", "FAILED LOADS"], rows


def _tenants(items: list[dict[str, Any]]) -> Rows:
    rows = [
        [
            t["name"],
            t["band"],
            t["keys"],
            t["quotas"].get("rpm"),
            t["quotas"].get("tpm"),
            t["quotas"].get("concurrency"),
        ]
        for t in items
    ]
    return ["NAME", "BAND", "KEYS", "RPM", "TPM", "CONCURRENCY"], rows


def _bands(items: list[dict[str, Any]]) -> Rows:
    rows = [[b["name"], b["ceiling"], b["queue_capacity"], b["queue_ttl_seconds"]] for b in items]
    return ["NAME", "CEILING", "QUEUE", "TTL_SECONDS"], rows


KINDS: dict[str, Callable[[list[dict[str, Any]]], Rows]] = {
    "nodes": _nodes,
    "models": _models,
    "replicas": _replicas,
    "endpoints": _endpoints,
    "adapters": _adapters,
    "tenants": _tenants,
    "bands": _bands,
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=list(KINDS), help="what to list")
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")
    apiclient.add_api_argument(parser)
    apiclient.add_token_argument(parser)
    apiclient.add_api_tls_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        base = apiclient.find_api_url(args.api)
        tls = apiclient.api_tls_flags(args)
        items = apiclient.get_json(base, f"/api/{args.kind}", token=args.token, tls=tls)
    except apiclient.ApiError as exc:
        print(f"llmgw get: {exc}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(output.to_json(items))
    else:
        headers, rows = KINDS[args.kind](items)
        print(output.table(headers, rows))
    return 0
