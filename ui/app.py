"""Chainlit chat UI for the Phi-3-vision API: the decorated handlers, nothing else.

Run with ``python -m ui`` (``make ui``). The UI talks to the API only over HTTP
(:mod:`ui.api`): ``GET /limits`` for the image limits, ``POST /v1/chat/completions`` streamed.
Helpers, one job each: image intake (:mod:`ui.images`), history and its old-image policy
(:mod:`ui.history`), readable errors (:mod:`ui.errors`), per-answer statistics
(:mod:`ui.stats`), persisted images (:mod:`ui.storage`), database schema (:mod:`ui.db`), login
(:mod:`ui.auth`), which pages may use a login (:mod:`ui.origins`), settings
(:mod:`ui.settings`). Design notes: ``ui/README.md``.
"""

from __future__ import annotations

import asyncio
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
from chainlit.config import SpontaneousFileUploadFeature
from chainlit.config import config as chainlit_config
from chainlit.data import get_data_layer
from chainlit.data.sql_alchemy import SQLAlchemyDataLayer
from chainlit.input_widget import NumberInput, Slider
from chainlit.server import app as chainlit_app
from fastapi import HTTPException
from starlette.requests import cookie_parser

from ui import auth, db, history, images, origins, serving, uploads
from ui.api import ApiClient, ServerLimits, Token, Usage
from ui.errors import ApiError
from ui.history import ANSWER_KEY, Conversation, HistoryImage, Turn
from ui.settings import UISettings
from ui.stats import AnswerStats
from ui.storage import LocalStorageClient, add_file_route
from ui.uploads import EmptyUploadGuard
from ui.users import Accounts, LoginLimiter, UsersFile

#: Argon2 verifications run at once (each ~64 MiB of memory, ~0.1 s of one core).
ARGON2_CONCURRENCY = 2
#: OpenAI's temperature range.
TEMPERATURE_MIN, TEMPERATURE_MAX = 0.0, 2.0

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


def chat_values(limits: ServerLimits) -> dict:
    """The chat's settings (Chainlit keeps them per session), validated."""
    values = cl.user_session.get("chat_settings") or {}
    return {
        "temperature": _clamped(values.get("temperature"), settings.default_temperature,
                                TEMPERATURE_MIN, TEMPERATURE_MAX, float),
        "max_tokens": _clamped(values.get("max_tokens"), settings.default_max_tokens,
                               1, settings.max_tokens_ceiling, int),
        "num_crops": _clamped(values.get("num_crops"), limits.num_crops,
                              1, limits.max_num_crops, int),
    }


async def send_chat_settings() -> None:
    """The chat settings panel; initial values: this chat's (resume) or the defaults."""
    current = cl.user_session.get("chat_settings") or {}
    try:
        limits = await server_limits()
        default_crops, max_crops = limits.num_crops, limits.max_num_crops
    except ApiError:
        default_crops, max_crops = 1, 1
    await cl.ChatSettings([
        Slider(id="temperature", label="Temperature", min=TEMPERATURE_MIN,
               max=TEMPERATURE_MAX, step=0.1,
               initial=current.get("temperature", settings.default_temperature)),
        NumberInput(id="max_tokens", label="Max tokens",
                    initial=current.get("max_tokens", settings.default_max_tokens),
                    description=f"Longest answer, 1 to {settings.max_tokens_ceiling} tokens."),
        Slider(id="num_crops", label="num_crops", min=1, max=max_crops, step=1,
               initial=current.get("num_crops", default_crops),
               description=f"Phi-3-vision HD crops per image (server default {default_crops}); "
                           "sent as mm_processor_kwargs when changed."),
    ]).send()


async def prepare_attachments(message: cl.Message, limits: ServerLimits
                              ) -> list[images.PreparedImage]:
    """Check and re-encode the message's files. Raises ImageRefused naming each bad file."""
    files = [el for el in message.elements or [] if el.path or el.content]
    images.check_count(len(files), limits)
    prepared, refused = [], []
    for el in files:
        raw = await asyncio.to_thread(Path(el.path).read_bytes) if el.path else el.content
        try:
            prepared.append(await asyncio.to_thread(
                images.prepare_image, el.name, raw, limits, settings.max_image_side_px,
                settings.jpeg_quality))
        except images.ImageRefused as exc:
            refused.append(exc.message)
    if refused:
        raise images.ImageRefused("\n".join(refused))
    return prepared


async def load_persisted_image(img: HistoryImage, limits: ServerLimits) -> str | None:
    """The data URL of a stored image of a resumed chat (None if gone or refused)."""
    if not img.object_key:
        return None
    try:
        raw = await storage.read_file(img.object_key)
        prepared = await asyncio.to_thread(images.prepare_image, img.name, raw, limits,
                                           settings.max_image_side_px, settings.jpeg_quality)
    except (OSError, ValueError, images.ImageRefused) as exc:
        log.warning("cannot reload %s: %s", img.object_key, exc)
        return None
    return prepared.data_url


async def finish_answer(msg: cl.Message, stats: AnswerStats, in_history: bool) -> None:
    """Put the statistics under the answer and persist it (ends the stream)."""
    answer = msg.content
    if in_history:  # what conversation_from_thread reads back on resume
        msg.metadata = {ANSWER_KEY: {"answer": answer, "stats": stats.to_dict()}}
    msg.content = f"{answer}\n\n{stats.footer()}" if answer else stats.footer()
    await msg.send()


async def stream_answer(body: dict, conversation: Conversation) -> None:
    """Stream one answer into a new message and record it in ``conversation``: the answer
    (also a stopped one) becomes the assistant turn; a failed request drops the user turn."""
    msg = cl.Message(content="")
    stats = AnswerStats()
    try:
        async for event in api.stream_chat(body, user=cl.context.session.user.identifier,
                                           conversation=cl.context.session.thread_id):
            if isinstance(event, Token):
                stats.on_token()
                await msg.stream_token(event.text)
            elif isinstance(event, Usage):
                stats.on_usage(event.usage)
    except ApiError as exc:
        conversation.pop_unanswered()
        if stats.chunks:  # failed mid-answer: keep what the user saw, out of the history
            await finish_answer(msg, stats, in_history=False)
        await cl.ErrorMessage(content=exc.message).send()
        return
    except asyncio.CancelledError:  # Stop: leaving the stream closed the HTTP request
        stats.stopped = True
        conversation.add(Turn("assistant", msg.content))
        await finish_answer(msg, stats, in_history=True)
        raise
    conversation.add(Turn("assistant", msg.content))
    await finish_answer(msg, stats, in_history=True)


# --- handlers ---------------------------------------------------------------------------------
@cl.data_layer
def data_layer() -> SQLAlchemyDataLayer:
    return SQLAlchemyDataLayer(conninfo=settings.database_url, storage_provider=storage)


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


@cl.on_chat_resume
async def on_chat_resume(thread: cl.types.ThreadDict) -> None:
    cl.user_session.set("conversation", history.conversation_from_thread(thread))
    await send_chat_settings()


@cl.on_stop
async def on_stop() -> None:
    # Chainlit has already cancelled the task running on_message: stream_answer leaves the
    # httpx stream, the connection closes, and the API aborts the request in vLLM.
    log.info("answer stopped by the user")


@cl.on_message
async def on_message(message: cl.Message) -> None:
    conversation: Conversation = cl.user_session.get("conversation")
    refusal = await quota_refusal(message)
    if refusal:
        await cl.ErrorMessage(content=refusal).send()
        return
    try:
        limits = await server_limits()
        prepared = await prepare_attachments(message, limits)
    except ApiError as exc:
        await cl.ErrorMessage(content=exc.message).send()
        return
    except images.ImageRefused as exc:
        await cl.ErrorMessage(content=f"Not sent. {exc.message}").send()
        return
    keep = history.window_size(settings.history_max_images, len(prepared),
                               limits.max_images_per_request)
    conversation.add(Turn("user", message.content,
                          [HistoryImage(p.name, p.data_url) for p in prepared]))
    await conversation.fill(keep, lambda img: load_persisted_image(img, limits))
    chat = chat_values(limits)
    body = {"model": settings.model or limits.model, "messages": conversation.messages(keep),
            "temperature": chat["temperature"], "max_tokens": chat["max_tokens"]}
    if chat["num_crops"] != limits.num_crops:
        body["mm_processor_kwargs"] = {"num_crops": chat["num_crops"]}
    try:
        await stream_answer(body, conversation)
    finally:
        conversation.trim(keep)
