"""LoRA adapters: the declared adapters, the latest adapter placement per base model, and
what each shard's engine holds.

A new leader loads its state from these tables: without them it would forget which
adapters exist and where they were placed, and unload every adapter of the fleet.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("name", sa.Text(), primary_key=True),
        sa.Column("base", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("tenants", JSONB(), nullable=False),
        sa.Column("pinned", sa.Integer(), nullable=False),
        sa.Column("event_id", sa.Text(), nullable=False),
        sa.Column("event_ts", sa.Double(), nullable=False),
    )
    op.create_index("ix_adapters_base", "adapters", ["base"])
    op.create_table(
        "adapter_holdings",
        sa.Column("model", sa.Text(), primary_key=True),
        sa.Column("holdings", JSONB(), nullable=False),
        sa.Column("loaded_at", JSONB(), nullable=False),
        sa.Column("decided_seq", sa.BigInteger(), nullable=False),
        sa.Column("decided_at", sa.Double(), nullable=False),
        sa.Column("explanation", sa.Text(), nullable=False),
    )
    # NULL: not reported (every shard before adapters existed).
    op.add_column("shards", sa.Column("adapters", JSONB(), nullable=True))
    op.add_column(
        "shards", sa.Column("adapter_errors", JSONB(), nullable=False, server_default="{}")
    )


def downgrade() -> None:
    op.drop_column("shards", "adapter_errors")
    op.drop_column("shards", "adapters")
    op.drop_table("adapter_holdings")
    op.drop_index("ix_adapters_base", table_name="adapters")
    op.drop_table("adapters")
