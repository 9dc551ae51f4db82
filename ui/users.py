"""The UI's team accounts: a users file of Argon2id password hashes, and its command.

``PHI3V_UI_ACCOUNTS=users-file`` makes the login check names and passwords against
``PHI3V_UI_USERS_FILE`` (``ui/.data/users.json`` by default), which this module's command
manages::

    ui/.venv/bin/python -m ui.users add alice        # asks for the password twice
    ui/.venv/bin/python -m ui.users reset alice      # a new password
    ui/.venv/bin/python -m ui.users lock alice       # refused at login until unlocked
    ui/.venv/bin/python -m ui.users unlock alice
    ui/.venv/bin/python -m ui.users remove alice
    ui/.venv/bin/python -m ui.users list
    echo "$PASSWORD" | ui/.venv/bin/python -m ui.users add alice --password-stdin

Hashes are made and checked by ``argon2-cffi`` (Argon2id, RFC 9106; the library's default
parameters, its encoded ``$argon2id$v=19$m=...`` format): never a plain or a fast hash. The file
is JSON, written atomically with mode 0600; the UI reads it again when it changes, so users
added while the UI runs can log in at once.

:class:`Accounts` answers a login: a wrong password, an unknown name and a locked user are
all refused the same way and all cost one Argon2 verification (an unknown or locked name is
checked against a fixed dummy hash), so neither the answer nor its timing tells whether a
name exists. :class:`LoginLimiter` refuses, the same way, a name and address pair after
``max_failures`` failed logins within ``window_s``.

This module imports neither Chainlit nor the API, so it loads in any environment.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import getpass
import json
import logging
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

log = logging.getLogger("ui.users")

#: Longest accepted user name and password (characters): bounds the work of one login.
MAX_NAME = 64
MAX_PASSWORD = 1024
#: Shortest password ``add``/``reset`` accept (characters; NIST SP 800-63B: at least 8).
MIN_PASSWORD = 8


class UsersFileError(ValueError):
    """A users file that cannot be read, or a command that cannot be done (message says why)."""


@dataclass
class UsersFile:
    """The users file: ``{"users": {name: {"hash": argon2 hash, "locked": bool}}}``.

    Args:
        path: the JSON file (created by the first :meth:`add`).
        hasher: the Argon2 hasher (the library's defaults).
    """

    path: Path
    hasher: PasswordHasher = field(default_factory=PasswordHasher)

    def load(self) -> dict[str, dict]:
        """The users by name (empty when the file does not exist).

        Raises:
            UsersFileError: the file is not a users file.
        """
        if not self.path.is_file():
            return {}
        try:
            users = json.loads(self.path.read_text())["users"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsersFileError(f"{self.path} is not a users file: {exc}") from None
        if not isinstance(users, dict):
            raise UsersFileError(f"{self.path} is not a users file: 'users' is not a map")
        return users

    def save(self, users: dict[str, dict]) -> None:
        """Write atomically (a temporary file of its own, synced, renamed over the old one),
        mode 0600."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"users": users}, f, indent=1, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def locked(self):
        """Hold the file's lock (``flock`` on ``<file>.lock``) for a read-modify-write:
        two commands at once must not lose each other's change."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def check_name(name: str) -> str:
        """``name`` if it is a valid user name (1-64 printable characters, no spaces).

        Raises:
            UsersFileError: naming what is wrong.
        """
        if not 1 <= len(name) <= MAX_NAME or not name.isprintable() or " " in name:
            raise UsersFileError(f"user name must be 1-{MAX_NAME} printable characters "
                                 f"without spaces, got {name!r}")
        return name

    def set_password(self, name: str, password: str, new: bool) -> None:
        """Add user ``name`` (``new``) or reset an existing user's password.

        Raises:
            UsersFileError: the name exists (add) or not (reset), or a password shorter than
                :data:`MIN_PASSWORD` or longer than :data:`MAX_PASSWORD`.
        """
        self.check_name(name)
        if not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
            raise UsersFileError(f"password must be {MIN_PASSWORD}-{MAX_PASSWORD} characters")
        hashed = self.hasher.hash(password)
        with self.locked():
            users = self.load()
            if new and name in users:
                raise UsersFileError(f"user {name!r} exists (reset changes the password)")
            if not new and name not in users:
                raise UsersFileError(f"no user {name!r}")
            entry = users.get(name, {"locked": False})
            entry["hash"] = hashed
            users[name] = entry
            self.save(users)

    def set_locked(self, name: str, locked: bool) -> None:
        """Lock or unlock ``name``. Raises :class:`UsersFileError` for an unknown name."""
        with self.locked():
            users = self.load()
            if name not in users:
                raise UsersFileError(f"no user {name!r}")
            users[name]["locked"] = locked
            self.save(users)

    def remove(self, name: str) -> None:
        """Remove ``name`` (their conversations stay in the store). Raises
        :class:`UsersFileError` for an unknown name."""
        with self.locked():
            users = self.load()
            if users.pop(name, None) is None:
                raise UsersFileError(f"no user {name!r}")
            self.save(users)


class LoginLimiter:
    """At most ``max_failures`` failed logins per (name, address) within ``window_s`` seconds;
    past that the pair is refused until its oldest failure leaves the window (a password
    guesser gets ``max_failures`` tries per window per name; the real user elsewhere is not
    locked out).

    Args:
        max_failures: failures allowed in the window.
        window_s: length of the window, seconds.
        clock: monotonic clock, seconds.
        max_keys: memory bound: the oldest pairs are forgotten first.
    """

    def __init__(self, max_failures: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.clock = clock
        self.max_keys = max_keys
        self._failures: dict[tuple[str, str], deque[float]] = {}

    def _recent(self, key: tuple[str, str]) -> deque[float]:
        times = self._failures.get(key, deque())
        while times and self.clock() - times[0] > self.window_s:
            times.popleft()
        return times

    def allowed(self, name: str, address: str) -> bool:
        """Whether a login of ``name`` from ``address`` may be checked now."""
        return len(self._recent((name.lower(), address))) < self.max_failures

    def failed(self, name: str, address: str) -> None:
        """Count a failed login."""
        key = (name.lower(), address)
        times = self._recent(key)
        times.append(self.clock())
        self._failures.pop(key, None)
        self._failures[key] = times  # most recent last: the oldest are dropped first
        while len(self._failures) > self.max_keys:
            self._failures.pop(next(iter(self._failures)))

    def succeeded(self, name: str, address: str) -> None:
        """Forget the pair's failures."""
        self._failures.pop((name.lower(), address), None)


class Accounts:
    """Logins against a :class:`UsersFile`, rate-limited by a :class:`LoginLimiter`.

    Args:
        users: the users file (read again whenever its modification time changes).
        limiter: failed-login limiter.
    """

    def __init__(self, users: UsersFile, limiter: LoginLimiter) -> None:
        self.users = users
        self.limiter = limiter
        self._cache: tuple[float, dict[str, dict]] | None = None
        # Verified in place of a real hash for an unknown or locked name: same cost.
        self._dummy = users.hasher.hash(os.urandom(16).hex())

    def _current(self) -> dict[str, dict]:
        try:
            mtime = self.users.path.stat().st_mtime
        except FileNotFoundError:
            return {}
        if self._cache is None or self._cache[0] != mtime:
            try:
                self._cache = (mtime, self.users.load())
            except UsersFileError as exc:
                # A broken edit must not lock everyone out: keep the last good copy.
                log.error("%s; logins use the last good copy", exc)
                return self._cache[1] if self._cache else {}
        return self._cache[1]

    def login(self, name: str, password: str, address: str) -> bool:
        """True when ``name`` may log in from ``address`` with ``password``.

        Every refusal (wrong password, unknown or locked name, too many failures, an
        over-long input) returns False after one Argon2 verification, so callers answer all
        of them with the same message in the same time class. A successful login rehashes a
        password whose hash uses outdated parameters.
        """
        name, password = name[:MAX_NAME + 1], password[:MAX_PASSWORD + 1]
        entry = self._current().get(name)
        usable = (entry is not None and not entry.get("locked")
                  and self.limiter.allowed(name, address)
                  and len(name) <= MAX_NAME and len(password) <= MAX_PASSWORD)
        stored = entry["hash"] if usable else self._dummy
        try:
            ok = self.users.hasher.verify(stored, password) and usable
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            ok = False
        if not ok:
            self.limiter.failed(name, address)
            return False
        self.limiter.succeeded(name, address)
        if self.users.hasher.check_needs_rehash(stored):
            try:
                self.users.set_password(name, password, new=False)
            except (OSError, UsersFileError) as exc:  # read-only file, an old short password
                log.warning("could not upgrade %r's password hash: %s", name, exc)
        return True


# --- the command ------------------------------------------------------------------------------
def _read_password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    first = getpass.getpass("password: ")
    if first != getpass.getpass("again: "):
        raise UsersFileError("the passwords differ")
    return first


def main(argv: list[str] | None = None) -> int:
    """``python -m ui.users``: manage the users file. Returns the exit status (2 on error)."""
    from ui.settings import UISettings

    parser = argparse.ArgumentParser(prog="python -m ui.users", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=Path, default=None,
                        help="users file (default: PHI3V_UI_USERS_FILE or ui/.data/users.json)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, what in (("add", "add a user"), ("reset", "set a user's new password")):
        p = sub.add_parser(command, help=what)
        p.add_argument("name")
        p.add_argument("--password-stdin", action="store_true",
                       help="read the password from the first line of standard input")
    for command, what in (("lock", "refuse a user's logins"), ("unlock", "allow them again"),
                          ("remove", "delete a user (their conversations stay)")):
        sub.add_parser(command, help=what).add_argument("name")
    sub.add_parser("list", help="the users, one per line (name, locked)")
    args = parser.parse_args(argv)
    users = UsersFile(args.file or UISettings().users_file)
    try:
        if args.command in ("add", "reset"):
            users.check_name(args.name)
            users.set_password(args.name, _read_password(args.password_stdin),
                               new=args.command == "add")
        elif args.command in ("lock", "unlock"):
            users.set_locked(args.name, args.command == "lock")
        elif args.command == "remove":
            users.remove(args.name)
        else:
            for name, entry in sorted(users.load().items()):
                print(f"{name}{'  (locked)' if entry.get('locked') else ''}")
            return 0
    except UsersFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.command}: {args.name} ({users.path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
