"""Placement decisions and failures record the verdicts they group instead of listing.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TABLES = ("placement_decisions", "placement_failures")


def upgrade() -> None:
    # '[]' = recorded before groups existed: such events list every node.
    for table in TABLES:
        op.add_column(
            table,
            sa.Column("verdict_groups", JSONB(), nullable=False, server_default="[]"),
        )


def downgrade() -> None:
    for table in TABLES:
        op.drop_column(table, "verdict_groups")
