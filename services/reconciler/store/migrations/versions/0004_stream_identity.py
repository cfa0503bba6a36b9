"""The consumer position records which stream it is a position in (its creation time).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # '' = not recorded yet (a database folded before this): the next term records it.
    op.add_column(
        "consumer_positions",
        sa.Column("stream_created", sa.Text(), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_column("consumer_positions", "stream_created")
