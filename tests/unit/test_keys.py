"""The keys file (``serve.keys``): its format, atomic 0600 writes, the CLI, lookups, reload on
change and on SIGHUP; auth on top of it (``serve.auth``): one 401 whatever was wrong, 403 on
``/admin/*`` for a tenant that is not admin; the ``user`` field (``serve.intake``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import stat

import pytest
from prometheus_client import CollectorRegistry

from serve import keys as keys_mod
from serve.app import Gateway, Phase
from serve.auth import ApiKeys, Auth
from serve.intake.errors import IntakeError
from serve.intake.images import ImagePolicy
from serve.intake.middleware import IntakeMiddleware
from serve.intake.request import MAX_USER_CHARS, RequestLimits, check_user
from serve.intake.urls import UrlPolicy
from serve.keys import KeysFile, KeysFileError, KeyStore, main
from serve.settings import Settings
from serve.tenants import ANONYMOUS, TENANT_SCOPE_KEY, USER_SCOPE_KEY, Tenant, TenantLimits


def cli(capsys, path, *argv: str) -> tuple[int, str, str]:
    """Run ``python -m serve.keys --file PATH *argv``; (status, stdout, stderr)."""
    status = main(["--file", str(path), *argv])
    out, err = capsys.readouterr()
    return status, out, err


def add(capsys, path, tenant: str, *flags: str) -> str:
    """A new key of ``tenant``: its token (stdout's one line)."""
    status, out, err = cli(capsys, path, "add", "--tenant", tenant, *flags)
    assert status == 0, err
    return out.strip()


def key_ids(path) -> list[str]:
    return [k["id"] for k in json.loads(path.read_text())["keys"]]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- the file ---------------------------------------------------------------------------------
def test_the_file_keeps_hashes_and_tenants_never_tokens(tmp_path, capsys):
    path = tmp_path / "keys.json"
    token = add(capsys, path, "team-a", "--weight", "2", "--max-concurrent", "4",
                "--tokens-per-day", "100000")
    assert token.startswith(keys_mod.TOKEN_PREFIX) and len(token) > 40
    data = json.loads(path.read_text())
    assert data["version"] == 1
    assert data["tenants"] == {"team-a": {
        "weight": 2.0, "limits": {"max_concurrent": 4, "tokens_per_day": 100000},
        "trusted_frontend": False, "admin": False}}
    (key,) = data["keys"]
    assert set(key) == {"id", "sha256", "tenant", "created", "revoked", "revoked_at"}
    assert key["id"].startswith("k_") and key["tenant"] == "team-a" and not key["revoked"]
    assert key["sha256"] == hashlib.sha256(token.encode()).hexdigest()
    assert token not in path.read_text()
    assert KeysFile.read(path).tenants["team-a"] == Tenant(
        "team-a", 2.0, TenantLimits(max_concurrent=4, tokens_per_day=100000))


def test_a_new_file_is_0600_and_an_existing_one_keeps_its_mode(tmp_path, capsys):
    path = tmp_path / "keys.json"
    add(capsys, path, "a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o640)
    add(capsys, path, "a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    if os.geteuid() == 0:  # root keeps the owner too (the API container's user)
        os.chown(path, 10001, 10001)
        add(capsys, path, "a")
        assert (path.stat().st_uid, path.stat().st_gid) == (10001, 10001)


def test_writes_are_atomic(tmp_path, capsys, monkeypatch):
    """A write that fails before the rename leaves the old file whole and no temporary file;
    a successful one replaces the file (a new inode) after an fsync."""
    path = tmp_path / "keys.json"
    add(capsys, path, "a")
    inode = path.stat().st_ino
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    add(capsys, path, "a")
    assert synced and path.stat().st_ino != inode  # replaced, not rewritten in place
    before = path.read_text()

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    status, out, err = cli(capsys, path, "add", "--tenant", "a")
    assert status == 1 and "No space left" in err and out == ""
    assert path.read_text() == before and len(key_ids(path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json", "keys.json.lock"]


@pytest.mark.parametrize("data, names", [
    ([], "top level"),
    ({"version": 2}, "version"),
    ({"version": 1, "tenant": {}}, "unknown field 'tenant'"),
    ({"version": 1, "tenants": {"a b": {}}}, "tenants['a b']"),
    ({"version": 1, "tenants": {"a": {"weight": 0}}}, "tenants['a'].weight"),
    ({"version": 1, "tenants": {"a": {"weight": True}}}, "tenants['a'].weight"),
    ({"version": 1, "tenants": {"a": {"limits": {"max_concurent": 3}}}},
     "unknown field 'max_concurent'"),
    ({"version": 1, "tenants": {"a": {"limits": {"tokens_per_day": 0}}}},
     "tenants['a'].limits.tokens_per_day"),
    ({"version": 1, "tenants": {"a": {"admin": "yes"}}}, "tenants['a'].admin"),
    ({"version": 1, "tenants": {}, "keys": [
        {"id": "k_1", "sha256": "0" * 64, "tenant": "b", "created": "t"}]},
     "keys[0] (k_1): tenant 'b' is not defined"),
    ({"version": 1, "tenants": {"a": {}}, "keys": [
        {"id": "k_1", "sha256": "xyz", "tenant": "a", "created": "t"}]}, "keys[0] (k_1)"),
    ({"version": 1, "tenants": {"a": {}}, "keys": [
        {"id": "k_1", "sha256": "0" * 64, "tenant": "a", "created": "t"},
        {"id": "k_1", "sha256": "1" * 64, "tenant": "a", "created": "t"}]},
     "keys[1] (k_1): a second key with this id"),
    ({"version": 1, "tenants": {"a": {}}, "keys": [
        {"id": "k_1", "sha256": "0" * 64, "tenant": "a", "created": "t"},
        {"id": "k_2", "sha256": "0" * 64, "tenant": "a", "created": "t"}]},
     "keys[1] (k_2): the same sha256"),
    ({"version": 1, "tenants": {"a": {}}, "keys": [
        {"id": "k_1", "sha256": "0" * 64, "tenant": "a", "created": "t", "token": "x"}]},
     "unknown field 'token'"),
])
def test_an_invalid_file_is_refused_naming_the_entry(tmp_path, data, names):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(data))
    with pytest.raises(KeysFileError) as err:
        KeyStore(path)
    assert str(path) in str(err.value) and names in str(err.value)


def test_missing_or_broken_files_say_so(tmp_path):
    with pytest.raises(KeysFileError, match="does not exist; make it with"):
        KeyStore(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(KeysFileError, match="not valid JSON"):
        KeyStore(tmp_path / "bad.json")
    # Nesting deeper than the JSON parser's stack is a bad file, not a crash.
    (tmp_path / "deep.json").write_text("[" * 200_000)
    with pytest.raises(KeysFileError, match="nested too deeply"):
        KeyStore(tmp_path / "deep.json")


@pytest.mark.parametrize("weight", [0, -1, 1e-7, 1e7, 1e308, float("inf")])
def test_a_weight_outside_its_bounds_is_refused(tmp_path, weight):
    # Fair admission divides by the sum of weights: 1e308 twice would make it infinite.
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"version": 1, "tenants": {"a": {"weight": weight}}}))
    with pytest.raises(KeysFileError, match=r"tenants\['a'\].weight"):
        KeyStore(path)


def test_a_keys_file_behind_a_symlink_is_written_through_it(tmp_path, capsys):
    target, link = tmp_path / "real" / "keys.json", tmp_path / "keys.json"
    target.parent.mkdir()
    add(capsys, target, "team-a")
    link.symlink_to(target)
    add(capsys, link, "team-b")
    assert link.is_symlink() and len(key_ids(target)) == 2


# --- the CLI ----------------------------------------------------------------------------------
def test_cli_add_list_revoke_rotate_and_tenant_set(tmp_path, capsys):
    path = tmp_path / "keys.json"
    token_a = add(capsys, path, "team-a")
    token_ui = add(capsys, path, "chat-ui", "--trusted-frontend")
    token_ops = add(capsys, path, "ops", "--admin")
    first, ui_id, ops_id = key_ids(path)

    status, out, err = cli(capsys, path, "list")
    assert status == 0 and "team-a" in out and first in out and "created" in out
    assert "chat-ui  weight 1  limits none  trusted_frontend" in out
    assert "ops  weight 1  limits none  admin" in out
    sha = json.loads(path.read_text())["keys"][0]["sha256"]
    for secret in (token_a, token_ui, token_ops, sha):
        assert secret not in out + err

    # add to an existing tenant with flags: refused, tenant set is the way
    status, _, err = cli(capsys, path, "add", "--tenant", "team-a", "--weight", "3")
    assert status == 1 and "tenant set team-a" in err
    status, _, err = cli(capsys, path, "tenant", "set", "team-a", "--weight", "3",
                         "--requests-per-minute", "60", "--tokens-per-month", "none")
    assert status == 0, err
    assert KeysFile.read(path).tenants["team-a"] == Tenant(
        "team-a", 3.0, TenantLimits(requests_per_minute=60))
    status, _, _ = cli(capsys, path, "tenant", "set", "team-a", "--requests-per-minute", "none",
                       "--admin")
    assert KeysFile.read(path).tenants["team-a"] == Tenant("team-a", 3.0, admin=True)
    status, _, err = cli(capsys, path, "tenant", "set", "team-a", "--weight", "-1")
    assert status == 1 and "weight" in err

    store = KeyStore(path)
    assert store.lookup(token_a).name == "team-a"
    status, out, err = cli(capsys, path, "rotate", first)
    new_token = out.strip()
    assert status == 0 and new_token.startswith("phi3v-") and f"key {first} revoked" in err
    status, out, _ = cli(capsys, path, "revoke", ops_id)
    assert status == 0 and out == ""
    status, _, err = cli(capsys, path, "revoke", ops_id)
    assert status == 0 and "revoked already" in err
    status, _, err = cli(capsys, path, "rotate", ops_id)
    assert status == 1 and "revoked already" in err
    status, _, err = cli(capsys, path, "revoke", "k_nope")
    assert status == 1 and "no key 'k_nope'" in err

    store = KeyStore(path)
    assert store.lookup(token_a) is None and store.lookup(token_ops) is None
    assert store.lookup(new_token).name == "team-a"
    assert store.lookup(token_ui).trusted_frontend
    _, out, _ = cli(capsys, path, "list")
    assert f"{first}  team-a" in out and "revoked 20" in out


def test_cli_needs_a_file_and_refuses_bad_values(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(keys_mod.FILE_ENV, raising=False)
    assert main(["list"]) == 2
    assert "--file" in capsys.readouterr().err
    monkeypatch.setenv(keys_mod.FILE_ENV, str(tmp_path / "env.json"))
    assert main(["add", "--tenant", "x"]) == 0  # the file from PHI3V_KEYS_FILE
    assert (tmp_path / "env.json").exists()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["add", "--tenant", "x", "--max-concurrent", "0"])
    status, _, err = cli(capsys, tmp_path / "k.json", "add", "--tenant", "no spaces")
    assert status == 1 and "tenant's name" in err
    status, _, err = cli(capsys, tmp_path / "missing.json", "list")
    assert status == 1 and "does not exist" in err


# --- lookups and reloads ----------------------------------------------------------------------
def test_lookup_finds_the_tenant_and_refuses_everything_else(tmp_path, capsys):
    path = tmp_path / "keys.json"
    token = add(capsys, path, "team-a")
    revoked = add(capsys, path, "team-a")
    cli(capsys, path, "revoke", key_ids(path)[1])
    store = KeyStore(path)
    assert store.lookup(token) == Tenant("team-a")
    for bad in (revoked, token[:-1], token + "x", "", "phi3v-", "\u00e9\u0000", "x" * 10_000):
        assert store.lookup(bad) is None, bad
    assert store.active_keys == 1 and store.revoked == 1


def test_a_changed_file_is_reloaded_within_the_check_interval(tmp_path, capsys):
    path = tmp_path / "keys.json"
    token = add(capsys, path, "team-a")
    clock = Clock()
    store = KeyStore(path, check_interval_s=1.0, clock=clock)
    cli(capsys, path, "revoke", key_ids(path)[0])
    clock.now = 0.5
    assert store.lookup(token) is not None  # not checked yet
    clock.now = 1.0
    assert store.lookup(token) is None
    later = add(capsys, path, "team-b")
    clock.now = 2.0
    assert store.lookup(later).name == "team-b"


def test_a_bad_file_keeps_the_keys_in_force_and_logs_once(tmp_path, capsys, caplog):
    path = tmp_path / "keys.json"
    token = add(capsys, path, "team-a")
    clock = Clock()
    store = KeyStore(path, clock=clock)
    good = path.read_text()
    path.write_text('{"version": 1, "tenants": {"a": {"weight": -1}}}')
    caplog.set_level(logging.ERROR, "serve.keys")
    for t in (1.0, 2.0, 3.0):
        clock.now = t
        assert store.lookup(token).name == "team-a"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "tenants['a'].weight" in errors[0].getMessage()
    assert "stay in force" in errors[0].getMessage()
    path.unlink()
    clock.now = 4.0
    assert store.lookup(token).name == "team-a"  # a deleted file keeps them too
    path.write_text(good)
    clock.now = 5.0
    assert store.lookup(token).name == "team-a" and store.reload()


async def test_sighup_reloads_the_file(tmp_path, capsys):
    path = tmp_path / "keys.json"
    token = add(capsys, path, "team-a")
    store = KeyStore(path, check_interval_s=3600)  # only the signal reloads here
    remove = store.on_sighup(asyncio.get_running_loop())
    try:
        cli(capsys, path, "revoke", key_ids(path)[0])
        assert store.lookup(token) is not None
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if store.lookup(token) is None:
                break
        assert store.lookup(token) is None
    finally:
        remove()


# --- auth -------------------------------------------------------------------------------------
def scope(path: str = "/v1/models", header: bytes | None = None) -> dict:
    headers = [(b"authorization", header)] if header is not None else []
    return {"type": "http", "method": "GET", "path": path, "headers": headers,
            "query_string": b""}


def test_auth_maps_keys_to_tenants(tmp_path, capsys):
    path = tmp_path / "keys.json"
    token = add(capsys, path, "team-a")
    auth = Auth(ApiKeys(["plain"]), KeyStore(path))
    assert auth.tenant(scope(header=f"Bearer {token}".encode())).name == "team-a"
    assert auth.tenant(scope(header=b"Bearer plain")) == ANONYMOUS  # tenant default, admin
    assert auth.tenant(scope(header=b"Bearer other")) is None
    assert Auth(ApiKeys([])).tenant(scope()) == ANONYMOUS  # no auth at all
    assert Auth(ApiKeys(["plain"])).tenant(scope(header=b"Bearer plain")) == ANONYMOUS
    # A keys file's tenant "default" sets what the plain keys get.
    cli(capsys, path, "tenant", "set", "default", "--weight", "4", "--no-admin")
    auth = Auth(ApiKeys(["plain"]), KeyStore(path))
    assert auth.tenant(scope(header=b"Bearer plain")) == Tenant("default", 4.0)


async def call(app, s: dict) -> tuple[int, bytes, dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(s, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, dict(start.get("headers") or [])


async def test_one_401_whatever_was_wrong_and_403_on_admin_routes(tmp_path, capsys):
    path = tmp_path / "keys.json"
    token = add(capsys, path, "team-a")
    revoked = add(capsys, path, "team-a")
    admin = add(capsys, path, "ops", "--admin")
    cli(capsys, path, "revoke", key_ids(path)[1])
    gateway = Gateway(Settings(device="cpu", keys_file=path, api_keys=["plain"]),
                      registry=CollectorRegistry())
    seen = []

    async def vllm(s, receive, send):
        seen.append(s.get(TENANT_SCOPE_KEY))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    gateway.state.openai_app, gateway.state.phase = vllm, Phase.READY
    refusals = []
    for header in (None, b"Bearer phi3v-unknown", f"Bearer {revoked}".encode(), b"Bearer",
                   f"Basic {token}".encode(), b"Bearer " + token[:-2].encode(), b"\xff\xfe"):
        status, body, headers = await call(gateway, scope(header=header))
        refusals.append((status, body, headers.get(b"www-authenticate")))
    # Two Authorization headers, a valid one first or last: a proxy may read the other one.
    for pair in ((token, "phi3v-unknown"), ("phi3v-unknown", token), (token, token)):
        two = scope()
        two["headers"] = [(b"authorization", f"Bearer {t}".encode()) for t in pair]
        status, body, headers = await call(gateway, two)
        refusals.append((status, body, headers.get(b"www-authenticate")))
    assert len(set(refusals)) == 1, refusals
    status, body, _ = refusals[0]
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert not seen

    assert (await call(gateway, scope(header=f"Bearer {token}".encode())))[0] == 200
    assert (await call(gateway, scope(header=b"Bearer plain")))[0] == 200
    assert [t.name for t in seen] == ["team-a", "default"]
    status, body, _ = await call(gateway, scope("/admin/autotuner", f"Bearer {token}".encode()))
    assert status == 403 and json.loads(body)["error"]["type"] == "permission_error"
    for key in (admin, "plain"):
        status, _, _ = await call(gateway, scope("/admin/autotuner", f"Bearer {key}".encode()))
        assert status == 200, key
    assert (await call(gateway, scope("/health")))[0] == 200  # open without a key


# --- the user field ---------------------------------------------------------------------------
def test_user_is_bounded_and_named_in_errors():
    assert check_user(None) is None and check_user("") is None
    assert check_user("alice@example.com") == "alice@example.com"
    assert check_user("u" * MAX_USER_CHARS) == "u" * MAX_USER_CHARS
    assert check_user("Zoë Müller 张伟") == "Zoë Müller 张伟"  # letters of any script
    # Invisible and direction-changing characters would make two users that look alike.
    for bad in ("u" * (MAX_USER_CHARS + 1), 42, ["a"], "a\nb", "alice\u200b", "rlo\u202eevil",
                "ls\u2028x", "\ufeffbom"):
        with pytest.raises(IntakeError) as err:
            check_user(bad)
        assert err.value.param == "user", bad


@pytest.mark.parametrize("tenant, in_scope", [
    (Tenant("chat-ui", trusted_frontend=True), "alice"),
    (Tenant("team-a"), None),
    (None, None),  # no tenant in the scope: ANONYMOUS
])
async def test_only_a_trusted_front_end_names_users_to_admission(tenant, in_scope):
    seen = []

    async def peer(s, receive, send):
        seen.append((s.get(USER_SCOPE_KEY), json.loads((await receive())["body"])))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    app = IntakeMiddleware(peer, RequestLimits(max_images=1),
                           ImagePolicy(2**20, 10**6, frozenset({"PNG"})), UrlPolicy())
    s = {**scope("/v1/chat/completions"), "method": "POST"}
    if tenant is not None:
        s[TENANT_SCOPE_KEY] = tenant
    body = {"messages": [{"role": "user", "content": "hi"}], "user": "alice"}
    sent = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    await app(s, receive, send)
    (user, forwarded), = seen
    assert user == in_scope and forwarded["user"] == "alice"  # vLLM gets it unchanged
