"""Route details in the request log: tier, complexity score, and what failover tried.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_logs") as batch:
        batch.add_column(sa.Column("route_tier", sa.String(100), nullable=True))
        batch.add_column(sa.Column("complexity_score", sa.Float(), nullable=True))
        batch.add_column(sa.Column("failover", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("request_logs") as batch:
        batch.drop_column("failover")
        batch.drop_column("complexity_score")
        batch.drop_column("route_tier")
