"""The chat features people expect from a chat about images, in a real browser (headless
Chromium, Playwright) against the session's real API: edit and resend, regenerate, per-chat
settings kept with the thread, export, which images the model saw, Copy copying the answer
alone, and refusals of edited and regenerated requests.

What the UI sends to the model is read on the wire: a recording reverse proxy
(``tests/browser/proxy.py``) sits between the UI and the API. One UI process for the module
(restarted once, same store, to show what survives a restart). Answers are short
(``ANSWER_TOKENS``): the tiny model writes gibberish, so assertions are about what was sent,
shown, copied and stored, never about content. Each test leaves a screenshot in
``test-artifacts/screenshots/<feature>.png`` (``make ui-screenshots`` copies them into
``ui/docs/screenshots/`` for ``ui/README.md``).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
import uuid
import zipfile
from urllib.parse import unquote

import httpx
import pytest

from tests.browser.helpers import (
    STATS_RE,
    ChatPage,
    local_only,
    start_ui,
    stop_ui,
)
from tests.browser.proxy import RecordingProxy
from tests.browser.test_ui import browser  # noqa: F401 - fixture
from tests.helpers import ARTIFACTS, IMAGES

#: max_tokens of the answers (~0.1 s per token on this CPU).
ANSWER_TOKENS = 8
SHOTS = ARTIFACTS / "screenshots"
RUNNING = "vllm:num_requests_running"
#: One answer in the page: its message id and its text.
ANSWERS_JS = ("els => els.map(e => [e.querySelector('[id^=step-]').id.slice(5), e.innerText])")


# --- fixtures: the proxy, one UI (restartable), one logged-in page --------------------------
@pytest.fixture(scope="module")
def proxy(server):
    peer = RecordingProxy(server.base_url)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def ui_data(tmp_path_factory):
    return tmp_path_factory.mktemp("ui-chat-data")


def launch_ui(proxy: RecordingProxy, data_dir):
    return start_ui(proxy.url, data_dir, log_name="ui-chat",
                    env={"PHI3V_UI_DEFAULT_MAX_TOKENS": str(ANSWER_TOKENS)})


@pytest.fixture(scope="module")
def ui(proxy, ui_data):
    """``{"proc": the running UI}``: a test may restart it (same store and auth secret)."""
    holder = {"proc": launch_ui(proxy, ui_data)}
    yield holder
    stop_ui(holder["proc"])


@pytest.fixture(scope="module")
async def chat(browser, ui) -> ChatPage:  # noqa: F811
    """One logged-in page for the module, allowed to use the clipboard."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900},
                                        accept_downloads=True)
    await context.grant_permissions(["clipboard-read", "clipboard-write"])
    await context.route("**/*", local_only)
    page = ChatPage(await context.new_page(), ui["proc"].url)
    await page.login("demo", "demo")
    yield page
    await context.close()


# --- what a person does, and reads back -----------------------------------------------------
async def shot(chat: ChatPage, feature: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    await chat.page.screenshot(path=str(SHOTS / f"{feature}.png"))


async def answers(chat: ChatPage) -> list[tuple[str, str]]:
    """(message id, text) of each answer on the page, in order."""
    return [tuple(a) for a in await chat.page.eval_on_selector_all(ChatPage.ASSISTANT,
                                                                    ANSWERS_JS)]


async def wait_answer(chat: ChatPage, not_ids: set[str] = frozenset(), contains: str = "",
                      finished=STATS_RE.search, timeout_s: float = 60) -> tuple[str, str]:
    """The first assistant message whose id is not in ``not_ids``, whose text contains
    ``contains`` and is ``finished`` (default: an answer with its statistics shown)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for mid, text in await answers(chat):
            if mid not in not_ids and contains in text and finished(text):
                return mid, text
        await chat.page.wait_for_timeout(100)
    raise AssertionError(f"no new answer with {contains!r}: {await answers(chat)!r}")


def refusal(text: str) -> bool:
    """An error message quoting the server's 400, as for a new message (ui/errors.py)."""
    return text.startswith("The server refused the request (400): ")


async def ask(chat: ChatPage, text: str, *photos: str) -> tuple[str, str]:
    """Send ``text`` with ``photos`` (names in the shared images) and wait for the answer."""
    before = {mid for mid, _ in await answers(chat)}
    if photos:
        await chat.attach(*(IMAGES / p for p in photos))
        await chat.wait_attached(len(photos))
    await chat.send(text)
    return await wait_answer(chat, before)


async def thread_id(chat: ChatPage, name: str) -> str:
    """The id of the user's thread named ``name`` (its first message)."""
    listed = await chat.page.context.request.post(
        f"{chat.base_url}/project/threads",
        data={"pagination": {"first": 50, "cursor": None}, "filter": {}})
    (found,) = [t["id"] for t in (await listed.json())["data"] if t["name"] == name]
    return found


async def edit(chat: ChatPage, old_text: str, new_text: str, screenshot: str = "") -> None:
    """Edit the user message ``old_text`` like a person: hover it, the pencil, type, confirm
    (a screenshot named ``screenshot`` before confirming)."""
    row = chat.page.locator(ChatPage.USER, has_text=old_text).locator(".group").first
    await row.hover()
    await row.locator(".edit-message").click()
    await chat.page.fill("#edit-chat-input", new_text)
    if screenshot:
        await shot(chat, screenshot)
    await chat.page.click(".confirm-edit")


def regenerate_button(chat: ChatPage):
    return chat.page.locator(f"{ChatPage.ASSISTANT} button:has(svg.lucide-refresh-cw)")


async def open_settings(chat: ChatPage) -> None:
    await chat.page.click("#chat-settings-open-modal")
    await chat.page.wait_for_selector("#system_prompt")


async def set_settings(chat: ChatPage, system_prompt: str | None = None,
                       max_tokens: int | None = None, images_steps: int = 0) -> None:
    """Change the chat settings like a person: type, arrow the 'Images re-sent' slider,
    confirm."""
    await open_settings(chat)
    if system_prompt is not None:
        await chat.page.fill("#system_prompt", system_prompt)
    if max_tokens is not None:
        await chat.page.fill("#max_tokens", str(max_tokens))
    slider = chat.page.locator("#history_images [role=slider]")
    for _ in range(abs(images_steps)):
        await slider.press("ArrowRight" if images_steps > 0 else "ArrowLeft")
    await chat.page.click("#confirm")


async def stored_files(data_dir, want: list[str], timeout_s: float = 10) -> list[str]:
    """The names of the files in the UI's storage, once they are ``want`` (sorted; Chainlit
    stores and deletes files in tasks of its own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        names = sorted(unquote(f.name) for f in (data_dir / "files").rglob("*") if f.is_file())
        if names == sorted(want) or time.monotonic() > deadline:
            return names
        await asyncio.sleep(0.1)


def sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def too_long(server) -> str:
    """A text the server refuses: twice as many words as the model's context."""
    max_model_len = httpx.get(f"{server.base_url}/limits").json()["max_model_len"]
    return "hello " * (2 * max_model_len)


# --- the photo chat the first tests share (edited, regenerated, copied, exported) -----------
@pytest.fixture(scope="module")
async def photo_chat(chat, proxy) -> dict:
    """A chat about chelsea.png; the tests below record its current question and answer."""
    await chat.new_chat()
    question = f"What is in this photo? ({uuid.uuid4().hex[:6]})"
    n = len(proxy.chats)
    mid, _ = await ask(chat, question, "chelsea.png")
    sent = (await proxy.wait_chats(n + 1))[n]
    assert sent.image_urls(), "the photo did not reach the model"
    return {"thread": await thread_id(chat, question), "question": question,
            "answer_id": mid, "answer": sent.answer, "photo_url": sent.image_urls()[0]}


async def test_edit_resends_the_message_with_its_photo(chat, proxy, photo_chat):
    n = len(proxy.chats)
    new_text = "What colour is the cat?"
    await edit(chat, photo_chat["question"], new_text, screenshot="edit")
    mid, _ = await wait_answer(chat, {photo_chat["answer_id"]})
    sent = (await proxy.wait_chats(n + 1))[n]
    # the edited text and the same photo, and nothing of the old exchange
    parts = sent.last_user_parts()
    assert parts[-1] == {"type": "text", "text": new_text}
    assert [p["type"] for p in parts] == ["image_url", "text"]
    assert sent.image_urls() == [photo_chat["photo_url"]]
    assert [m["role"] for m in sent.messages] == ["user"]
    # the old answer is gone, the new one is the only one
    assert [a[0] for a in await answers(chat)] == [mid]
    photo_chat.update(question=new_text, answer_id=mid, answer=sent.answer)


async def test_regenerate_replaces_the_answer_with_the_same_request(chat, proxy, photo_chat):
    n = len(proxy.chats)
    previous = proxy.chats[n - 1]
    assert await regenerate_button(chat).count() == 1  # on the newest answer only
    await regenerate_button(chat).hover()
    await chat.page.get_by_text("Regenerate").first.wait_for()
    await shot(chat, "regenerate")
    await regenerate_button(chat).click()
    mid, _ = await wait_answer(chat, {photo_chat["answer_id"]})
    again = (await proxy.wait_chats(n + 1))[n]
    assert again.messages == previous.messages  # the same messages, the photo included
    assert {k: again.body[k] for k in ("max_tokens", "temperature")} == {
        k: previous.body[k] for k in ("max_tokens", "temperature")}
    assert [a[0] for a in await answers(chat)] == [mid]  # replaced, not added
    assert await regenerate_button(chat).count() == 1
    photo_chat.update(answer_id=mid, answer=again.answer)


async def test_copy_copies_the_answer_without_the_statistics(chat, photo_chat):
    answer = chat.page.locator(ChatPage.ASSISTANT).last
    await answer.locator("button:has(svg.lucide-copy)").click()
    await answer.locator("svg.lucide-check").wait_for()
    await shot(chat, "copy")
    copied = await chat.page.evaluate("navigator.clipboard.readText()")
    assert copied == photo_chat["answer"]
    assert not STATS_RE.search(copied)
    stats = await answer.locator(".answer-stats").inner_text()
    assert STATS_RE.search(stats) and await answer.locator(".answer-stats").is_visible()


async def test_settings_reach_the_server_and_survive_a_restart(chat, proxy, ui, ui_data):
    """System prompt first, maximum length as max_tokens; after the UI process restarts and
    the thread is reopened, the panel shows them and the next request carries them."""
    prompt = "Answer in one short sentence.\nNever more."
    await chat.new_chat()
    await open_settings(chat)
    await chat.page.fill("#system_prompt", prompt)
    await chat.page.fill("#max_tokens", "9")
    await shot(chat, "settings")
    await chat.page.click("#confirm")
    question = f"Hello there ({uuid.uuid4().hex[:6]})"
    n = len(proxy.chats)
    await ask(chat, question)
    sent = (await proxy.wait_chats(n + 1))[n]
    assert sent.messages[0] == {"role": "system", "content": prompt}
    assert sent.body["max_tokens"] == 9
    tid = await thread_id(chat, question)

    stop_ui(ui["proc"])  # a restart: the socket never says goodbye
    ui["proc"] = launch_ui(proxy, ui_data)
    chat.base_url = ui["proc"].url
    await chat.open_thread(tid)
    await open_settings(chat)
    assert await chat.page.input_value("#system_prompt") == prompt
    assert await chat.page.input_value("#max_tokens") == "9"
    await chat.page.keyboard.press("Escape")
    n = len(proxy.chats)
    await ask(chat, "And again?")
    again = (await proxy.wait_chats(n + 1))[n]
    assert again.messages[0] == {"role": "system", "content": prompt}
    assert again.messages[1]["content"] == question  # the history came back too
    assert again.body["max_tokens"] == 9


async def test_export_after_a_restart(chat, photo_chat, ui_data):
    """Markdown, JSON and zip of the photo chat, from the store of the restarted UI (which
    kept Regenerate on the newest answer)."""
    await chat.open_thread(photo_chat["thread"])
    assert await regenerate_button(chat).count() == 1
    await chat.page.click("#command-Export")
    await chat.page.click("#chat-submit")
    await chat.page.wait_for_selector("a[download='conversation.zip']", timeout=30_000)
    await shot(chat, "export")
    files = {}
    for name in ("conversation.md", "conversation.json", "conversation.zip"):
        async with chat.page.expect_download() as download:
            await chat.page.click(f"a[download='{name}']")
        files[name] = (await (await download.value).path()).read_bytes()
    doc = json.loads(files["conversation.json"])
    assert [(m["role"], m["content"]) for m in doc["messages"]] == [
        ("user", photo_chat["question"]), ("assistant", photo_chat["answer"])]
    assert doc["settings"] == {"system_prompt": "", "temperature": 0.7,
                               "max_tokens": ANSWER_TOKENS, "history_images": 2,
                               "num_crops": 1}
    (image,) = doc["messages"][0]["images"]
    assert image["name"] == "chelsea.png"
    assert image["sha256"] == sha256((IMAGES / "chelsea.png").read_bytes())  # as uploaded
    md = files["conversation.md"].decode()
    for text in (photo_chat["question"], photo_chat["answer"].strip(),
                 f"| max_tokens | {ANSWER_TOKENS} |", f"]({image['file']})"):
        assert text in md, text
    with zipfile.ZipFile(io.BytesIO(files["conversation.zip"])) as zf:
        assert sorted(zf.namelist()) == sorted(["conversation.md", "conversation.json",
                                                image["file"]])
        assert sha256(zf.read(image["file"])) == image["sha256"]
        assert json.loads(zf.read("conversation.json"))["messages"] == doc["messages"]
    # stored: the photo once and the export's files (the statistics are no files; the answers
    # an edit and a regeneration replaced left none behind)
    want = ["chelsea.png", "conversation.json", "conversation.md", "conversation.zip"]
    assert await stored_files(ui_data, want) == want


async def test_edit_after_a_restart_resends_the_stored_photo(chat, proxy, photo_chat,
                                                             ui_data):
    """A resumed message carries no files: its photo comes back from storage, as sent
    before. The export after it goes, its files too."""
    n = len(proxy.chats)
    old = {mid for mid, _ in await answers(chat)}
    await edit(chat, photo_chat["question"], "Is the cat awake?")
    mid, _ = await wait_answer(chat, old)
    sent = (await proxy.wait_chats(n + 1))[n]
    assert sent.image_urls() == [photo_chat["photo_url"]]
    assert sent.last_user_parts()[-1]["text"] == "Is the cat awake?"
    assert [a[0] for a in await answers(chat)] == [mid]
    assert await stored_files(ui_data, ["chelsea.png"]) == ["chelsea.png"]


async def test_the_answer_says_which_images_the_model_saw(chat, proxy):
    """Six photos in three messages: the newest 2 are re-sent (the default), and the answer
    says so; 'Images re-sent' at 3 and Regenerate: the newest 3."""
    await chat.new_chat()
    photos = [("chelsea.png", "coffee.png"), ("astronaut.png", "rocket.jpg"),
              ("page.png", "one_pixel.png")]
    for i, pair in enumerate(photos):
        n = len(proxy.chats)
        _, text = await ask(chat, f"Compare these, part {i + 1}.", *pair)
        sent = (await proxy.wait_chats(n + 1))[n]
    assert "The model saw images 5-6 of 6 (the newest 2); raise 'Images re-sent' in the " \
           "chat settings to send more." in text
    assert len(sent.image_urls()) == 2
    notes = [p["text"] for m in sent.messages if isinstance(m["content"], list)
             for p in m["content"] if "omitted" in p.get("text", "")]
    assert len(notes) == 4
    await shot(chat, "images-seen")

    shown = await answers(chat)
    assert len(shown) == 3 and await regenerate_button(chat).count() == 1
    assert await chat.page.locator(ChatPage.ASSISTANT).last.locator(
        "svg.lucide-refresh-cw").count() == 1  # on the newest answer only
    await set_settings(chat, images_steps=1)
    old = {mid for mid, _ in shown}
    n = len(proxy.chats)
    await regenerate_button(chat).click()
    _, text = await wait_answer(chat, old)
    sent = (await proxy.wait_chats(n + 1))[n]
    assert len(sent.image_urls()) == 3
    assert "The model saw images 4-6 of 6 (the newest 3)" in text


async def test_refused_regenerate_and_edit_show_the_error_and_leave_no_trace(chat, proxy,
                                                                             server):
    """Regenerate with a system prompt the server refuses, then an edit to a text it refuses:
    both show the server's 400 like a new message would; the next request carries neither."""
    await chat.new_chat()
    question = f"Hi ({uuid.uuid4().hex[:6]})"
    answer_id, _ = await ask(chat, question)
    await set_settings(chat, system_prompt=too_long(server))
    await regenerate_button(chat).click()
    first, _ = await wait_answer(chat, {answer_id}, finished=refusal, timeout_s=30)
    await set_settings(chat, system_prompt="")
    # the edit removes what followed the message (the first error) and is refused in turn
    await edit(chat, question, too_long(server))
    second, _ = await wait_answer(chat, {answer_id, first}, finished=refusal, timeout_s=30)
    await shot(chat, "error")
    assert [mid for mid, _ in await answers(chat)] == [second]
    n = len(proxy.chats)
    assert [c.status for c in proxy.chats[n - 2:]] == [400, 400]
    await ask(chat, "After the refusals.")
    sent = (await proxy.wait_chats(n + 1))[n]
    assert sent.messages == [{"role": "user", "content": "After the refusals."}]


async def test_stop_ends_a_regenerated_answer(chat, proxy, server):
    """Stop reaches a regenerated answer (Chainlit runs action callbacks outside the task
    Stop cancels): the server's request ends, the partial answer is marked stopped."""
    for _ in range(3):  # an answer that ends on its own before Stop shows nothing about Stop
        await chat.new_chat()
        await ask(chat, f"Tell me a long story ({uuid.uuid4().hex[:6]}).")
        await set_settings(chat, max_tokens=1500)
        old = {mid for mid, _ in await answers(chat)}
        await regenerate_button(chat).click()
        deadline = time.monotonic() + 30
        while await server.ametric(RUNNING) < 1:
            assert time.monotonic() < deadline, "the regenerated request did not start"
            await chat.page.wait_for_timeout(100)
        if await chat.press_stop(lambda: server.ametric(RUNNING)):
            break
    else:
        pytest.fail("three regenerated answers ended on their own before Stop could be pressed")
    stopped_at = time.monotonic()
    while await server.ametric(RUNNING) > 0:
        assert time.monotonic() - stopped_at < 10, "the server kept generating after Stop"
        await chat.page.wait_for_timeout(100)
    _, text = await wait_answer(chat, old, contains="stopped")
    assert int(STATS_RE.search(text)["tokens"]) < 1500
