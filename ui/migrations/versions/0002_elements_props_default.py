"""``elements.props`` defaults to ``{}`` in stores of the UI's first release too.

Chainlit's ``SQLAlchemyDataLayer`` (2.12) leaves ``props`` out of the row of an element
without props and reads it back with ``json.loads``: a ``NULL`` there is a 500 for the
element (``GET /project/thread/<id>/element/<id>``). The baseline (``0001``) gives the column
the default ``'{}'``, as did the UI from commit 1facae9 on; the first UI release (281cace)
created it without one, and ``0001`` adopts such a store as it is (it checks columns, not
defaults). This revision gives ``props`` its default and fills the ``NULL``s that release
wrote with ``'{}'``, what the default would have written. A store that already has the
default is left alone (SQLite rebuilds a table to change a default; no need to copy it).

Revision ID: 0002
Revises: 0001
Create Date: 2026-05-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.Text().with_variant(postgresql.JSONB(), "postgresql")
#: ``props``'s default, as ``0001`` writes it: an empty JSON object.
EMPTY = "'{}'"


def has_default(bind: sa.Connection) -> bool:
    """Whether ``elements.props`` has a default (any: the UI only ever wrote ``'{}'``)."""
    (props,) = [c for c in sa.inspect(bind).get_columns("elements") if c["name"] == "props"]
    return props["default"] is not None


def baseline_elements() -> sa.Table:
    """``elements`` as ``0001`` defines it: what SQLite's rebuild copies from when there is no
    store to reflect it from (``alembic upgrade --sql``)."""
    metadata = sa.MetaData()  # with the tables its foreign key names
    for name, items in context.script.get_revision("0001").module.tables().items():
        sa.Table(name, metadata, *items)
    return metadata.tables["elements"]


def upgrade() -> None:
    offline = context.is_offline_mode()  # alembic upgrade --sql: no store to look at
    if not offline and has_default(op.get_bind()):
        return
    # SQLite has no ALTER COLUMN: batch mode rebuilds the table there (create, copy, drop,
    # rename; keys kept) from the store's own table, reflected, or offline from the baseline's;
    # PostgreSQL gets a plain ALTER COLUMN ... SET DEFAULT.
    with op.batch_alter_table("elements",
                              copy_from=baseline_elements() if offline else None) as batch:
        batch.alter_column("props", existing_type=JSON, server_default=sa.text(EMPTY))
    op.execute(f'UPDATE elements SET "props" = {EMPTY} WHERE "props" IS NULL')


def downgrade() -> None:
    # Nothing: 0001's schema has the default too (only the first release's lacked it), and
    # removing it would bring the 500 back.
    pass
