"""The UI's conversation store is versioned (``ui/db.py``, ``ui/migrations``): a store created
before migrations is adopted with its data, a later revision's column reaches it, a fresh store
gets the same schema, a failed upgrade changes nothing, an unknown schema is refused.

Each case runs on SQLite and on PostgreSQL. The stores are built and read by
``ui_db_probe.py`` in the UI's own venv (``ui/.venv``: Chainlit 2.12, SQLAlchemy, Alembic; made
like ``make ui-install`` if missing), conversations written and read back by Chainlit's own
data layer. PostgreSQL is a throwaway cluster from Debian's ``postgresql`` binaries
(``initdb``/``pg_ctl`` in a temporary directory, a free port on 127.0.0.1): its cases are
skipped, saying so, where the package is not installed (.ci/run does not install it).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.browser.helpers import UI_VENV, ensure_ui_venv
from tests.helpers import ROOT, free_port

PROBE = Path(__file__).with_name("ui_db_probe.py")
MIGRATIONS = ROOT / "ui" / "migrations"
#: Where Debian's postgresql package puts its server binaries, one directory per major version.
PG_BINDIRS = "/usr/lib/postgresql/*/bin"

#: A later revision as a Chainlit upgrade would need one: a new column (``{down}``: the head
#: of ``ui/migrations``; ``{then}``: more of ``upgrade()``).
LATER_REVISION = '''"""A later Chainlit's column."""
import sqlalchemy as sa
from alembic import op

revision = "later"
down_revision = {down!r}
branch_labels = None
depends_on = None


def upgrade():
    op.add_column("threads", sa.Column("archived", sa.Boolean))
{then}


def downgrade():
    op.drop_column("threads", "archived")
'''
ARCHIVED = ["archived", "BOOLEAN", True, None]  # as the probe lists a column


# --- the stores ---------------------------------------------------------------------------------
@dataclass
class Postgres:
    """A throwaway PostgreSQL server on 127.0.0.1:``port``, user ``phi3v`` (trust auth)."""

    bindir: Path
    port: int

    def new_database(self, name: str) -> str:
        """A new empty database; its async URL."""
        db = f"{name}_{uuid.uuid4().hex[:8]}"
        subprocess.run([self.bindir / "createdb", "-h", "127.0.0.1", "-p", str(self.port),
                        "-U", "phi3v", db], check=True, capture_output=True)
        return f"postgresql+asyncpg://phi3v@127.0.0.1:{self.port}/{db}"


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    found = sorted(Path("/").glob(PG_BINDIRS.lstrip("/")),
                   key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    if not found or not (found[-1] / "initdb").is_file():
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql); "
                    "the SQLite cases ran")
    bindir = found[-1]
    as_owner: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root: the package's postgres user
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user to run PostgreSQL")
        as_owner = ["runuser", "-u", "postgres", "--"]
    base = Path(tempfile.mkdtemp(prefix="phi3v-pg-"))
    if as_owner:
        shutil.chown(base, "postgres")
    data, port = base / "data", free_port()
    subprocess.run([*as_owner, bindir / "initdb", "-D", data, "-U", "phi3v", "--auth=trust",
                    "-E", "UTF8", "--no-sync"], check=True, capture_output=True)
    subprocess.run([*as_owner, bindir / "pg_ctl", "-D", data, "-l", base / "server.log", "-w",
                    "-o", f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off",
                    "start"], check=True, capture_output=True)
    try:
        yield Postgres(bindir, port)
    finally:
        subprocess.run([*as_owner, bindir / "pg_ctl", "-D", data, "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def new_store(request, tmp_path) -> Callable[[str], str]:
    """``new_store(name)``: the URL of a new empty store of the case's database."""
    if request.param == "sqlite":
        return lambda name: f"sqlite+aiosqlite:///{tmp_path / name}.db"
    return request.getfixturevalue("postgres").new_database


@pytest.fixture(scope="module")
def ui_python() -> Path:
    return ensure_ui_venv()


def probe(ui_python: Path, *calls: list[str]) -> list:
    """Run ``calls`` in one ``ui_db_probe.py`` process; their results."""
    # Chainlit writes a default .chainlit/ into its app root when it finds none: point it at
    # the UI's own, as `python -m ui` does.
    proc = subprocess.run([ui_python, PROBE, json.dumps(calls)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "CHAINLIT_APP_ROOT": str(ROOT / "ui")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def alembic(url: str, migrations: Path, *args: str) -> subprocess.CompletedProcess:
    """The documented command (ui/README.md), run from the project root on the store at
    ``url``, given as the UI's own setting."""
    return subprocess.run([UI_VENV / "bin" / "alembic", "-c", migrations / "alembic.ini", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PHI3V_UI_DATABASE_URL": url})


def with_later_revision(head: str, tmp_path: Path, then: str = "") -> Path:
    """A copy of ``ui/migrations`` with :data:`LATER_REVISION` on top of ``head``."""
    copy = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "versions" / "later.py").write_text(LATER_REVISION.format(down=head, then=then))
    return copy


# --- the cases ----------------------------------------------------------------------------------
def test_store_from_before_migrations_is_adopted_with_its_data(ui_python, new_store):
    """What the UI does at start (ui.db.upgrade) to a store of the UI before migrations, with a
    conversation in it: records the baseline, touches no table, loses no row; Chainlit reads
    the conversation back as before; a second start changes nothing."""
    url = new_store("before")
    _, _, before, upgraded, after, upgraded_again, again, head = probe(
        ui_python, ["legacy", url], ["conversation", url], ["snapshot", url],
        ["upgrade", url], ["snapshot", url], ["upgrade", url], ["snapshot", url],
        ["head", url])
    assert before["version"] is None
    assert len(before["thread"]["steps"]) == 2 and len(before["thread"]["elements"]) == 1
    assert upgraded == {} and upgraded_again == {}
    assert after["version"] == [head] == again["version"]
    for snapshot in (after, again):
        assert snapshot["schema"] == {"alembic_version": snapshot["schema"]["alembic_version"],
                                      **before["schema"]}
        assert snapshot["rows"] == before["rows"]
        assert snapshot["thread"] == before["thread"] and snapshot["user"] == before["user"]


def test_later_revision_adds_its_column_and_keeps_the_data(ui_python, new_store, tmp_path):
    """The documented command brings a store of the UI before migrations, with a conversation,
    to a later revision: its new column appears, every row stays as it was."""
    url = new_store("later")
    _, _, before, head = probe(ui_python, ["legacy", url], ["conversation", url],
                               ["snapshot", url], ["head", url])
    migrations = with_later_revision(head, tmp_path)
    upgrade = alembic(url, migrations, "upgrade", "head")
    assert upgrade.returncode == 0, upgrade.stderr
    [after] = probe(ui_python, ["snapshot", url])
    assert after["version"] == ["later"]
    assert after["schema"]["threads"]["columns"] == [*before["schema"]["threads"]["columns"],
                                                     ARCHIVED]
    assert after["rows"]["threads"] == [{**row, "archived": None}
                                        for row in before["rows"]["threads"]]
    assert {t: r for t, r in after["rows"].items() if t != "threads"} == {
        t: r for t, r in before["rows"].items() if t != "threads"}
    assert after["thread"] == before["thread"] and after["user"] == before["user"]


def test_fresh_store_gets_the_schema_of_before(ui_python, new_store):
    """The revisions build on an empty store exactly the tables the UI created before
    migrations (columns, types, nullability, defaults, keys, cascades, unique constraints)."""
    fresh, old = new_store("fresh"), new_store("old")
    upgraded, _, migrated, created = probe(
        ui_python, ["upgrade", fresh], ["legacy", old], ["snapshot", fresh], ["snapshot", old])
    assert upgraded == {}
    assert set(created["schema"]) == {"users", "threads", "steps", "elements", "feedbacks"}
    assert migrated["schema"] == {"alembic_version": migrated["schema"]["alembic_version"],
                                  **created["schema"]}


def test_first_release_store_gets_the_props_default(ui_python, new_store):
    """A store of the UI's first release (``elements.props`` without its default) upgraded as
    at start: ``props`` gets the default of a fresh store, the ``NULL`` that release stored for
    an element without props becomes ``{}``, every other row stays; an element Chainlit's data
    layer stores without props afterwards gets ``{}`` too, and both read back."""
    url, fresh = new_store("first"), new_store("fresh")
    _, _, before, upgraded, _, after, read, last, new = probe(
        ui_python, ["legacy", url, "first-release"], ["conversation", url], ["snapshot", url],
        ["upgrade", url], ["upgrade", fresh], ["snapshot", url], ["element", url],
        ["snapshot", url], ["snapshot", fresh])
    assert [r["props"] for r in before["rows"]["elements"]] == [None]  # the first release's
    assert upgraded == {}
    assert after["schema"] == new["schema"]
    assert after["rows"]["elements"] == [{**row, "props": "{}"}
                                         for row in before["rows"]["elements"]]
    assert {t: r for t, r in after["rows"].items() if t != "elements"} == {
        t: r for t, r in before["rows"].items() if t != "elements"}
    assert after["thread"]["steps"] == before["thread"]["steps"]
    assert [r["props"] for r in last["rows"]["elements"]] == ["{}", "{}"]
    # Chainlit 2.12's get_element json.loads the column, which asyncpg already returns decoded
    # from JSONB: on PostgreSQL it fails for every element, default or not.
    if url.startswith("sqlite"):
        assert read == {"6f1c2a0e-0000-4000-8000-000000000004": {},
                        "6f1c2a0e-0000-4000-8000-000000000006": {}}


def test_failed_upgrade_changes_nothing(ui_python, new_store, tmp_path):
    """A revision that fails half-way (after its column) leaves the store as it was: not even
    the baseline's adoption is recorded, so the next start tries again from the same place."""
    url = new_store("failed")
    _, before, head = probe(ui_python, ["legacy", url], ["snapshot", url], ["head", url])
    migrations = with_later_revision(head, tmp_path, then='    raise RuntimeError("half-way")')
    upgraded, after = probe(ui_python, ["upgrade", url, str(migrations)], ["snapshot", url])
    assert "half-way" in upgraded["error"]
    assert after == before and after["version"] is None
    assert "alembic_version" not in after["schema"]
    assert ARCHIVED not in after["schema"]["threads"]["columns"]


def test_store_of_an_unknown_schema_is_refused(ui_python, new_store):
    """A store with the UI's tables but not all their columns is not adopted: the upgrade
    fails naming what is missing, and records nothing."""
    url = new_store("unknown")
    _, _, upgraded, after = probe(ui_python, ["legacy", url],
                                  ["sql", url, 'ALTER TABLE steps DROP COLUMN "modes"'],
                                  ["upgrade", url], ["snapshot", url])
    assert "steps.modes" in upgraded["error"]
    assert after["version"] is None


def test_ui_does_not_start_on_a_store_it_cannot_upgrade(ui_python, tmp_path):
    """``python -m ui`` upgrades the store before serving: one it cannot upgrade stops it,
    saying why, instead of a UI whose every save fails."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'chat.db'}"
    probe(ui_python, ["legacy", url], ["sql", url, 'ALTER TABLE steps DROP COLUMN "modes"'])
    env = {**os.environ, "PHI3V_UI_DATABASE_URL": url,
           "PHI3V_UI_STORAGE_DIR": str(tmp_path / "files"),
           "PHI3V_UI_AUTH_SECRET_FILE": str(tmp_path / "auth_secret")}
    try:
        ui = subprocess.run([ui_python, "-m", "ui", "--port", str(free_port())], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the UI kept running on a store it could not upgrade")
    assert ui.returncode != 0
    assert "steps.modes" in ui.stderr
