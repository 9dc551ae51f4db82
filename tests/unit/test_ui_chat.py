"""The chat features' pure parts (main venv, no Chainlit): edits and regenerations of the
conversation, which images the model saw, and exports (``ui/history.py``, ``ui/export.py``).
The same features in a real browser: ``tests/browser/test_ui_chat.py``."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from datetime import datetime, timezone

from ui import export, history
from ui.history import Conversation, HistoryImage, Turn


def image(name: str, key: str | None = None) -> HistoryImage:
    return HistoryImage(name, f"data:image/png;base64,{name}", object_key=key)


def chat(*turns: tuple) -> Conversation:
    """A conversation of (role, text, message id[, images]) tuples."""
    return Conversation([Turn(role, text, list(imgs[0]) if imgs else [], message_id=mid)
                         for role, text, mid, *imgs in turns])


# --- edits and regenerations -------------------------------------------------------------------
def test_an_edit_truncates_at_the_edited_turn_and_hands_back_its_images():
    photo = image("cat.png")
    conv = chat(("user", "Q1", "u1", [photo]), ("assistant", "A1", "a1"),
                ("user", "Q2", "u2"), ("assistant", "A2", "a2"))
    edited = conv.take_for_edit("u1")
    assert edited.images == [photo] and edited.text == "Q1"
    assert conv.turns == []
    assert chat(("user", "Q1", "u1")).take_for_edit("other") is None
    # an assistant id is not an edit
    assert chat(("user", "Q1", "u1"), ("assistant", "A1", "a1")).take_for_edit("a1") is None


def test_turns_whose_messages_left_the_chat_are_dropped():
    """Chainlit's edit removes the messages after the edited one before on_message runs."""
    conv = chat(("user", "Q1", "u1"), ("assistant", "A1", "a1"), ("user", "Q2", "u2"),
                ("assistant", "A2", "a2"))
    conv.retain({"u1", "a1", "u2"})
    assert [t.message_id for t in conv.turns] == ["u1", "a1", "u2"]


def test_a_refused_turn_is_kept_aside_for_an_edit_of_its_message():
    photo = image("cat.png")
    conv = chat(("user", "Q1", "u1"), ("assistant", "A1", "a1"))
    conv.add(Turn("user", "too long", [photo], message_id="u2"))
    conv.pop_unanswered()
    assert [t.message_id for t in conv.turns] == ["u1", "a1"]  # not in the history
    assert conv.take_for_edit("u2").images == [photo]
    assert conv.refused == {}
    conv.add(Turn("user", "again", message_id="u3"))
    conv.pop_unanswered()
    conv.retain({"u1", "a1"})  # its message was removed by an edit above it
    assert conv.refused == {}


def test_regenerate_pops_only_the_newest_answer():
    conv = chat(("user", "Q1", "u1"), ("assistant", "A1", "a1"), ("user", "Q2", "u2"),
                ("assistant", "A2", "a2"))
    assert conv.last_answer_id == "a2"
    assert not conv.pop_answer("a1")
    assert conv.pop_answer("a2")
    assert [t.message_id for t in conv.turns] == ["u1", "a1", "u2"]
    assert conv.last_answer_id is None
    assert not conv.pop_answer("a2")


def test_system_prompt_goes_first_when_set():
    conv = chat(("user", "Q1", "u1"))
    assert conv.messages(2, "Be brief.")[0] == {"role": "system", "content": "Be brief."}
    assert conv.messages(2, "  \n")[0]["role"] == "user"
    assert conv.messages(2)[0] == {"role": "user", "content": "Q1"}


async def test_trimmed_uploads_are_read_back_through_their_element():
    """An upload of this session has no object key: fill finds it through its element id,
    so an edit that brings it back into the window resends it."""
    old = HistoryImage("a.png", "data:a", element_id="e1")
    conv = Conversation([Turn("user", "Q1", [old], message_id="u1"),
                         Turn("assistant", "A1", message_id="a1"),
                         Turn("user", "Q2", [image("b.png")], message_id="u2")])
    conv.trim(keep=1)
    assert old.data_url is None
    conv.take_for_edit("u2")
    loaded = []

    async def load(img):
        loaded.append(img.element_id)
        return "data:again"

    await conv.fill(keep=1, load=load)
    assert loaded == ["e1"] and old.data_url == "data:again"


# --- which images the model saw ----------------------------------------------------------------
def six_image_chat() -> Conversation:
    names = iter(f"{n}.png" for n in range(1, 7))
    conv = Conversation()
    for i in range(3):
        conv.add(Turn("user", f"Q{i}", [image(next(names)), image(next(names))]))
        conv.add(Turn("assistant", f"A{i}"))
    return conv


def test_images_seen_counts_in_conversation_order():
    conv = six_image_chat()
    assert conv.images_seen(2) == ([5, 6], 6)
    assert conv.images_seen(0) == ([], 6)
    assert conv.images_seen(9) == ([1, 2, 3, 4, 5, 6], 6)
    conv.turns[4].images[0].data_url = None  # image 5 could not be read back
    assert conv.images_seen(3) == ([4, 6], 6)


def test_images_seen_line():
    line = history.images_seen_line
    assert line([3, 4], 4, keep=2, max_per_request=4) == (
        "The model saw images 3-4 of 4 (the newest 2); raise 'Images re-sent' in the chat "
        "settings to send more.")
    assert line([1, 2], 2, keep=2, max_per_request=4) is None
    assert line([], 0, keep=2, max_per_request=4) is None
    assert line([6], 6, keep=1, max_per_request=4) == (
        "The model saw image 6 of 6 (the newest 1); raise 'Images re-sent' in the chat "
        "settings to send more.")
    assert line([], 3, keep=0, max_per_request=4).startswith(
        "The model saw none of the 3 images; raise")
    assert line([3, 4, 5, 6], 6, keep=4, max_per_request=4) == (
        "The model saw images 3-6 of 6 (the newest 4); the server takes at most 4 images "
        "per request.")
    assert line([4, 6], 6, keep=3, max_per_request=4) == (
        "The model saw images 4, 6 of 6; 1 could not be read back from storage; raise "
        "'Images re-sent' in the chat settings to send more.")
    assert history.WINDOW_SETTING in line([2], 2, keep=1, max_per_request=4)


# --- the persisted thread ----------------------------------------------------------------------
def answer_meta(text: str, **extra) -> str:
    return json.dumps({"phi3v": {"answer": text, "stats": {"tokens": 3}, **extra}})


PHOTO = b"\x89PNG fake photo bytes"
THREAD = {
    "id": "t1", "name": "Cats", "createdAt": "2025-01-01T10:00:00",
    "metadata": {"chat_settings": {"system_prompt": "Be brief."}},
    "steps": [
        {"id": "u1", "type": "user_message", "output": "What is this?", "createdAt": "1"},
        {"id": "r1", "type": "run", "name": "on_message", "parentId": "u1", "createdAt": "1.5"},
        {"id": "a1", "type": "assistant_message", "output": "A cat", "parentId": "r1",
         "metadata": answer_meta("A cat"), "createdAt": "2"},
        {"id": "u2", "type": "user_message", "output": "refused", "createdAt": "3"},
        {"id": "e2", "type": "assistant_message", "output": "(400)", "metadata": "{}",
         "createdAt": "4"},
        {"id": "u3", "type": "user_message", "output": "And now?", "createdAt": "5"},
        {"id": "r3", "type": "run", "name": "on_message", "parentId": "u3", "createdAt": "5.5"},
        # an export came after u3's first answer; its regenerated answer is newer still
        {"id": "x", "type": "user_message", "output": "", "createdAt": "7"},
        {"id": "xa", "type": "assistant_message", "output": "files", "metadata": "{}",
         "createdAt": "8"},
        {"id": "a3", "type": "assistant_message", "output": "Still a cat", "parentId": "r3",
         "metadata": answer_meta("Still a cat", images_seen="The model saw ..."),
         "createdAt": "9"},
    ],
    "elements": [
        {"id": "i1", "type": "image", "forId": "u1", "name": "my cat.png", "objectKey": "k/1"},
        {"id": "i2", "type": "image", "forId": "u2", "name": "bad.png", "objectKey": "k/2"},
        {"id": "i3", "type": "image", "forId": "u3", "name": "gone.png", "objectKey": "k/3"},
        {"id": "s1", "type": "text", "forId": "a1", "name": "Statistics", "objectKey": "k/s"},
        {"id": "f1", "type": "file", "forId": "xa", "name": "conversation.zip",
         "objectKey": "k/z"},
    ],
}


def test_answers_belong_to_the_message_their_run_answers():
    """A regenerated answer is newer than an export made before it: its parent chain, not
    its time, says which message it answers."""
    pairs = history.answered_steps(THREAD)
    assert [(u["id"], a["id"]) for u, a in pairs] == [("u1", "a1"), ("u3", "a3")]
    conv = history.conversation_from_thread(THREAD)
    assert [(t.role, t.text, t.message_id) for t in conv.turns] == [
        ("user", "What is this?", "u1"), ("assistant", "A cat", "a1"),
        ("user", "And now?", "u3"), ("assistant", "Still a cat", "a3")]
    assert [(i.name, i.object_key, i.element_id) for i in conv.turns[0].images] == [
        ("my cat.png", "k/1", "i1")]


# --- exports -----------------------------------------------------------------------------------
SETTINGS = {"system_prompt": "Be brief.\nVery.", "temperature": 0.7, "max_tokens": 16,
            "history_images": 2, "num_crops": 1}
WHEN = datetime(2025, 1, 2, 3, 4, 6, tzinfo=timezone.utc)  # zip times: 2 s steps


def built() -> export.Export:
    assert [el["id"] for el in export.image_elements_of(THREAD)] == ["i1", "i3"]
    return export.build(THREAD, SETTINGS, {"i1": PHOTO, "i3": None}, exported_at=WHEN)


def test_export_json_holds_messages_settings_and_image_digests():
    doc = json.loads(built().json_text())
    assert doc["format"] == export.FORMAT
    assert doc["thread"] == {"id": "t1", "name": "Cats", "created_at": "2025-01-01T10:00:00"}
    assert doc["exported_at"] == "2025-01-02T03:04:06+00:00"
    assert doc["settings"] == SETTINGS
    assert [(m["role"], m["content"]) for m in doc["messages"]] == [
        ("user", "What is this?"), ("assistant", "A cat"), ("user", "And now?"),
        ("assistant", "Still a cat")]
    assert doc["messages"][0]["images"] == [{
        "name": "my cat.png", "file": "images/01-my_cat.png",
        "sha256": hashlib.sha256(PHOTO).hexdigest(), "bytes": len(PHOTO)}]
    assert doc["messages"][2]["images"] == [
        {"name": "gone.png", "file": None, "sha256": None, "missing": True}]
    assert doc["messages"][1]["stats"] == {"tokens": 3}
    assert doc["messages"][3]["images_seen"] == "The model saw ..."


def test_export_markdown_reads_as_the_conversation():
    md = built().markdown()
    assert md.startswith("# Cats\n")
    assert "| max_tokens | 16 |" in md and "| temperature | 0.7 |" in md
    assert "```text\nBe brief.\nVery.\n```" in md
    assert md.index("### User") < md.index("What is this?") < md.index("### Assistant")
    assert "![my cat.png](images/01-my_cat.png)" in md
    assert "*[gone.png: no longer stored]*" in md
    assert "refused" not in md and "conversation.zip" not in md
    no_prompt = export.build(THREAD, {**SETTINGS, "system_prompt": ""}, {}).markdown()
    assert "System prompt: none" in no_prompt


def test_export_zip_holds_both_files_and_the_stored_images():
    result = built()
    with zipfile.ZipFile(io.BytesIO(result.zip_bytes())) as zf:
        assert sorted(zf.namelist()) == ["conversation.json", "conversation.md",
                                         "images/01-my_cat.png"]
        doc = json.loads(zf.read("conversation.json"))
        photo = zf.read(doc["messages"][0]["images"][0]["file"])
        assert hashlib.sha256(photo).hexdigest() == doc["messages"][0]["images"][0]["sha256"]
        assert zf.read("conversation.md").decode() == result.markdown()
        assert zf.getinfo("conversation.md").date_time == (2025, 1, 2, 3, 4, 6)


def test_zip_paths_are_safe_and_numbered():
    assert export.zip_path(3, "../../etc/passwd") == "images/03-passwd"
    assert export.zip_path(12, "été photo.JPG") == "images/12-t_photo.JPG"
    assert export.zip_path(1, "...") == "images/01-image"


def test_nothing_answered_exports_no_messages():
    assert export.build({"id": "t", "steps": []}, {}, {}).document["messages"] == []
