"""The keys file: API keys and the tenants they belong to (``--keys-file``), read by the
server (:class:`KeyStore`) and managed with ``python -m serve.keys`` (:func:`main`).

The file is one JSON object::

    {"version": 1,
     "tenants": {"team-a": {"weight": 2.0, "limits": {"max_concurrent": 8},
                            "trusted_frontend": false, "admin": false}},
     "keys": [{"id": "k_3f9a0c1d2e4b", "sha256": "<64 hex digits>", "tenant": "team-a",
               "created": "2025-06-01T12:00:00Z", "revoked": false, "revoked_at": null}]}

A tenant's ``limits`` take the fields of :class:`serve.tenants.TenantLimits` (absent or null:
unlimited). Every key names a tenant of ``tenants``. An unknown field anywhere is an error,
so a misspelt limit is never silently "unlimited".

**Tokens and their hashes.** A token is :data:`TOKEN_PREFIX` + ``secrets.token_urlsafe(32)``:
256 random bits. It is printed once, when it is made; the file keeps only its SHA-256. A plain
SHA-256, without salt or a slow key-derivation function, is enough for tokens of this
entropy: a slow hash (bcrypt, Argon2) makes guessing a *low-entropy* password expensive, and a
salt defeats tables precomputed over likely passwords; neither helps against a search of 2**256
equally likely tokens, which is out of reach at any hashing speed. A fast digest also keeps the
per-request check one hash and one dictionary access. The prefix makes a leaked token easy to
recognise (secret scanners, logs). The key id (``k_`` + 12 hex digits) is random and public:
it names the key in the CLI and logs, and says nothing about the token.

**Lookup** (:meth:`KeyStore.lookup`): the presented token is hashed, its digest looked up in
a dictionary of the keys not revoked, and compared with :func:`hmac.compare_digest`: the same
steps whichever key matches, or none. A revoked key is not in that dictionary: it is refused
exactly as an unknown token is.

**Reload.** The server re-reads the file when its inode, size or modification time changed
(checked on a lookup, at most once per :data:`RELOAD_CHECK_S`) and on SIGHUP. A file that
does not load (missing, not JSON, an invalid entry) leaves the keys in force and logs an error
naming the entry.

**Writes** (the CLI): under an exclusive lock on ``<file>.lock``, the new content goes to a
temporary file in the same directory, is fsynced, and replaces the file with
:func:`os.replace` (the directory is fsynced too): a reader sees the old file or the new one,
never a part. A new file is created 0600; an existing one keeps its permission bits, and its
owner where the writer may set it (root). Mount the file's *directory* into a container: a
single-file bind mount cannot be replaced.

Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.tenants import Tenant, TenantLimits

log = logging.getLogger("serve.keys")

#: Version of the file format.
FORMAT_VERSION = 1
#: Start of every token (recognisable when leaked).
TOKEN_PREFIX = "phi3v-"
#: Start of every key id.
KEY_ID_PREFIX = "k_"
#: Seconds between two checks of the file for a change (on a lookup).
RELOAD_CHECK_S = 1.0
#: A tenant's name: it labels metrics and logs.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: Environment variable naming the file (the server's ``--keys-file``), the CLI's default.
FILE_ENV = "PHI3V_KEYS_FILE"

_LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(TenantLimits))
_TENANT_FIELDS = ("weight", "limits", "trusted_frontend", "admin")
#: Bounds of a tenant's weight. Fair admission divides by the sum of the waiting tenants'
#: weights: bounded, a few thousand tenants' sum stays a finite float and a share stays
#: above 0. A ratio of 10^12 between two tenants is beyond any use.
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6
_KEY_FIELDS = ("id", "sha256", "tenant", "created", "revoked", "revoked_at")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class KeysFileError(ValueError):
    """The keys file cannot be read or is invalid (the message names the file and entry)."""


def new_token() -> str:
    """A new API token (module docstring)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> bytes:
    """The SHA-256 of a token, as the file keeps it (hex) and the lookup compares it."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class KeyEntry:
    """One key of the file (never its token)."""

    id: str
    sha256: str
    tenant: str
    created: str
    revoked: bool = False
    revoked_at: str | None = None


@dataclass
class KeysFile:
    """The file's content: tenants by name and keys in creation order."""

    tenants: dict[str, Tenant] = dataclasses.field(default_factory=dict)
    keys: list[KeyEntry] = dataclasses.field(default_factory=list)

    # --- reading ----------------------------------------------------------------------------
    @classmethod
    def read(cls, path: Path) -> KeysFile:
        """Load and validate ``path``.

        Raises:
            KeysFileError: unreadable, not JSON, or an invalid entry (named).
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise KeysFileError(f"keys file {path} does not exist; make it with `python -m "
                                f"serve.keys --file {path} add --tenant NAME`") from None
        except OSError as exc:
            raise KeysFileError(f"keys file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise KeysFileError(f"keys file {path}: not UTF-8 text") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise KeysFileError(f"keys file {path}: not valid JSON ({exc})") from None
        except RecursionError:  # nesting deeper than the parser's stack: no keys file is
            raise KeysFileError(f"keys file {path}: not valid JSON (nested too deeply)") \
                from None
        return cls.from_json(data, str(path))

    @classmethod
    def from_json(cls, data: Any, source: str = "keys file") -> KeysFile:
        """Validate decoded JSON (module docstring's format).

        Raises:
            KeysFileError: naming ``source`` and the entry.
        """
        def fail(where: str, message: str) -> KeysFileError:
            return KeysFileError(f"{source}: {where}: {message}")

        if not isinstance(data, dict):
            raise fail("top level", "must be a JSON object")
        _no_unknown(data, ("version", "tenants", "keys"), "top level", fail)
        if data.get("version") != FORMAT_VERSION:
            raise fail("version", f"must be {FORMAT_VERSION}; got {data.get('version')!r}")
        tenants_data, keys_data = data.get("tenants", {}), data.get("keys", [])
        if not isinstance(tenants_data, dict):
            raise fail("tenants", "must be an object of tenants by name")
        if not isinstance(keys_data, list):
            raise fail("keys", "must be a list")
        tenants = {name: _tenant(name, value, fail) for name, value in tenants_data.items()}
        keys: list[KeyEntry] = []
        ids: set[str] = set()
        digests: set[str] = set()
        for i, value in enumerate(keys_data):
            entry = _key(value, f"keys[{i}]", fail)
            where = f"keys[{i}] ({entry.id})"
            if entry.tenant not in tenants:
                raise fail(where, f"tenant {entry.tenant!r} is not defined in 'tenants'")
            if entry.id in ids:
                raise fail(where, "a second key with this id")
            if entry.sha256 in digests:
                raise fail(where, "the same sha256 as an earlier key")
            ids.add(entry.id)
            digests.add(entry.sha256)
            keys.append(entry)
        return cls(tenants, keys)

    # --- writing ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The file's JSON object (limits left out where unlimited)."""
        tenants = {}
        for name, t in self.tenants.items():
            limits = {k: v for k, v in dataclasses.asdict(t.limits).items() if v is not None}
            tenants[name] = {"weight": t.weight, "limits": limits,
                             "trusted_frontend": t.trusted_frontend, "admin": t.admin}
        return {"version": FORMAT_VERSION, "tenants": tenants,
                "keys": [dataclasses.asdict(k) for k in self.keys]}

    def write(self, path: Path) -> None:
        """Write atomically (module docstring): a temporary file, fsync, :func:`os.replace`.
        A symbolic link is followed: its target is replaced, the link kept."""
        path = Path(os.path.realpath(path))
        text = json.dumps(self.to_json(), indent=2) + "\n"
        try:
            old = os.stat(path)
        except FileNotFoundError:
            old = None
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:  # mkstemp: created 0600
                file.write(text)
                file.flush()
                if old is not None:  # the server's user may be the file's owner, not ours
                    os.fchmod(file.fileno(), old.st_mode & 0o777)
                    with contextlib.suppress(PermissionError):
                        os.fchown(file.fileno(), old.st_uid, old.st_gid)
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # --- changes ----------------------------------------------------------------------------
    def key(self, key_id: str) -> KeyEntry:
        """The key ``key_id``. Raises :class:`KeysFileError` when there is none."""
        for entry in self.keys:
            if entry.id == key_id:
                return entry
        raise KeysFileError(f"no key {key_id!r} (`list` shows the key ids)")

    def add_key(self, tenant: str) -> tuple[KeyEntry, str]:
        """A new key of ``tenant`` (which must exist), and its token."""
        if tenant not in self.tenants:
            raise KeysFileError(f"no tenant {tenant!r}")
        token = new_token()
        taken = {k.id for k in self.keys}
        key_id = KEY_ID_PREFIX + secrets.token_hex(6)
        while key_id in taken:  # pragma: no cover - 48 random bits
            key_id = KEY_ID_PREFIX + secrets.token_hex(6)
        entry = KeyEntry(key_id, token_digest(token).hex(), tenant, _now())
        self.keys.append(entry)
        return entry, token

    def revoke(self, key_id: str) -> KeyEntry:
        """Revoke ``key_id`` (again: no change)."""
        entry = self.key(key_id)
        if not entry.revoked:
            entry.revoked, entry.revoked_at = True, _now()
        return entry

    def rotate(self, key_id: str) -> tuple[KeyEntry, str]:
        """A new key for ``key_id``'s tenant, and its token; ``key_id`` is revoked."""
        old = self.key(key_id)
        if old.revoked:
            raise KeysFileError(f"key {key_id} is revoked already; make a new one with "
                                f"`add --tenant {old.tenant}`")
        new = self.add_key(old.tenant)
        self.revoke(key_id)
        return new

    def set_tenant(self, name: str, **changes: Any) -> Tenant:
        """Create tenant ``name`` or change it: ``weight``, ``trusted_frontend``, ``admin``
        and the :class:`TenantLimits` fields (None: unlimited). Validated as when read."""
        current = self.tenants.get(name, Tenant(name))
        limits = {k: changes.pop(k) for k in _LIMIT_FIELDS if k in changes}
        data = {"weight": current.weight,
                "limits": {**dataclasses.asdict(current.limits), **limits},
                "trusted_frontend": current.trusted_frontend, "admin": current.admin,
                **changes}

        def fail(where: str, message: str) -> KeysFileError:
            return KeysFileError(f"{where}: {message}")

        self.tenants[name] = _tenant(name, data, fail)
        return self.tenants[name]


def _no_unknown(value: dict, known: Sequence[str], where: str, fail) -> None:
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise fail(where, f"unknown field {unknown[0]!r} (known: {', '.join(known)})")


def _tenant(name: Any, value: Any, fail) -> Tenant:
    where = f"tenants[{name!r}]"
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise fail(where, "a tenant's name is 1-64 letters, digits, '.', '_' or '-', "
                   "starting with a letter or digit")
    if not isinstance(value, dict):
        raise fail(where, "must be an object")
    _no_unknown(value, _TENANT_FIELDS, where, fail)
    weight = value.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
            MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise fail(f"{where}.weight", f"must be a number from {MIN_WEIGHT:g} to "
                   f"{MAX_WEIGHT:g}; got {weight!r}")
    limits = value.get("limits") or {}
    if not isinstance(limits, dict):
        raise fail(f"{where}.limits", "must be an object")
    _no_unknown(limits, _LIMIT_FIELDS, f"{where}.limits", fail)
    for field, limit in limits.items():
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise fail(f"{where}.limits.{field}",
                       f"must be an integer >= 1 or null (unlimited); got {limit!r}")
    flags = {}
    for flag in ("trusted_frontend", "admin"):
        flags[flag] = value.get(flag, False)
        if not isinstance(flags[flag], bool):
            raise fail(f"{where}.{flag}", f"must be true or false; got {flags[flag]!r}")
    return Tenant(name, float(weight), TenantLimits(**limits), **flags)


def _key(value: Any, where: str, fail) -> KeyEntry:
    if not isinstance(value, dict):
        raise fail(where, "must be an object")
    _no_unknown(value, _KEY_FIELDS, where, fail)
    key_id = value.get("id")
    if not isinstance(key_id, str) or not key_id or not key_id.isprintable():
        raise fail(where, "id must be a non-empty string")
    where = f"{where} ({key_id})"
    if not isinstance(value.get("sha256"), str) or not _HEX64.fullmatch(value["sha256"]):
        raise fail(where, "sha256 must be 64 lower-case hex digits")
    for name in ("tenant", "created"):
        if not isinstance(value.get(name), str):
            raise fail(where, f"{name} must be a string")
    if not isinstance(value.get("revoked", False), bool):
        raise fail(where, "revoked must be true or false")
    if value.get("revoked_at") is not None and not isinstance(value["revoked_at"], str):
        raise fail(where, "revoked_at must be a string or null")
    return KeyEntry(key_id, value["sha256"], value["tenant"], value["created"],
                    value.get("revoked", False), value.get("revoked_at"))


# --- the server's view ------------------------------------------------------------------------
def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What tells a changed file: device, inode, size, modification time (None: missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


#: What a lookup compares against when no key has the digest: the same work as a match.
_NO_KEY: tuple[bytes, Tenant | None] = (bytes(32), None)


class KeyStore:
    """The keys of a keys file, as the server checks them (module docstring).

    Args:
        path: the keys file.
        check_interval_s: least seconds between two checks of the file for a change.
        clock: monotonic clock (tests).

    Raises:
        KeysFileError: the file does not load now.
    """

    def __init__(self, path: Path, check_interval_s: float = RELOAD_CHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._interval = check_interval_s
        self._clock = clock
        self._checked = clock()
        self._stamp = _stamp(self.path)
        self._install(KeysFile.read(self.path))

    def _install(self, content: KeysFile) -> None:
        by_digest = {}
        for entry in content.keys:
            if not entry.revoked:
                digest = bytes.fromhex(entry.sha256)
                by_digest[digest] = (digest, content.tenants[entry.tenant])
        self._by_digest = by_digest
        self._tenants = dict(content.tenants)
        self.revoked = sum(k.revoked for k in content.keys)

    @property
    def active_keys(self) -> int:
        """Keys that are not revoked."""
        return len(self._by_digest)

    def tenant(self, name: str) -> Tenant | None:
        """The tenant ``name`` as the file defines it, or None."""
        return self._tenants.get(name)

    def lookup(self, token: str) -> Tenant | None:
        """The tenant of ``token``, or None (unknown, revoked, malformed: the same). Checks
        the file for a change first (at most once per ``check_interval_s``)."""
        self.check_file()
        digest = token_digest(token)
        stored, tenant = self._by_digest.get(digest, _NO_KEY)
        matched = hmac.compare_digest(stored, digest)
        return tenant if matched else None

    def check_file(self) -> None:
        """Reload when the file changed since the last load or failed load (at most once per
        ``check_interval_s``)."""
        now = self._clock()
        if now - self._checked < self._interval:
            return
        self._checked = now
        if _stamp(self.path) != self._stamp:
            self.reload()

    def reload(self) -> bool:
        """Re-read the file now. A file that does not load keeps the keys in force and logs
        an error (once per version of the file). Returns whether it loaded."""
        self._stamp = _stamp(self.path)  # taken before reading: a later write is seen again
        try:
            content = KeysFile.read(self.path)
        except KeysFileError as exc:
            log.error("%s; the keys loaded before stay in force", exc)
            return False
        self._install(content)
        log.info("keys file %s loaded: %d keys in force, %d revoked, %d tenants", self.path,
                 self.active_keys, self.revoked, len(self._tenants))
        return True

    def on_sighup(self, loop) -> Callable[[], None]:
        """Reload on SIGHUP (an asyncio signal handler on ``loop``); returns what removes it.
        Where signals cannot be handled (not the main thread) nothing is installed."""
        def reload() -> None:
            log.info("SIGHUP: reloading the keys file %s", self.path)
            self.reload()

        try:
            loop.add_signal_handler(signal.SIGHUP, reload)
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):
            log.warning("SIGHUP cannot be handled here; the keys file reloads on change only")
            return lambda: None
        return lambda: loop.remove_signal_handler(signal.SIGHUP)


# --- python -m serve.keys ---------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``<path>.lock`` while the file is read, changed and written."""
    import fcntl

    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _limit(text: str) -> int | None:
    """A limit flag's value: an integer >= 1, or ``none`` (unlimited)."""
    if text.lower() in ("none", "unlimited"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none'; got {text!r}") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or 'none'); got {value}")
    return value


def _tenant_options(parser: argparse.ArgumentParser) -> None:
    """The tenant's flags; a flag not given leaves the value as it is (argparse.SUPPRESS)."""
    parser.add_argument("--weight", type=float, default=argparse.SUPPRESS,
                        help=f"weight in fair admission ({MIN_WEIGHT:g} to {MAX_WEIGHT:g}; "
                        "default 1)")
    for field in _LIMIT_FIELDS:
        parser.add_argument("--" + field.replace("_", "-"), type=_limit,
                            default=argparse.SUPPRESS, metavar="N",
                            help=f"limit {field} (an integer, or 'none': unlimited)")
    parser.add_argument("--trusted-frontend", action=argparse.BooleanOptionalAction,
                        default=argparse.SUPPRESS,
                        help="a front end (the chat UI) naming its logged-in user in 'user'")
    parser.add_argument("--admin", action=argparse.BooleanOptionalAction,
                        default=argparse.SUPPRESS, help="may call /admin/* routes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serve.keys",
        description="Manage the API keys and tenants of a keys file (--keys-file). A running "
        "server picks up each change within a second (and on SIGHUP).")
    parser.add_argument("--file", type=Path, default=os.environ.get(FILE_ENV),
                        help=f"the keys file (default: ${FILE_ENV})")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="a new key for a tenant (created if new); prints "
                              "its token once")
    add.add_argument("--tenant", required=True)
    _tenant_options(add)
    commands.add_parser("list", help="tenants, and keys (ids, tenants, created, revoked)")
    revoke = commands.add_parser("revoke", help="revoke a key")
    revoke.add_argument("key_id")
    rotate = commands.add_parser("rotate", help="a new key for the same tenant; the old one "
                                 "is revoked; prints the new token once")
    rotate.add_argument("key_id")
    tenant = commands.add_parser("tenant", help="change a tenant")
    tenant_commands = tenant.add_subparsers(dest="tenant_command", required=True)
    tenant_set = tenant_commands.add_parser("set", help="set a tenant's weight, limits and "
                                            "flags (created if new)")
    tenant_set.add_argument("name")
    _tenant_options(tenant_set)
    return parser


def _tenant_changes(args: argparse.Namespace) -> dict[str, Any]:
    names = ("weight", "trusted_frontend", "admin", *_LIMIT_FIELDS)
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _print_token(entry: KeyEntry, token: str, path: Path) -> None:
    """The token alone on stdout (``TOKEN=$(python -m serve.keys add ...)``), the rest on
    stderr."""
    print(f"new key {entry.id} of tenant {entry.tenant!r} in {path}; its token, shown this "
          "once (the file keeps only its hash):", file=sys.stderr)
    print(token)


def _list(content: KeysFile) -> None:
    print("tenants:")
    for name, t in content.tenants.items():
        limits = {k: v for k, v in dataclasses.asdict(t.limits).items() if v is not None}
        flags = [f for f in ("trusted_frontend", "admin") if getattr(t, f)]
        print(f"  {name}  weight {t.weight:g}  limits "
              f"{json.dumps(limits) if limits else 'none'}"
              f"{'  ' + ' '.join(flags) if flags else ''}")
    print("keys:")
    for k in content.keys:
        state = f"revoked {k.revoked_at or ''}".rstrip() if k.revoked else "active"
        print(f"  {k.id}  {k.tenant}  created {k.created}  {state}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m serve.keys``; returns the exit status (1: an error, printed)."""
    args = build_parser().parse_args(argv)
    if args.file is None:
        print(f"error: name the keys file with --file or ${FILE_ENV}", file=sys.stderr)
        return 2
    path: Path = args.file
    try:
        if args.command == "list":
            _list(KeysFile.read(path))
            return 0
        with _locked(path):
            content = KeysFile.read(path) if path.exists() else KeysFile()
            if args.command == "add":
                changes = _tenant_changes(args)
                if args.tenant in content.tenants and changes:
                    raise KeysFileError(f"tenant {args.tenant!r} exists; change it with "
                                        f"`tenant set {args.tenant} ...`")
                if args.tenant not in content.tenants:
                    content.set_tenant(args.tenant, **changes)
                entry, token = content.add_key(args.tenant)
            elif args.command == "rotate":
                entry, token = content.rotate(args.key_id)
            elif args.command == "revoke":
                was = content.key(args.key_id).revoked
                entry = content.revoke(args.key_id)
            else:  # tenant set
                tenant = content.set_tenant(args.name, **_tenant_changes(args))
            content.write(path)
    except KeysFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.command == "rotate":
        print(f"key {args.key_id} revoked", file=sys.stderr)
    if args.command in ("add", "rotate"):
        _print_token(entry, token, path)
    elif args.command == "revoke":
        print(f"key {entry.id} of tenant {entry.tenant!r} "
              f"{'was revoked already' if was else 'revoked'}", file=sys.stderr)
    else:
        print(f"tenant {tenant.name!r}: weight {tenant.weight:g}, {tenant.limits}, "
              f"trusted_frontend {tenant.trusted_frontend}, admin {tenant.admin}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
