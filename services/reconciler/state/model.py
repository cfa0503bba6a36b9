"""The folded state of the cluster: what the event log says, and nothing else.

`ClusterState` is built only by `fold.apply()` from events in log order. It
holds desired state (models, tenants, bands) and actual state (nodes, replicas,
shards, liveness). Placement and reconciliation read it; the Postgres tables
are projections of it; `llmgw audit replay` rebuilds it from the archive. No
wall clock is read here: every time in it came from an event.
"""

from __future__ import annotations

import enum
import hashlib

import msgspec

from llmgw import contracts as c
from llmgw.reconciler.state import replica_index

# The reason a shard of a lost node carries: its replica is replaced, but the shard
# itself said nothing about its profile (replacement back-off ignores it).
NODE_LOST = "node lost"


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    UNREACHABLE = "unreachable"
    LOST = "lost"


class NodeView(msgspec.Struct, kw_only=True):
    node: str
    gpus: dict[str, c.GpuInfo] = msgspec.field(default_factory=dict)
    host: c.HostInfo = msgspec.field(default_factory=c.HostInfo)
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    engines: list[str] = msgspec.field(default_factory=list)
    boot_id: str = ""
    liveness: Liveness = Liveness.ALIVE
    liveness_since: float = 0.0  # ts of the event that set it
    registered_seq: int = 0
    registered_at: float = 0.0


class ShardView(msgspec.Struct, kw_only=True):
    shard_id: str
    model: str
    replica_id: str
    shard_index: int = 0
    node: str = ""
    gpus: list[str] = msgspec.field(default_factory=list)
    state: c.ShardState = c.ShardState.PENDING
    url: str = ""
    port: int = 0
    reason: str = ""
    exit_code: int | None = None
    output_tail: list[str] = msgspec.field(default_factory=list)
    max_running: int | None = None
    updated_seq: int = 0
    updated_at: float = 0.0
    # The LoRA adapters its engine holds, as the agent last reported (None: not reported,
    # or void since the engine left ready), and the engine's answer to each failed load.
    adapters: list[str] | None = None
    adapter_errors: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.state in c.TERMINAL_SHARD_STATES


class ReplicaView(msgspec.Struct, kw_only=True):
    replica_id: str
    model: str
    # prefill | decode: which pool of a disaggregated model it belongs to; "": aggregated.
    role: str = ""
    assignments: list[c.ShardAssignment] = msgspec.field(default_factory=list)
    decided_seq: int = 0
    # profile_digest() of the model's profile when it was placed; "" = not known
    # (placed before this was recorded), which never counts as outdated.
    profile_digest: str = ""
    retired: bool = False
    retired_reason: str = ""

    @property
    def shard_ids(self) -> list[str]:
        return [a.shard_id for a in self.assignments]


class AdapterHoldings(msgspec.Struct, kw_only=True):
    """Which replicas of one base model hold which adapters, as the latest AdaptersPlaced
    decided, and since when each has held each (what the hold time is measured from)."""

    model: str
    holdings: dict[str, list[str]] = msgspec.field(default_factory=dict)
    # replica -> adapter -> wall time (event ts) of the decision that loaded it there.
    loaded_at: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    decided_seq: int = 0
    decided_at: float = 0.0
    explanation: str = ""
    # replica -> seq of the decision that last changed its set: what its SetShardAdapters
    # is keyed by (ids.adapters_key), so a decision for another replica is no new command.
    changed_seq: dict[str, int] = msgspec.field(default_factory=dict)


# dict=True: room for derived indexes kept beside the fields (replica_index), which
# equality, encoding and the projection never see.
class ClusterState(msgspec.Struct, kw_only=True, dict=True):
    last_seq: int = 0
    # The newest leader term folded: control events of an older term are refused.
    term: int = 0
    nodes: dict[str, NodeView] = msgspec.field(default_factory=dict)
    models: dict[str, c.ModelDeclared] = msgspec.field(default_factory=dict)
    tenants: dict[str, c.TenantDeclared] = msgspec.field(default_factory=dict)
    bands: list[c.Band] = msgspec.field(default_factory=list)
    # Never removed: a retired replica stays, flagged, so its id is never given again
    # (queries.next_replica_id) and a late event of it is never taken for a new one's.
    replicas: dict[str, ReplicaView] = msgspec.field(default_factory=dict)
    shards: dict[str, ShardView] = msgspec.field(default_factory=dict)
    # The latest failure to place, per replica id not yet placed.
    failures: dict[str, c.PlacementFailed] = msgspec.field(default_factory=dict)
    # The autoscaler's latest decision per autoscaled model or pool (its `to_replicas` is
    # the count), by (model, role): role "" the whole model's count, prefill or decode a pool's.
    scaled: dict[tuple[str, str], c.ModelScaled] = msgspec.field(default_factory=dict)
    # Declared LoRA adapters by name, and the latest adapter placement per base model.
    adapters: dict[str, c.AdapterDeclared] = msgspec.field(default_factory=dict)
    adapter_holdings: dict[str, AdapterHoldings] = msgspec.field(default_factory=dict)

    def copy(self) -> ClusterState:
        """A deep copy (placement experiments and replay must not touch the live state)."""
        out = msgspec.convert(msgspec.to_builtins(self), ClusterState)
        replica_index.carry(self, out)
        return out

    def desired_replicas(self, model: str, role: str | None = None) -> int:
        """How many replicas `model` should have: the catalog's count, or for an
        autoscaled model the autoscaler's latest decision kept within [min, max]
        (the bounds may have changed since), starting at min.

        `role` asks for one pool: "" the aggregated replicas, prefill or decode a
        disaggregated model's pool (a model has either kind, never both); None: all.
        """
        decl = self.models.get(model)
        if decl is None:
            return 0
        if decl.disaggregation is not None:
            if role is None:
                return sum(self.desired_replicas(model, r) for r in c.PD_ROLES)
            if role not in c.PD_ROLES:
                return 0
            pool: c.PoolSpec = getattr(decl.disaggregation, role)
            return self._within(pool.autoscale, pool.replicas, (model, role))
        if role:
            return 0
        return self._within(decl.autoscale, decl.replicas, (model, ""))

    def _within(self, spec: c.AutoscaleSpec | None, fixed: int, key: tuple[str, str]) -> int:
        if spec is None:
            return fixed
        scaled = self.scaled.get(key)
        n = scaled.to_replicas if scaled is not None else spec.min
        return min(spec.max, max(spec.min, n))

    def autoscaled(self) -> list[tuple[str, str, c.AutoscaleSpec]]:
        """(model, role, spec) of every count the autoscaler decides, by model then role:
        an autoscaled model's (role "") and each autoscaled pool's."""
        out = []
        for model in sorted(self.models):
            out += [(model, role, spec) for role, spec in autoscale_specs(self.models[model])]
        return out

    def active_replicas(self, model: str, role: str | None = None) -> list[ReplicaView]:
        """The model's replicas not retired: of one pool (`role`), or all (None)."""
        return [
            r
            for r in self.replicas.values()
            if r.model == model and not r.retired and (role is None or r.role == role)
        ]

    def pools(self, model: str) -> tuple[str, ...]:
        """The roles `model`'s replicas play: its pools, plus any role an active replica
        still has from before the model changed kind (so those are scaled down)."""
        decl = self.models.get(model)
        wanted = c.PD_ROLES if decl is not None and decl.disaggregation is not None else ("",)
        left = {r.role for r in self.active_replicas(model)} - set(wanted)
        return (*wanted, *sorted(left))

    def shards_on(self, node: str) -> list[ShardView]:
        return [s for s in self.shards.values() if s.node == node]

    def adapters_of(self, model: str) -> list[c.AdapterDeclared]:
        """The adapters declared on base `model`, by name."""
        return sorted((a for a in self.adapters.values() if a.base == model), key=lambda a: a.name)


def autoscale_specs(decl: c.ModelDeclared) -> list[tuple[str, c.AutoscaleSpec]]:
    """(role, spec) of each count of `decl` that follows demand: the model's ("") or, for
    a disaggregated model, its pools'."""
    if decl.disaggregation is None:
        return [("", decl.autoscale)] if decl.autoscale is not None else []
    pools = [(role, getattr(decl.disaggregation, role).autoscale) for role in c.PD_ROLES]
    return [(role, spec) for role, spec in pools if spec is not None]


def pool_profile(decl: c.ModelDeclared, role: str) -> c.ServingProfile:
    """The profile a replica of `role` runs: its pool's own, or else the model's."""
    if decl.disaggregation is not None and role in c.PD_ROLES:
        own = getattr(decl.disaggregation, role).profile
        if own is not None:
            return own
    return decl.profile


def profile_digest(profile: c.ServingProfile) -> str:
    """A stable digest of a serving profile: equal content, equal digest.

    Fields left at their default are not part of it, so adding a field to
    ServingProfile (with a default that keeps today's behaviour) leaves every
    digest as it was: otherwise the upgrade alone would roll every replica of
    the fleet. Digests are stored with replicas: this must never change.
    """
    defaults = type(profile)()
    content = {
        name: getattr(profile, name)
        for name in profile.__struct_fields__
        if getattr(profile, name) != getattr(defaults, name)
    }
    raw = msgspec.json.encode(content, order="sorted")
    return hashlib.sha256(raw).hexdigest()[:16]
