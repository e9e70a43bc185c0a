"""Budgets per key: an amount (picodollars) and a period.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("budget_picousd", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("budget_period", sa.String(10), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("budget_period")
        batch.drop_column("budget_picousd")
