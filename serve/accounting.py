"""Tenant limits and usage in the request path: the quota layer (after the intake, before
admission), the per-tenant series, the usage store and ``GET /admin/usage``.

**The layer** (:class:`QuotaMiddleware`), on the generation routes: the request's tenant
(``serve.tenants.TENANT_SCOPE_KEY``, set by auth; absent: ``ANONYMOUS``) and its prompt
tokens as the intake estimated them (image tokens included) go to :meth:`Quota.check
<serve.quota.Quota.check>`. Over a limit: 429, ``Retry-After`` (left out where the request
alone exceeds the limit), ``X-Phi3v-Reject-Reason`` naming the limit, and an OpenAI-style
error whose ``code`` is ``<limit>_exceeded`` (``tokens_per_minute_exceeded``) and whose
message names the tenant's limit and value. Else the request counts as started (queued at
admission included, so ``max_concurrent`` holds queued requests) until its answer ends.

**What a request costs**: vLLM's own count of its prompt and completion tokens (the access
record's, :func:`serve.logs.vllm_usage`; the prompt includes the image tokens). Where vLLM
reports none for a request it served (the Responses API, a client that left before the end),
the intake's prompt estimate, and the answer tokens admission saw go out (``answer_tokens``
on the request's state: a streamed answer's token events, a whole body's own ``usage``). A
request admission refused costs nothing.

**Per request**, once its answer ended, on its tenant's series (``serve.metrics``) and today's
row in the usage store (``serve.usage``; per user for a trusted front end): one request, its
tokens (prompt, completion, and image tokens: the intake's count), a refusal with its reason
(a tenant limit here, or admission's 429 reason), and a good request when admission judged it
good (goodput, noted on the request's state as ``goodput``).

**``GET /admin/usage?since=YYYY-MM-DD&tenant=NAME``** (an admin tenant; auth answers 403 to
others, and so does the handler): the usage store's totals per tenant and UTC day from
``since`` (default: the first of the current month) on, with each user of a trusted front end
(:meth:`serve.usage.UsageStore.report`).

Limits and usage are per replica: each API process counts its own requests in its own store.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Iterable, Iterator
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.admission.limiter import REJECT_REASONS
from serve.asgi import PROMPT_TOKENS_SCOPE_KEY, REQUEST_STATE_KEY, response_channel
from serve.errors import error_body, openai_error
from serve.logs import note, vllm_usage
from serve.metrics import Metrics
from serve.quota import Quota, Refusal, Ticket, utc_day
from serve.routes import GENERATION_ROUTES
from serve.settings import Settings
from serve.tenants import ANONYMOUS, TENANT_SCOPE_KEY, USER_SCOPE_KEY, Tenant
from serve.usage import IN_MEMORY, UsageStore, month_start

#: The usage store's file next to the keys file (``--usage-db``'s default with a keys file).
DEFAULT_USAGE_DB_NAME = "usage.sqlite3"


def usage_db_path(settings: Settings) -> str:
    """``--usage-db``, or its default: :data:`DEFAULT_USAGE_DB_NAME` next to ``--keys-file``
    when one is given, else in memory."""
    if settings.usage_db is not None:
        return str(settings.usage_db)
    if settings.keys_file is not None:
        return str(Path(settings.keys_file).parent / DEFAULT_USAGE_DB_NAME)
    return IN_MEMORY


def start_tenants(settings: Settings) -> list[Tenant]:
    """The tenants known at start, whose series exist from the first scrape: the keys file's,
    and ``default`` (:data:`~serve.tenants.ANONYMOUS`) when it can be a request's tenant (no
    keys file, or plain ``--api-keys``). Tenants added to the keys file later appear at
    their first request."""
    tenants: dict[str, Tenant] = {}
    if settings.keys_file is not None:
        from serve.keys import KeysFile, KeysFileError

        with contextlib.suppress(KeysFileError):  # auth reports it
            tenants.update(KeysFile.read(settings.keys_file).tenants)
    if settings.keys_file is None or settings.api_keys or settings.api_key_file:
        tenants.setdefault(ANONYMOUS.name, ANONYMOUS)
    return list(tenants.values())


def refusal_response(refusal: Refusal) -> Response:
    """The 429 of a request over a tenant limit (module docstring)."""
    body = error_body(429, refusal.message, "rate_limit_exceeded")
    body["error"]["code"] = refusal.code
    headers = {"X-Phi3v-Reject-Reason": refusal.limit}
    if refusal.retry_after_s is not None:
        headers["Retry-After"] = str(refusal.retry_after_s)
    return JSONResponse(body, status_code=429, headers=headers)


class Accounting:
    """Tenant limits and usage of one API process (module docstring).

    Args:
        quota: the per-tenant counts (its day and month totals are seeded here from
            ``store``).
        store: the usage store.
        metrics: where the ``phi3v_tenant_*`` series are.
        tenants: the tenants known at start (:func:`start_tenants`).
    """

    def __init__(self, quota: Quota, store: UsageStore, metrics: Metrics,
                 tenants: Iterable[Tenant] = ()) -> None:
        self.quota = quota
        self.store = store
        self.metrics = metrics
        #: Every tenant seen, by name: its latest definition (the keys file reloads).
        self.tenants: dict[str, Tenant] = {}
        metrics.tenants.budgets = self.budgets
        today = utc_day(quota.clock())
        day, month = store.tokens_since(today), store.tokens_since(month_start(today))
        for name, tokens in month.items():
            quota.seed(name, day.get(name, 0), tokens)
        for tenant in tenants:
            self.know(tenant)

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics,
                      tenants: Iterable[Tenant] | None = None) -> Accounting:
        """The accounting of ``settings`` (the store at :func:`usage_db_path`)."""
        store = UsageStore(usage_db_path(settings))
        return cls(Quota(), store, metrics,
                   start_tenants(settings) if tenants is None else tenants)

    def know(self, tenant: Tenant) -> None:
        """Keep ``tenant``'s latest definition (on first sight its series appear at 0)."""
        self.metrics.tenants.add_tenant(tenant.name)
        self.tenants[tenant.name] = tenant

    def budgets(self) -> Iterator[tuple[str, str, float]]:
        """``phi3v_tenant_budget_used_ratio``: ``(tenant, period, ratio)`` of each budget
        (read at scrape time)."""
        for name, tenant in list(self.tenants.items()):
            for period in ("day", "month"):
                ratio = self.quota.budget_used(tenant, period)
                if ratio is not None:
                    yield name, period, ratio

    # --- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start writing usage (the store's writer thread)."""
        self.store.start()

    def close(self) -> None:
        """Write the rest and close the store (blocking: run it in a thread)."""
        self.store.close()

    # --- the request path -------------------------------------------------------------------
    def wrap(self, app: ASGIApp) -> QuotaMiddleware:
        """``app`` behind the quota layer."""
        return QuotaMiddleware(app, self)

    def admit(self, tenant: Tenant, prompt_tokens: int) -> Refusal | Ticket:
        """A request of ``tenant`` arrives: the refusal of its limits, or its ticket."""
        if self.tenants.get(tenant.name) is not tenant:
            self.know(tenant)
        refusal = self.quota.check(tenant, prompt_tokens)
        if refusal is not None:
            return refusal
        return self.quota.started(tenant, prompt_tokens)

    def count(self, tenant: str, user: str, *, prompt: int = 0, completion: int = 0,
              image: int = 0, good: bool = False, refusal: str | None = None) -> None:
        """Count one request of ``tenant`` (module docstring) on its series and in the store."""
        self.metrics.tenants.count(tenant, prompt, completion, image, good, refusal)
        self.store.add(tenant, user, requests=1, prompt_tokens=prompt,
                       completion_tokens=completion, image_tokens=image,
                       good_requests=int(good), refusal=refusal)

    def finish(self, ticket: Ticket, scope: Scope, estimate: int, user: str) -> None:
        """The request of ``ticket`` ended: bill it (module docstring) and count it."""
        state = scope.get(REQUEST_STATE_KEY) or {}
        reason = state.get("reject_reason")
        prompt, completion = vllm_usage(scope)
        # Admission notes the queue wait of a request it admitted (and of one it refused,
        # with the reason): admitted and served means the engine read the prompt.
        served = "queue_wait_s" in state and reason is None
        if prompt is None:
            prompt = estimate if served and state.get("status", 200) == 200 else 0
        if completion is None:
            completion = state.get("answer_tokens") or 0
        self.quota.finished(ticket, prompt, completion)
        self.count(ticket.tenant, user, prompt=prompt, completion=completion,
                   image=int(state.get("image_tokens") or 0) if prompt else 0,
                   good=bool(state.get("goodput")),
                   refusal=reason if reason in REJECT_REASONS else None)

    # --- GET /admin/usage -------------------------------------------------------------------
    async def usage_page(self, request: Request) -> Response:
        """``GET /admin/usage?since=YYYY-MM-DD&tenant=NAME`` (module docstring): 403 for a
        tenant that is not admin, 400 for a ``since`` that is not a date."""
        if not request.scope.get(TENANT_SCOPE_KEY, ANONYMOUS).admin:
            return openai_error(403, "GET /admin/usage needs an admin tenant's API key.",
                                type_="permission_error")
        since_text = request.query_params.get("since")
        if since_text is None:
            since = month_start(utc_day(self.quota.clock()))
        else:
            try:
                since = datetime.date.fromisoformat(since_text)
            except ValueError:
                return openai_error(400, "'since' must be a date, YYYY-MM-DD.", param="since")
        report = await asyncio.to_thread(self.store.report, since,
                                         request.query_params.get("tenant"))
        return JSONResponse({**report, "persistent": self.store.persistent})


class QuotaMiddleware:
    """The quota layer of the generation routes (module docstring)."""

    def __init__(self, app: ASGIApp, accounting: Accounting) -> None:
        self.app = app
        self.accounting = accounting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope.get("path") not in GENERATION_ROUTES):
            await self.app(scope, receive, send)
            return
        tenant = scope.get(TENANT_SCOPE_KEY) or ANONYMOUS
        user = (scope.get(USER_SCOPE_KEY) or "") if tenant.trusted_frontend else ""
        estimate = int(scope.get(PROMPT_TOKENS_SCOPE_KEY) or 0)
        admitted = self.accounting.admit(tenant, estimate)
        if isinstance(admitted, Refusal):
            note(reject_reason=admitted.limit)  # the access record
            self.accounting.count(tenant.name, user, refusal=admitted.limit)
            await refusal_response(admitted)(scope, receive, send)
            return
        channel = response_channel(send, scope)
        # Billed when the answer ends (its last message sent), before its client's next request.
        channel.on_end(lambda failed: self.accounting.finish(admitted, scope, estimate, user))
        try:
            await self.app(scope, receive, channel)
        except BaseException:
            channel.end(failed=True)
            raise
        channel.end()  # no-op after the last message: for an answer its client left
