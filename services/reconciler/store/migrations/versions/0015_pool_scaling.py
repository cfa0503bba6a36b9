"""The autoscaler's latest decision is kept per model and pool: a disaggregated model's
prefill and decode pools scale apart, each with its own ModelScaled.

`role` joins the primary key ("" for a whole model, every row written before pools
scaled), so a new leader loading its state from the table finds each pool's count.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "model_scaling",
        sa.Column("role", sa.Text(), nullable=False, server_default=sa.text("''")),
    )
    op.drop_constraint("model_scaling_pkey", "model_scaling", type_="primary")
    op.create_primary_key("model_scaling_pkey", "model_scaling", ["model", "role"])


def downgrade() -> None:
    # A pool's decision has no place in a table keyed by model alone.
    op.execute("DELETE FROM model_scaling WHERE role <> ''")
    op.drop_constraint("model_scaling_pkey", "model_scaling", type_="primary")
    op.create_primary_key("model_scaling_pkey", "model_scaling", ["model"])
    op.drop_column("model_scaling", "role")
