"""Replicas record the digest of the serving profile they were placed with (rolling updates).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # "" = placed before digests were recorded: such replicas are never rolled.
    op.add_column(
        "replicas",
        sa.Column("profile_digest", sa.Text(), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_column("replicas", "profile_digest")
