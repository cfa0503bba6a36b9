"""The operator read side: queries over the projection tables, shaped for JSON.

Leader and standbys answer alike: everything comes from Postgres, which the
leader keeps in step with the log. Each function takes an open connection and
returns builtins (lists and dicts) ready to encode.
"""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy import and_, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw import contracts as c
from llmgw import subjects
from llmgw.reconciler.state.model import pool_profile, profile_digest
from llmgw.reconciler.state.queries import is_outdated
from llmgw.reconciler.store import rows, store
from llmgw.reconciler.store import tables as t

_ACTIVE_SHARD = t.Shard.state.not_in([s.value for s in c.TERMINAL_SHARD_STATES])
# The state a replica shows: its least advanced shard's.
_STATE_ORDER = ["failed", "stopped", "pending", "validating", "launching", "loading", "draining"]
MAX_EVENTS = 10_000


async def _rows(conn: AsyncConnection, stmt) -> list[dict[str, Any]]:
    return [dict(row) for row in (await conn.execute(stmt)).mappings()]


async def nodes(conn: AsyncConnection) -> list[dict[str, Any]]:
    busy: dict[str, list[str]] = {}
    active: dict[str, int] = {}
    for row in await _rows(conn, select(t.Shard.node, t.Shard.gpus).where(_ACTIVE_SHARD)):
        busy.setdefault(row["node"], []).extend(row["gpus"])
        active[row["node"]] = active.get(row["node"], 0) + 1
    out = []
    for row in await _rows(conn, select(t.Node.__table__).order_by(t.Node.node)):
        gpus = sorted(row["gpus"].values(), key=lambda g: g.get("index", 0))
        out.append(
            {
                "node": row["node"],
                "liveness": row["liveness"],
                "liveness_since": row["liveness_since"],
                "address": row["host"].get("address", ""),
                "labels": row["labels"],
                "engines": row["engines"],
                "gpus": gpus,
                "busy_gpus": sorted(busy.get(row["node"], [])),
                "active_shards": active.get(row["node"], 0),
                "host": row["host"],
                "boot_id": row["boot_id"],
                "registered_at": row["registered_at"],
                "registered_seq": row["registered_seq"],
            }
        )
    return out


def _replica_state(shards: list[dict[str, Any]], retired: bool) -> str:
    if retired:
        return "retired"
    if not shards:
        return "pending"
    states = {s["state"] for s in shards}
    for state in _STATE_ORDER:
        if state in states:
            return state
    return "ready"


def _digest(profile: dict[str, Any]) -> str:
    # Through the struct, so defaults of fields added since the row was written count
    # exactly as they do in the reconciler's in-memory state.
    return profile_digest(msgspec.convert(profile, c.ServingProfile))


def _pool_digests(row: dict[str, Any]) -> dict[tuple[str, str], str]:
    """(model, role) -> the digest of the profile its replicas of that pool should run."""
    decl = msgspec.convert(
        {"name": row["name"], "profile": row["profile"], "disaggregation": row["disaggregation"]},
        c.ModelDeclared,
    )
    roles = c.PD_ROLES if decl.disaggregation is not None else ("",)
    return {(decl.name, role): profile_digest(pool_profile(decl, role)) for role in roles}


async def _declared_digests(conn: AsyncConnection, model: str | None) -> dict[tuple[str, str], str]:
    q = select(t.Model.name, t.Model.profile, t.Model.disaggregation)
    if model is not None:
        q = q.where(t.Model.name == model)
    out: dict[tuple[str, str], str] = {}
    for row in await _rows(conn, q):
        out.update(_pool_digests(row))
    return out


async def _replicas_with_shards(
    conn: AsyncConnection, model: str | None = None
) -> list[dict[str, Any]]:
    rq = select(t.Replica.__table__).order_by(t.Replica.model, t.Replica.replica_id)
    sq = select(t.Shard.__table__).order_by(t.Shard.replica_id, t.Shard.shard_index)
    if model is not None:
        rq = rq.where(t.Replica.model == model)
        sq = sq.where(t.Shard.model == model)
    declared = await _declared_digests(conn, model)
    by_replica: dict[str, list[dict[str, Any]]] = {}
    for shard in await _rows(conn, sq):
        by_replica.setdefault(shard["replica_id"], []).append(
            {
                k: shard[k]
                for k in (
                    "shard_id",
                    "shard_index",
                    "node",
                    "state",
                    "url",
                    "gpus",
                    "reason",
                    "adapters",
                    "adapter_errors",
                )
            }
        )
    out = []
    for rep in await _rows(conn, rq):
        shards = by_replica.get(rep["replica_id"], [])
        pool = (rep["model"], rep["role"])
        out.append(
            {
                "replica_id": rep["replica_id"],
                "model": rep["model"],
                "role": rep["role"],
                "state": _replica_state(shards, rep["retired"]),
                "retired": rep["retired"],
                "retired_reason": rep["retired_reason"],
                "decided_seq": rep["decided_seq"],
                "profile_digest": rep["profile_digest"],
                # As queries.outdated() sees it: active, and placed with another
                # profile than the one declared now for its pool. A rolling update
                # replaces it.
                "outdated": not rep["retired"]
                and pool in declared
                and is_outdated(rep["profile_digest"], declared[pool]),
                "shards": shards,
            }
        )
    return out


async def models(conn: AsyncConnection) -> list[dict[str, Any]]:
    counts: dict[str, dict[str, int]] = {}
    for rep in await _replicas_with_shards(conn):
        if rep["retired"]:
            continue
        n = counts.setdefault(rep["model"], {"active": 0, "ready": 0})
        n["active"] += 1
        n["ready"] += rep["state"] == "ready"
    scaled: dict[str, dict[str, int]] = {}
    cols = (t.ModelScaling.model, t.ModelScaling.role, t.ModelScaling.to_replicas)
    for r in await _rows(conn, select(*cols)):
        scaled.setdefault(r["model"], {})[r["role"]] = r["to_replicas"]
    out = []
    for row in await _rows(conn, select(t.Model.__table__).order_by(t.Model.name)):
        n = counts.get(row["name"], {"active": 0, "ready": 0})
        out.append(
            {
                "name": row["name"],
                "aliases": row["aliases"],
                "fallbacks": row["fallbacks"],
                "replicas": _desired(row, scaled.get(row["name"], {})),
                "autoscale": row["autoscale"],
                "disaggregation": row["disaggregation"],
                "active_replicas": n["active"],
                "ready_replicas": n["ready"],
                "engine": row["profile"].get("engine", ""),
                "profile": row["profile"],
                "scheduling": row["scheduling"],
                "deadlines": row["deadlines"],
                "declared_at": row["event_ts"],
            }
        )
    return out


def _desired(model_row: dict[str, Any], scaled_to: dict[str, int]) -> int:
    """The desired count as the fold has it (ClusterState.desired_replicas); `scaled_to`:
    the autoscaler's latest count by role ("": the whole model's)."""
    pools = model_row.get("disaggregation")
    if pools is not None:
        return sum(_within(pools.get(role, {}), scaled_to.get(role)) for role in c.PD_ROLES)
    return _within(model_row, scaled_to.get(""))


def _within(counted: dict[str, Any], scaled_to: int | None) -> int:
    """A model's or pool's count: its fixed replicas, or its autoscaled count in bounds."""
    if counted.get("autoscale") is None:
        return counted.get("replicas", 1)
    spec = msgspec.convert(counted["autoscale"], c.AutoscaleSpec)
    n = scaled_to if scaled_to is not None else spec.min
    return min(spec.max, max(spec.min, n))


async def replicas(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Placed replicas, then replicas that could not be placed (state 'unplaced')."""
    out = await _replicas_with_shards(conn)
    fq = select(t.PlacementFailure.__table__).order_by(
        t.PlacementFailure.model, t.PlacementFailure.replica_id
    )
    for row in await _rows(conn, fq):
        out.append(
            {
                "replica_id": row["replica_id"],
                "model": row["model"],
                "role": row["role"],
                "state": "unplaced",
                "retired": False,
                "retired_reason": "",
                "decided_seq": row["based_on_seq"],
                "profile_digest": "",
                "outdated": False,
                "explanation": row["explanation"],
                "shards": [],
            }
        )
    return out


async def endpoints(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Per declared model (and any model still serving): its ready and draining shards."""
    by_model: dict[str, list[dict[str, Any]]] = {
        name: [] for name in (await conn.execute(select(t.Model.name))).scalars()
    }
    q = (
        select(t.Shard.__table__)
        .where(t.Shard.state.in_(["ready", "draining"]), t.Shard.url != "")
        .order_by(t.Shard.model, t.Shard.shard_id)
    )
    rq = select(t.Replica.replica_id, t.Replica.role).where(t.Replica.role != "")
    roles = {row["replica_id"]: row["role"] for row in await _rows(conn, rq)}
    for shard in await _rows(conn, q):
        by_model.setdefault(shard["model"], []).append(
            {
                "shard_id": shard["shard_id"],
                "url": shard["url"],
                "node": shard["node"],
                "replica_id": shard["replica_id"],
                "role": roles.get(shard["replica_id"], ""),
                "state": shard["state"],
            }
        )
    return [{"model": m, "endpoints": eps} for m, eps in sorted(by_model.items())]


async def tenants(conn: AsyncConnection) -> list[dict[str, Any]]:
    out = []
    for row in await _rows(conn, select(t.Tenant.__table__).order_by(t.Tenant.name)):
        out.append(
            {
                "name": row["name"],
                "band": row["band"],
                "keys": len(row["key_hashes"]),
                "quotas": row["quotas"],
                "declared_at": row["event_ts"],
            }
        )
    return out


async def catalog(conn: AsyncConnection) -> dict[str, Any]:
    """The folded catalog as its declarations (ModelDeclared, TenantDeclared, Band,
    AdapterDeclared): what `llmgw apply` diffs against where the stream no longer holds
    every declaration."""
    tables = (t.Model.__table__, t.Tenant.__table__, t.Adapter.__table__, rows.BANDS_TABLE)
    folded = rows.state_from_rows(
        {tbl.name: await _rows(conn, select(tbl)) for tbl in tables},
        await store.read_position(conn) or 0,
    )
    return {
        "folded_seq": folded.last_seq,
        "models": [msgspec.to_builtins(m) for _, m in sorted(folded.models.items())],
        "tenants": [msgspec.to_builtins(x) for _, x in sorted(folded.tenants.items())],
        "bands": [msgspec.to_builtins(b) for b in folded.bands],
        "adapters": [msgspec.to_builtins(a) for _, a in sorted(folded.adapters.items())],
    }


async def bands(conn: AsyncConnection) -> list[dict[str, Any]]:
    rows = await _rows(conn, select(t.BandRow.__table__).order_by(t.BandRow.position))
    return [{k: v for k, v in row.items() if k != "position"} for row in rows]


async def events(
    conn: AsyncConnection, from_seq: int = 1, to_seq: int | None = None, limit: int = 1000
) -> list[dict[str, Any]]:
    limit = max(1, min(limit, MAX_EVENTS))
    cond = [t.ArchivedEvent.seq >= from_seq]
    if to_seq is not None:
        cond.append(t.ArchivedEvent.seq <= to_seq)
    q = select(t.ArchivedEvent.__table__).where(and_(*cond)).order_by(t.ArchivedEvent.seq)
    out = []
    for row in await _rows(conn, q.limit(limit)):
        out.append(
            {
                "seq": row["seq"],
                "subject": row["subject"],
                "type": row["type"],
                "id": row["msg_id"],
                "ts": row["ts"],
                "event": msgspec.json.decode(row["payload"]),
            }
        )
    return out


async def dead_letters(conn: AsyncConnection, limit: int = 100) -> list[dict[str, Any]]:
    q = select(t.DeadLetter.__table__).order_by(t.DeadLetter.seq.desc()).limit(limit)
    return [
        {
            "seq": row["seq"],
            "subject": row["subject"],
            "reason": row["reason"],
            "raw": row["raw"].decode("utf-8", "replace"),
            "received_at": row["received_at"],
        }
        for row in await _rows(conn, q)
    ]


async def _model_of_alias(conn: AsyncConnection, alias: str) -> str | None:
    """The declared model that `alias` names (the catalog keeps aliases unique)."""
    for row in await _rows(conn, select(t.Model.name, t.Model.aliases)):
        if alias in (row["aliases"] or []):
            return row["name"]
    return None


async def _base_of_adapter(conn: AsyncConnection, name: str) -> str | None:
    rows_ = await _rows(conn, select(t.Adapter.base).where(t.Adapter.name == name))
    return rows_[0]["base"] if rows_ else None


async def _adapter_views(conn: AsyncConnection, base: str | None) -> list[dict[str, Any]]:
    """Declared adapters (of one base model, or all): where the leader placed each, where
    each serving engine reports holding it, and what an engine answered to a failed load."""
    aq = select(t.Adapter.__table__).order_by(t.Adapter.name)
    hq = select(t.AdapterHolding.model, t.AdapterHolding.holdings)
    sq = select(t.Shard.__table__).where(
        t.Shard.state.in_(["ready", "draining"]), t.Shard.shard_index == 0
    )
    if base is not None:
        aq = aq.where(t.Adapter.base == base)
        hq = hq.where(t.AdapterHolding.model == base)
        sq = sq.where(t.Shard.model == base)
    holdings = {row["model"]: row["holdings"] for row in await _rows(conn, hq)}
    shards = await _rows(conn, sq.order_by(t.Shard.replica_id))
    out = []
    for a in await _rows(conn, aq):
        mine = [sh for sh in shards if sh["model"] == a["base"]]
        out.append(
            {
                "name": a["name"],
                "base": a["base"],
                "source": a["source"],
                "tenants": a["tenants"],
                "pinned": a["pinned"],
                "placed_on": sorted(
                    rid for rid, held in holdings.get(a["base"], {}).items() if a["name"] in held
                ),
                "held_on": [sh["replica_id"] for sh in mine if a["name"] in (sh["adapters"] or [])],
                "errors": {
                    sh["replica_id"]: sh["adapter_errors"][a["name"]]
                    for sh in mine
                    if a["name"] in (sh["adapter_errors"] or {})
                },
            }
        )
    return out


async def adapters(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Every declared adapter, placed where and held where (`llmgw get adapters`)."""
    return await _adapter_views(conn, None)


async def adapters_of(conn: AsyncConnection, model: str) -> dict[str, Any]:
    """The adapters declared on base `model`, and the latest placement's explanation."""
    placed_rows = await _rows(
        conn, select(t.AdapterHolding.__table__).where(t.AdapterHolding.model == model)
    )
    placed = placed_rows[0] if placed_rows else None
    return {
        "declared": await _adapter_views(conn, model),
        "decided_seq": placed["decided_seq"] if placed else None,
        "decided_at": placed["decided_at"] if placed else None,
        "explanation": placed["explanation"] if placed else "",
    }


async def explain(conn: AsyncConnection, model: str) -> dict[str, Any] | None:
    """The latest decision or failure per replica of `model` (a name, an alias or an
    adapter, as clients send it), with every node's verdict, and its adapters."""
    declared = (await _rows(conn, select(t.Model.__table__).where(t.Model.name == model))) or None
    if declared is None:
        named = await _model_of_alias(conn, model)
        if named is not None:
            return {**(await explain(conn, named) or {}), "asked_as": model}
        base = await _base_of_adapter(conn, model)
        if base is not None:
            return {**(await explain(conn, base) or {}), "asked_as": model, "asked_kind": "adapter"}
    latest = (
        select(func.max(t.PlacementDecision.seq))
        .where(t.PlacementDecision.model == model)
        .group_by(t.PlacementDecision.replica_id)
    )
    q = (
        select(t.PlacementDecision.__table__)
        .where(t.PlacementDecision.seq.in_(latest))
        .order_by(t.PlacementDecision.replica_id)
    )
    decisions = await _rows(conn, q)
    replicas_now = await _replicas_with_shards(conn, model)
    if declared is None and not decisions and not replicas_now:
        return None
    autoscaled = declared[0].get("autoscale") if declared else None
    history = await scaling_history(conn, model)
    latest = {h.get("role", ""): h for h in history}  # the last decision per model or pool
    scaled_to = {role: h["to_replicas"] for role, h in latest.items()}
    desired = _desired(declared[0], scaled_to) if declared else 0
    return {
        "model": model,
        "declared": declared is not None,
        "desired_replicas": desired,
        "autoscale": autoscaled,
        "scaling": history,
        "profile": declared[0]["profile"] if declared else None,
        "profile_digest": _digest(declared[0]["profile"]) if declared else None,
        "decisions": decisions,
        "replicas": replicas_now,
        "adapters": await adapters_of(conn, model),
        "disaggregation": declared[0]["disaggregation"] if declared else None,
        "pools": _pools(declared[0], replicas_now, latest) if declared else [],
    }


def _pools(
    model_row: dict[str, Any], replicas_now: list[dict[str, Any]], latest: dict[str, dict]
) -> list[dict[str, Any]]:
    """A disaggregated model's pools: per role the count wanted, placed (active) and
    ready, the profile its replicas run (the pool's own, or the model's), and for an
    autoscaled pool its bounds and the autoscaler's last decision (`latest`, by role)."""
    if model_row.get("disaggregation") is None:
        return []
    decl = msgspec.convert(
        {k: model_row[k] for k in ("name", "profile", "disaggregation")}, c.ModelDeclared
    )
    out = []
    for role in c.PD_ROLES:
        spec: c.PoolSpec = getattr(decl.disaggregation, role)
        active = [r for r in replicas_now if r["role"] == role and not r["retired"]]
        last = latest.get(role)
        out.append(
            {
                "role": role,
                "desired_replicas": _within(
                    msgspec.to_builtins(spec), last["to_replicas"] if last else None
                ),
                "autoscale": msgspec.to_builtins(spec.autoscale) if spec.autoscale else None,
                "last_scaling": last,
                "placed": len(active),
                "ready": sum(r["state"] == "ready" for r in active),
                "own_profile": spec.profile is not None,
                "profile": msgspec.to_builtins(pool_profile(decl, role)),
            }
        )
    return out


async def scaling_history(
    conn: AsyncConnection, model: str, limit: int = 50
) -> list[dict[str, Any]]:
    """The autoscaler's latest decisions for `model`, oldest first, from the archive."""
    q = (
        select(t.ArchivedEvent.seq, t.ArchivedEvent.payload)
        .where(t.ArchivedEvent.subject == subjects.control_event("scale", model))
        .order_by(t.ArchivedEvent.seq.desc())
        .limit(limit)
    )
    out = []
    for row in reversed(await _rows(conn, q)):
        try:
            ev = c.decode(row["payload"], c.ModelScaled)
        except c.ContractError:
            continue
        if ev.model != model:  # another name mapped to the same subject token
            continue
        item = msgspec.to_builtins(ev)
        # The per-router inputs (up to 64 routers) are for `llmgw audit replay`, which
        # reads the log; the explanation and the combined signals say what explain shows.
        item.pop("inputs", None)
        item["seq"] = row["seq"]
        out.append(item)
    return out


async def status(conn: AsyncConnection) -> dict[str, Any]:
    position = await store.read_position(conn)
    dead = (await conn.execute(select(func.count()).select_from(t.DeadLetter))).scalar_one()
    archived = (await conn.execute(select(func.max(t.ArchivedEvent.seq)))).scalar_one_or_none()
    return {
        "folded_seq": position or 0,
        "last_archived_seq": archived or 0,
        "dead_letters": dead,
    }
