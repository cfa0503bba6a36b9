"""Replicas keep the pool they belong to (prefill | decode), and so does the placement
history.

Without the column a new leader, loading its state from the tables, would count a
disaggregated model's pool replicas as aggregated ones: it would retire them all and
place aggregated replicas instead. `llmgw explain` reads the role of each decision from
the history.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("replicas", "placement_decisions"):
        op.add_column(
            table, sa.Column("role", sa.Text(), nullable=False, server_default=sa.text("''"))
        )


def downgrade() -> None:
    for table in ("placement_decisions", "replicas"):
        op.drop_column(table, "role")
