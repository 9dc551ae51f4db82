"""The UI for a team, in a real browser: two users from a users file, each alone with their
threads, elements and files, across a restart; login refusals; header login's proxy check."""

from __future__ import annotations

import uuid
from urllib.parse import quote

import httpx
import pytest

from tests.browser.helpers import ChatPage, start_ui, stop_ui
from tests.browser.test_ui import ANSWER_TOKENS, browser, new_page  # noqa: F401 - fixture
from tests.helpers import IMAGES
from ui.users import UsersFile

PASSWORDS = {"alice": "alice-password", "bob": "bob-password", "carol": "carol-password"}


@pytest.fixture(scope="module")
def team_dir(tmp_path_factory):
    """A UI data directory with a users file of three users (carol locked)."""
    data = tmp_path_factory.mktemp("ui-team")
    users = UsersFile(data / "users.json")
    for name, password in PASSWORDS.items():
        users.set_password(name, password, new=True)
    users.set_locked("carol", True)
    return data


#: Each user's storage quota: room for one chelsea.png, not two.
QUOTA = int(1.5 * (IMAGES / "chelsea.png").stat().st_size)


def team_env(data) -> dict[str, str]:
    return {"PHI3V_UI_ACCOUNTS": "users-file", "PHI3V_UI_USERS_FILE": str(data / "users.json"),
            "PHI3V_UI_DEFAULT_MAX_TOKENS": str(ANSWER_TOKENS),
            "PHI3V_UI_LOGIN_MAX_FAILURES": "3", "PHI3V_UI_USER_QUOTA_BYTES": str(QUOTA)}


@pytest.fixture(scope="module")
def team_ui(server, team_dir):
    holder = {"proc": start_ui(server.base_url, team_dir, env=team_env(team_dir),
                               log_name="ui-team")}
    yield holder
    stop_ui(holder["proc"])


async def chat_with_image(page: ChatPage, image: str, question: str) -> None:
    await page.new_chat()
    await page.attach(IMAGES / image)
    await page.wait_attached(1)
    await page.send(question)
    await page.sample_answer(after=0)
    await page.page.locator(ChatPage.USER).locator("img").first.wait_for()


async def threads_of(page: ChatPage) -> list[dict]:
    answer = await page.page.context.request.post(
        f"{page.base_url}/project/threads",
        data={"pagination": {"first": 20, "cursor": None}, "filter": {}})
    assert answer.status == 200
    return (await answer.json())["data"]


async def test_two_users_each_see_only_their_own(browser, team_ui, server, team_dir):  # noqa: F811
    ui = team_ui["proc"]
    alice, bob = await new_page(browser, ui), await new_page(browser, ui)
    questions = {"alice": f"alice asks about the cat {uuid.uuid4().hex[:6]}",
                 "bob": f"bob asks about the rocket {uuid.uuid4().hex[:6]}"}
    await alice.login("alice", PASSWORDS["alice"])
    await bob.login("bob", PASSWORDS["bob"])
    await chat_with_image(alice, "chelsea.png", questions["alice"])
    await chat_with_image(bob, "rocket.jpg", questions["bob"])

    # The sidebar and the thread list: each their own thread only.
    for page, me, other in ((alice, "alice", "bob"), (bob, "bob", "alice")):
        await page.page.reload()
        history = page.page.locator("#thread-history")
        await history.locator("a", has_text=questions[me]).wait_for(timeout=20_000)
        assert await history.locator("a", has_text=questions[other]).count() == 0
        assert [t["name"] for t in await threads_of(page)] == [questions[me]]

    # Bob asks for Alice's thread, element, file, and to delete her thread: 404 each, as for
    # things that do not exist; Alice gets each of them.
    (thread,) = await threads_of(alice)
    full = await (await alice.page.context.request.get(
        f"{ui.url}/project/thread/{thread['id']}")).json()
    (element,) = [e for e in full["elements"] if e.get("objectKey")]
    urls = {"thread": f"{ui.url}/project/thread/{thread['id']}",
            "element": f"{ui.url}/project/thread/{thread['id']}/element/{element['id']}",
            "file": f"{ui.url}{element['url']}"}
    for what, url in urls.items():
        assert (await bob.page.context.request.get(url)).status == 404, what
        assert (await alice.page.context.request.get(url)).status == 200, what
    for missing in (f"{ui.url}/project/thread/{uuid.uuid4()}",
                    f"{ui.url}/project/thread/{uuid.uuid4()}/element/{uuid.uuid4()}"):
        assert (await bob.page.context.request.get(missing)).status == 404
    deleted = await bob.page.context.request.delete(f"{ui.url}/project/thread",
                                                    data={"threadId": thread["id"]})
    assert deleted.status == 404
    assert [t["id"] for t in await threads_of(alice)] == [thread["id"]]  # still there

    # Alice's quota holds one chelsea.png: a second is refused, with the figures, and not kept.
    # (Her thread is opened by its address: after the reload above the page may show it
    # before its session resumed, when there is no composer yet.)
    await alice.open_thread(thread["id"])
    await alice.attach(IMAGES / "chelsea.png")
    await alice.wait_attached(1)
    await alice.send("the same cat again")
    await alice.page.get_by_text("Not sent: your stored images take").wait_for(timeout=20_000)
    again = await (await alice.page.context.request.get(urls["thread"])).json()
    assert len([e for e in again["elements"] if e.get("objectKey")]) == 1

    # A restart: both histories and their images are intact.
    stop_ui(ui)
    team_ui["proc"] = ui = start_ui(server.base_url, team_dir, env=team_env(team_dir),
                                    log_name="ui-team")
    for page, me in ((alice, "alice"), (bob, "bob")):
        page.base_url = ui.url
        await page.page.context.clear_cookies()
        await page.login(me, PASSWORDS[me])
        await page.page.locator("#thread-history a", has_text=questions[me]).click()
        await page.page.wait_for_function(
            "() => { const i = document.querySelector('[data-step-type=user_message] img');"
            " return i && i.complete && i.naturalWidth > 0; }", timeout=20_000)
        assert await page.page.locator(ChatPage.USER, has_text=questions[me]).count() == 1
    # Deleting a thread deletes its files.
    # (ui.storage.LocalStorageClient's layout: one percent-encoded directory per key segment)
    path = (team_dir / "files").joinpath(
        *(quote(part, safe="") for part in element["objectKey"].split("/")))
    assert path.is_file()
    deleted = await alice.page.context.request.delete(f"{ui.url}/project/thread",
                                                      data={"threadId": thread["id"]})
    assert deleted.status == 200 and not path.exists()
    # ... and leaves no empty directory behind (Alice's refused second image included).
    files = team_dir / "files"
    assert [p for p in files.rglob("*") if p.is_dir() and not any(p.iterdir())] == []
    for page in (alice, bob):
        await page.page.context.close()


async def test_another_users_thread_opens_like_a_missing_one(browser, team_ui):  # noqa: F811
    """Bob opens the URL of Alice's thread, then of a thread that does not exist: both say
    the thread was not found and open a new chat of his own that works (no "Could not reach
    the server"); Alice's thread is untouched."""
    ui = team_ui["proc"]
    alice, bob = await new_page(browser, ui), await new_page(browser, ui)
    await alice.login("alice", PASSWORDS["alice"])
    await bob.login("bob", PASSWORDS["bob"])
    question = f"alice's own thread {uuid.uuid4().hex[:6]}"
    await alice.new_chat()
    await alice.send(question)
    await alice.sample_answer(after=0)
    (thread,) = [t for t in await threads_of(alice) if t["name"] == question]
    url = f"{ui.url}/project/thread/{thread['id']}"
    steps = (await (await alice.page.context.request.get(url)).json())["steps"]

    replies = []
    for thread_id in (thread["id"], str(uuid.uuid4())):
        await bob.page.goto(f"{ui.url}/thread/{thread_id}")
        await bob.wait_session()
        await bob.page.get_by_text("Couldn't resume chat: Thread not found.").wait_for(
            timeout=10_000)
        replies.append(f"bob writes {uuid.uuid4().hex[:6]}")
        await bob.send(replies[-1])
        await bob.sample_answer(after=0)
        assert await bob.page.get_by_text("Could not reach the server").count() == 0
    bob_threads = await threads_of(bob)
    assert {t["name"] for t in bob_threads} >= set(replies)
    assert thread["id"] not in [t["id"] for t in bob_threads]
    assert (await (await alice.page.context.request.get(url)).json())["steps"] == steps
    for page in (alice, bob):
        await page.page.context.close()


def test_start_banner_names_the_account_source(team_ui, team_dir):
    """`python -m ui` says where logins come from: here the users file, not 'demo'."""
    log = team_ui["proc"].log_path.read_text(errors="replace")
    banner = next(line for line in log.splitlines() if line.startswith("UI: http://"))
    assert f"accounts from {team_dir / 'users.json'}" in banner
    assert "demo" not in banner


def test_login_refusals_look_the_same(team_ui):
    """Wrong password, unknown name, locked user: one status, one body. Then the rate limit:
    after 3 failures even the right password is refused, the same way."""
    url = f"{team_ui['proc'].url}/login"

    def login(name: str, password: str) -> httpx.Response:
        return httpx.post(url, data={"username": name, "password": password}, timeout=30)

    refusals = [login("alice", "wrong-password"), login("nobody", "whatever-pass"),
                login("carol", PASSWORDS["carol"])]
    assert {(r.status_code, r.text) for r in refusals} == {(refusals[0].status_code,
                                                            refusals[0].text)}
    assert refusals[0].status_code == 401
    assert login("bob", PASSWORDS["bob"]).status_code == 200
    for _ in range(2):  # alice has 1 failure from above: 3 in all
        login("alice", "wrong-password")
    limited = login("alice", PASSWORDS["alice"])
    assert (limited.status_code, limited.text) == (refusals[0].status_code, refusals[0].text)


def test_header_login_only_from_the_proxy(server, tmp_path):
    """accounts=header: the user name header counts only on connections from a trusted
    proxy address (127.0.0.2 here; the test's other connections come from 127.0.0.1)."""
    ui = start_ui(server.base_url, tmp_path, env={
        "PHI3V_UI_ACCOUNTS": "header", "PHI3V_UI_AUTH_HEADER": "X-Auth-User",
        "PHI3V_UI_TRUSTED_PROXIES": '["127.0.0.2/32"]'})
    try:
        banner = next(line for line in ui.log_path.read_text(errors="replace").splitlines()
                      if line.startswith("UI: http://"))
        assert "user name from the X-Auth-User header of 127.0.0.2/32" in banner
        assert "demo" not in banner
        headers = {"X-Auth-User": "dave"}
        direct = httpx.post(f"{ui.url}/auth/header", headers=headers, timeout=30)
        assert direct.status_code == 401 and "access_token" not in direct.cookies
        proxy = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        with proxy:
            via_proxy = proxy.post(f"{ui.url}/auth/header", headers=headers, timeout=30)
            assert via_proxy.status_code == 200, via_proxy.text
            assert via_proxy.cookies.get("access_token")
            missing = proxy.post(f"{ui.url}/auth/header", timeout=30)
            assert missing.status_code == 401
    finally:
        stop_ui(ui)
