"""Chainlit chat UI for the Phi-3-vision API: the decorated handlers, nothing else.

Run with ``python -m ui`` (``make ui``). The UI talks to the API only over HTTP
(:mod:`ui.api`): ``GET /limits`` for the image limits, ``POST /v1/chat/completions`` streamed.
Helpers, one job each: image intake (:mod:`ui.images`), history and its old-image policy
(:mod:`ui.history`), readable errors (:mod:`ui.errors`), per-answer statistics
(:mod:`ui.stats`), exports (:mod:`ui.export`), persisted images (:mod:`ui.storage`), database
schema (:mod:`ui.db`), login (:mod:`ui.auth`), which pages may use a login
(:mod:`ui.origins`), settings (:mod:`ui.settings`). Design notes: ``ui/README.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import uuid
from pathlib import Path

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # `chainlit run ui/app.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import chainlit as cl
import chainlit.auth.cookie as chainlit_cookie
import chainlit.server as chainlit_server
from chainlit.auth import get_current_user, get_token_from_cookies
from chainlit.chat_context import chat_context
from chainlit.config import SpontaneousFileUploadFeature
from chainlit.config import config as chainlit_config
from chainlit.data import get_data_layer
from chainlit.data.sql_alchemy import SQLAlchemyDataLayer
from chainlit.input_widget import NumberInput, Slider, TextInput
from chainlit.server import app as chainlit_app
from fastapi import HTTPException
from starlette.requests import cookie_parser

from ui import auth, db, export, history, images, origins, serving, uploads
from ui.api import ApiClient, ServerLimits, Token, Usage
from ui.errors import ApiError
from ui.history import ANSWER_KEY, Conversation, HistoryImage, Turn
from ui.settings import UISettings
from ui.stats import AnswerStats
from ui.storage import LocalStorageClient, add_file_route
from ui.throttle import TokenBatcher
from ui.uploads import EmptyUploadGuard
from ui.users import Accounts, LoginLimiter, UsersFile

#: Argon2 verifications run at once (each ~64 MiB of memory, ~0.1 s of one core).
ARGON2_CONCURRENCY = 2
#: OpenAI's temperature range.
TEMPERATURE_MIN, TEMPERATURE_MAX = 0.0, 2.0
#: The composer command answering with the conversation's files (Chainlit's commands:
#: ``message.command`` in on_message).
EXPORT_COMMAND = "Export"
#: Name of the action under the newest answer that asks for another answer.
REGENERATE_ACTION = "regenerate"
#: The custom element under each answer (``ui/public/elements/Stats.jsx``): its statistics
#: and which images the model saw, kept out of the message's content so that Copy copies the
#: answer alone.
STATS_ELEMENT = "Stats"

log = logging.getLogger("ui")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
settings = UISettings()
# Both entry points, `python -m ui` and `chainlit run ui/app.py`, reach here before Chainlit
# serves (its run_chainlit loads this module, then starts uvicorn), so what must hold before the
# first request is done here, once per process. The store's schema to its newest revision
# (ui/db.py): a failed upgrade stops the start with its reason, instead of a UI whose every save
# fails (Chainlit's on_app_startup would log it and serve anyway).
asyncio.run(db.upgrade(settings.database_url))
# Idle connections outlast the idle timeout of a proxy in front (ui/serving.py).
serving.set_keep_alive(settings.keep_alive_s)
api = ApiClient(settings)
storage = LocalStorageClient(settings.storage_dir)
auth.ensure_auth_secret(settings.auth_secret_file)
add_file_route(chainlit_app, storage,
               owner_of=lambda key: db.element_owner(get_data_layer(), key))
chainlit_app.add_middleware(EmptyUploadGuard)
chainlit_app.add_middleware(auth.ClientAddress)
# Which pages may use a login (ui/origins.py): the UI's own and PHI3V_UI_ALLOWED_ORIGINS, over
# HTTP (CORS) and the websocket (engineio's Origin check, which Chainlit turns off).
origins.restrict_cors(chainlit_app, settings.allowed_origins)
chainlit_server.sio.eio.cors_allowed_origins = origins.socket_origin_check(
    settings.allowed_origins)
# Chainlit marks its cookies Secure only with SameSite=None (CHAINLIT_COOKIE_SAMESITE=none), which
# would send the login along with other sites' requests; the UI keeps Lax (ui/__main__.py) and
# sets Secure itself. The module reads the flag at each Set-Cookie.
if not hasattr(chainlit_cookie, "_cookie_secure"):  # a Chainlit upgrade renamed it
    raise RuntimeError("chainlit.auth.cookie has no _cookie_secure: PHI3V_UI_COOKIE_SECURE "
                       "cannot apply (ui/app.py)")
chainlit_cookie._cookie_secure = settings.cookie_secure


# --- helpers used by the handlers -------------------------------------------------------------
def apply_upload_limits(limits: ServerLimits) -> None:
    """Make the browser's upload gate (Chainlit's spontaneous_file_upload) the server's."""
    spec = images.upload_spec(limits)
    if chainlit_config.features.spontaneous_file_upload is None:
        chainlit_config.features.spontaneous_file_upload = SpontaneousFileUploadFeature(**spec)
    else:
        for key, value in spec.items():
            setattr(chainlit_config.features.spontaneous_file_upload, key, value)


async def server_limits() -> ServerLimits:
    """``GET /limits`` (cached), keeping the browser's upload gate in step."""
    limits = await api.limits()
    apply_upload_limits(limits)
    return limits


def _clamped(value, default, lo, hi, kind):
    try:
        return max(lo, min(hi, kind(float(value))))
    except (TypeError, ValueError):
        return default


def max_tokens_limit(limits: ServerLimits | None) -> int:
    """Largest maximum answer length a user may pick, tokens."""
    ceiling = settings.max_tokens_ceiling
    return min(ceiling, limits.max_model_len) if limits else ceiling


def default_window(limits: ServerLimits) -> int:
    """Default of 'Images re-sent': ``PHI3V_UI_HISTORY_MAX_IMAGES``, at most the server's
    images per request."""
    return min(settings.history_max_images, limits.max_images_per_request)


def chat_values(limits: ServerLimits) -> dict:
    """The chat's settings (Chainlit keeps them per session), validated; the order is the
    settings panel's."""
    values = cl.user_session.get("chat_settings") or {}
    prompt = values.get("system_prompt")
    return {
        "system_prompt": settings.default_system_prompt if prompt is None else str(prompt),
        "temperature": _clamped(values.get("temperature"), settings.default_temperature,
                                TEMPERATURE_MIN, TEMPERATURE_MAX, float),
        "max_tokens": _clamped(values.get("max_tokens"),
                               min(settings.default_max_tokens, max_tokens_limit(limits)),
                               1, max_tokens_limit(limits), int),
        "history_images": _clamped(values.get("history_images"), default_window(limits),
                                   0, limits.max_images_per_request, int),
        "num_crops": _clamped(values.get("num_crops"), limits.num_crops,
                              1, limits.max_num_crops, int),
    }


def settings_widgets(current: dict, limits: ServerLimits | None) -> list:
    """The chat settings panel: initial values ``current`` (this chat's), else the defaults,
    each stated in its description. Defaults come from the server's ``GET /limits`` where it
    has one (``limits``; ``None`` while the API does not answer), else from the UI's settings.
    num_crops stays the last slider (the browser tests move it by its position)."""
    crops, max_crops = (limits.num_crops, limits.max_num_crops) if limits else (1, 1)
    max_images = limits.max_images_per_request if limits else settings.history_max_images
    window = default_window(limits) if limits else settings.history_max_images
    tokens_limit = max_tokens_limit(limits)
    tokens = min(settings.default_max_tokens, tokens_limit)
    prompt = settings.default_system_prompt
    return [
        TextInput(id="system_prompt", label="System prompt", multiline=True,
                  initial=current.get("system_prompt", prompt), placeholder="None",
                  description="Sent first, as a system message, with every request of this "
                              f"chat; empty: none. Default: {prompt or 'none'}."),
        Slider(id="temperature", label="Temperature", min=TEMPERATURE_MIN,
               max=TEMPERATURE_MAX, step=0.1,
               initial=current.get("temperature", settings.default_temperature),
               description="Sampling randomness, 0 (always the likeliest token) to 2. "
                           f"Default {settings.default_temperature}."),
        NumberInput(id="max_tokens", label="Maximum answer length",
                    initial=current.get("max_tokens", tokens),
                    description=f"Longest answer, 1 to {tokens_limit} tokens (sent as "
                                f"max_tokens). Default {tokens}."),
        Slider(id="history_images", label=history.WINDOW_SETTING, min=0, max=max_images,
               step=1, initial=current.get("history_images", window),
               description="How many of the conversation's newest images each request "
                           "carries (at least those of the new message; the server takes at "
                           f"most {max_images}); older ones become a short note, and the "
                           f"answer says which images the model saw. Default {window}."),
        Slider(id="num_crops", label="num_crops", min=1, max=max_crops, step=1,
               initial=current.get("num_crops", crops),
               description=f"Phi-3-vision HD crops per image. Default {crops} (the server's); "
                           "sent as mm_processor_kwargs when changed."),
    ]


async def send_chat_settings() -> None:
    """The chat settings panel; initial values: this chat's (resume) or the defaults."""
    try:
        limits = await server_limits()
    except ApiError:
        limits = None
    await cl.ChatSettings(settings_widgets(cl.user_session.get("chat_settings") or {},
                                           limits)).send()


async def persist_chat_settings() -> None:
    """Write the chat's settings into its thread's metadata, where resuming it reads them
    back. Chainlit writes them there only when the browser's socket disconnects, which a UI
    that is killed or restarted never sees. Nothing before the thread exists (its first
    message creates it; the answer to it writes them)."""
    thread_id = cl.context.session.thread_id
    if await thread_author(thread_id) is None:
        return
    values = dict(cl.context.session.chat_settings or {})
    await get_data_layer().update_thread(thread_id, metadata={"chat_settings": values})


async def send_commands() -> None:
    """The composer's Export button (a Chainlit command)."""
    await cl.context.emitter.set_commands([{
        "id": EXPORT_COMMAND, "icon": "download", "button": True, "persistent": False,
        "description": "Download this conversation: Markdown, JSON (messages, settings, "
                       "SHA-256 of each image) and a zip with both and the images."}])


async def prepare_attachments(message: cl.Message, limits: ServerLimits
                              ) -> list[HistoryImage]:
    """Check and re-encode the message's files. Raises ImageRefused naming each bad file."""
    files = [el for el in message.elements or [] if el.path or el.content]
    images.check_count(len(files), limits)
    prepared, refused = [], []
    for el in files:
        raw = await asyncio.to_thread(Path(el.path).read_bytes) if el.path else el.content
        try:
            image = await asyncio.to_thread(
                images.prepare_image, el.name, raw, limits, settings.max_image_side_px,
                settings.jpeg_quality)
        except images.ImageRefused as exc:
            refused.append(exc.message)
            continue
        prepared.append(HistoryImage(image.name, image.data_url, element_id=el.id))
    if refused:
        raise images.ImageRefused("\n".join(refused))
    return prepared


async def stored_key(img: HistoryImage) -> str | None:
    """Where the original of ``img`` is stored: its object key, or the one the data layer
    gave the element of an upload of this session."""
    if img.object_key is None and img.element_id:
        el = await get_data_layer().get_element(cl.context.session.thread_id, img.element_id)
        img.object_key = (el or {}).get("objectKey")
    return img.object_key


async def load_persisted_image(img: HistoryImage, limits: ServerLimits) -> str | None:
    """The data URL of a stored image (a resumed chat's, or an upload whose bytes were
    dropped from memory); None if gone or refused."""
    key = await stored_key(img)
    if not key:
        return None
    try:
        raw = await storage.read_file(key)
        prepared = await asyncio.to_thread(images.prepare_image, img.name, raw, limits,
                                           settings.max_image_side_px, settings.jpeg_quality)
    except (OSError, ValueError, images.ImageRefused) as exc:
        log.warning("cannot reload %s: %s", key, exc)
        return None
    return prepared.data_url


def regenerate_action() -> cl.Action:
    return cl.Action(name=REGENERATE_ACTION, payload={}, icon="refresh-cw",
                     tooltip="Regenerate")


async def withdraw_regenerate() -> None:
    """Take the Regenerate action off the answer that has it (a newer message arrived)."""
    action = cl.user_session.get("regenerate_action")
    if action is not None:
        cl.user_session.set("regenerate_action", None)
        await action.remove()


async def offer_regenerate(msg: cl.Message) -> None:
    """Put the Regenerate action on ``msg`` (the newest answer) only."""
    await withdraw_regenerate()
    action = regenerate_action()
    msg.actions = [action]
    cl.user_session.set("regenerate_action", action)


async def finish_answer(msg: cl.Message, stats: AnswerStats, in_history: bool,
                        seen: str | None) -> None:
    """Put the statistics (and ``seen``, the line saying which images the model saw) under
    the answer, in an element of their own: the message's content stays the answer alone,
    which Chainlit's Copy copies. Persist it (ends the stream)."""
    answer = msg.content
    if in_history:  # what conversation_from_thread and exports read back
        record = {"answer": answer, "stats": stats.to_dict()}
        if seen:
            record["images_seen"] = seen
        msg.metadata = {ANSWER_KEY: record}
        await offer_regenerate(msg)
    lines = [stats.line()] + ([seen] if seen else [])
    msg.elements = [cl.CustomElement(name=STATS_ELEMENT, props={"lines": lines},
                                     display="inline")]
    await msg.send()
    if in_history:
        await persist_chat_settings()


async def stream_answer(body: dict, conversation: Conversation, seen: str | None) -> None:
    """Stream one answer into a new message and record it in ``conversation``: the answer
    (also a stopped one) becomes the assistant turn; a failed request drops the user turn."""
    msg = cl.Message(content="")
    stats = AnswerStats()
    batcher = TokenBatcher()  # fewer page updates than tokens (ui/throttle.py)
    events = api.stream_chat(body, user=cl.context.session.user.identifier,
                             conversation=cl.context.session.thread_id)
    try:
        # aclosing: a Stop that cancels this task while it awaits the page (stream_token),
        # not the stream, must still close the stream here, in this task: left to the
        # garbage collector, the HTTP request stayed open and vLLM kept generating.
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    if isinstance(event, Token):
                        stats.on_token()
                        piece = batcher.add(event.text)
                        if piece:
                            await msg.stream_token(piece)
                    elif isinstance(event, Usage):
                        stats.on_usage(event.usage)
            finally:  # however it ended, the answer holds every token (finish_answer sends it)
                msg.content += batcher.rest()
    except ApiError as exc:
        conversation.pop_unanswered()
        if stats.chunks:  # failed mid-answer: keep what the user saw, out of the history
            await finish_answer(msg, stats, in_history=False, seen=seen)
        await cl.ErrorMessage(content=exc.message).send()
        return
    except asyncio.CancelledError:  # Stop: leaving the stream closed the HTTP request
        stats.stopped = True
        conversation.add(Turn("assistant", msg.content, message_id=msg.id))
        await finish_answer(msg, stats, in_history=True, seen=seen)
        raise
    conversation.add(Turn("assistant", msg.content, message_id=msg.id))
    await finish_answer(msg, stats, in_history=True, seen=seen)


async def answer(conversation: Conversation, current_images: int) -> None:
    """Send the conversation, which ends with a user turn carrying ``current_images``
    images, with the chat's settings, and stream the answer (:func:`stream_answer`)."""
    try:
        limits = await server_limits()
    except ApiError as exc:
        conversation.pop_unanswered()
        await cl.ErrorMessage(content=exc.message).send()
        return
    chat = chat_values(limits)
    keep = history.window_size(chat["history_images"], current_images,
                               limits.max_images_per_request)
    await conversation.fill(keep, lambda img: load_persisted_image(img, limits))
    seen = history.images_seen_line(*conversation.images_seen(keep), keep,
                                    limits.max_images_per_request)
    body = {"model": settings.model or limits.model,
            "messages": conversation.messages(keep, chat["system_prompt"]),
            "temperature": chat["temperature"], "max_tokens": chat["max_tokens"]}
    if chat["num_crops"] != limits.num_crops:
        body["mm_processor_kwargs"] = {"num_crops": chat["num_crops"]}
    try:
        await stream_answer(body, conversation, seen)
    finally:
        conversation.trim(keep)


async def send_export() -> None:
    """Answer the Export command with the conversation's files, built from the stored thread
    (:mod:`ui.export`): conversation.md, conversation.json, conversation.zip."""
    thread = await get_data_layer().get_thread(cl.context.session.thread_id)
    if not thread or not history.answered_steps(thread):
        await cl.Message(content="Nothing to export yet: this conversation has no answer.",
                         metadata={"command": EXPORT_COMMAND}).send()
        return
    try:
        values = chat_values(await server_limits())
    except ApiError:  # the settings as stored, unvalidated
        values = dict(cl.user_session.get("chat_settings") or {})
    stored = {}
    for el in export.image_elements_of(thread):
        try:
            stored[el["id"]] = await storage.read_file(el.get("objectKey") or "")
        except (OSError, ValueError):
            stored[el["id"]] = None
    files = export.build(thread, values, stored)
    count, pictures = len(files.document["messages"]), len(files.files)
    await cl.Message(
        content=f"This conversation as files ({count} messages, {pictures} "
                f"image{'' if pictures == 1 else 's'}): Markdown, JSON (messages, settings, "
                "SHA-256 of each image) and a zip with both and the images.",
        metadata={"command": EXPORT_COMMAND},
        elements=[
            cl.File(name=export.MARKDOWN_NAME, content=files.markdown().encode(),
                    mime="text/markdown", display="inline"),
            cl.File(name=export.JSON_NAME, content=files.json_text().encode(),
                    mime="application/json", display="inline"),
            cl.File(name=export.ZIP_NAME, content=files.zip_bytes(), mime="application/zip",
                    display="inline"),
        ]).send()


# --- handlers ---------------------------------------------------------------------------------
class DataLayer(SQLAlchemyDataLayer):
    """Chainlit's SQLAlchemy data layer, with two changes to what it stores.

    - A custom element (the statistics under each answer, :data:`STATS_ELEMENT`) is stored as
      its row and props only. Chainlit would also write its props as a file into storage, one
      per answer, which the browser never reads (it renders the element from its props) and
      which would count towards the user's storage quota.
    - ``delete_step`` also deletes the stored files of the removed message's elements.
      Chainlit's deletes only their rows, which left the images of messages an edit removes on
      disk for good.
    """

    async def create_element(self, element):
        if element.type != "custom" or not element.for_id:
            return await super().create_element(element)
        row = {k: v for k, v in element.to_dict().items() if v is not None}
        row["props"] = json.dumps(row.get("props") or {})
        columns = ", ".join(f'"{c}"' for c in row)
        updates = ", ".join(f'"{c}" = :{c}' for c in row if c != "id")
        await self.execute_sql(
            f"INSERT INTO elements ({columns}) VALUES ({', '.join(f':{c}' for c in row)}) "
            f"ON CONFLICT (id) DO UPDATE SET {updates}", row)

    async def delete_step(self, step_id: str):
        if cl.context.session.has_first_interaction:  # else Chainlit queues the deletion
            rows = await self.execute_sql(
                'SELECT "objectKey" AS key FROM elements WHERE "forId" = :id '
                'AND "objectKey" IS NOT NULL', {"id": step_id})
            for row in rows if isinstance(rows, list) else []:
                await storage.delete_file(row["key"])
        return await super().delete_step(step_id)


@cl.data_layer
def data_layer() -> SQLAlchemyDataLayer:
    return DataLayer(conninfo=settings.database_url, storage_provider=storage)


@cl.on_app_startup
async def on_startup() -> None:
    try:
        await server_limits()
    except ApiError as exc:  # the API may start after the UI (make demo): retried per chat
        log.warning("GET /limits failed at start (%s); upload limits from config.toml until "
                    "the API answers", exc.message)


@cl.on_app_shutdown
async def on_shutdown() -> None:
    await api.aclose()


def register_login() -> None:
    """Register the Chainlit login callback of ``settings.accounts`` (:mod:`ui.auth`)."""
    if settings.accounts == "demo":
        @cl.password_auth_callback
        async def demo_login(username: str, password: str) -> cl.User | None:
            if auth.check_password(settings, username, password):
                return cl.User(identifier=username, metadata={"provider": "demo"})
            return None
    elif settings.accounts == "users-file":
        accounts = Accounts(UsersFile(settings.users_file),
                            LoginLimiter(settings.login_max_failures, settings.login_window_s))

        # One Argon2 check holds ~64 MiB for ~0.1 s: at most ARGON2_CONCURRENCY at once, so a
        # flood of logins waits instead of exhausting the UI's memory.
        checks = asyncio.Semaphore(ARGON2_CONCURRENCY)

        @cl.password_auth_callback
        async def file_login(username: str, password: str) -> cl.User | None:
            address = auth.client_key(auth.CLIENT_ADDRESS.get())
            async with checks:
                ok = await asyncio.to_thread(accounts.login, username, password, address)
            if ok:
                return cl.User(identifier=username, metadata={"provider": "users-file"})
            log.warning("login refused for %r from %s", username[:64], address)
            return None
    elif settings.accounts == "header":
        @cl.header_auth_callback
        async def header_login(headers) -> cl.User | None:
            address = auth.CLIENT_ADDRESS.get()
            name = auth.header_user(headers, address, settings)
            if name is None:
                log.warning("header login refused from %s", address)
                return None
            return cl.User(identifier=name, metadata={"provider": "header"})
    else:  # oauth: Chainlit raises at start, naming the variables, when no provider is set
        @cl.oauth_callback
        async def oauth_login(provider_id: str, token: str, raw_user_data: dict,
                              default_user: cl.User, id_token: str | None = None
                              ) -> cl.User | None:
            if not auth.oauth_allowed(default_user.identifier, settings.oauth_allowed):
                log.warning("OAuth login of %r (%s) is not in PHI3V_UI_OAUTH_ALLOWED",
                            default_user.identifier, provider_id)
                return None
            # Scoped by provider: the same e-mail at another provider is another account.
            return cl.User(identifier=f"{provider_id}:{default_user.identifier}",
                           metadata={**default_user.metadata, "provider": provider_id})


async def thread_author(thread_id: str) -> str | None:
    """The identifier of the user who owns the thread (None: no such thread)."""
    try:
        return await get_data_layer().get_thread_author(thread_id)
    except ValueError:
        return None


async def thread_author_or_404(username: str, thread_id: str) -> bool:
    """Chainlit's thread ownership check (``chainlit.data.acl.is_thread_author``), answering
    another user's thread like a missing one: 404 (Chainlit's own says 401 "Unauthorized",
    which tells that the thread exists; for a missing one it fails with a 500)."""
    if await thread_author(thread_id) != username:
        raise HTTPException(status_code=404, detail="Not found")
    return True


async def socket_user(environ: dict) -> str | None:
    """The identifier of the user whose login cookie a socket handshake carries, or None."""
    token = get_token_from_cookies(cookie_parser(environ.get("HTTP_COOKIE", "")))
    try:
        user = await get_current_user(token=token) if token else None
    except HTTPException:  # a token that does not verify
        return None
    return user.identifier if user else None


register_login()
# Every route of Chainlit's server that takes a thread or element id checks its owner here.
chainlit_server.is_thread_author = thread_author_or_404
chainlit_connect = chainlit_server.sio.handlers["/"]["connect"]


@chainlit_server.sio.on("connect")
async def connect(sid: str, environ: dict, auth: dict | None):
    """Chainlit's socket connect, with another user's thread (the URL ``/thread/<id>``)
    opened like a missing one. Chainlit refuses such a handshake, which tells that the
    thread exists and leaves the page saying "Could not reach the server" until a reload; a
    missing thread opens a new chat. So the foreign id is swapped for a new random one that
    names no thread, and Chainlit takes its path for a missing thread: a new chat of the
    user's own, nothing of the other thread read or written."""
    thread_id = (auth or {}).get("threadId")
    if thread_id:
        author = await thread_author(thread_id)
        if author is not None and author != await socket_user(environ):
            auth = {**auth, "threadId": str(uuid.uuid4())}
    return await chainlit_connect(sid, environ, auth)


async def quota_refusal(message: cl.Message) -> str | None:
    """The refusal of a message whose images would pass the user's storage quota (and its
    images, already stored by Chainlit, removed again), or None."""
    files = [el for el in message.elements or [] if el.path]
    if not settings.user_quota_bytes or not files:
        return None
    user = cl.context.session.user
    stored = await db.user_elements(get_data_layer(), user.identifier)
    mine = {el.id for el in files}
    used = sum(storage.size(key) for eid, key in stored.items() if eid not in mine)
    incoming = sum(Path(el.path).stat().st_size for el in files)
    refusal = uploads.quota_refusal(used, incoming, settings.user_quota_bytes)
    if refusal:
        for _ in range(50):  # Chainlit stores the message's files in a task of its own
            if mine <= set(await db.user_elements(get_data_layer(), user.identifier)):
                break
            await asyncio.sleep(0.1)
        for el in files:
            await el.remove()
    return refusal


@cl.on_chat_start
async def on_chat_start() -> None:
    cl.user_session.set("conversation", Conversation())
    await send_chat_settings()
    await send_commands()


def newest_message_id(thread: cl.types.ThreadDict) -> str | None:
    """Id of the thread's newest message step."""
    messages = [s for s in thread.get("steps") or [] if s.get("type") in
                ("user_message", "assistant_message")]
    return max(messages, key=lambda s: s.get("createdAt") or "")["id"] if messages else None


@cl.on_chat_resume
async def on_chat_resume(thread: cl.types.ThreadDict) -> None:
    conversation = history.conversation_from_thread(thread)
    cl.user_session.set("conversation", conversation)
    await send_chat_settings()
    await send_commands()
    # Regenerate stays on the newest answer while nothing came after it (as in a live chat).
    # Sent before Chainlit replays the thread to the browser, which keeps the action.
    last = conversation.last_answer_id
    if last and last == newest_message_id(thread):
        action = regenerate_action()
        await action.send(for_id=last)
        cl.user_session.set("regenerate_action", action)


@cl.on_settings_update
async def on_settings_update(values: dict) -> None:
    await persist_chat_settings()


@cl.on_stop
async def on_stop() -> None:
    # Chainlit has already cancelled the task running on_message (or the regeneration):
    # stream_answer leaves the httpx stream, the connection closes, and the API aborts the
    # request in vLLM.
    log.info("answer stopped by the user")


async def accepted_images(message: cl.Message) -> list[HistoryImage] | None:
    """The images of a new message, checked against the storage quota and the server's
    limits and re-encoded; None when refused (the reason is in the chat)."""
    refusal = await quota_refusal(message)
    if refusal:
        await cl.ErrorMessage(content=refusal).send()
        return None
    try:
        return await prepare_attachments(message, await server_limits())
    except ApiError as exc:
        await cl.ErrorMessage(content=exc.message).send()
    except images.ImageRefused as exc:
        await cl.ErrorMessage(content=f"Not sent. {exc.message}").send()
    return None


@cl.on_message
async def on_message(message: cl.Message) -> None:
    """A new message, a command, or an edited message. Chainlit's edit_message handler has
    removed the messages after an edited one and calls this with the same message, whose
    elements it may not carry (a resumed chat): its turn's images are reused instead, and the
    quota check, which would remove the message's stored images on a refusal, is skipped."""
    # Chainlit's edit_message awaits on_message in its socket handler, not in the session's
    # current_task, so Stop would not reach an edited message's answer (chainlit/socket.py,
    # edit_message; client_message runs process_message as current_task).
    cl.context.session.current_task = asyncio.current_task()
    await withdraw_regenerate()
    if message.command == EXPORT_COMMAND:
        await send_export()
        return
    conversation: Conversation = cl.user_session.get("conversation")
    conversation.retain({m.id for m in chat_context.get()})
    edited = conversation.take_for_edit(message.id)
    if edited is not None:
        found = edited.images
    else:
        found = await accepted_images(message)
        if found is None:
            return
    conversation.add(Turn("user", message.content, found, message_id=message.id))
    await answer(conversation, len(found))


@cl.action_callback(REGENERATE_ACTION)
async def on_regenerate(action: cl.Action) -> None:
    """Replace the newest answer with a new one to the same messages and images, with the
    chat's settings. Runs as the session's current task, so Stop ends it like any answer
    (Chainlit runs action callbacks in the HTTP request, outside that task)."""
    conversation: Conversation = cl.user_session.get("conversation")
    old = next((m for m in chat_context.get() if m.id == action.forId), None)
    if old is None or not conversation.pop_answer(action.forId):
        await cl.context.emitter.send_toast("Only the newest answer can be regenerated.",
                                            "warning")
        return
    cl.user_session.set("regenerate_action", None)
    await old.remove()
    asker = conversation.turns[-1]
    cl.context.session.current_task = asyncio.create_task(regenerate(conversation, asker))


async def regenerate(conversation: Conversation, asker: Turn) -> None:
    """The new answer to ``asker`` (the conversation's last turn), in an ``on_message`` run
    under that message as Chainlit makes for a message: the browser then places it there and
    gives it the Copy button of answers."""
    await cl.context.emitter.task_start()
    try:
        async with cl.Step(name="on_message", type="run", parent_id=asker.message_id):
            await answer(conversation, len(asker.images))
    except asyncio.CancelledError:  # Stop: the answer is kept, marked stopped
        pass
    finally:
        await cl.context.emitter.task_end()
