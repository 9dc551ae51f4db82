"""Baseline: the schema ``ui/db.py`` created before migrations, or its adoption.

The tables are those Chainlit's ``SQLAlchemyDataLayer`` (2.12) reads and writes: ``users``,
``threads``, ``steps``, ``elements``, ``feedbacks``, as in Chainlit's documented PostgreSQL
schema (docs: Data layers → SQLAlchemy) plus the newer ``steps`` columns the 2.12 code writes
(``command``, ``defaultOpen``, ``autoCollapse``, ``modes``), and ``elements.props`` defaults to
``{}``: the data layer leaves it out of the row of an element without props and then fails
reading it back (``json.loads(None)``: a 500 for ``GET /project/thread/<id>/element/<id>``).
PostgreSQL gets ``UUID``/``JSONB``/``TEXT[]``; SQLite, which has none of these, ``TEXT`` (the
data layer already parses JSON it reads back as text).

A database created by the UI before migrations (``CREATE TABLE IF NOT EXISTS`` at start) has
these five tables and no ``alembic_version``: it is adopted as it is, this revision recorded
and no table touched. One that has only some of the tables, or tables lacking some of the
columns below, is refused with their names rather than guessed at.

Revision ID: 0001
Revises:
Create Date: 2026-05-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

UUID = sa.Text().with_variant(postgresql.UUID(), "postgresql")
JSON = sa.Text().with_variant(postgresql.JSONB(), "postgresql")
TEXT_ARRAY = sa.Text().with_variant(postgresql.ARRAY(sa.Text()), "postgresql")


def primary_key() -> sa.Column:
    """The ``id`` column. Not ``NOT NULL`` on SQLite, as the tables created before migrations
    (SQLite lets a primary key other than ``INTEGER`` be NULL; PostgreSQL never does)."""
    return sa.Column("id", UUID, primary_key=True, nullable=True)


def cascade_to(column: str, target: str) -> sa.ForeignKeyConstraint:
    """``column`` references ``target`` (``table.id``); deleting the target deletes the row."""
    return sa.ForeignKeyConstraint([column], [target], ondelete="CASCADE")


def tables() -> dict[str, list[sa.Column | sa.Constraint]]:
    """Each table's columns and constraints, in creation order (fresh objects per call: a
    Column belongs to one table)."""
    return {
        "users": [
            primary_key(),
            sa.Column("identifier", sa.Text, nullable=False, unique=True),
            sa.Column("metadata", JSON, nullable=False),
            sa.Column("createdAt", sa.Text),
        ],
        "threads": [
            primary_key(),
            sa.Column("createdAt", sa.Text),
            sa.Column("name", sa.Text),
            sa.Column("userId", UUID),
            sa.Column("userIdentifier", sa.Text),
            sa.Column("tags", TEXT_ARRAY),
            sa.Column("metadata", JSON),
            cascade_to("userId", "users.id"),
        ],
        "steps": [
            primary_key(),
            sa.Column("name", sa.Text, nullable=False),
            sa.Column("type", sa.Text, nullable=False),
            sa.Column("threadId", UUID, nullable=False),
            sa.Column("parentId", UUID),
            sa.Column("streaming", sa.Boolean, nullable=False),
            sa.Column("waitForAnswer", sa.Boolean),
            sa.Column("isError", sa.Boolean),
            sa.Column("metadata", JSON),
            sa.Column("tags", TEXT_ARRAY),
            sa.Column("input", sa.Text),
            sa.Column("output", sa.Text),
            sa.Column("createdAt", sa.Text),
            sa.Column("command", sa.Text),
            sa.Column("start", sa.Text),
            sa.Column("end", sa.Text),
            sa.Column("generation", JSON),
            sa.Column("showInput", sa.Text),
            sa.Column("language", sa.Text),
            sa.Column("indent", sa.Integer),
            sa.Column("defaultOpen", sa.Boolean),
            sa.Column("autoCollapse", sa.Boolean),
            sa.Column("modes", JSON),
            cascade_to("threadId", "threads.id"),
        ],
        "elements": [
            primary_key(),
            sa.Column("threadId", UUID),
            sa.Column("type", sa.Text),
            sa.Column("url", sa.Text),
            sa.Column("chainlitKey", sa.Text),
            sa.Column("name", sa.Text, nullable=False),
            sa.Column("display", sa.Text),
            sa.Column("objectKey", sa.Text),
            sa.Column("size", sa.Text),
            sa.Column("page", sa.Integer),
            sa.Column("language", sa.Text),
            sa.Column("forId", UUID),
            sa.Column("mime", sa.Text),
            sa.Column("props", JSON, server_default=sa.text("'{}'")),
            sa.Column("autoPlay", sa.Boolean),
            sa.Column("playerConfig", JSON),
            cascade_to("threadId", "threads.id"),
        ],
        "feedbacks": [
            primary_key(),
            sa.Column("forId", UUID, nullable=False),
            sa.Column("threadId", UUID, nullable=False),
            sa.Column("value", sa.Integer, nullable=False),
            sa.Column("comment", sa.Text),
            cascade_to("threadId", "threads.id"),
        ],
    }


def missing_from(bind: sa.Connection, wanted: dict[str, list]) -> list[str]:
    """What the database at ``bind`` lacks of ``wanted``'s tables that it has: their columns
    (``table.column``), or the tables themselves when it has only some of them; empty both
    when it has them all, with their columns, and when it has none."""
    inspector = sa.inspect(bind)
    present = [t for t in wanted if inspector.has_table(t)]
    if not present:
        return []
    missing = [t for t in wanted if t not in present]
    for table in present:
        have = {c["name"] for c in inspector.get_columns(table)}
        missing += [f"{table}.{i.name}" for i in wanted[table]
                    if isinstance(i, sa.Column) and i.name not in have]
    return missing


def upgrade() -> None:
    wanted = tables()
    if not context.is_offline_mode():  # offline (alembic upgrade --sql): the DDL, unchecked
        bind = op.get_bind()
        if missing := missing_from(bind, wanted):
            raise RuntimeError(
                f"the database has some of the UI's tables but lacks {', '.join(missing)}: "
                "not a schema this revision knows; upgrade it by hand or start from an empty "
                "database")
        if sa.inspect(bind).has_table("users"):  # created before migrations: adopted as is
            return
    for table, items in wanted.items():
        op.create_table(table, *items)


def downgrade() -> None:
    raise RuntimeError("below the baseline there is no schema: downgrading would delete every "
                       "conversation; drop the tables by hand if that is what you want")
