"""Per-tenant limits (:class:`serve.tenants.TenantLimits`): who is over which limit, and when
a refused request may come back.

Five limits, each None (unlimited) or a number, counted per tenant name:

1. ``max_concurrent``: the tenant's requests between :meth:`Quota.started` and
   :meth:`Quota.finished` (the gateway starts them before admission, so queued requests
   count);
2. ``requests_per_minute``: requests started in the last :data:`WINDOW_S` seconds (a sliding
   window, not a fixed minute);
3. ``tokens_per_minute``: tokens in the last :data:`WINDOW_S` seconds: a request's prompt
   tokens (image tokens included) at its start, completion tokens at its end;
4. ``tokens_per_day``: tokens of the current UTC day;
5. ``tokens_per_month``: tokens of the current UTC calendar month.

A request's prompt is reserved at its start at the intake's estimate and replaced at its end
by the count the server bills (vLLM's, ``serve.accounting``); the day and month totals start
from the usage store (:meth:`Quota.seed`), so a restart forgets no budget.

A request is refused when it would go over a limit: the concurrent or per-minute request count
has reached the limit, or the tokens used plus its prompt tokens exceed it. When several
limits refuse it, the one whose ``Retry-After`` is longest is named (before then another would
refuse it again). ``Retry-After`` is computed:

- a window limit: when enough of the window's entries have left it;
- a day or month budget: the next UTC midnight or first of the month;
- ``max_concurrent``: when the tenant's oldest running request should end, at the mean
  duration of its recent requests (at least 1 s; 1 s with no history);
- a prompt larger than a token limit itself can never pass: ``retry_after_s`` is None.

Standard library only; the clock (wall time, seconds) is injectable.
"""

from __future__ import annotations

import collections
import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.tenants import Tenant

#: Seconds of the sliding windows of ``requests_per_minute`` and ``tokens_per_minute``.
WINDOW_S = 60.0
#: The limits, in the order :class:`~serve.tenants.TenantLimits` declares them; each is the
#: reason a refusal names (``X-Phi3v-Reject-Reason``, the ``reason`` label).
LIMITS = ("max_concurrent", "requests_per_minute", "tokens_per_minute", "tokens_per_day",
          "tokens_per_month")
#: Weight of the newest request in the mean duration behind ``max_concurrent``'s Retry-After.
DURATION_EWMA_ALPHA = 0.2


@dataclass(frozen=True)
class Refusal:
    """A request over one of its tenant's limits.

    Attributes:
        tenant: the tenant's name.
        limit: the limit's name (:data:`LIMITS`).
        value: the limit's value.
        used: what the tenant holds of it now (requests or tokens).
        requested: what this request would add (1 request, or its prompt tokens).
        retry_after_s: whole seconds (>= 1) until the request would pass this limit; None
            when it never can (its prompt exceeds the limit itself).
    """

    tenant: str
    limit: str
    value: int
    used: int
    requested: int
    retry_after_s: int | None

    @property
    def code(self) -> str:
        """The error's machine-readable code: ``tokens_per_minute_exceeded``."""
        return f"{self.limit}_exceeded"

    @property
    def message(self) -> str:
        """One sentence naming the tenant's limit, its value and what is used of it."""
        used = {"max_concurrent": f"{self.used} running or queued",
                "requests_per_minute": f"{self.used} in the last minute",
                "tokens_per_minute": f"{self.used} tokens in the last minute",
                "tokens_per_day": f"{self.used} tokens this UTC day",
                "tokens_per_month": f"{self.used} tokens this UTC month"}[self.limit]
        if self.limit.startswith("tokens"):
            used += f", this request's prompt {self.requested}"
        text = (f"Tenant '{self.tenant}' is over its {self.limit} limit of {self.value} "
                f"({used})")
        if self.retry_after_s is None:
            return text + ": this request alone exceeds the limit and cannot be served."
        return text + f"; retry in {self.retry_after_s} s."


@dataclass(eq=False)
class Ticket:
    """A started request of ``tenant``: hand it back once to :meth:`Quota.finished`."""

    tenant: str
    start: float
    #: The window entry of its prompt tokens: ``[time, tokens]`` (the estimate until the end).
    entry: list
    done: bool = False


@dataclass
class _Usage:
    """What one tenant holds."""

    running: dict[Ticket, float] = field(default_factory=dict)  # insertion order = start order
    requests: collections.deque = field(default_factory=collections.deque)  # start times
    tokens: collections.deque = field(default_factory=collections.deque)  # [time, tokens]
    window_tokens: int = 0
    day: tuple[datetime.date, int] | None = None  # (UTC day, tokens)
    month: tuple[tuple[int, int], int] | None = None  # ((year, month), tokens)
    mean_duration_s: float | None = None


#: The last day :func:`utc_day` answered: (its first second, its end, the day).
_last_day: tuple[float, float, datetime.date] = (0.0, 0.0, datetime.date(1970, 1, 1))


def utc_day(now: float) -> datetime.date:
    """The UTC calendar day of the wall time ``now`` (the last one is kept: a request asks
    several times)."""
    global _last_day
    start, end, day = _last_day
    if not start <= now < end:
        day = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).date()
        start = datetime.datetime.combine(day, datetime.time(), datetime.timezone.utc) \
            .timestamp()
        _last_day = (start, start + 86400.0, day)
    return day


def _month(day: datetime.date) -> tuple[int, int]:
    return day.year, day.month


def _midnight_after(day: datetime.date) -> float:
    start = datetime.datetime.combine(day + datetime.timedelta(days=1), datetime.time(),
                                      datetime.timezone.utc)
    return start.timestamp()


def _month_after(day: datetime.date) -> float:
    year, month = (day.year + 1, 1) if day.month == 12 else (day.year, day.month + 1)
    return datetime.datetime(year, month, 1, tzinfo=datetime.timezone.utc).timestamp()


def _seconds(delay: float) -> int:
    """Whole seconds >= 1 for ``Retry-After``, rounded up."""
    return max(1, math.ceil(delay - 1e-9))


class Quota:
    """The per-tenant counts of one API process (module docstring).

    Args:
        clock: wall time, seconds (UTC days and months come from it).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._usage: dict[str, _Usage] = {}

    # --- state ------------------------------------------------------------------------------
    def seed(self, tenant: str, tokens_today: int, tokens_this_month: int) -> None:
        """Start ``tenant``'s day and month totals from the usage store (at start)."""
        usage = self._of(tenant)
        day = utc_day(self.clock())
        usage.day = (day, tokens_today)
        usage.month = (_month(day), tokens_this_month)

    def concurrent(self, tenant: str) -> int:
        """``tenant``'s requests started and not finished."""
        usage = self._usage.get(tenant)
        return len(usage.running) if usage else 0

    def tokens_today(self, tenant: str) -> int:
        """``tenant``'s tokens of the current UTC day."""
        usage = self._usage.get(tenant)
        day = utc_day(self.clock())
        return usage.day[1] if usage and usage.day and usage.day[0] == day else 0

    def tokens_this_month(self, tenant: str) -> int:
        """``tenant``'s tokens of the current UTC month."""
        usage = self._usage.get(tenant)
        month = _month(utc_day(self.clock()))
        return usage.month[1] if usage and usage.month and usage.month[0] == month else 0

    def tokens_last_minute(self, tenant: str) -> int:
        """``tenant``'s tokens in the last :data:`WINDOW_S` seconds."""
        usage = self._usage.get(tenant)
        if usage is None:
            return 0
        self._expire(usage, self.clock())
        return usage.window_tokens

    def budget_used(self, tenant: Tenant, period: str) -> float | None:
        """Share (0 upwards) of ``tenant``'s ``day`` or ``month`` token budget used; None
        without that budget."""
        limits = tenant.limits
        if period == "day":
            budget, used = limits.tokens_per_day, self.tokens_today(tenant.name)
        else:
            budget, used = limits.tokens_per_month, self.tokens_this_month(tenant.name)
        return None if not budget else used / budget

    # --- admission --------------------------------------------------------------------------
    def check(self, tenant: Tenant, prompt_tokens: int) -> Refusal | None:
        """Whether a request of ``prompt_tokens`` would go over one of ``tenant``'s limits:
        the refusal with the longest ``Retry-After`` (module docstring), or None."""
        now = self.clock()
        usage = self._of(tenant.name)
        self._expire(usage, now)
        limits, name = tenant.limits, tenant.name
        refusals = []
        if limits.max_concurrent is not None and len(usage.running) >= limits.max_concurrent:
            oldest = next(iter(usage.running.values()), now)
            wait = (usage.mean_duration_s or 0.0) - (now - oldest)
            refusals.append(Refusal(name, "max_concurrent", limits.max_concurrent,
                                    len(usage.running), 1,
                                    _seconds(wait) if limits.max_concurrent else None))
        rpm = limits.requests_per_minute
        if rpm is not None and len(usage.requests) >= rpm:
            # The oldest starts must leave the window until fewer than rpm remain.
            leaves = usage.requests[len(usage.requests) - rpm] if rpm > 0 else None
            refusals.append(Refusal(name, "requests_per_minute", rpm, len(usage.requests), 1,
                                    None if leaves is None else
                                    _seconds(leaves + WINDOW_S - now)))
        tpm = limits.tokens_per_minute
        if tpm is not None and usage.window_tokens + prompt_tokens > tpm:
            refusals.append(Refusal(name, "tokens_per_minute", tpm, usage.window_tokens,
                                    prompt_tokens, self._window_frees(usage, prompt_tokens, tpm,
                                                                      now)))
        for limit, value in (("tokens_per_day", limits.tokens_per_day),
                             ("tokens_per_month", limits.tokens_per_month)):
            if value is None:
                continue
            day = limit == "tokens_per_day"
            used = self.tokens_today(name) if day else self.tokens_this_month(name)
            if used + prompt_tokens > value:
                ends = (_midnight_after if day else _month_after)(utc_day(now))
                refusals.append(Refusal(name, limit, value, used, prompt_tokens,
                                        None if prompt_tokens > value else
                                        _seconds(ends - now)))
        if not refusals:
            return None
        return max(refusals, key=lambda r: math.inf if r.retry_after_s is None
                   else r.retry_after_s)

    @staticmethod
    def _window_frees(usage: _Usage, prompt_tokens: int, limit: int, now: float) -> int | None:
        """Seconds until enough tokens leave the window for ``prompt_tokens`` more to fit."""
        if prompt_tokens > limit:
            return None
        excess = usage.window_tokens + prompt_tokens - limit
        for when, tokens in usage.tokens:
            excess -= tokens
            if excess <= 0:
                return _seconds(when + WINDOW_S - now)
        return 1  # not reached: the window's entries sum to window_tokens

    def started(self, tenant: Tenant, prompt_tokens: int) -> Ticket:
        """Count a request of ``tenant`` that :meth:`check` let through: one more running,
        one more start in the window, ``prompt_tokens`` reserved until :meth:`finished`."""
        now = self.clock()
        usage = self._of(tenant.name)
        entry = [now, prompt_tokens]
        ticket = Ticket(tenant.name, now, entry)
        usage.running[ticket] = now
        usage.requests.append(now)
        usage.tokens.append(entry)
        usage.window_tokens += prompt_tokens
        self._add_budget(usage, now, prompt_tokens)
        return ticket

    def finished(self, ticket: Ticket, prompt_tokens: int, completion_tokens: int) -> None:
        """The request of ``ticket`` ended: its prompt counts ``prompt_tokens`` (replacing the
        estimate reserved at its start), plus ``completion_tokens`` now. A ticket counts
        once; a second call does nothing."""
        if ticket.done:
            return
        ticket.done = True
        now = self.clock()
        usage = self._of(ticket.tenant)
        usage.running.pop(ticket, None)
        duration = now - ticket.start
        usage.mean_duration_s = duration if usage.mean_duration_s is None else (
            DURATION_EWMA_ALPHA * duration + (1 - DURATION_EWMA_ALPHA) * usage.mean_duration_s)
        change = prompt_tokens - ticket.entry[1]
        if ticket.entry[0] > now - WINDOW_S:  # its prompt is still in the window
            ticket.entry[1] = prompt_tokens
            usage.window_tokens += change
        if completion_tokens:
            usage.tokens.append([now, completion_tokens])
            usage.window_tokens += completion_tokens
        # The prompt's correction belongs to the day (month) its estimate was counted in: a
        # request that started before midnight corrects a total that is no longer kept, and
        # taking it from the new day's would leave that below 0.
        start_day, day = utc_day(ticket.start), utc_day(now)
        self._add_budget(usage, now, (change if start_day == day else 0) + completion_tokens,
                         month_tokens=(change if _month(start_day) == _month(day) else 0)
                         + completion_tokens)

    # --- internals --------------------------------------------------------------------------
    def _of(self, tenant: str) -> _Usage:
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = _Usage()
        return usage

    @staticmethod
    def _expire(usage: _Usage, now: float) -> None:
        """Drop the window entries older than :data:`WINDOW_S` (they no longer count)."""
        start = now - WINDOW_S
        while usage.requests and usage.requests[0] <= start:
            usage.requests.popleft()
        while usage.tokens and usage.tokens[0][0] <= start:
            usage.window_tokens -= usage.tokens.popleft()[1]

    @staticmethod
    def _add_budget(usage: _Usage, now: float, tokens: int,
                    month_tokens: int | None = None) -> None:
        """Add ``tokens`` to the day total and ``month_tokens`` (default ``tokens``) to the
        month's (a new day or month starts at 0)."""
        day = utc_day(now)
        usage.day = (day, (usage.day[1] if usage.day and usage.day[0] == day else 0) + tokens)
        month = _month(day)
        usage.month = (month, (usage.month[1] if usage.month and usage.month[0] == month
                               else 0) + (tokens if month_tokens is None else month_tokens))
