"""The request log counts a stream's resumptions (a replica failed mid-answer, another went on).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_logs") as batch:  # SQLite alters by copying the table
        batch.add_column(sa.Column("resumptions", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("request_logs") as batch:
        batch.drop_column("resumptions")
