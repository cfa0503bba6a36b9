"""Questions asked of the folded state, each answered in one place. Pure, no I/O.

Reconcile, placement, the fold's checks, the projection and replay all ask
whether a replica is ready or broken, which GPUs are busy or being freed,
which replicas run an old profile, which shards could be adopted and what the
next replica is called.
Each answer lives here once, so those modules cannot drift apart on what
"busy" or "ready" means.

Replica ids are `<model token>-r<n>`. Replicas are never removed from the
state: retiring one (scale down, rolling update, model removed) keeps it,
flagged, and so does every table loaded back from the projection. So the
highest number among a model's replica ids only grows, and the next replica
gets one above it: an id is never reused, and a late event of a retired
replica (a shard status, a stop) can never be taken for a new one's. Those
highest numbers are kept by `replica_index`, so asking costs the same with
100k retired replicas as with none.
"""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.state.ids import replica_id, replica_number, replica_token
from llmgw.reconciler.state.model import (
    ClusterState,
    Liveness,
    ReplicaView,
    ShardView,
    pool_profile,
    profile_digest,
)
from llmgw.reconciler.state.replica_index import index_of

# ---------------------------------------------------------------- replica ids


def next_replica_id(state: ClusterState, model: str, role: str = "") -> str:
    """The id `model`'s next replica (of pool `role`) gets: one above every number its
    ids have had.

    A number counts when the replica is the model's (of the same pool) or its id
    carries the same token: a model removed and a new one whose name maps to the same
    token (`a/b`, then `a.b`) must not take the first one's ids either, nor a model
    named `m-prefill` the ids of model `m`'s prefill pool.
    """
    top = index_of(state).top(replica_token(model, role), model, role)
    return replica_id(model, top + 1, role)


# ---------------------------------------------------------------- readiness


def is_ready(state: ClusterState, replica: ReplicaView) -> bool:
    """Every shard of the replica is ready (a draining one is not)."""
    return all(
        (s := state.shards.get(sid)) is not None and s.state == c.ShardState.READY
        for sid in replica.shard_ids
    )


def broken_shard(state: ClusterState, replica: ReplicaView) -> tuple[str, str] | None:
    """A shard of the replica that is gone (failed, stopped, or owned by someone else)."""
    for sid in replica.shard_ids:
        shard = state.shards.get(sid)
        if shard is None or shard.replica_id != replica.replica_id:
            return sid, "taken over by another replica"
        if shard.terminal:
            why = f": {shard.reason}" if shard.reason else ""
            return sid, f"{shard.state.value}{why}"
    return None


# ---------------------------------------------------------------- GPUs


def holds_gpus(shard: ShardView) -> bool:
    """A shard holds its GPUs until it has finished (stopped or failed)."""
    return not shard.terminal


def is_owned(state: ClusterState, shard: ShardView) -> bool:
    """The shard belongs to a replica that is placed and not retired."""
    owner = state.replicas.get(shard.replica_id)
    return owner is not None and not owner.retired


def busy_gpus(state: ClusterState, *, owned_only: bool = False) -> dict[str, set[str]]:
    """GPUs per node held by shards that have not finished.

    `owned_only`: only those held by active replicas' shards, leaving out the
    ones an unowned shard still runs on (what adoption may take over).
    """
    out: dict[str, set[str]] = {}
    for shard in state.shards.values():
        if holds_gpus(shard) and (not owned_only or is_owned(state, shard)):
            out.setdefault(shard.node, set()).update(shard.gpus)
    return out


def gpu_holders(state: ClusterState) -> dict[tuple[str, str], str]:
    """(node, GPU) -> the id of the shard holding it, for every busy GPU."""
    out: dict[tuple[str, str], str] = {}
    for shard in state.shards.values():
        if holds_gpus(shard):
            for gpu in shard.gpus:
                out[(shard.node, gpu)] = shard.shard_id
    return out


def freeing(state: ClusterState, model: str) -> bool:
    """A retired replica of `model` still holds GPUs: room is already on its way."""
    return any(
        not s.terminal and (owner := state.replicas.get(s.replica_id)) is not None and owner.retired
        for s in state.shards.values()
        if s.model == model
    )


def model_shards(state: ClusterState, model: str) -> dict[str, int]:
    """Per node, the running shards of `model` that are not retired replicas' (unowned count)."""
    out: dict[str, int] = {}
    for shard in state.shards.values():
        if shard.model != model or not holds_gpus(shard):
            continue
        replica = state.replicas.get(shard.replica_id)
        if replica is None or not replica.retired:
            out[shard.node] = out.get(shard.node, 0) + 1
    return out


# ---------------------------------------------------------------- profiles


def is_outdated(placed_digest: str, declared_digest: str) -> bool:
    """A replica placed with `placed_digest` runs another profile than the one declared now.

    "" (placed before digests were recorded) is never outdated: such replicas are not rolled.
    """
    return bool(placed_digest) and placed_digest != declared_digest


def outdated(state: ClusterState, model: str, role: str = "") -> list[ReplicaView]:
    """Active replicas (of pool `role`) placed with another profile than the one declared
    now for it, newest first.

    Newest first, like scale-down: the longest-running replicas keep serving longest.
    """
    decl = state.models.get(model)
    if decl is None:
        return []
    want = profile_digest(pool_profile(decl, role))
    stale = [r for r in state.active_replicas(model, role) if is_outdated(r.profile_digest, want)]
    return sorted(stale, key=lambda r: (-r.decided_seq, newest_first(r.replica_id)))


def newest_first(rid: str) -> int:
    """A sort key putting higher replica numbers first (an id without one last)."""
    return -(replica_number(rid) or 0)


# ---------------------------------------------------------------- adoption


def adoptable(state: ClusterState, model: str, role: str = "") -> list[ShardView]:
    """Shards a node runs for `model` that no active replica owns and that could serve as
    one of pool `role`.

    Only single-shard replicas are adopted: a multi-node group cannot be
    checked for consistency from registrations alone. A shard of a pool is
    adopted only back into the pool its retired replica was in: an engine
    launched as prefill (its KV connector's producer) cannot decode, and a
    shard no replica ever owned says nothing of its role.
    """
    decl = state.models.get(model)
    if decl is None:
        return []
    profile = pool_profile(decl, role)
    if profile.shards_per_replica != 1:
        return []
    want = profile_digest(profile)
    busy_by_owned = busy_gpus(state, owned_only=True)
    out = []
    for sid in sorted(state.shards):
        s = state.shards[sid]
        owner = state.replicas.get(s.replica_id)
        node = state.nodes.get(s.node)
        if (
            s.model == model
            and s.state == c.ShardState.READY
            and (owner is None or owner.retired)
            and (owner.role == role if owner is not None else not role)
            # A replica retired by a rolling update runs the old profile: never take it back.
            and (owner is None or not is_outdated(owner.profile_digest, want))
            and node is not None
            and node.liveness == Liveness.ALIVE
            and len(s.gpus) == profile.gpus_per_shard
            and not set(s.gpus) & busy_by_owned.get(s.node, set())
        ):
            out.append(s)
    return out
