"""A conversation's history and what of it is sent to the model.

**Old-image policy.** Every request carries the whole text history, but only the newest
``keep`` images (``keep`` = ``PHI3V_UI_HISTORY_MAX_IMAGES``, raised to the number of images in
the current message, capped by the server's ``max_images_per_request``). Each older image part
is replaced by a short text note (:data:`OMITTED_NOTE`), so the model still knows an image was
there. Why: every image costs hundreds to thousands of prompt tokens (313 at ``num_crops=1``,
up to 2,509 at 16) and the server caps images per request. The bytes of images that fell out
of the window are dropped from memory (:meth:`Conversation.trim`).

**What counts as history.** A user turn and the model's answer to it. A turn the server
refused (or that was refused by the intake) never enters the history; a stopped answer does,
with the text the user saw. On resume (:func:`conversation_from_thread`) the same rule is
applied to the persisted steps: only user messages answered by one of our answers (steps whose
metadata carries :data:`ANSWER_KEY`) are kept, and only the images inside the window are
re-read from storage and re-encoded (:meth:`Conversation.fill`).

No Chainlit import: unit-tested in the main test environment.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

#: Text put in place of an image part older than the window.
OMITTED_NOTE = "[image {name} omitted: only the {keep} most recent images are sent]"
#: Metadata key of our answer steps: ``{"answer": text, "stats": {...}}``.
ANSWER_KEY = "phi3v"


@dataclass
class HistoryImage:
    """An image of a user turn: its ``data:`` URL while inside the window, else ``None``."""

    name: str
    data_url: str | None = None
    object_key: str | None = None  # where the persisted original is (resume)


@dataclass
class Turn:
    role: str  # "user" | "assistant"
    text: str
    images: list[HistoryImage] = field(default_factory=list)


class Conversation:
    """The turns of one chat (kept in the Chainlit user session; not JSON, so not persisted
    there: the data layer's steps and elements are the persisted copy)."""

    def __init__(self, turns: list[Turn] | None = None) -> None:
        self.turns: list[Turn] = turns or []

    def add(self, turn: Turn) -> None:
        self.turns.append(turn)

    def pop_unanswered(self) -> None:
        """Drop a trailing user turn (its request failed)."""
        if self.turns and self.turns[-1].role == "user":
            self.turns.pop()

    def images_newest_first(self) -> list[HistoryImage]:
        return [img for turn in reversed(self.turns) for img in reversed(turn.images)]

    def trim(self, keep: int) -> None:
        """Forget the bytes of images outside the newest ``keep``."""
        for img in self.images_newest_first()[keep:]:
            img.data_url = None

    async def fill(self, keep: int, load: Callable[[HistoryImage], Awaitable[str | None]]
                   ) -> None:
        """Load the ``data:`` URL of window images that have none yet but are persisted
        (a resumed chat). ``load`` returns ``None`` for an image that cannot be read."""
        for img in self.images_newest_first()[:keep]:
            if img.data_url is None and img.object_key:
                img.data_url = await load(img)

    def messages(self, keep: int) -> list[dict]:
        """OpenAI chat messages: the newest ``keep`` images as ``image_url`` parts, older ones
        as :data:`OMITTED_NOTE` text, images before the text of their turn."""
        window = {id(img) for img in self.images_newest_first()[:keep]}
        out = []
        for turn in self.turns:
            if turn.role != "user" or not turn.images:
                out.append({"role": turn.role, "content": turn.text})
                continue
            parts: list[dict] = []
            for img in turn.images:
                if id(img) in window and img.data_url:
                    parts.append({"type": "image_url", "image_url": {"url": img.data_url}})
                else:
                    parts.append({"type": "text",
                                  "text": OMITTED_NOTE.format(name=img.name, keep=keep)})
            parts.append({"type": "text", "text": turn.text})
            out.append({"role": "user", "content": parts})
        return out


def window_size(history_max_images: int, current_images: int, max_per_request: int) -> int:
    """How many images a request carries (see the module's policy)."""
    return min(max(history_max_images, current_images), max_per_request)


def _metadata(step: dict) -> dict:
    meta = step.get("metadata") or {}
    if isinstance(meta, str):  # SQLite returns JSON columns as text
        try:
            meta = json.loads(meta)
        except ValueError:
            meta = {}
    return meta if isinstance(meta, dict) else {}


def conversation_from_thread(thread: dict) -> Conversation:
    """Rebuild a :class:`Conversation` from a persisted Chainlit thread (``ThreadDict``).

    Images come back as references (``object_key``) without bytes; :meth:`Conversation.fill`
    loads those inside the window when the next request is built.
    """
    steps = sorted(thread.get("steps") or [], key=lambda s: s.get("createdAt") or "")
    images_by_step: dict[str, list[HistoryImage]] = {}
    for el in thread.get("elements") or []:
        if el.get("type") == "image" and el.get("forId"):
            images_by_step.setdefault(el["forId"], []).append(
                HistoryImage(name=el.get("name") or "image", object_key=el.get("objectKey")))
    conv = Conversation()
    pending: Turn | None = None
    for step in steps:
        if step.get("type") == "user_message":
            pending = Turn("user", step.get("output") or "", images_by_step.get(step["id"], []))
        elif step.get("type") == "assistant_message" and pending is not None:
            answer = _metadata(step).get(ANSWER_KEY)
            if isinstance(answer, dict) and "answer" in answer:
                conv.add(pending)
                conv.add(Turn("assistant", answer["answer"]))
                pending = None
    return conv
