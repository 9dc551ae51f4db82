"""Who a request belongs to: the tenant of its API key, with the tenant's weight in fair
admission and its limits. The keys file that maps keys to tenants is :mod:`serve.keys`.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.admission.fair import DEFAULT_TENANT

#: ASGI scope key of the request's :class:`Tenant` (set by auth; absent: :data:`ANONYMOUS`).
TENANT_SCOPE_KEY = "phi3v.tenant"
#: ASGI scope key of the end user a trusted front end named (OpenAI's ``user`` field).
USER_SCOPE_KEY = "phi3v.user"


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits; None: unlimited. Over any, a request is refused 429 with
    ``Retry-After`` and an error naming the limit.

    Attributes:
        max_concurrent: requests of the tenant admitted or queued at once.
        requests_per_minute: requests started in any 60 s.
        tokens_per_minute: prompt + completion tokens (image tokens included) in any 60 s.
        tokens_per_day: tokens per UTC day.
        tokens_per_month: tokens per UTC calendar month.
    """

    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None


@dataclass(frozen=True)
class Tenant:
    """A tenant: a team, service or person with one or more API keys.

    Attributes:
        name: the tenant's name (the ``tenant`` label of its metrics: never a key).
        weight: its weight in fair admission (> 0): under joint overload tenants hold slots
            in proportion to their weights.
        limits: its :class:`TenantLimits`.
        trusted_frontend: its keys belong to a front end (the chat UI) that names its
            logged-in user in OpenAI's ``user`` field: the tenant's capacity is shared fairly
            among those users, and usage is accounted per user. From other keys ``user`` is
            only recorded.
        admin: its keys may call ``/admin/*`` routes (usage).
    """

    name: str
    weight: float = 1.0
    limits: TenantLimits = field(default_factory=TenantLimits)
    trusted_frontend: bool = False
    admin: bool = False


#: The tenant of every request when no keys file is configured (``--api-key(s)`` or no auth):
#: one tenant, the single FIFO of before.
ANONYMOUS = Tenant(DEFAULT_TENANT, admin=True)
