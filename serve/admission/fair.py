"""Weighted fair sharing of the admission slots between tenants (:class:`FairQueue`).

The live limit (the autotuner's) says how many requests the engine holds; this module says
*whose*. Waiting requests sit in one FIFO per tenant, and each slot that frees goes to the
waiting tenant furthest below its weighted share of the slots in use once that slot is given:
the smallest ``in_flight - share x (in use + 1)``, ``share`` being the tenant's weight over
the active tenants' (ties: the earliest arrival). That is weighted max-min fairness by
progressive filling (Bertsekas & Gallager, *Data Networks*, 2nd ed., section 6.5.2) applied
to whole slots, the largest-deficit pick of smooth weighted round robin (nginx's
``upstream`` weights), and the rule Kubernetes' API Priority and Fairness applies to its
concurrency "seats". The plain ratio ``in_flight / weight`` would be Adams' divisor method,
which favours the lighter tenant whenever the split is not whole (Balinski & Young, *Fair
Representation*, 2nd ed., 2001): with weights 3:1 holding 12:4 it gives a 17th slot to the
lighter one (12:5, where the shares are 12.75:4.25).

- **work-conserving**: a slot is never left free while anyone waits, so a tenant alone uses
  every slot, beyond its share;
- **no preemption**: a tenant over its share keeps its running requests; it gives slots back
  as they finish, because each freed slot goes to the tenant furthest below its share;
- **weights**: under joint overload tenants hold slots in proportion to their weights, so
  with requests of equal length they complete in that proportion.

Within a tenant whose requests name their end users (a trusted front end such as the chat UI,
``serve.tenants``), the tenant's slots are shared the same way among its users, with equal
weights. With a single tenant and no users it is exactly the FIFO it replaces. Standard
library only: the server's limiter (:mod:`serve.admission.limiter`) and the simulator's gate
(``bench/sim.py``) share it.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterator
from typing import Generic, TypeVar

from serve.admission.rules import check as check_rules

T = TypeVar("T")

#: Tenant of requests that carry none (no keys file: one tenant, the FIFO of before).
DEFAULT_TENANT = "default"


class FairQueue(Generic[T]):
    """Waiting items (one FIFO per tenant, or per tenant and user) and the slots each holds.

    The caller tells it when a request takes a slot (:meth:`started`, done by :meth:`pop`)
    and gives it back (:meth:`finished`); :meth:`head` names whose item is next. Weights are
    per tenant, > 0, and the latest one given for a tenant counts. ``user`` (None: none
    named) splits a tenant's share among its users.

    Args:
        ablate: rules of :data:`serve.admission.rules.RULES` switched off (benchmarks only):
            ``fair_below_share``.
    """

    def __init__(self, ablate: frozenset[str] = frozenset()) -> None:
        self.ablate = check_rules(ablate)
        #: tenant -> user -> FIFO of (arrival order, item)
        self._queues: dict[str, dict[str | None, collections.deque[tuple[int, T]]]] = {}
        self._weights: dict[str, float] = {}
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._user_in_flight: collections.Counter[tuple[str, str | None]] = \
            collections.Counter()
        self._order = itertools.count()
        self._pending = 0

    # --- state --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._pending

    def pending(self, tenant: str | None = None) -> int:
        """Items waiting: all of them, or ``tenant``'s."""
        if tenant is None:
            return self._pending
        return sum(len(q) for q in self._queues.get(tenant, {}).values())

    def in_flight(self, tenant: str, user: str | None = None) -> int:
        """Slots ``tenant`` holds now (``user``'s of them, when given)."""
        if user is None:
            return self._in_flight[tenant]
        return self._user_in_flight[tenant, user]

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def share(self, tenant: str) -> float:
        """``tenant``'s weighted share (0-1] of the slots among the tenants active now (with
        a request waiting or running), itself included."""
        active = {t for t in self._queues if self.pending(t)} | {
            t for t, n in self._in_flight.items() if n > 0} | {tenant}
        total = sum(self.weight(t) for t in active)
        return self.weight(tenant) / total

    def queued(self, tenant: str, user: str | None = None) -> int:
        """Items of ``tenant`` waiting: all of them, or with ``user`` that user's."""
        if user is None:
            return self.pending(tenant)
        return len(self._queues.get(tenant, {}).get(user, ()))

    def _users(self, tenant: str, user: str | None) -> int:
        """Users of ``tenant`` active now (waiting or holding a slot), ``user`` included."""
        active = {u for u, q in self._queues.get(tenant, {}).items() if q}
        active.update(u for (t, u), n in self._user_in_flight.items() if t == tenant and n > 0)
        active.add(user)
        return len(active)

    def position(self, tenant: str, user: str | None = None) -> int:
        """Places from the head a request of ``tenant`` queued now is worth, in requests of
        the whole queue: its tenant's queue, plus the slots it holds beyond its share of
        those in use, scaled by the tenant's :meth:`share` of the drain (``n`` requests of a
        tenant holding half the slots wait about as long as ``2n`` of a tenant alone). A
        tenant alone: its queue length (the FIFO's position). With ``user`` (a trusted front
        end's) among several active users of the tenant, the tenant's queue ahead of it is
        what the tenant's turns give the user (:meth:`_next_user`: an equal share each): its
        own queue and slots beyond that share, times the users, at most the tenant's queue."""
        share = self.share(tenant)
        over = max(0.0, self._in_flight[tenant] - share * sum(self._in_flight.values()))
        ahead: float = self.pending(tenant)
        if user is not None and (users := self._users(tenant, user)) > 1:
            mine_over = max(0.0, self._user_in_flight[tenant, user]
                            - self._in_flight[tenant] / users)
            ahead = min(ahead, (self.queued(tenant, user) + mine_over) * users)
        return math.ceil((ahead + over) / share)

    def below_share(self, tenant: str) -> bool:
        """Whether other tenants are active and ``tenant`` holds fewer slots than its share
        of those in use: the next free slot is its. A tenant alone is never below its
        share."""
        share = self.share(tenant)
        return share < 1.0 and self._in_flight[tenant] < share * sum(self._in_flight.values())

    def over_share(self, tenant: str, user: str | None = None) -> bool:
        """Whether ``tenant`` is the only active tenant or holds more slots than its share of
        those in use: what it waits for is its own load, not the others'. The queue deadline
        (``AdmissionLimiter.acquire``) refuses only such a tenant's requests, so a tenant
        within its share is never refused for the others' flood. With ``user`` (a trusted
        front end's), the user too must be alone in the tenant or hold more than an equal
        share of the tenant's slots: one user's flood is no reason to refuse another's."""
        share = self.share(tenant)
        over = share >= 1.0 or self._in_flight[tenant] > share * sum(self._in_flight.values())
        if not over or user is None or (users := self._users(tenant, user)) == 1:
            return over
        return self._user_in_flight[tenant, user] > self._in_flight[tenant] / users

    def ahead(self, tenant: str, ahead: int) -> int:
        """How many of the ``ahead`` admitted requests still waiting for a batch slot count
        against ``tenant``'s wait when it is shed or queued: none when it is
        :meth:`below_share` (the others' load is no reason to refuse the tenant that is next
        for a slot; their engine queue is bounded by the TTFT target already), else all."""
        if "fair_below_share" in self.ablate:
            return ahead
        return 0 if self.below_share(tenant) else ahead

    def heads(self) -> Iterator[tuple[str, T]]:
        """The first waiting item of each FIFO (tenant, or tenant and user): the oldest of
        it."""
        for tenant, users in self._queues.items():
            for queue in users.values():
                if queue:
                    yield tenant, queue[0][1]

    def items(self) -> Iterator[T]:
        """Every waiting item, tenant by tenant."""
        for users in self._queues.values():
            for queue in users.values():
                for _, item in queue:
                    yield item

    # --- changes ------------------------------------------------------------------------
    def push(self, tenant: str, item: T, weight: float = 1.0, user: str | None = None) -> None:
        """Queue ``item`` at the end of ``tenant``'s (``user``'s) FIFO.

        Raises:
            ValueError: ``weight`` <= 0.
        """
        if weight <= 0:
            raise ValueError(f"tenant weight must be > 0, not {weight}")
        self._weights[tenant] = weight
        users = self._queues.setdefault(tenant, {})
        users.setdefault(user, collections.deque()).append((next(self._order), item))
        self._pending += 1

    def _next_user(self, tenant: str) -> str | None:
        """Whose FIFO of ``tenant`` the tenant's next slot goes to: the user holding fewest
        of the tenant's slots (ties: the earliest arrival). Raises KeyError if none waits."""
        best = min((self._user_in_flight[tenant, user], queue[0][0], user is None, user or "")
                   for user, queue in self._queues[tenant].items() if queue)
        return None if best[2] else best[3]

    def head(self) -> tuple[str, T] | None:
        """The tenant whose item the next free slot goes to, and that item (not removed);
        None when nothing waits."""
        waiting = {}
        for tenant, users in self._queues.items():
            first = min((q[0][0] for q in users.values() if q), default=None)
            if first is not None:
                waiting[tenant] = first
        if not waiting:
            return None
        # The deficit against the weighted share of the slots in use once this one is given,
        # scaled by the active tenants' total weight (no division, so ties are exact).
        total = sum(self.weight(t) for t in set(waiting) | {
            t for t, n in self._in_flight.items() if n > 0})
        in_use = sum(self._in_flight.values()) + 1
        best: tuple[float, int, str] | None = None
        for tenant, first in waiting.items():
            key = (self._in_flight[tenant] * total - self.weight(tenant) * in_use, first, tenant)
            if best is None or key < best:
                best = key
        tenant = best[2]
        return tenant, self._queues[tenant][self._next_user(tenant)][0][1]

    def pop(self, tenant: str) -> T:
        """Remove the item :meth:`head` names for ``tenant`` and count the slot it takes
        (:meth:`started`).

        Raises:
            KeyError: nothing of ``tenant`` waits.
        """
        user = self._next_user(tenant)
        _, item = self._queues[tenant][user].popleft()
        self._pending -= 1
        self._forget_if_empty(tenant, user)
        self.started(tenant, user)
        return item

    def _forget_if_empty(self, tenant: str, user: str | None) -> None:
        """Drop ``user``'s FIFO of ``tenant`` once empty, and the tenant's once it has none:
        behind a front end with many users, every pass over the queues (:meth:`head`,
        :meth:`share`) would otherwise grow with every user ever seen."""
        users = self._queues.get(tenant)
        if users is not None and not users.get(user, True):
            del users[user]
            if not users:
                del self._queues[tenant]

    def remove(self, tenant: str, item: T) -> bool:
        """Take ``item`` out of ``tenant``'s queues (it left: timeout, cancel). True if it
        was there."""
        for user, queue in self._queues.get(tenant, {}).items():
            for entry in queue:
                if entry[1] is item:
                    queue.remove(entry)
                    self._pending -= 1
                    self._forget_if_empty(tenant, user)
                    return True
        return False

    def drain(self) -> list[T]:
        """Remove and return every waiting item."""
        items = list(self.items())
        self._queues.clear()
        self._pending = 0
        return items

    def started(self, tenant: str, user: str | None = None) -> None:
        """``tenant`` (``user``) took a slot (without queueing, or by :meth:`pop`)."""
        self._in_flight[tenant] += 1
        self._user_in_flight[tenant, user] += 1

    def finished(self, tenant: str, user: str | None = None) -> None:
        """``tenant`` (``user``) gave a slot back."""
        for counter, key in ((self._in_flight, tenant), (self._user_in_flight, (tenant, user))):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]
