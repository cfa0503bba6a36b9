"""The next replica number is derived from the replicas table: replica_counters goes.

Replicas are never deleted (a retired one keeps its row), so the highest number among
a model's replica ids is what the counter held. The downgrade recreates the table and
fills it from the replicas, so an older reconciler loads the same counters it wrote.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_table("replica_counters")


def downgrade() -> None:
    op.create_table(
        "replica_counters",
        sa.Column("model", sa.Text(), primary_key=True, nullable=False),
        sa.Column("last_n", sa.BigInteger(), nullable=False),
    )
    # Replica ids end in -r<n>; the counter was the highest n per model.
    op.execute(
        """
        INSERT INTO replica_counters (model, last_n)
        SELECT model, max(substring(replica_id FROM '-r([0-9]+)$')::bigint)
        FROM replicas
        WHERE replica_id ~ '-r[0-9]+$'
        GROUP BY model
        """
    )
