"""The conversation store's schema, created at start (Chainlit creates no tables).

The tables are those Chainlit's ``SQLAlchemyDataLayer`` (2.12) reads and writes: ``users``,
``threads``, ``steps``, ``elements``, ``feedbacks``, as in Chainlit's documented PostgreSQL
schema (docs: Data layers → SQLAlchemy) plus the newer ``steps`` columns the 2.12 code writes
(``command``, ``defaultOpen``, ``autoCollapse``, ``modes``), and ``elements.props`` defaults to
``{}``: the data layer leaves it out of the row of an element without props and then fails
reading it back (``json.loads(None)``: a 500 for ``GET /project/thread/<id>/element/<id>``).
One DDL serves both databases:
PostgreSQL gets ``UUID``/``JSONB``/``TEXT[]``; SQLite, which has none of these, gets ``TEXT``
(the data layer already parses JSON it reads back as text). Every statement is
``CREATE TABLE IF NOT EXISTS``: running it on an existing store changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    "id" {uuid} PRIMARY KEY,
    "identifier" TEXT NOT NULL UNIQUE,
    "metadata" {json} NOT NULL,
    "createdAt" TEXT
);
CREATE TABLE IF NOT EXISTS threads (
    "id" {uuid} PRIMARY KEY,
    "createdAt" TEXT,
    "name" TEXT,
    "userId" {uuid},
    "userIdentifier" TEXT,
    "tags" {text_array},
    "metadata" {json},
    FOREIGN KEY ("userId") REFERENCES users("id") ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS steps (
    "id" {uuid} PRIMARY KEY,
    "name" TEXT NOT NULL,
    "type" TEXT NOT NULL,
    "threadId" {uuid} NOT NULL,
    "parentId" {uuid},
    "streaming" BOOLEAN NOT NULL,
    "waitForAnswer" BOOLEAN,
    "isError" BOOLEAN,
    "metadata" {json},
    "tags" {text_array},
    "input" TEXT,
    "output" TEXT,
    "createdAt" TEXT,
    "command" TEXT,
    "start" TEXT,
    "end" TEXT,
    "generation" {json},
    "showInput" TEXT,
    "language" TEXT,
    "indent" INT,
    "defaultOpen" BOOLEAN,
    "autoCollapse" BOOLEAN,
    "modes" {json},
    FOREIGN KEY ("threadId") REFERENCES threads("id") ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS elements (
    "id" {uuid} PRIMARY KEY,
    "threadId" {uuid},
    "type" TEXT,
    "url" TEXT,
    "chainlitKey" TEXT,
    "name" TEXT NOT NULL,
    "display" TEXT,
    "objectKey" TEXT,
    "size" TEXT,
    "page" INT,
    "language" TEXT,
    "forId" {uuid},
    "mime" TEXT,
    "props" {json} DEFAULT '{{}}',
    "autoPlay" BOOLEAN,
    "playerConfig" {json},
    FOREIGN KEY ("threadId") REFERENCES threads("id") ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS feedbacks (
    "id" {uuid} PRIMARY KEY,
    "forId" {uuid} NOT NULL,
    "threadId" {uuid} NOT NULL,
    "value" INT NOT NULL,
    "comment" TEXT,
    FOREIGN KEY ("threadId") REFERENCES threads("id") ON DELETE CASCADE
);
"""

TYPES = {
    "postgresql": {"uuid": "UUID", "json": "JSONB", "text_array": "TEXT[]"},
    "sqlite": {"uuid": "TEXT", "json": "TEXT", "text_array": "TEXT"},
}


def schema_statements(database_url: str) -> list[str]:
    """The ``CREATE TABLE`` statements for ``database_url``'s dialect."""
    dialect = make_url(database_url).get_backend_name()
    if dialect not in TYPES:
        raise ValueError(f"unsupported database {dialect!r}: use sqlite or postgresql")
    ddl = SCHEMA.format(**TYPES[dialect])
    return [s.strip() for s in ddl.split(";") if s.strip()]


async def create_schema(database_url: str) -> None:
    """Create the tables if missing (and the SQLite file's directory)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(database_url)
    try:
        async with engine.begin() as conn:
            for statement in schema_statements(database_url):
                await conn.execute(text(statement))
    finally:
        await engine.dispose()


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
