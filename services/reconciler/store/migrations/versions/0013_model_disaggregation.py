"""Models keep their prefill/decode pools (`disaggregation:`).

Without the column a new leader, loading its state from the tables, would see a
disaggregated model as aggregated and re-place its pools as plain replicas; a
replica that could not be placed keeps the pool it was for.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("models", sa.Column("disaggregation", JSONB(), nullable=True))
    op.add_column(
        "placement_failures",
        sa.Column("role", sa.Text(), nullable=False, server_default=sa.text("''")),
    )


def downgrade() -> None:
    op.drop_column("placement_failures", "role")
    op.drop_column("models", "disaggregation")
