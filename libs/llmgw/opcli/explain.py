"""`llmgw explain MODEL`: where a model's replicas run and why, or why they do not run.

Reads GET /api/explain/{model} from the operator API: the latest placement
decision or failure per replica, each with a verdict per node, as the
reconciler recorded it in the log, and the model's LoRA adapters: where the
leader placed each, where each engine reports holding it, and why (the latest
adapter placement's explanation). A disaggregated model shows each pool (count
wanted, placed, ready; its profile), the KV connector, and each replica's role.
MODEL may be an alias or an adapter, as clients send it. `-o json` prints the
API's answer as is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

import msgspec

from llmgw import contracts as c
from llmgw.opcli import apiclient
from llmgw.verdicttext import group_line


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model name (as declared in the catalog)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument(
        "--all", action="store_true", help="also show the decisions of retired replicas"
    )
    apiclient.add_api_argument(parser)
    apiclient.add_token_argument(parser)
    apiclient.add_api_tls_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        base = apiclient.find_api_url(args.api)
        path = f"/api/explain/{quote(args.model, safe='')}"
        data = apiclient.get_json(base, path, token=args.token, tls=apiclient.api_tls_flags(args))
    except apiclient.ApiError as exc:
        print(f"llmgw explain: {exc}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print("\n".join(render(data, show_retired=args.all)))
    return 0


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "?"


def _where(assignments: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"shard {a['shard_index']} on {a['node']} ({','.join(a['gpus'])})" for a in assignments
    )


def _roll_line(replicas: Iterable[dict[str, Any]]) -> list[str]:
    """While replicas run an earlier profile, how far the rolling update has come."""
    active = [r for r in replicas if not r.get("retired")]
    current = sum(1 for r in active if not r.get("outdated"))
    if current == len(active):
        return []
    return [
        f"rolling update in progress: {current} of {len(active)} replica(s) on the current profile"
    ]


def _outdated_mark(rep: dict[str, Any] | None) -> str:
    return "  (OUTDATED: placed with an earlier profile)" if rep and rep.get("outdated") else ""


SCALING_SHOWN = 10


def _scaling_lines(data: dict[str, Any]) -> list[str]:
    """An autoscaled model: its bounds, then its latest scaling decisions, oldest first."""
    spec = data.get("autoscale")
    if not spec:
        return []
    lines = [f"autoscaled: {_bounds(spec)}"]
    history = [ev for ev in data.get("scaling") or [] if not ev.get("role")]
    if not history:
        lines.append("  no scaling decision yet: at min until demand says otherwise")
    for ev in history[-SCALING_SHOWN:]:
        lines.append(f"  seq {ev['seq']}: {ev.get('explanation') or ev['rule']}")
    # A scale-up placement could not meet: say so here, next to the decision.
    active = sum(1 for r in data.get("replicas") or [] if not r.get("retired"))
    wanted = data.get("desired_replicas", 0)
    failed = [d for d in data.get("decisions") or [] if d.get("outcome") == "failed"]
    if active < wanted and failed:
        last = max(failed, key=lambda d: d["seq"])
        lines.append(f"  only {active} of {wanted} placed: {last.get('explanation', '')}")
    return lines


def _bounds(spec: dict[str, Any]) -> str:
    signal = spec.get("signal") or "load"
    target = "queued request(s) per replica" if signal == "queue" else "load"
    return (
        f"{spec.get('min')} to {spec.get('max')} replica(s), target {target} "
        f"{spec.get('target')} (up after {spec.get('scale_up_after_seconds'):g} s, "
        f"down after {spec.get('scale_down_after_seconds'):g} s)"
    )


def _adapter_lines(data: dict[str, Any]) -> list[str]:
    """A base model's adapters: placed where, held where (engines' reports), and why."""
    info = data.get("adapters") or {}
    declared = info.get("declared") or []
    if not declared:
        return []
    slots = (data.get("profile") or {}).get("max_loras", 0)
    lines = [f"adapters ({slots} slot(s) per replica):"]
    width = max(len(a["name"]) for a in declared)
    for a in declared:
        placed = ", ".join(a.get("placed_on") or []) or "-"
        held = ", ".join(a.get("held_on") or []) or "-"
        pinned = f"pinned on {a['pinned']}; " if a.get("pinned") else ""
        lines.append(f"  {a['name']:<{width}}  {pinned}placed on {placed}; held on {held}")
        for rid, answer in sorted((a.get("errors") or {}).items()):
            lines.append(f"  {'':<{width}}  ! {rid} failed to load it: {answer}")
    if info.get("decided_seq") is not None:
        why = info.get("explanation") or "no change explained"
        lines.append(
            f"  last placement seq {info['decided_seq']}, {_when(info.get('decided_at'))}: {why}"
        )
    else:
        lines.append("  no adapter placement yet: adapters are placed when requests ask for them")
    return lines


def _shape(p: dict[str, Any]) -> str:
    return (
        f"engine {p.get('engine', '?')}, {p.get('gpus_per_shard', 1)} GPU(s) per shard x "
        f"{p.get('shards_per_replica', 1)} shard(s)"
        + (f", selector {p['selector']}" if p.get("selector") else "")
    )


def _pool_lines(data: dict[str, Any]) -> list[str]:
    """A disaggregated model: each pool's counts and profile, and the KV connector."""
    spec = data.get("disaggregation")
    if not spec:
        return []
    lines = ["disaggregated: a prefill pool computes prompts, a decode pool generates"]
    for pool in data.get("pools") or []:
        whose = "its own profile" if pool.get("own_profile") else "the model's profile"
        lines.append(
            f"  {pool['role']:<7}  {pool['desired_replicas']} wanted, {pool['placed']} placed, "
            f"{pool['ready']} ready; {_shape(pool.get('profile') or {})} ({whose})"
        )
        if pool.get("autoscale"):
            lines.append(f"           autoscaled: {_bounds(pool['autoscale'])}")
            last = pool.get("last_scaling")
            lines.append(
                f"           seq {last['seq']}: {last.get('explanation') or last['rule']}"
                if last
                else "           no scaling decision yet: at min until demand says otherwise"
            )
    conn = spec.get("connector") or {}
    where = f", shared path {conn['shared_path']}" if conn.get("shared_path") else ""
    extra = f", extra {conn['extra']}" if conn.get("extra") else ""
    lines.append(f"  connector {conn.get('kind', '?')}{where}{extra}")
    if spec.get("min_prompt_tokens"):
        lines.append(
            f"  prompts under {spec['min_prompt_tokens']} tokens skip prefill (decode pool alone)"
        )
    return lines


def render(data: dict[str, Any], *, show_retired: bool = False) -> list[str]:
    model = data["model"]
    replicas = {r["replica_id"]: r for r in data.get("replicas") or []}
    kind = "an adapter" if data.get("asked_kind") == "adapter" else "an alias"
    lines = [f"{data['asked_as']} is {kind} of {model}"] if data.get("asked_as") else []
    if data.get("declared"):
        p = data.get("profile") or {}
        lines.append(f"{model}: {data.get('desired_replicas', 0)} replica(s) wanted; {_shape(p)}")
        lines.extend(_pool_lines(data))
        lines.extend(_roll_line(replicas.values()))
        lines.extend(_scaling_lines(data))
        lines.extend(_adapter_lines(data))
    else:
        lines.append(f"{model}: not in the catalog (removed); history follows")
    hidden = 0
    for d in sorted(data.get("decisions") or [], key=lambda d: d["seq"]):
        rep = replicas.get(d["replica_id"])
        if rep is not None and rep.get("retired") and not show_retired:
            hidden += 1
            continue
        lines.append("")
        role = f" ({d['role']})" if d.get("role") else ""
        head = (
            f"{d['replica_id']}{role}  seq {d['seq']}, based on seq {d['based_on_seq']}, "
            f"{_when(d.get('ts'))}"
        )
        if d["outcome"] == "failed":
            lines.append(f"{head}: NOT PLACED")
        else:
            verb = "adopted" if d.get("adopted") else "placed"
            where = _where(d.get("assignments") or [])
            lines.append(f"{head}: {verb}: {where}{_outdated_mark(rep)}")
        if rep is not None:
            state = rep["state"]
            if rep.get("retired"):
                state += f" ({rep.get('retired_reason') or 'retired'})"
            lines.append(f"  now: {state}")
        if d.get("explanation"):
            lines.append(f"  why: {d['explanation']}")
        width = max((len(v["node"]) for v in d.get("verdicts") or []), default=0)
        for v in d.get("verdicts") or []:
            mark = "+" if v["fits"] else "-"
            lines.append(f"  {mark} {v['node']:<{width}}  {v['reason']}")
        # A large fleet's other nodes, counted by kind of reason (absent in older events).
        for g in msgspec.convert(d.get("verdict_groups") or [], list[c.VerdictGroup]):
            lines.append(f"  {'+' if g.fits else '-'} {group_line(g)}")
    if not data.get("decisions"):
        lines.append("no placement decisions recorded yet")
    if hidden:
        lines.append("")
        lines.append(f"({hidden} retired replica(s) not shown; --all shows them)")
    return lines
