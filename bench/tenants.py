"""Open-loop load from several tenants against one server, and its counts (``make
bench-fairness`` and ``tests/engine/test_tenant_fairness.py``).

Poisson arrivals at rates relative to the server's measured capacity, every request the same
streamed chat of :data:`MAX_TOKENS` tokens (``ignore_eos``), so every request's TTFT and ITL are
the client's and completions split as slots do. Pure asyncio + httpx; no vLLM import.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

#: Output tokens of every request: the same work each. Long enough that decoding, not HTTP,
#: bounds the capacity: the rates are multiples of it, and the client, the gateway and the
#: engine share 2 cores, so with answers of a few tokens 4x capacity is ~100 requests/s whose
#: handling (arrivals, refusals) starves the engine, and then every queue, the light tenant's
#: too, waits for a stalled engine.
MAX_TOKENS = 96
#: TTFT and mean-ITL targets, seconds, of the server and of a good answer (goodput):
#: generous for a loaded 2-core machine.
SLO_TTFT_S = 10.0
SLO_ITL_S = 1.0
#: The gateway's bound on a request's queue wait (``--max-queue-wait-s``): the TTFT target less
#: the time from admission to the first token with every slot busy (a prefill beside the
#: decoding answers, about a second here). The server's queue deadline does the same once a
#: flood's opening burst window (the TTFT target) has passed, not inside it; bounded by the
#: target itself there, a request let in at the end of its wait misses the target by that
#: time, and whether each did would be the goodput's noise (``docs/admission.md``).
MAX_QUEUE_WAIT_S = SLO_TTFT_S - 2.0
#: Seconds from a run's first arrival before its counts start: an idle server first fills in
#: arrival order, and the queues build up.
WARM_S = 6.0


#: The tenants of the load (name: weight): a flooding one and a light one, one that sends the
#: same arrivals alone, and two of weights 3:1.
TENANTS = {"flood": 1, "light": 1, "alone": 1, "heavy": 3, "lighter": 1}
#: Rates, multiples of the server's capacity: the flood (4x) beside the light tenant (0.2x,
#: well under its share), and weights 3:1 at 2x and 1x (each well over its share of 0.75 and
#: 0.25, so both queues grow even when the capacity was under-measured).
FLOOD_X, LIGHT_X, HEAVY_X, LIGHTER_X = 4.0, 0.2, 2.0, 1.0


def write_keys(path: Path) -> dict[str, str]:
    """A keys file of :data:`TENANTS` at ``path`` (``serve.keys``); ``{tenant: API key}``."""
    from serve.keys import KeysFile

    content, tokens = KeysFile(), {}
    for name, weight in TENANTS.items():
        content.set_tenant(name, weight=weight)
        tokens[name] = content.add_key(name)[1]
    content.write(path)
    return tokens


def flood_load(tokens: dict[str, str], capacity: float,
               alone: bool = False) -> dict[str, tuple[str, float]]:
    """The senders of :func:`open_loop` for the flood: ``flood`` at :data:`FLOOD_X` and
    ``light`` at :data:`LIGHT_X` times ``capacity`` (requests/s); with ``alone``, the same
    arrivals all sent with tenant ``alone``'s key."""
    return {name: (tokens["alone" if alone else name], x * capacity)
            for name, x in (("flood", FLOOD_X), ("light", LIGHT_X))}


def weighted_load(tokens: dict[str, str], capacity: float) -> dict[str, tuple[str, float]]:
    """The senders of :func:`open_loop` for joint overload: ``heavy`` (weight 3) at
    :data:`HEAVY_X` and ``lighter`` (weight 1) at :data:`LIGHTER_X` times ``capacity``."""
    return {name: (tokens[name], x * capacity)
            for name, x in (("heavy", HEAVY_X), ("lighter", LIGHTER_X))}


def server_args(max_num_seqs: int = 8) -> list[str]:
    """The flags of a server under this load (with ``--keys-file`` of :func:`write_keys`): a
    small ``max_num_seqs`` so that the queues form in the gateway, where fairness acts, and
    the SLOs above, with the queue wait bounded by :data:`MAX_QUEUE_WAIT_S`."""
    return ["--max-num-seqs", str(max_num_seqs), "--slo-ttft-s", str(SLO_TTFT_S),
            "--slo-itl-s", str(SLO_ITL_S), "--max-queue-wait-s", str(MAX_QUEUE_WAIT_S),
            "--autotune-interval-s", "0.5"]


@dataclass
class Outcome:
    """One request's outcome. Times are monotonic seconds."""

    tenant: str
    #: HTTP status; 0 for a transport error (the connection closed under the client).
    status: int
    ttft_s: float | None = None
    #: Within both SLOs (:data:`SLO_TTFT_S`, :data:`SLO_ITL_S`) with HTTP 200.
    good: bool = False
    sent_at: float = 0.0
    #: When the first token arrived (None: none did).
    first_at: float | None = None
    #: When the answer ended (or the refusal came).
    done_at: float = 0.0
    #: Why the gateway refused it (``X-Phi3v-Reject-Reason``, else the body's start).
    reason: str | None = None


async def one(client: httpx.AsyncClient, base_url: str, model: str, token: str,
              tenant: str) -> Outcome:
    """One streamed chat of ``tenant`` with API key ``token``; a transport error is an
    outcome of status 0 with the error as its reason, not the run's end."""
    start = time.monotonic()
    try:
        outcome = await _one(client, base_url, model, token, tenant, start)
    except httpx.TransportError as exc:
        outcome = Outcome(tenant, 0, reason=repr(exc))
    outcome.sent_at, outcome.done_at = start, time.monotonic()
    return outcome


async def _one(client: httpx.AsyncClient, base_url: str, model: str, token: str, tenant: str,
               start: float) -> Outcome:
    body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a story."}]}
    first = last = None
    gaps: list[float] = []
    async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {token}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(tenant, r.status_code,
                           reason=r.headers.get("x-phi3v-reject-reason", r.text[:200]))
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                now = time.monotonic()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    ttft = None if first is None else first - start
    itl = sum(gaps) / len(gaps) if gaps else 0.0
    return Outcome(tenant, 200, ttft, ttft is not None and ttft <= SLO_TTFT_S
                   and itl <= SLO_ITL_S, first_at=first)


async def capacity_rps(base_url: str, model: str, token: str, n: int = 16) -> float:
    """Completed requests per second with a full backlog of ``n`` requests.

    Raises:
        RuntimeError: a request did not get HTTP 200.
    """
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.monotonic()
        results = await asyncio.gather(*(one(client, base_url, model, token, "probe")
                                         for _ in range(n)))
    bad = [(r.status, r.reason) for r in results if r.status != 200]
    if bad:
        raise RuntimeError(f"capacity probe refused: {bad}")
    return n / (time.monotonic() - start)


async def open_loop(base_url: str, model: str, senders: dict[str, tuple[str, float]],
                    duration_s: float, seed: int = 0) -> list[Outcome]:
    """Poisson arrivals for ``duration_s`` seconds: ``{tenant: (API key, rate per
    second)}``, the schedule drawn from ``random.Random(seed)`` (the same seed, the same
    arrivals); waits for every answer."""
    rng = random.Random(seed)
    schedule = []
    for tenant, (token, rate) in sorted(senders.items()):
        t = rng.expovariate(rate)
        while t < duration_s:
            schedule.append((t, tenant, token))
            t += rng.expovariate(rate)
    schedule.sort()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        start = time.monotonic()
        tasks = []
        for at, tenant, token in schedule:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(c, base_url, model, token, tenant)))
        return list(await asyncio.gather(*tasks))


def p90(values: Iterable[float]) -> float:
    """The 90th percentile (nearest rank below). Raises IndexError for no values."""
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


def window(outcomes: list[Outcome], duration_s: float) -> tuple[float, float]:
    """The loaded window of an open-loop run, monotonic seconds: from :data:`WARM_S` after
    its first arrival to its last arrival. A run of fixed length also serves its queue after
    the arrivals stop, for as long as the queue's wait allows: counting those would score how
    long a queue each tenant may keep, not how the slots were shared while it was loaded."""
    start = min(o.sent_at for o in outcomes)
    return start + WARM_S, start + duration_s


def served_in_window(outcomes: Iterable[Outcome], lo: float, hi: float,
                     good_only: bool = False) -> float:
    """Answers served inside ``[lo, hi]``, each counted by the share of its decoding (first
    token to end) that fell inside: an answer wholly inside counts 1, one cut by an edge its
    share. Counting whole answers that ended inside instead moves the count by up to one
    answer per slot at each edge (8 slots: ~10 % of a 15-s run's ~80 answers); shares sum to
    the same in the long run without that edge noise (the "fractional" count of a renewal
    process). HTTP 200 answers with a first token only; with ``good_only``, only good ones
    (:attr:`Outcome.good`): goodput."""
    total = 0.0
    for o in outcomes:
        if o.status != 200 or o.first_at is None or (good_only and not o.good):
            continue
        span = o.done_at - o.first_at
        if span <= 0:
            total += 1.0 if lo <= o.done_at <= hi else 0.0
            continue
        total += max(0.0, min(hi, o.done_at) - max(lo, o.first_at)) / span
    return total


def served_by_tenant(outcomes: list[Outcome], duration_s: float,
                     tenants: Iterable[str]) -> dict[str, float]:
    """Each tenant's answers served in the loaded :func:`window` of an open-loop run of
    ``duration_s`` seconds (:func:`served_in_window`)."""
    lo, hi = window(outcomes, duration_s)
    return {t: served_in_window([o for o in outcomes if o.tenant == t], lo, hi)
            for t in tenants}
