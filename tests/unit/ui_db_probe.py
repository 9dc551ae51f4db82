"""Run by ``tests/unit/test_ui_db.py`` with the UI's interpreter (``ui/.venv``: SQLAlchemy,
Alembic, Chainlit): builds and reads conversation stores.

``python tests/unit/ui_db_probe.py CALLS``: CALLS is a JSON list of ``[action, database URL,
*arguments]``; prints the JSON list of their results. The actions:

- ``legacy``: create the schema as ``ui/db.py`` did before migrations (``BEFORE_MIGRATIONS``,
  its DDL as of commit 12708ea), nothing else; ``legacy URL first-release``: as the UI's first
  release did (commit 281cace: the same but for ``elements.props``, without its default);
- ``conversation``: write a conversation through Chainlit's own ``SQLAlchemyDataLayer``: a
  user, a thread, a user message with an image (stored under a temporary directory; its
  row without ``props``), an answer with our step metadata, a feedback;
- ``element``: store one more image element without props in the conversation's thread
  through Chainlit's data layer, then read both elements back with its ``get_element``:
  ``{id: props}``, a failed read as its error;
- ``sql``: run one statement;
- ``upgrade``: ``ui.db.upgrade`` (what the UI runs at start), with the script directory given
  as argument if any; a failure is reported as ``{"error": ...}``;
- ``head``: the newest revision of ``ui/migrations``;
- ``snapshot``: the store as it is: ``schema`` (each table's columns, keys, unique
  constraints), ``rows`` (every row of the UI's tables), ``version`` (Alembic's revisions,
  null without its table) and, when there is a thread, ``thread`` and ``user`` as Chainlit's
  data layer reads them back.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CHAINLIT_APP_ROOT", str(ROOT / "ui"))  # its config.toml, no new one

TABLES = ("users", "threads", "steps", "elements", "feedbacks")
USER, THREAD = "alice", "6f1c2a0e-0000-4000-8000-000000000001"
QUESTION, ANSWER = "6f1c2a0e-0000-4000-8000-000000000002", "6f1c2a0e-0000-4000-8000-000000000003"
IMAGE, FEEDBACK = "6f1c2a0e-0000-4000-8000-000000000004", "6f1c2a0e-0000-4000-8000-000000000005"
NEW_IMAGE = "6f1c2a0e-0000-4000-8000-000000000006"

#: ``ui/db.py``'s ``SCHEMA`` and ``TYPES`` before migrations (commit 12708ea), verbatim: what a
#: store created by that UI holds.
BEFORE_MIGRATIONS = """
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
#: The first release's DDL (commit 281cace): ``elements.props`` had no default.
FIRST_RELEASE = BEFORE_MIGRATIONS.replace("""{json} DEFAULT '{{}}',""", "{json},")
assert FIRST_RELEASE != BEFORE_MIGRATIONS
TYPES = {
    "postgresql": {"uuid": "UUID", "json": "JSONB", "text_array": "TEXT[]"},
    "sqlite": {"uuid": "TEXT", "json": "TEXT", "text_array": "TEXT"},
}


async def legacy(url: str, release: str = "before-migrations") -> dict:
    ddl = {"before-migrations": BEFORE_MIGRATIONS, "first-release": FIRST_RELEASE}[release]
    ddl = ddl.format(**TYPES[make_url(url).get_backend_name()])
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        for statement in filter(str.strip, ddl.split(";")):
            await conn.execute(text(statement))
    await engine.dispose()
    return {}


def data_layer(url: str, files: Path | None = None):
    """Chainlit's data layer on ``url``, storing element files under ``files``."""
    from chainlit.data.sql_alchemy import SQLAlchemyDataLayer

    from ui.storage import LocalStorageClient

    return SQLAlchemyDataLayer(conninfo=url, storage_provider=LocalStorageClient(
        files or Path(tempfile.mkdtemp())))


async def conversation(url: str) -> dict:
    import chainlit as cl
    from chainlit.context import init_http_context
    from chainlit.types import Feedback
    from chainlit.user import User

    init_http_context(thread_id=THREAD)  # the data layer's writes run outside a chat
    layer = data_layer(url)
    user = await layer.create_user(User(identifier=USER, metadata={"provider": "users-file"}))
    await layer.update_thread(THREAD, name="Cats", user_id=user.id,
                              metadata={"chat_settings": {"temperature": 0.7}})
    await layer.create_step({"id": QUESTION, "threadId": THREAD, "name": USER,
                             "type": "user_message", "output": "What is in the image?",
                             "streaming": False, "createdAt": "2026-05-01T10:00:00.000Z"})
    await layer.create_step({"id": ANSWER, "threadId": THREAD, "parentId": QUESTION,
                             "name": "Phi-3-vision", "type": "assistant_message",
                             "output": "A cat.", "streaming": False, "isError": False,
                             "metadata": {"phi3v": {"answer": "A cat.", "stats": {}}},
                             "createdAt": "2026-05-01T10:00:01.000Z"})
    await layer.create_element(cl.Image(id=IMAGE, name="cat.png", content=b"\x89PNG",
                                        mime="image/png", display="inline",
                                        thread_id=THREAD, for_id=QUESTION))
    await layer.upsert_feedback(Feedback(forId=ANSWER, threadId=THREAD, value=1,
                                         comment="right", id=FEEDBACK))
    await layer.engine.dispose()
    return {}


async def element(url: str) -> dict:
    import chainlit as cl
    from chainlit.context import init_http_context

    init_http_context(thread_id=THREAD)
    layer = data_layer(url)
    await layer.create_element(cl.Image(id=NEW_IMAGE, name="dog.png", content=b"\x89PNG",
                                        mime="image/png", display="inline",
                                        thread_id=THREAD, for_id=QUESTION))
    read = {}
    for element_id in (IMAGE, NEW_IMAGE):
        try:
            found = await layer.get_element(THREAD, element_id)
            read[element_id] = found["props"] if found else None
        except Exception as exc:  # noqa: BLE001 - the test reads what the data layer raised
            read[element_id] = f"{type(exc).__name__}: {exc}"
    await layer.engine.dispose()
    return read


async def sql(url: str, statement: str) -> dict:
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.execute(text(statement))
    await engine.dispose()
    return {}


async def head(url: str) -> str:
    from alembic.script import ScriptDirectory

    from ui import db

    return ScriptDirectory.from_config(db.alembic_config(url)).get_current_head()


async def upgrade(url: str, migrations: str | None = None) -> dict:
    from ui import db

    try:
        await (db.upgrade(url, Path(migrations)) if migrations else db.upgrade(url))
    except Exception as exc:  # noqa: BLE001 - the test reads what the upgrade raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {}


def schema_of(conn) -> dict:
    inspector = inspect(conn)
    schema = {}
    for table in inspector.get_table_names():
        schema[table] = {
            "columns": [[c["name"], str(c["type"]), c["nullable"], c["default"]]
                        for c in inspector.get_columns(table)],
            "primary_key": inspector.get_pk_constraint(table)["constrained_columns"],
            "foreign_keys": sorted(
                [fk["constrained_columns"], fk["referred_table"], fk["referred_columns"],
                 fk["options"].get("ondelete")] for fk in inspector.get_foreign_keys(table)),
            "unique": sorted(u["column_names"] for u in inspector.get_unique_constraints(table)),
        }
    return schema


async def snapshot(url: str) -> dict:
    engine = create_async_engine(url)
    async with engine.connect() as conn:
        schema = await conn.run_sync(schema_of)
        rows = {t: [{k: str(v) if v is not None else None for k, v in r._mapping.items()}
                    for r in await conn.execute(text(f'SELECT * FROM {t} ORDER BY "id"'))]
                for t in TABLES if t in schema}
        version = ([r[0] for r in await conn.execute(text("SELECT version_num FROM "
                                                          "alembic_version"))]
                   if "alembic_version" in schema else None)
    await engine.dispose()
    found = {"schema": schema, "rows": rows, "version": version}
    if rows.get("threads"):
        layer = data_layer(url)
        found["thread"], user = await layer.get_thread(THREAD), await layer.get_user(USER)
        found["user"] = user.to_dict() if user else None
        await layer.engine.dispose()
    return found


ACTIONS = {"legacy": legacy, "conversation": conversation, "element": element, "sql": sql,
           "head": head, "upgrade": upgrade, "snapshot": snapshot}


async def main(calls: list[list[str]]) -> list:
    return [await ACTIONS[action](*args) for action, *args in calls]


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1]))), default=str))
