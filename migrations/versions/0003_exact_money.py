"""Costs as exact integers (picodollars), the reference-model cost, and an `estimated` flag.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_logs") as batch:
        batch.drop_column("cost_usd")  # never filled before this revision
        batch.add_column(sa.Column("cost_picousd", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("reference_cost_picousd", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("cost_estimated", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("request_logs") as batch:
        batch.drop_column("cost_estimated")
        batch.drop_column("reference_cost_picousd")
        batch.drop_column("cost_picousd")
        batch.add_column(sa.Column("cost_usd", sa.Numeric(20, 10), nullable=True))
