"""The Postgres tables: projections of the folded state, the event archive, and bookkeeping.

Two kinds of table live here:

- state projections (nodes, shards, replicas, models, tenants, bands,
  placement_failures, model_scaling, adapters, adapter_holdings): one row per entry of `ClusterState`.
  Column names are the field names of the state's views, so a row is
  `msgspec.to_builtins(view)` and a view is `msgspec.convert(row, View)`;
  loading the state back from these tables is exact.
- logs derived from events (event_archive, placement_decisions, dead_letters)
  and the consumer position, which moves in the same transaction as every
  other write of a batch.

Alembic migrations (migrations/versions) create these tables; a test checks
that the migrations and these models agree.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Boolean, Double, Index, Integer, LargeBinary, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

Json = dict[str, Any]


class Base(DeclarativeBase):
    type_annotation_map = {Json: JSONB, list[Any]: JSONB, int: BigInteger, float: Double}


# ------------------------------------------------------------------ state projections


class Node(Base):
    __tablename__ = "nodes"

    node: Mapped[str] = mapped_column(Text, primary_key=True)
    gpus: Mapped[Json]  # GPU UUID -> GpuInfo
    host: Mapped[Json]
    labels: Mapped[Json]
    engines: Mapped[list[Any]]
    boot_id: Mapped[str] = mapped_column(Text)
    liveness: Mapped[str] = mapped_column(Text)  # alive | unreachable | lost
    liveness_since: Mapped[float]
    registered_seq: Mapped[int]
    registered_at: Mapped[float]


class Shard(Base):
    __tablename__ = "shards"
    __table_args__ = (
        Index("ix_shards_node", "node"),
        Index("ix_shards_model", "model"),
    )

    shard_id: Mapped[str] = mapped_column(Text, primary_key=True)
    model: Mapped[str] = mapped_column(Text)
    replica_id: Mapped[str] = mapped_column(Text)
    shard_index: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(Text)
    gpus: Mapped[list[Any]]
    state: Mapped[str] = mapped_column(Text)
    url: Mapped[str] = mapped_column(Text)
    port: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    output_tail: Mapped[list[Any]]
    max_running: Mapped[int | None] = mapped_column(Integer)
    updated_seq: Mapped[int]
    updated_at: Mapped[float]
    adapters: Mapped[list[Any] | None]  # NULL: not reported
    adapter_errors: Mapped[Json] = mapped_column(server_default="{}")


class Replica(Base):
    __tablename__ = "replicas"
    __table_args__ = (Index("ix_replicas_model", "model"),)

    replica_id: Mapped[str] = mapped_column(Text, primary_key=True)
    model: Mapped[str] = mapped_column(Text)
    assignments: Mapped[list[Any]]
    decided_seq: Mapped[int]
    profile_digest: Mapped[str] = mapped_column(Text)
    retired: Mapped[bool] = mapped_column(Boolean)
    retired_reason: Mapped[str] = mapped_column(Text)
    role: Mapped[str] = mapped_column(Text, server_default="")  # prefill | decode | ""


class Model(Base):
    """The declared model, as the last ModelDeclared said (event id and ts kept)."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    aliases: Mapped[list[Any]]
    fallbacks: Mapped[list[Any]]
    replicas: Mapped[int] = mapped_column(Integer)
    profile: Mapped[Json]
    scheduling: Mapped[Json]
    deadlines: Mapped[Json]
    autoscale: Mapped[Json | None]
    upstream: Mapped[Json]
    owned_by: Mapped[str] = mapped_column(Text)
    api_kinds: Mapped[list[Any]]
    migration: Mapped[Json]
    disaggregation: Mapped[Json | None]
    event_id: Mapped[str] = mapped_column(Text)
    event_ts: Mapped[float]


class ModelScaling(Base):
    """The autoscaler's latest decision per autoscaled model (role "") or pool of a
    disaggregated model (the ModelScaled event)."""

    __tablename__ = "model_scaling"

    model: Mapped[str] = mapped_column(Text, primary_key=True)
    role: Mapped[str] = mapped_column(Text, primary_key=True, server_default="")
    from_replicas: Mapped[int] = mapped_column(Integer)
    to_replicas: Mapped[int] = mapped_column(Integer)
    rule: Mapped[str] = mapped_column(Text)
    signals: Mapped[Json]
    sustained_seconds: Mapped[float]
    based_on_seq: Mapped[int]
    explanation: Mapped[str] = mapped_column(Text)
    event_id: Mapped[str] = mapped_column(Text)
    event_ts: Mapped[float]
    signal: Mapped[str] = mapped_column(Text, server_default="load")
    inputs: Mapped[list[Any]] = mapped_column(server_default="[]")  # at most 64 routers
    since_last_change_seconds: Mapped[float | None]
    term: Mapped[int] = mapped_column(BigInteger, server_default="0")  # the leader's


class Adapter(Base):
    """A declared LoRA adapter, as the last AdapterDeclared said (event id and ts kept)."""

    __tablename__ = "adapters"
    __table_args__ = (Index("ix_adapters_base", "base"),)

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    base: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(Text)
    tenants: Mapped[list[Any]]
    pinned: Mapped[int] = mapped_column(Integer)
    event_id: Mapped[str] = mapped_column(Text)
    event_ts: Mapped[float]


class AdapterHolding(Base):
    """The latest adapter placement per base model (state.model.AdapterHoldings)."""

    __tablename__ = "adapter_holdings"

    model: Mapped[str] = mapped_column(Text, primary_key=True)
    holdings: Mapped[Json]  # replica -> adapters
    loaded_at: Mapped[Json]  # replica -> adapter -> when it was loaded there
    decided_seq: Mapped[int]
    decided_at: Mapped[float]
    explanation: Mapped[str] = mapped_column(Text)
    changed_seq: Mapped[Json] = mapped_column(server_default="{}")  # replica -> seq


class Tenant(Base):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    band: Mapped[str] = mapped_column(Text)
    key_hashes: Mapped[list[Any]]
    quotas: Mapped[Json]
    event_id: Mapped[str] = mapped_column(Text)
    event_ts: Mapped[float]
    cache_isolation: Mapped[str] = mapped_column(Text, server_default="none")


class BandRow(Base):
    __tablename__ = "bands"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    position: Mapped[int] = mapped_column(Integer)  # 0 = highest priority
    ceiling: Mapped[float]
    queue_capacity: Mapped[int] = mapped_column(Integer)
    queue_ttl_seconds: Mapped[float]


class PlacementFailure(Base):
    """The latest failure to place, per replica not placed yet (state, not history)."""

    __tablename__ = "placement_failures"

    replica_id: Mapped[str] = mapped_column(Text, primary_key=True)
    model: Mapped[str] = mapped_column(Text)
    based_on_seq: Mapped[int]
    verdicts: Mapped[list[Any]]
    verdict_groups: Mapped[list[Any]]  # the nodes `verdicts` leaves out (large fleets)
    explanation: Mapped[str] = mapped_column(Text)
    event_id: Mapped[str] = mapped_column(Text)
    event_ts: Mapped[float]
    term: Mapped[int] = mapped_column(BigInteger, server_default="0")  # the leader's
    role: Mapped[str] = mapped_column(Text, server_default="")  # prefill | decode | ""


# ------------------------------------------------------------------ event-derived logs


class PlacementDecision(Base):
    """Every PlacementDecided / PlacementFailed, with the verdicts that explain it."""

    __tablename__ = "placement_decisions"
    __table_args__ = (Index("ix_placement_decisions_model_seq", "model", "seq"),)

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    outcome: Mapped[str] = mapped_column(Text)  # decided | failed
    model: Mapped[str] = mapped_column(Text)
    replica_id: Mapped[str] = mapped_column(Text)
    based_on_seq: Mapped[int]
    assignments: Mapped[list[Any]]
    adopted: Mapped[bool] = mapped_column(Boolean)  # took over shards a node already ran
    verdicts: Mapped[list[Any]]
    verdict_groups: Mapped[list[Any]]  # the nodes `verdicts` leaves out (large fleets)
    explanation: Mapped[str] = mapped_column(Text)
    ts: Mapped[float]
    role: Mapped[str] = mapped_column(Text, server_default="")  # prefill | decode | ""


class ArchivedEvent(Base):
    """Every folded event, byte for byte: audits and replays outlive stream retention."""

    __tablename__ = "event_archive"
    __table_args__ = (Index("ux_event_archive_msg_id", "msg_id", unique=True),)

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    subject: Mapped[str] = mapped_column(Text)
    type: Mapped[str] = mapped_column(Text)
    msg_id: Mapped[str] = mapped_column(Text)
    ts: Mapped[float]
    payload: Mapped[bytes] = mapped_column(LargeBinary)


class DeadLetter(Base):
    """An event the fold could not apply: the raw bytes and why, acknowledged and skipped."""

    __tablename__ = "dead_letters"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    subject: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)
    raw: Mapped[bytes] = mapped_column(LargeBinary)
    received_at: Mapped[float]


class ConsumerPosition(Base):
    """The last stream sequence whose effects are committed, per consumer."""

    __tablename__ = "consumer_positions"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    stream: Mapped[str] = mapped_column(Text)
    last_seq: Mapped[int]
    updated_at: Mapped[float]
    # The stream's creation time (ISO 8601, as JetStream reports it): its identity. A
    # stream deleted and created again restarts at seq 1 under the same name.
    stream_created: Mapped[str] = mapped_column(Text, server_default="")
    # The newest leader term the fold has seen, committed with the position it belongs
    # to: a new term's fold refuses control events of older terms from the start.
    term: Mapped[int] = mapped_column(BigInteger, server_default="0")


class LeaderTerm(Base):
    """The leader term counter: incremented by each process that takes the leader lock."""

    __tablename__ = "leader_terms"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    term: Mapped[int] = mapped_column(BigInteger)
    holder: Mapped[str] = mapped_column(Text, server_default="")
    started_at: Mapped[float]
