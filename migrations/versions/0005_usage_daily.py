"""Daily usage aggregates, maintained with the request log.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_daily",
        sa.Column("day", sa.Date(), primary_key=True),
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("team", sa.String(200), primary_key=True),
        sa.Column("requested_model", sa.String(200), primary_key=True),
        sa.Column("backend", sa.String(200), primary_key=True),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_picousd", sa.BigInteger(), nullable=False),
        sa.Column("reference_cost_picousd", sa.BigInteger(), nullable=False),
        sa.Column("reference_basis_picousd", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_usage_daily_key_day", "usage_daily", ["key_id", "day"])
    op.create_index("ix_usage_daily_team_day", "usage_daily", ["team", "day"])


def downgrade() -> None:
    op.drop_index("ix_usage_daily_team_day", "usage_daily")
    op.drop_index("ix_usage_daily_key_day", "usage_daily")
    op.drop_table("usage_daily")
