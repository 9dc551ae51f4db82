"""Per-tenant usage, per UTC day, in SQLite (``--usage-db``): what ``GET /admin/usage``
answers and what the day and month budgets start from after a restart (``serve.quota``).

One row per (day, tenant, user): requests, prompt, completion and image tokens (prompt tokens
include the image tokens; image tokens are also counted alone), good requests (goodput), and
refusals by reason in a second table. ``user`` is the end user a trusted front end named
(``serve.tenants.Tenant.trusted_frontend``), else empty.

Writes are batched off the event loop: :meth:`UsageStore.add` only adds to a dict in memory;
a writer thread upserts what gathered every :data:`FLUSH_INTERVAL_S` in one transaction
(``executemany``), and :meth:`UsageStore.close` writes the rest. At most that interval of usage
is lost when the process is killed (SIGKILL, power loss); a SIGTERM loses nothing. The file is
in WAL mode (readers such as ``sqlite3 usage.sqlite3`` do not block the writer).

Where: ``--usage-db PATH``; by default ``usage.sqlite3`` next to the keys file when there is
one, else in memory (``:memory:``: totals and budgets last as long as the process).

Standard library only.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from serve.quota import utc_day

log = logging.getLogger("serve.usage")

#: Seconds between two writes of the gathered usage.
FLUSH_INTERVAL_S = 1.0
#: The counted fields of a row, in the table's column order.
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "image_tokens", "good_requests")
#: ``path`` of a store kept in memory.
IN_MEMORY = ":memory:"

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    day TEXT NOT NULL,            -- UTC, YYYY-MM-DD
    tenant TEXT NOT NULL,
    user TEXT NOT NULL,           -- '' unless a trusted front end named its user
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    image_tokens INTEGER NOT NULL,
    good_requests INTEGER NOT NULL,
    PRIMARY KEY (day, tenant, user)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS refusals (
    day TEXT NOT NULL,
    tenant TEXT NOT NULL,
    user TEXT NOT NULL,
    reason TEXT NOT NULL,
    requests INTEGER NOT NULL,
    PRIMARY KEY (day, tenant, user, reason)
) WITHOUT ROWID;
"""
_UPSERT_USAGE = (
    f"INSERT INTO usage (day, tenant, user, {', '.join(FIELDS)}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (day, tenant, user) DO UPDATE SET "
    + ", ".join(f"{f} = {f} + excluded.{f}" for f in FIELDS))
_UPSERT_REFUSALS = (
    "INSERT INTO refusals (day, tenant, user, reason, requests) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (day, tenant, user, reason) DO UPDATE SET requests = requests + "
    "excluded.requests")


class UsageStoreError(ValueError):
    """The usage store's file cannot be opened or is not a usage store."""


class UsageStore:
    """Usage totals per (UTC day, tenant, user) in SQLite (module docstring).

    Args:
        path: the SQLite file (created with its tables if missing), or :data:`IN_MEMORY`.
        clock: wall time, seconds (the day a usage counts on).
        flush_interval_s: seconds between the writer thread's writes.

    Raises:
        UsageStoreError: ``path`` cannot be opened, or holds something else.
    """

    def __init__(self, path: str | Path = IN_MEMORY, clock: Callable[[], float] = time.time,
                 flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.path = str(path)
        self.clock = clock
        self.flush_interval_s = flush_interval_s
        try:
            if self.path != IN_MEMORY:
                # Owner-only, like the keys file: it names tenants and users. SQLite gives its
                # -wal and -shm files the database file's permissions.
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            self._db = sqlite3.connect(self.path, check_same_thread=False,
                                       isolation_level=None)
            if self.path != IN_MEMORY:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise UsageStoreError(f"usage store {self.path}: {exc} (--usage-db names a "
                                  "SQLite file in a directory the server can write)") from None
        self._db_lock = threading.Lock()
        #: Counts not written yet: (day, tenant, user) -> [FIELDS...], and refusals by reason.
        self._pending: dict[tuple[datetime.date, str, str], list[int]] = {}
        self._pending_refusals: collections.Counter[tuple[datetime.date, str, str, str]] = \
            collections.Counter()
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None

    @property
    def persistent(self) -> bool:
        """Whether the totals outlive the process (a file, not memory)."""
        return self.path != IN_MEMORY

    # --- writing ----------------------------------------------------------------------------
    def add(self, tenant: str, user: str = "", *, requests: int = 0, prompt_tokens: int = 0,
            completion_tokens: int = 0, image_tokens: int = 0, good_requests: int = 0,
            refusal: str | None = None) -> None:
        """Count one request's usage on today's row of (``tenant``, ``user``) and, when it was
        refused, one refusal for ``refusal`` (the reason). In memory only: microseconds, safe
        on the event loop; written within :attr:`flush_interval_s`."""
        key = (utc_day(self.clock()), tenant, user)
        values = (requests, prompt_tokens, completion_tokens, image_tokens, good_requests)
        with self._pending_lock:
            row = self._pending.get(key)
            if row is None:
                self._pending[key] = list(values)
            else:
                for i, value in enumerate(values):
                    row[i] += value
            if refusal is not None:
                self._pending_refusals[(*key, refusal)] += 1

    def flush(self) -> int:
        """Write what gathered, in one transaction. Returns how many rows it upserted."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
            refusals, self._pending_refusals = self._pending_refusals, collections.Counter()
        if not pending and not refusals:
            return 0
        with self._db_lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(_UPSERT_USAGE, [
                    (day.isoformat(), *key, *row) for (day, *key), row in pending.items()])
                self._db.executemany(_UPSERT_REFUSALS, [
                    (day.isoformat(), *key, n) for (day, *key), n in refusals.items()])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return len(pending) + len(refusals)

    def start(self) -> None:
        """Start the writer thread (it flushes every :attr:`flush_interval_s`)."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="usage-writer",
                                            daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
            except sqlite3.Error:  # a full disk: keep serving, try the next batch
                log.exception("usage: write to %s failed", self.path)

    def close(self) -> None:
        """Stop the writer, write the rest, close the database."""
        self._stop.set()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        try:
            self.flush()
        finally:
            with self._db_lock:
                self._db.close()

    # --- reading ----------------------------------------------------------------------------
    def tokens_since(self, day: datetime.date) -> dict[str, int]:
        """Tokens (prompt + completion) of each tenant from ``day`` (UTC) on, written or not
        (what :meth:`serve.quota.Quota.seed` starts from)."""
        self.flush()
        with self._db_lock:
            rows = self._db.execute(
                "SELECT tenant, SUM(prompt_tokens + completion_tokens) FROM usage "
                "WHERE day >= ? GROUP BY tenant", (day.isoformat(),)).fetchall()
        return {tenant: int(tokens) for tenant, tokens in rows}

    def report(self, since: datetime.date, tenant: str | None = None) -> dict:
        """The totals of each tenant (or only ``tenant``) and day from ``since`` on, with its
        users where a trusted front end named them (the body of ``GET /admin/usage``)::

            {"since": "2025-06-01", "days": [
                {"day": "2025-06-02", "tenant": "chat-ui", "requests": 12,
                 "prompt_tokens": 9000, "completion_tokens": 800, "image_tokens": 7000,
                 "tokens": 9800, "good_requests": 11, "refusals": {"tokens_per_minute": 1},
                 "users": [{"user": "alice", "requests": 7, ...}]}]}

        Sorted by day, then tenant; users by name.
        """
        self.flush()
        where, args = "WHERE day >= ?", [since.isoformat()]
        if tenant is not None:
            where, args = where + " AND tenant = ?", [*args, tenant]
        with self._db_lock:
            rows = self._db.execute(
                f"SELECT day, tenant, user, {', '.join(FIELDS)} FROM usage {where}",
                args).fetchall()
            refused = self._db.execute(
                f"SELECT day, tenant, user, reason, requests FROM refusals {where}",
                args).fetchall()
        users: dict[tuple[str, str, str], dict] = {}
        for day, name, user, *values in rows:
            users[(day, name, user)] = _totals(dict(zip(FIELDS, values, strict=True)))
        for day, name, user, reason, n in refused:
            totals = users.setdefault((day, name, user), _totals({}))
            totals["refusals"][reason] = n
        days: dict[tuple[str, str], dict] = {}
        for (day, name, user), totals in sorted(users.items()):
            entry = days.setdefault((day, name), {"day": day, "tenant": name,
                                                  **_totals({}), "users": []})
            for field in (*FIELDS, "tokens"):
                entry[field] += totals[field]
            for reason, n in totals["refusals"].items():
                entry["refusals"][reason] = entry["refusals"].get(reason, 0) + n
            if user:
                entry["users"].append({"user": user, **totals})
        for entry in days.values():
            if not entry["users"]:
                del entry["users"]
        return {"since": since.isoformat(), "days": [days[k] for k in sorted(days)]}


def _totals(values: dict) -> dict:
    totals = {field: int(values.get(field, 0)) for field in FIELDS}
    totals["tokens"] = totals["prompt_tokens"] + totals["completion_tokens"]
    totals["refusals"] = {}
    return totals


def month_start(day: datetime.date) -> datetime.date:
    """The first day of ``day``'s month."""
    return day.replace(day=1)
