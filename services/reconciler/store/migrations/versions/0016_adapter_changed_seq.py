"""Adapter holdings keep, per replica, the seq of the decision that last changed its set.

A replica's SetShardAdapters is keyed by it (state.ids.adapters_key). Without the column
a new leader, loading its state from the table, would key each replica by the model's
latest decision instead, and re-send every replica's unfinished load as a new command.
Rows written before it have none: the fold then takes the row's decided_seq, the seq
their commands were keyed by.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "adapter_holdings",
        sa.Column("changed_seq", JSONB(), nullable=False, server_default="{}"),
    )


def downgrade() -> None:
    op.drop_column("adapter_holdings", "changed_seq")
