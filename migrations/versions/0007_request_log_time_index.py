"""An index on the request log's time, for retention and time-range queries.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_request_logs_created", "request_logs", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_request_logs_created", "request_logs")
