"""Virtual keys and the request log.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("team", sa.String(200), nullable=True),
        sa.Column("allowed_models", sa.JSON(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rotated_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_api_keys_key_hash", "api_keys", ["key_hash"], unique=True)
    op.create_index("ix_api_keys_team", "api_keys", ["team"])
    op.create_table(
        "request_logs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("team", sa.String(200), nullable=True),
        sa.Column("requested_model", sa.String(200), nullable=True),
        sa.Column("backend", sa.String(200), nullable=True),
        sa.Column("deployment", sa.String(500), nullable=True),
        sa.Column("route_reason", sa.String(500), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("error_type", sa.String(100), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Numeric(12, 3), nullable=True),
        sa.Column("ttft_ms", sa.Numeric(12, 3), nullable=True),
        sa.Column("overhead_ms", sa.Numeric(12, 3), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("cost_usd", sa.Numeric(20, 10), nullable=True),
        sa.Column("request_body", sa.Text(), nullable=True),
        sa.Column("response_body", sa.Text(), nullable=True),
    )
    op.create_index("ix_request_logs_key_created", "request_logs", ["key_id", "created_at"])
    op.create_index("ix_request_logs_team_created", "request_logs", ["team", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_request_logs_team_created", table_name="request_logs")
    op.drop_index("ix_request_logs_key_created", table_name="request_logs")
    op.drop_table("request_logs")
    op.drop_index("ix_api_keys_team", table_name="api_keys")
    op.drop_index("ix_api_keys_key_hash", table_name="api_keys")
    op.drop_table("api_keys")
