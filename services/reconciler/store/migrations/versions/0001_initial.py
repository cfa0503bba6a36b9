"""Initial schema: state projections, placement decisions, event archive, dead letters, position.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _text(name: str, **kw) -> sa.Column:
    return sa.Column(name, sa.Text(), nullable=False, **kw)


def _json(name: str) -> sa.Column:
    return sa.Column(name, JSONB(), nullable=False)


def _big(name: str, **kw) -> sa.Column:
    return sa.Column(name, sa.BigInteger(), nullable=False, **kw)


def _int(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.Integer(), nullable=nullable)


def _float(name: str) -> sa.Column:
    return sa.Column(name, sa.Double(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "nodes",
        _text("node", primary_key=True),
        _json("gpus"),
        _json("host"),
        _json("labels"),
        _json("engines"),
        _text("boot_id"),
        _text("liveness"),
        _float("liveness_since"),
        _big("registered_seq"),
        _float("registered_at"),
    )
    op.create_table(
        "shards",
        _text("shard_id", primary_key=True),
        _text("model"),
        _text("replica_id"),
        _int("shard_index"),
        _text("node"),
        _json("gpus"),
        _text("state"),
        _text("url"),
        _int("port"),
        _text("reason"),
        _int("exit_code", nullable=True),
        _json("output_tail"),
        _int("max_running", nullable=True),
        _big("updated_seq"),
        _float("updated_at"),
    )
    op.create_index("ix_shards_node", "shards", ["node"])
    op.create_index("ix_shards_model", "shards", ["model"])
    op.create_table(
        "replicas",
        _text("replica_id", primary_key=True),
        _text("model"),
        _json("assignments"),
        _big("decided_seq"),
        sa.Column("retired", sa.Boolean(), nullable=False),
        _text("retired_reason"),
    )
    op.create_index("ix_replicas_model", "replicas", ["model"])
    op.create_table(
        "models",
        _text("name", primary_key=True),
        _json("aliases"),
        _json("fallbacks"),
        _int("replicas"),
        _json("profile"),
        _json("scheduling"),
        _json("deadlines"),
        _text("event_id"),
        _float("event_ts"),
    )
    op.create_table(
        "tenants",
        _text("name", primary_key=True),
        _text("band"),
        _json("key_hashes"),
        _json("quotas"),
        _text("event_id"),
        _float("event_ts"),
    )
    op.create_table(
        "bands",
        _text("name", primary_key=True),
        _int("position"),
        _float("ceiling"),
        _int("queue_capacity"),
        _float("queue_ttl_seconds"),
    )
    op.create_table(
        "placement_failures",
        _text("replica_id", primary_key=True),
        _text("model"),
        _big("based_on_seq"),
        _json("verdicts"),
        _text("explanation"),
        _text("event_id"),
        _float("event_ts"),
    )
    op.create_table(
        "replica_counters",
        _text("model", primary_key=True),
        _big("last_n"),
    )
    op.create_table(
        "placement_decisions",
        _big("seq", primary_key=True, autoincrement=False),
        _text("outcome"),
        _text("model"),
        _text("replica_id"),
        _big("based_on_seq"),
        _json("assignments"),
        sa.Column("adopted", sa.Boolean(), nullable=False),
        _json("verdicts"),
        _text("explanation"),
        _float("ts"),
    )
    op.create_index("ix_placement_decisions_model_seq", "placement_decisions", ["model", "seq"])
    op.create_table(
        "event_archive",
        _big("seq", primary_key=True, autoincrement=False),
        _text("subject"),
        _text("type"),
        _text("msg_id"),
        _float("ts"),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
    )
    op.create_index("ux_event_archive_msg_id", "event_archive", ["msg_id"], unique=True)
    op.create_table(
        "dead_letters",
        _big("seq", primary_key=True, autoincrement=False),
        _text("subject"),
        _text("reason"),
        sa.Column("raw", sa.LargeBinary(), nullable=False),
        _float("received_at"),
    )
    op.create_table(
        "consumer_positions",
        _text("name", primary_key=True),
        _text("stream"),
        _big("last_seq"),
        _float("updated_at"),
    )


def downgrade() -> None:
    for table in (
        "consumer_positions",
        "dead_letters",
        "event_archive",
        "placement_decisions",
        "replica_counters",
        "placement_failures",
        "bands",
        "tenants",
        "models",
        "replicas",
        "shards",
        "nodes",
    ):
        op.drop_table(table)
