"""The conversation store: its schema, versioned by Alembic, and the queries of ours.

Chainlit creates no tables, and a Chainlit release may read and write new columns. The schema
is therefore a chain of Alembic revisions in ``ui/migrations/versions`` (``0001``: the tables
Chainlit 2.12's ``SQLAlchemyDataLayer`` uses, on SQLite and PostgreSQL); the UI brings the
store to the newest revision at every start (:func:`upgrade`), and the same runs as a command
(``ui/README.md``: Persistence). A store created before there were revisions is adopted by
``0001`` as it is.

An upgrade is one transaction that first takes the store's migration lock: on PostgreSQL an
advisory lock, on SQLite the file's write lock (``BEGIN IMMEDIATE``; Python's ``sqlite3``
would otherwise run DDL outside any transaction). So replicas starting together upgrade one
after the other, and an upgrade that fails changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event, pool, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

#: Alembic's script directory: ``env.py``, ``alembic.ini`` and ``versions/``.
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
DIALECTS = ("sqlite", "postgresql")
#: PostgreSQL advisory lock held by an upgrade: any fixed 64-bit key that all UI processes
#: share and other applications of the database do not use (the bytes of "phi3v-ui").
PG_LOCK_KEY = int.from_bytes(b"phi3v-ui", "big")


def migration_engine(database_url: str) -> AsyncEngine:
    """An engine for one upgrade of ``database_url`` (async SQLAlchemy URL): no pool, and on
    SQLite a real transaction around DDL that takes the write lock at once (SQLAlchemy docs,
    pysqlite/aiosqlite: "Serializable isolation / Savepoints / Transactional DDL"). Creates
    the SQLite file's directory. Raises ``ValueError`` for another database."""
    url = make_url(database_url)
    dialect = url.get_backend_name()
    if dialect not in DIALECTS:
        raise ValueError(f"unsupported database {dialect!r}: use sqlite or postgresql")
    engine = create_async_engine(url, poolclass=pool.NullPool)
    if dialect == "sqlite":
        if url.database not in (None, "", ":memory:"):
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)

        @event.listens_for(engine.sync_engine, "connect")
        def no_driver_transactions(dbapi_connection, _record) -> None:
            dbapi_connection.isolation_level = None

        @event.listens_for(engine.sync_engine, "begin")
        def begin_immediate(connection) -> None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
    return engine


async def migrate(database_url: str, run: Callable[[Connection], Any]) -> None:
    """Call ``run`` with a connection to ``database_url`` inside one transaction holding the
    migration lock; commit if it returns, roll back if it raises (and re-raise)."""
    engine = migration_engine(database_url)
    try:
        async with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                                         {"key": PG_LOCK_KEY})
            await connection.run_sync(run)
    finally:
        await engine.dispose()


def alembic_config(database_url: str, migrations: Path = MIGRATIONS_DIR) -> Config:
    """Alembic's configuration for ``database_url`` and the script directory ``migrations``
    (the command reads the same from ``ui/migrations/alembic.ini``)."""
    config = Config()
    config.set_main_option("script_location", str(migrations))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


async def upgrade(database_url: str, migrations: Path = MIGRATIONS_DIR,
                  revision: str = "head") -> None:
    """Bring the store at ``database_url`` to ``revision`` of ``migrations`` (what the UI runs
    at start). Raises what the failing revision raised, the store left as it was."""
    config = alembic_config(database_url, migrations)

    def run(connection: Connection) -> None:
        config.attributes["connection"] = connection  # env.py runs on it
        command.upgrade(config, revision)

    await migrate(database_url, run)


async def element_owner(data_layer: Any, object_key: str) -> str | None:
    """Identifier of the user who owns the thread of the element stored at ``object_key``
    (``data_layer``: Chainlit's ``SQLAlchemyDataLayer``)."""
    rows = await data_layer.execute_sql(
        'SELECT t."userIdentifier" AS owner FROM elements e '
        'JOIN threads t ON t."id" = e."threadId" WHERE e."objectKey" = :key',
        {"key": object_key})
    return rows[0]["owner"] if isinstance(rows, list) and rows else None


async def user_elements(data_layer: Any, identifier: str) -> dict[str, str]:
    """``{element id: object key}`` of the stored files in ``identifier``'s threads."""
    rows = await data_layer.execute_sql(
        'SELECT e."id" AS id, e."objectKey" AS key FROM elements e '
        'JOIN threads t ON t."id" = e."threadId" '
        'WHERE t."userIdentifier" = :user AND e."objectKey" IS NOT NULL',
        {"user": identifier})
    return {str(r["id"]): r["key"] for r in rows} if isinstance(rows, list) else {}
