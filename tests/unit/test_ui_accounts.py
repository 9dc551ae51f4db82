"""The UI's team accounts: users file, login refusals, rate limit, header trust, quota text."""

from __future__ import annotations

import io
import json
import stat
import sys

import pytest
from argon2 import PasswordHasher

from ui import auth, uploads
from ui.settings import UISettings
from ui.users import Accounts, LoginLimiter, UsersFile, UsersFileError, main


class CountingHasher(PasswordHasher):
    """argon2-cffi's hasher, counting its verifications (the work a login does)."""

    verifies = 0

    def verify(self, hash, password):  # noqa: A002 - the library's parameter name
        CountingHasher.verifies += 1
        return super().verify(hash, password)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def users(tmp_path) -> UsersFile:
    f = UsersFile(tmp_path / "users.json", CountingHasher())
    f.set_password("alice", "correct horse", new=True)
    f.set_password("bob", "battery staple", new=True)
    return f


def test_the_file_holds_argon2id_hashes_only_readable_by_its_owner(users):
    text = users.path.read_text()
    assert "correct horse" not in text and "battery staple" not in text
    entries = json.loads(text)["users"]
    assert all(e["hash"].startswith("$argon2id$v=19$m=") for e in entries.values())
    assert stat.S_IMODE(users.path.stat().st_mode) == 0o600
    with pytest.raises(UsersFileError, match="exists"):
        users.set_password("alice", "another password", new=True)
    with pytest.raises(UsersFileError, match="8-1024 characters"):
        users.set_password("carol", "short", new=True)
    with pytest.raises(UsersFileError, match="user name"):
        users.set_password("has space", "long enough", new=True)


def test_wrong_password_unknown_and_locked_users_are_refused_alike(users):
    """Each refusal is a plain False after exactly one Argon2 verification, as a success is:
    neither the answer nor the work tells whether the name exists or is locked."""
    users.set_locked("bob", True)
    accounts = Accounts(users, LoginLimiter(100, 60))
    cases = {"right": ("alice", "correct horse"), "wrong": ("alice", "wrong password"),
             "unknown": ("mallory", "correct horse"), "locked": ("bob", "battery staple")}
    outcome = {}
    for case, (name, password) in cases.items():
        before = CountingHasher.verifies
        outcome[case] = accounts.login(name, password, "10.0.0.1")
        assert CountingHasher.verifies - before == 1, case
    assert outcome == {"right": True, "wrong": False, "unknown": False, "locked": False}
    users.set_locked("bob", False)
    assert accounts.login("bob", "battery staple", "10.0.0.1")  # the file is read again


def test_failed_logins_are_limited_per_name_and_address(users):
    clock = Clock()
    accounts = Accounts(users, LoginLimiter(3, 60, clock=clock))
    for _ in range(3):
        assert not accounts.login("alice", "guess", "10.0.0.9")
    before = CountingHasher.verifies
    assert not accounts.login("alice", "correct horse", "10.0.0.9")  # right, but limited
    assert CountingHasher.verifies - before == 1  # still the same work
    assert accounts.login("alice", "correct horse", "10.0.0.1")  # another address
    assert accounts.login("bob", "battery staple", "10.0.0.9")  # another name
    clock.t = 61.0
    assert accounts.login("alice", "correct horse", "10.0.0.9")  # the window passed


def test_outdated_hash_is_upgraded_on_login(tmp_path):
    weak = UsersFile(tmp_path / "users.json", PasswordHasher(time_cost=1, memory_cost=8192))
    weak.set_password("alice", "correct horse", new=True)
    old = weak.load()["alice"]["hash"]
    current = UsersFile(weak.path)
    assert Accounts(current, LoginLimiter(5, 60)).login("alice", "correct horse", "::1")
    new = current.load()["alice"]["hash"]
    assert new != old and not PasswordHasher().check_needs_rehash(new)


def test_the_command(tmp_path, monkeypatch, capsys):
    path = tmp_path / "users.json"

    def run(*args: str, stdin: str = "") -> int:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        return main(["--file", str(path), *args])

    assert run("add", "alice", "--password-stdin", stdin="correct horse\n") == 0
    assert run("add", "alice", "--password-stdin", stdin="correct horse\n") == 2
    assert "exists" in capsys.readouterr().err
    assert run("lock", "alice") == 0
    capsys.readouterr()
    assert run("list") == 0 and capsys.readouterr().out == "alice  (locked)\n"
    assert run("reset", "alice", "--password-stdin", stdin="new password\n") == 0
    accounts = Accounts(UsersFile(path), LoginLimiter(5, 60))
    assert not accounts.login("alice", "new password", "::1")  # still locked
    assert run("unlock", "alice") == 0
    assert accounts.login("alice", "new password", "::1")
    assert run("remove", "alice") == 0 and run("remove", "alice") == 2
    assert run("add", "bob", "--password-stdin", stdin="short\n") == 2


def test_header_login_is_trusted_only_from_the_proxy():
    settings = UISettings(accounts="header", trusted_proxies=["10.1.0.0/16", "::1"])
    headers = {"X-Forwarded-User": "alice"}
    assert auth.header_user(headers, "10.1.2.3", settings) == "alice"
    assert auth.header_user(headers, "::1", settings) == "alice"
    assert auth.header_user(headers, "127.0.0.1", settings) is None  # not the proxy
    assert auth.header_user(headers, "", settings) is None
    assert auth.header_user({}, "10.1.2.3", settings) is None
    assert auth.header_user({"X-Forwarded-User": " "}, "10.1.2.3", settings) is None


def test_settings_reach_the_chainlit_process_intact():
    """python -m ui hands its settings on as environment variables: lists as JSON."""
    settings = UISettings(trusted_proxies=["10.0.0.0/8"], accounts="header")
    env = settings.env()
    assert json.loads(env["PHI3V_UI_TRUSTED_PROXIES"]) == ["10.0.0.0/8"]
    import os

    saved = dict(os.environ)
    try:
        os.environ.update(env)
        again = UISettings()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert again.trusted_proxies == ["10.0.0.0/8"] and again.accounts == "header"


def test_quota_refusal_names_the_figures():
    assert uploads.quota_refusal(10, 10, 0) is None  # no quota
    assert uploads.quota_refusal(2**20, 2**20, 2 * 2**20) is None  # exactly full
    text = uploads.quota_refusal(150 * 2**20, 60 * 2**20, 200 * 2**20)
    assert "150.0 MB of your 200.0 MB" in text and "60.0 MB" in text


def test_client_keys_group_ipv6_by_64_and_unmap_ipv4():
    assert auth.client_key("2001:db8::1") == auth.client_key("2001:db8::2") == "2001:db8::/64"
    assert auth.client_key("::ffff:10.0.0.1") == auth.client_key("10.0.0.1") == "10.0.0.1"
    assert auth.trusted("::ffff:127.0.0.1", ["127.0.0.1/32"])


def test_header_given_twice_is_refused():
    """A proxy that appends its own header leaves the client's forged one first."""
    from starlette.datastructures import Headers

    settings = UISettings(accounts="header", trusted_proxies=["127.0.0.1"])
    twice = Headers(raw=[(b"x-forwarded-user", b"mallory"), (b"x-forwarded-user", b"alice")])
    assert auth.header_user(twice, "127.0.0.1", settings) is None
    once = Headers(raw=[(b"x-forwarded-user", b"alice")])
    assert auth.header_user(once, "127.0.0.1", settings) == "alice"


def test_oauth_needs_an_allow_list():
    allowed = ["alice@example.com", "@corp.example"]
    assert auth.oauth_allowed("Alice@Example.com", allowed)
    assert auth.oauth_allowed("bob@corp.example", allowed)
    assert not auth.oauth_allowed("bob@corp.example.evil", allowed)
    assert not auth.oauth_allowed("carol@example.com", allowed)
    assert not auth.oauth_allowed("alice@example.com", [])  # empty: nobody


def test_concurrent_changes_keep_every_user(tmp_path):
    import threading

    users = UsersFile(tmp_path / "users.json")
    names = [f"user{i}" for i in range(6)]
    threads = [threading.Thread(target=users.set_password, args=(n, "long enough", True))
               for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(users.load()) == names


class ReadOnlyUsersFile(UsersFile):
    """A users file on a read-only mount (a Kubernetes Secret or ConfigMap)."""

    def save(self, users):
        raise OSError(30, "Read-only file system")


def test_broken_file_and_readonly_rehash_do_not_break_logins(tmp_path):
    weak = UsersFile(tmp_path / "users.json", PasswordHasher(time_cost=1, memory_cost=8192))
    weak.set_password("alice", "correct horse", new=True)
    old = weak.load()["alice"]["hash"]
    accounts = Accounts(ReadOnlyUsersFile(weak.path), LoginLimiter(5, 60))
    assert accounts.login("alice", "correct horse", "::1")  # the upgrade fails, not the login
    assert weak.load()["alice"]["hash"] == old
    weak.path.write_text("{ not json")  # a broken edit: the last good copy is used
    import os

    os.utime(weak.path, (1, 1))
    assert accounts.login("alice", "correct horse", "::1")
    assert not accounts.login("alice", "wrong password", "::1")
