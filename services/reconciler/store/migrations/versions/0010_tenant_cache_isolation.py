"""Tenants keep their cache isolation (none, tenant or key).

Without the column a new leader, loading its state from the tables, would write tenant
records without it: every tenant's prefix cache would be shared again.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "tenants", sa.Column("cache_isolation", sa.Text(), nullable=False, server_default="none")
    )


def downgrade() -> None:
    op.drop_column("tenants", "cache_isolation")
