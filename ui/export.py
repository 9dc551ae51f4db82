"""A conversation as files to download: Markdown, JSON, and a zip with both and its images.

Built from the persisted thread (Chainlit's ``ThreadDict``), so an export shows what is stored,
after a restart too. Its messages are the conversation as :mod:`ui.history` defines it: each
answered user message and its answer (refused messages, error notes and earlier exports are
left out); an answer's text is the answer alone, its statistics are in the JSON.

- ``conversation.json``: ``{"format", "thread": {"id", "name", "created_at"}, "exported_at",
  "settings": {...}, "messages": [{"role", "content", "created_at", "images": [{"name",
  "file", "sha256", "bytes"}]} | {"role": "assistant", "content", "created_at", "stats",
  "images_seen"?}]}``; ``sha256`` is the hex digest of the image's stored bytes (the file as
  uploaded), ``file`` its path in the zip (``null``, with ``"missing": true``, when the stored
  file is gone).
- ``conversation.md``: the same for people: the settings, then each message under its role,
  images linked to their path in the zip.
- ``conversation.zip``: ``conversation.md``, ``conversation.json`` and ``images/NN-name``.

No Chainlit import: unit-tested in the main test environment.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ui.history import answer_of, answered_steps, image_elements

#: The JSON's ``format``: bump when its shape changes.
FORMAT = "phi3v-ui-export/1"
MARKDOWN_NAME, JSON_NAME, ZIP_NAME = "conversation.md", "conversation.json", "conversation.zip"
#: Characters kept in an image's file name in the zip (anything else becomes ``_``).
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def image_elements_of(thread: dict) -> list[dict]:
    """The image elements an export of ``thread`` includes (to read their stored bytes)."""
    images = image_elements(thread)
    return [el for user, _ in answered_steps(thread) for el in images.get(user["id"], [])]


def zip_path(number: int, name: str) -> str:
    """Where image ``number`` (1-based) of the conversation goes in the zip."""
    safe = _UNSAFE.sub("_", name.rsplit("/", 1)[-1]).strip("._") or "image"
    return f"images/{number:02d}-{safe}"


@dataclass
class Export:
    """One export: :attr:`document` (the JSON) and :attr:`files` (zip path -> image bytes)."""

    document: dict
    files: dict[str, bytes] = field(default_factory=dict)

    def json_text(self) -> str:
        return json.dumps(self.document, indent=2, ensure_ascii=False) + "\n"

    def markdown(self) -> str:
        return to_markdown(self.document)

    def zip_bytes(self) -> bytes:
        """The zip: the Markdown and JSON (deflated) and the images (stored as they are:
        already compressed)."""
        buf = io.BytesIO()
        stamp = _zip_time(self.document.get("exported_at"))
        with zipfile.ZipFile(buf, "w") as zf:
            for name, text in ((MARKDOWN_NAME, self.markdown()), (JSON_NAME, self.json_text())):
                zf.writestr(zipfile.ZipInfo(name, stamp), text.encode(), zipfile.ZIP_DEFLATED)
            for path, raw in self.files.items():
                zf.writestr(zipfile.ZipInfo(path, stamp), raw, zipfile.ZIP_STORED)
        return buf.getvalue()


def _zip_time(iso: str | None) -> tuple[int, int, int, int, int, int]:
    try:
        t = datetime.fromisoformat(iso or "")
    except ValueError:
        return (1980, 1, 1, 0, 0, 0)
    return (max(t.year, 1980), t.month, t.day, t.hour, t.minute, t.second)


def _image_entry(number: int, el: dict, raw: bytes | None, files: dict[str, bytes]) -> dict:
    name = el.get("name") or "image"
    if raw is None:
        return {"name": name, "file": None, "sha256": None, "missing": True}
    path = zip_path(number, name)
    files[path] = raw
    return {"name": name, "file": path, "sha256": hashlib.sha256(raw).hexdigest(),
            "bytes": len(raw)}


def build(thread: dict, settings: dict, image_bytes: dict[str, bytes | None],
          exported_at: datetime | None = None) -> Export:
    """The export of ``thread`` with the chat's ``settings`` (as sent to the model);
    ``image_bytes``: the stored bytes of each element of :func:`image_elements_of` by element
    id (``None``: the file is gone)."""
    images = image_elements(thread)
    files: dict[str, bytes] = {}
    messages, number = [], 0
    for user, answer in answered_steps(thread):
        entries = []
        for el in images.get(user["id"], []):
            number += 1
            entries.append(_image_entry(number, el, image_bytes.get(el.get("id")), files))
        messages.append({"role": "user", "content": user.get("output") or "",
                         "created_at": user.get("createdAt"), "images": entries})
        meta = answer_of(answer)
        reply = {"role": "assistant", "content": meta["answer"],
                 "created_at": answer.get("createdAt"), "stats": meta.get("stats") or {}}
        if meta.get("images_seen"):
            reply["images_seen"] = meta["images_seen"]
        messages.append(reply)
    when = (exported_at or datetime.now(timezone.utc)).isoformat(timespec="seconds")
    document = {
        "format": FORMAT,
        "thread": {"id": thread.get("id"), "name": thread.get("name"),
                   "created_at": thread.get("createdAt")},
        "exported_at": when,
        "settings": settings,
        "messages": messages,
    }
    return Export(document, files)


def _settings_markdown(settings: dict) -> list[str]:
    lines = ["## Settings", "", "| setting | value |", "|---|---|"]
    for key, value in settings.items():
        if key != "system_prompt":
            lines.append(f"| {key} | {value} |")
    prompt = settings.get("system_prompt") or ""
    lines += ["", "System prompt:" if prompt.strip() else "System prompt: none", ""]
    if prompt.strip():
        lines += ["```text", prompt, "```", ""]
    return lines


def _message_markdown(message: dict) -> list[str]:
    lines = [f"### {message['role'].capitalize()}", ""]
    for img in message.get("images") or []:
        if img.get("file"):
            lines += [f"![{img['name']}]({img['file']})", ""]
        else:
            lines += [f"*[{img['name']}: no longer stored]*", ""]
    lines += [message["content"], ""]
    if message.get("images_seen"):
        lines += [f"*{message['images_seen']}*", ""]
    return lines


def to_markdown(document: dict) -> str:
    """The Markdown of an export's JSON document."""
    thread = document.get("thread") or {}
    lines = [f"# {thread.get('name') or 'Conversation'}", "",
             f"Exported {document.get('exported_at')} from the Phi-3-vision chat "
             f"(conversation {thread.get('id')}, started {thread.get('created_at')}).", ""]
    lines += _settings_markdown(document.get("settings") or {})
    lines += ["## Conversation", ""]
    for message in document.get("messages") or []:
        lines += _message_markdown(message)
    return "\n".join(lines).rstrip() + "\n"
