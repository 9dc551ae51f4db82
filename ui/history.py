"""A conversation's history and what of it is sent to the model.

**Old-image policy.** Every request carries the whole text history, but only the newest
``keep`` images (``keep`` = ``PHI3V_UI_HISTORY_MAX_IMAGES``, raised to the number of images in
the current message, capped by the server's ``max_images_per_request``). Each older image part
is replaced by a short text note (:data:`OMITTED_NOTE`), so the model still knows an image was
there. Why: every image costs hundreds to thousands of prompt tokens (313 at ``num_crops=1``,
up to 2,509 at 16) and the server caps images per request. The bytes of images that fell out
of the window are dropped from memory (:meth:`Conversation.trim`).

``keep`` is a chat setting (:data:`WINDOW_SETTING`, default ``PHI3V_UI_HISTORY_MAX_IMAGES``);
when older images are left out, the answer says which ones the model saw
(:func:`images_seen_line`).

**What counts as history.** A user turn and the model's answer to it. A turn the server
refused (or that was refused by the intake) never enters the history; a stopped answer does,
with the text the user saw. On resume (:func:`conversation_from_thread`) the same rule is
applied to the persisted steps: only user messages answered by one of our answers (steps whose
metadata carries :data:`ANSWER_KEY`) are kept, and only the images inside the window are
re-read from storage and re-encoded (:meth:`Conversation.fill`).

**Edits and regenerations.** Each turn knows the id of the chat message that shows it
(``message_id``), so an edited message truncates the conversation at its turn
(:meth:`Conversation.take_for_edit`) and a regenerated answer replaces the last assistant turn
(:meth:`Conversation.pop_answer`). A turn whose request failed is kept aside
(:attr:`Conversation.refused`), so editing that message resends its images too.

No Chainlit import: unit-tested in the main test environment.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

#: Text put in place of an image part older than the window.
OMITTED_NOTE = "[image {name} omitted: only the {keep} most recent images are sent]"
#: Metadata key of our answer steps: ``{"answer": text, "stats": {...}}`` (and
#: ``"images_seen"``: the line of :func:`images_seen_line`, when there was one).
ANSWER_KEY = "phi3v"
#: Label of the chat setting holding ``keep`` (named in :func:`images_seen_line`'s advice).
WINDOW_SETTING = "Images re-sent"


@dataclass
class HistoryImage:
    """An image of a user turn: its ``data:`` URL while inside the window, else ``None``."""

    name: str
    data_url: str | None = None
    object_key: str | None = None  # where the persisted original is (resume)
    element_id: str | None = None  # the Chainlit element storing it (uploads of this session)

    @property
    def reloadable(self) -> bool:
        """Whether :meth:`Conversation.fill` can read it back once its bytes are dropped."""
        return bool(self.object_key or self.element_id)


@dataclass
class Turn:
    role: str  # "user" | "assistant"
    text: str
    images: list[HistoryImage] = field(default_factory=list)
    message_id: str | None = None  # the chat message (Chainlit step) showing this turn


class Conversation:
    """The turns of one chat (kept in the Chainlit user session; not JSON, so not persisted
    there: the data layer's steps and elements are the persisted copy)."""

    def __init__(self, turns: list[Turn] | None = None) -> None:
        self.turns: list[Turn] = turns or []
        #: User turns whose request failed, by message id (an edit of that message resends
        #: them with their images).
        self.refused: dict[str, Turn] = {}

    def add(self, turn: Turn) -> None:
        self.turns.append(turn)

    def pop_unanswered(self) -> None:
        """Drop a trailing user turn (its request failed), kept in :attr:`refused`."""
        if self.turns and self.turns[-1].role == "user":
            turn = self.turns.pop()
            if turn.message_id:
                self.refused[turn.message_id] = turn

    def retain(self, message_ids: set[str]) -> None:
        """Drop the turns whose message is no longer in the chat (an edit removes every
        message after the edited one)."""
        self.turns = [t for t in self.turns if t.message_id is None or t.message_id in message_ids]
        self.refused = {k: t for k, t in self.refused.items() if k in message_ids}

    def take_for_edit(self, message_id: str) -> Turn | None:
        """The user turn of ``message_id``, removed with every turn after it (the edited
        message is sent again as a new turn); or its refused turn; ``None`` when the message
        is not part of the conversation."""
        for i, turn in enumerate(self.turns):
            if turn.message_id == message_id and turn.role == "user":
                del self.turns[i:]
                return turn
        return self.refused.pop(message_id, None)

    @property
    def last_answer_id(self) -> str | None:
        """Message id of the newest answer when the conversation ends with one."""
        if self.turns and self.turns[-1].role == "assistant":
            return self.turns[-1].message_id
        return None

    def pop_answer(self, message_id: str) -> bool:
        """Remove the newest answer if it is ``message_id``'s (regenerate); whether it was."""
        if message_id and self.last_answer_id == message_id:
            self.turns.pop()
            return True
        return False

    def images_newest_first(self) -> list[HistoryImage]:
        return [img for turn in reversed(self.turns) for img in reversed(turn.images)]

    def trim(self, keep: int) -> None:
        """Forget the bytes of images outside the newest ``keep``, and of refused turns' images
        that :meth:`fill` can read back."""
        for img in self.images_newest_first()[keep:]:
            img.data_url = None
        for turn in self.refused.values():
            for img in turn.images:
                if img.reloadable:
                    img.data_url = None

    async def fill(self, keep: int, load: Callable[[HistoryImage], Awaitable[str | None]]
                   ) -> None:
        """Load the ``data:`` URL of window images that have none yet but are persisted
        (a resumed chat, or an upload trimmed earlier). ``load`` returns ``None`` for an image
        that cannot be read."""
        for img in self.images_newest_first()[:keep]:
            if img.data_url is None and img.reloadable:
                img.data_url = await load(img)

    def images_seen(self, keep: int) -> tuple[list[int], int]:
        """Which images a request with window ``keep`` carries: their numbers (1 = the
        conversation's first image, in order) and the number of images in the conversation.
        An image of the window that could not be read back is not carried."""
        ordered = [img for turn in self.turns for img in turn.images]
        window = {id(img) for img in self.images_newest_first()[:keep]}
        sent = [n for n, img in enumerate(ordered, 1) if id(img) in window and img.data_url]
        return sent, len(ordered)

    def messages(self, keep: int, system: str | None = None) -> list[dict]:
        """OpenAI chat messages: ``system`` first when set, then the turns with the newest
        ``keep`` images as ``image_url`` parts, older ones as :data:`OMITTED_NOTE` text,
        images before the text of their turn."""
        window = {id(img) for img in self.images_newest_first()[:keep]}
        out = [{"role": "system", "content": system}] if system and system.strip() else []
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


def _ranges(numbers: list[int]) -> str:
    """``[1, 3, 4, 5]`` -> ``"1, 3-5"``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def images_seen_line(sent: list[int], total: int, keep: int, max_per_request: int
                     ) -> str | None:
    """One line for under an answer when the model did not see every image of the
    conversation, e.g. "The model saw images 3-4 of 4 (the newest 2); raise 'Images re-sent'
    in the chat settings to send more."; ``None`` when it saw them all. ``sent`` and
    ``total``: :meth:`Conversation.images_seen`; ``keep``: the request's window;
    ``max_per_request``: the server's ``max_images_per_request``."""
    if len(sent) == total:
        return None
    if not sent:
        seen = f"none of the {total} images"
    else:
        noun = "image" if len(sent) == 1 else "images"
        seen = f"{noun} {_ranges(sent)} of {total}"
        if sent == list(range(total - len(sent) + 1, total + 1)):
            seen += f" (the newest {len(sent)})"
    reasons = []
    unread = min(keep, total) - len(sent)
    if unread > 0:
        reasons.append(f"{unread} could not be read back from storage")
    if keep < total:
        reasons.append(f"the server takes at most {max_per_request} images per request"
                       if keep >= max_per_request else
                       f"raise '{WINDOW_SETTING}' in the chat settings to send more")
    return f"The model saw {seen}; " + "; ".join(reasons) + "."


def _metadata(step: dict) -> dict:
    meta = step.get("metadata") or {}
    if isinstance(meta, str):  # SQLite returns JSON columns as text
        try:
            meta = json.loads(meta)
        except ValueError:
            meta = {}
    return meta if isinstance(meta, dict) else {}


def answer_of(step: dict) -> dict | None:
    """The :data:`ANSWER_KEY` metadata of one of our answer steps, else ``None``."""
    answer = _metadata(step).get(ANSWER_KEY)
    return answer if isinstance(answer, dict) and "answer" in answer else None


def _asker(step: dict, by_id: dict[str, dict]) -> dict | None:
    """The user message an answer step replies to, up its parent chain (Chainlit nests an
    answer in the ``on_message`` run of the message it answers); ``None`` without one."""
    seen: set[str] = set()
    parent = step.get("parentId")
    while parent and parent in by_id and parent not in seen:
        seen.add(parent)
        if by_id[parent].get("type") == "user_message":
            return by_id[parent]
        parent = by_id[parent].get("parentId")
    return None


def answered_steps(thread: dict) -> list[tuple[dict, dict]]:
    """The conversation of a persisted Chainlit thread (``ThreadDict``): each user message
    step answered by one of our answers, with that answer step, in the messages' order.
    Refused messages, error notes and command answers (an export) are not part of it.

    An answer belongs to the message its parent chain leads to (a regenerated answer is newer
    than later messages such as an export), else to the user message just before it."""
    steps = sorted(thread.get("steps") or [], key=lambda s: s.get("createdAt") or "")
    by_id = {s["id"]: s for s in steps if s.get("id")}
    answers: dict[str, dict] = {}
    pending = None
    for step in steps:
        if step.get("type") == "user_message":
            pending = step
        elif step.get("type") == "assistant_message" and answer_of(step):
            asker = _asker(step, by_id) or pending
            if asker is not None:
                answers[asker["id"]] = step
                pending = None if asker is pending else pending
    return [(s, answers[s["id"]]) for s in steps
            if s.get("type") == "user_message" and s["id"] in answers]


def image_elements(thread: dict) -> dict[str, list[dict]]:
    """The thread's image elements by the id of the step they belong to, in stored order."""
    out: dict[str, list[dict]] = {}
    for el in thread.get("elements") or []:
        if el.get("type") == "image" and el.get("forId"):
            out.setdefault(el["forId"], []).append(el)
    return out


def conversation_from_thread(thread: dict) -> Conversation:
    """Rebuild a :class:`Conversation` from a persisted Chainlit thread (``ThreadDict``).

    Images come back as references (``object_key``) without bytes; :meth:`Conversation.fill`
    loads those inside the window when the next request is built.
    """
    images = image_elements(thread)
    conv = Conversation()
    for user, answer in answered_steps(thread):
        conv.add(Turn("user", user.get("output") or "",
                      [HistoryImage(name=el.get("name") or "image", object_key=el.get("objectKey"),
                                    element_id=el.get("id"))
                       for el in images.get(user["id"], [])],
                      message_id=user["id"]))
        conv.add(Turn("assistant", answer_of(answer)["answer"], message_id=answer["id"]))
    return conv
