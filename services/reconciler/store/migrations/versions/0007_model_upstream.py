"""Models keep what routers need of them beyond placement: upstream headers (and the
names of secret ones), owned_by for /v1/models, and the API kinds they serve.

Without these columns a new leader, loading its state from the tables, would write
projection records without them: the engines' API keys would vanish from routers.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "models", sa.Column("upstream", JSONB(), nullable=False, server_default=sa.text("'{}'"))
    )
    op.add_column("models", sa.Column("owned_by", sa.Text(), nullable=False, server_default=""))
    op.add_column(
        "models", sa.Column("api_kinds", JSONB(), nullable=False, server_default=sa.text("'[]'"))
    )


def downgrade() -> None:
    op.drop_column("models", "api_kinds")
    op.drop_column("models", "owned_by")
    op.drop_column("models", "upstream")
