"""Models keep their mid-stream migration setting (`migration: {max: N}`).

Without the column a new leader, loading its state from the tables, would write
projection records with migration off: routers would cut streams again.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "models", sa.Column("migration", JSONB(), nullable=False, server_default=sa.text("'{}'"))
    )


def downgrade() -> None:
    op.drop_column("models", "migration")
