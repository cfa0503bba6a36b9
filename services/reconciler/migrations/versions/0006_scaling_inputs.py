"""Scaling decisions keep the signal their target was in, the per-router inputs and the
cool-down measured on the leader's monotonic clock.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
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


def downgrade() -> None:
    for column in ("since_last_change_seconds", "inputs", "signal"):
        op.drop_column("model_scaling", column)
