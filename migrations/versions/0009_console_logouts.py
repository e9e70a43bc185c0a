"""Console sessions ended by their logout before they expire (the cookie alone would outlive it).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_logouts",
        sa.Column("nonce", sa.String(32), primary_key=True),
        sa.Column("expires", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_console_logouts_expires", "console_logouts", ["expires"])


def downgrade() -> None:
    op.drop_index("ix_console_logouts_expires", "console_logouts")
    op.drop_table("console_logouts")
