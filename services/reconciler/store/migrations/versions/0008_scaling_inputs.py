"""Scaling decisions keep the signal their target was in, the per-router inputs, the
cool-down measured on the leader's monotonic clock, and the leader term that decided
them (ModelScaled carries it like every control event; 0006 gave it to failures only).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Defaults = decided before these were recorded: a load target, no inputs, and a
    # cool-down replay compares by the events' wall times.
    op.add_column(
        "model_scaling", sa.Column("signal", sa.Text(), nullable=False, server_default="load")
    )
    op.add_column(
        "model_scaling", sa.Column("inputs", JSONB(), nullable=False, server_default="[]")
    )
    op.add_column(
        "model_scaling", sa.Column("since_last_change_seconds", sa.Double(), nullable=True)
    )
    op.add_column(
        "model_scaling", sa.Column("term", sa.BigInteger(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    for column in ("term", "since_last_change_seconds", "inputs", "signal"):
        op.drop_column("model_scaling", column)
