"""Autoscaled models: their autoscale spec, and the autoscaler's latest decision per model.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL: a fixed replica count (every model declared before autoscaling existed).
    op.add_column("models", sa.Column("autoscale", JSONB(), nullable=True))
    op.create_table(
        "model_scaling",
        sa.Column("model", sa.Text(), primary_key=True),
        sa.Column("from_replicas", sa.Integer(), nullable=False),
        sa.Column("to_replicas", sa.Integer(), nullable=False),
        sa.Column("rule", sa.Text(), nullable=False),
        sa.Column("signals", JSONB(), nullable=False),
        sa.Column("sustained_seconds", sa.Double(), nullable=False),
        sa.Column("based_on_seq", sa.BigInteger(), nullable=False),
        sa.Column("explanation", sa.Text(), nullable=False),
        sa.Column("event_id", sa.Text(), nullable=False),
        sa.Column("event_ts", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("model_scaling")
    op.drop_column("models", "autoscale")
