"""Leader terms: a counter taken with the lock, and the newest term the fold has seen.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leader_terms",
        sa.Column("name", sa.Text(), primary_key=True),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False, server_default=""),
        sa.Column("started_at", sa.Double(), nullable=False),
    )
    # 0: folded before terms existed; the next leader's TermStarted moves it.
    for table in ("consumer_positions", "placement_failures"):
        op.add_column(table, sa.Column("term", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    for table in ("consumer_positions", "placement_failures"):
        op.drop_column(table, "term")
    op.drop_table("leader_terms")
