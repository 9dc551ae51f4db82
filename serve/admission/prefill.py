"""Admission by predicted prefill time: the *prefill backlog* of the requests admitted that
have no first token yet, in engine seconds.

A request's time to a first token is the prefill work admitted before it (vLLM schedules
waiting requests first come, first served) plus its own, plus the engine steps that work
takes. Counting requests (the live limit) cannot see that a burst of 32 photos needs ten
times the prefill of 32 short texts on a CPU engine; counting their predicted prefill
seconds can. In mode ``auto`` the limiter (``serve.admission.limiter``) therefore also

1. admits a request only while the backlog plus its own prefill stays within the TTFT
   target (:meth:`PrefillBacklog.admits`; an empty backlog admits anything),
2. while streams decode, admits a request only while the prefill admitted over the last
   :data:`DUTY_WINDOW_TTFTS` TTFT targets plus its own stays within the share of that time the
   ITL target leaves to prefill (:meth:`PrefillBacklog.duty_ratio`): a step that prefills
   (an image encode above all) delays every decoding stream's next token, so a stream's mean
   inter-token latency is about ``decode step / (1 - prefill share)``, and
3. while one tenant is active, refuses at once (reason ``slo``) a request that could meet the
   target on an idle engine but cannot behind the work ahead of it
   (:meth:`PrefillBacklog.hopeless`): a refusal now lets the client retry or go elsewhere,
   where admitting it would make it late and delay every request behind it.

The costs are the engine's own, measured at boot (:class:`PrefillCosts`,
``serve.admission.probe``): a step's fixed cost, a prompt token's and an image token's (the
vision encoder's share, on top of the token's). The backlog learns that a request got its
first token from vLLM's per-step stats (the count of first tokens each step,
``IterationStats.time_to_first_tokens_iter``), oldest admission first, as vLLM schedules; a
request that ends without one (refused by vLLM, client gone) leaves it when its slot is
released.

Standard library only.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from serve.admission.engine_stats import SlidingWindow

if TYPE_CHECKING:
    from serve.admission.slots import SlotCounter

#: The prediction's costs are scaled by this factor. A prefill on a busy engine shares its
#: steps with the decodes and the other prefills (the per-sequence cost the probes on an idle
#: engine do not see) and a probe's cost is a single figure, not a distribution: the factor
#: keeps the prediction on the side of admitting less and refusing early, short of refusing
#: steady traffic an unlimited engine serves in time. Chosen on the simulator's suite
#: (``python -m bench.simjudge``, every profile, seeds 0-9; docs/admission.md).
COST_MARGIN = 1.3

#: The window of the prefill share (:meth:`PrefillBacklog.admits`), in TTFT targets: one
#: request the backlog bound admits (at most a TTFT target of prefill) fits an otherwise
#: empty window at any share over one half, and a change of traffic shows within seconds.
#: Chosen on the simulator's suite (``python -m bench.simjudge``, every profile, seeds 0-9;
#: docs/admission.md): one target cost gpu-like T3, five lost the cpu T5 gain.
DUTY_WINDOW_TTFTS = 2.0


@dataclass(frozen=True)
class PrefillCosts:
    """The engine's prefill costs, seconds: ``step_s`` for one engine step (its fixed cost),
    ``token_s`` per prompt token (image tokens included), ``image_token_s`` per image token
    on top of that (the vision encoder). The step-time model of ``bench.calibrate`` and
    ``bench.sim.EngineConfig`` without its per-sequence terms."""

    step_s: float
    token_s: float
    image_token_s: float

    @classmethod
    def from_probes(cls, short: tuple[int, float], long: tuple[int, float],
                    image: tuple[int, int, float]) -> "PrefillCosts":
        """The costs that explain three prefills timed alone on an idle engine: ``short``
        and ``long`` text prompts ``(prompt tokens, seconds to the first token)`` and an
        image prompt ``(prompt tokens, image tokens, seconds)``. Each time is taken to be
        one step's fixed cost plus the prompt's token costs; a cost that comes out negative
        (timing noise) is 0.

        Raises:
            ValueError: the long prompt is not longer than the short one, or the image
                prompt has no image tokens.
        """
        (n1, t1), (n2, t2), (n3, m3, t3) = short, long, image
        if n2 <= n1:
            raise ValueError(f"the long probe ({n2} tokens) must be longer than the short "
                             f"one ({n1})")
        if m3 <= 0:
            raise ValueError("the image probe has no image tokens")
        token_s = max(0.0, (t2 - t1) / (n2 - n1))
        step_s = max(0.0, t1 - token_s * n1)
        image_token_s = max(0.0, (t3 - step_s - token_s * n3) / m3)
        return cls(step_s, token_s, image_token_s)

    def prefill_s(self, tokens: int, image_tokens: int = 0) -> float:
        """Seconds of prefill of a prompt of ``tokens`` tokens, ``image_tokens`` of them
        image tokens (the steps' fixed cost not counted: :meth:`PrefillBacklog.hopeless`)."""
        return self.token_s * tokens + self.image_token_s * image_tokens


class PrefillBacklog:
    """Predicted prefill seconds of the admitted requests without a first token.

    Inactive (admits everything, refuses nothing) until :attr:`costs` is set and while
    :attr:`active` is False (the admission modes other than ``auto``).

    Args:
        ttft_target_s: the TTFT target, seconds (None: no bound, always inactive).
        step_tokens: prompt tokens one engine step computes (vLLM's
            ``max_num_batched_tokens``; 0: unknown, the steps are not counted).
        margin: the factor on every predicted cost (:data:`COST_MARGIN`).
        ablate: rules switched off (``serve.admission.rules``: ``prefill_backlog``, the
            bound; ``prefill_shed``, the refusal of a hopeless request; ``prefill_duty``,
            the prefill share while streams decode).
        itl_target_s: the ITL (TPOT) target, seconds (None: no prefill share bound).
        clock: monotonic clock, seconds (the prefill share's window).
    """

    def __init__(self, ttft_target_s: float | None, step_tokens: int = 0,
                 margin: float = COST_MARGIN, ablate: frozenset[str] = frozenset(),
                 itl_target_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttft_target_s = ttft_target_s
        self.itl_target_s = itl_target_s
        self.step_tokens = step_tokens
        self.margin = margin
        self.bound = "prefill_backlog" not in ablate
        self.shed = "prefill_shed" not in ablate
        self.duty = "prefill_duty" not in ablate and itl_target_s is not None
        #: Predicted prefill seconds admitted within the share's window, one sample each.
        self._share = SlidingWindow(DUTY_WINDOW_TTFTS * (ttft_target_s or 0.0), clock)
        self.costs: PrefillCosts | None = None
        self.active = True
        #: Admitted requests in admission order: key -> (seconds, prompt tokens).
        self._entries: collections.OrderedDict[object, tuple[float, int]] = \
            collections.OrderedDict()
        self.backlog_s = 0.0
        self.backlog_tokens = 0

    @property
    def on(self) -> bool:
        """Whether the backlog is kept now (costs known, a target, active)."""
        return self.active and self.costs is not None and self.ttft_target_s is not None

    def __len__(self) -> int:
        return len(self._entries)

    def cost(self, tokens: int, image_tokens: int = 0) -> float:
        """Predicted prefill seconds of a request (0 while the costs are unknown)."""
        if self.costs is None:
            return 0.0
        return self.margin * self.costs.prefill_s(tokens, image_tokens)

    def admits(self, cost_s: float, streams: bool = False) -> bool:
        """Whether a request predicted to prefill in ``cost_s`` seconds may enter the
        engine now: the backlog is empty, or it and the request fit the TTFT target; and,
        where ``streams`` (admitted requests are decoding; the caller leaves out a burst at
        an idle engine, whose own streams the burst's prefill delays once), the prefill
        admitted within the last :attr:`duty_window_s` plus the request's stays within
        :meth:`duty_ratio` of that window (an empty window admits anything)."""
        if not self.on or not self.bound:
            return True
        if self._entries and self.backlog_s + cost_s > self.ttft_target_s:
            return False
        if not streams or not self.duty:
            return True
        return not len(self._share) or \
            self._share.sum() + cost_s <= self.duty_ratio() * self.duty_window_s

    def admits_at(self, cost_s: float, slots: SlotCounter) -> bool:
        """:meth:`admits` at the state of ``slots``: streams decode when more requests are in
        flight than wait for a first token and no burst at an idle engine is open."""
        return self.admits(cost_s, slots.in_flight > len(self._entries)
                           and slots.bursts.current() is None)

    @property
    def duty_window_s(self) -> float:
        """Seconds over which the prefill share is counted (:data:`DUTY_WINDOW_TTFTS`)."""
        return self._share.window_s

    def duty_ratio(self) -> float:
        """The share of engine time prefill may take while streams decode (0-1):
        ``1 - step_s / itl_target``. A stream gets a token per engine step, and the steps
        that prefill take the rest of the time, so its mean inter-token latency is about
        ``step_s / (1 - share)``; at this share it is the ITL target (the decode-prefill
        interference of Sarathi-Serve, Agrawal et al., OSDI 2024, taken over a window instead
        of per step: an image encode cannot be chunked). ``step_s`` is the engine step's
        fixed cost measured at boot (:class:`PrefillCosts`); 1 while it is unknown."""
        if self.costs is None or not self.itl_target_s:
            return 1.0
        return max(0.0, 1.0 - self.costs.step_s / self.itl_target_s)

    def forget_share(self) -> None:
        """Empty the prefill share's window (the benchmark's reset to the boot state)."""
        self._share.clear()

    @property
    def admitted_s(self) -> float:
        """Predicted prefill seconds admitted within the share's window."""
        return self._share.sum()

    def hopeless(self, waited_s: float, cost_s: float, tokens: int,
                 ahead_s: float = 0.0, ahead_tokens: int = 0) -> bool:
        """Whether a request that has waited ``waited_s`` seconds, predicted to prefill in
        ``cost_s`` seconds (``tokens`` prompt tokens), cannot get its first token within
        the TTFT target behind the backlog and ``ahead_s`` seconds (``ahead_tokens``
        tokens) of queued requests ahead of it, while alone it could. The steps that work
        takes add their fixed cost. A request that cannot meet the target even alone is
        never called hopeless: refusing it would refuse it on every retry."""
        if not self.on or not self.shed or (not self._entries and not ahead_s):
            return False
        target = self.ttft_target_s
        step_s = self.margin * self.costs.step_s
        if waited_s + cost_s + step_s * self._steps(tokens) > target:
            return False
        work = self.backlog_tokens + ahead_tokens + tokens
        return (waited_s + self.backlog_s + ahead_s + cost_s
                + step_s * self._steps(work)) > target

    def hopeless_behind(self, waited_s: float, cost_s: float, tokens: int, position: float,
                        queued: Iterable[tuple[float, int]]) -> bool:
        """:meth:`hopeless` for a request behind ``position`` of the ``queued`` requests
        (each ``(predicted seconds, prompt tokens)``; their mean counts for each place ahead:
        the fair queue gives a position in requests, not which ones)."""
        if not self.on or not self.shed:
            return False
        ahead_s = ahead_tokens = 0.0
        if position:
            costs = list(queued)
            if costs:
                scale = position / len(costs)
                ahead_s = scale * sum(c for c, _ in costs)
                ahead_tokens = scale * sum(t for _, t in costs)
        return self.hopeless(waited_s, cost_s, tokens, ahead_s, int(ahead_tokens))

    def _steps(self, tokens: int) -> int:
        """Engine steps that prefill ``tokens`` prompt tokens (1 when the budget is
        unknown)."""
        return max(1, math.ceil(tokens / self.step_tokens)) if self.step_tokens else 1

    def add(self, key: object, cost_s: float, tokens: int) -> None:
        """Request ``key`` entered the engine, predicted to prefill in ``cost_s`` seconds."""
        self._entries[key] = (cost_s, tokens)
        self.backlog_s += cost_s
        self.backlog_tokens += tokens
        if self.duty:
            self._share.add(cost_s)

    def first_tokens(self, n: int) -> bool:
        """The engine produced ``n`` first tokens: the ``n`` oldest requests leave the
        backlog (vLLM prefills first come, first served). True when the backlog shrank."""
        popped = False
        for _ in range(min(n, len(self._entries))):
            _, (cost, tokens) = self._entries.popitem(last=False)
            self._drop(cost, tokens)
            popped = True
        return popped

    def discard(self, key: object) -> None:
        """Request ``key`` ended (its slot released); it leaves the backlog if still in."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._drop(*entry)

    def _drop(self, cost: float, tokens: int) -> None:
        self.backlog_s -= cost
        self.backlog_tokens -= tokens
        if not self._entries:  # no float drift left over once empty
            self.backlog_s, self.backlog_tokens = 0.0, 0

    def state(self) -> dict:
        """For ``GET /admin/autotuner``: the costs, the margin, the backlog now."""
        return {"costs": None if self.costs is None else asdict(self.costs),
                "margin": self.margin, "active": self.on, "requests": len(self._entries),
                "backlog_s": round(self.backlog_s, 4), "backlog_tokens": self.backlog_tokens,
                "duty_ratio": round(self.duty_ratio(), 4) if self.duty else None,
                "duty_window_s": self.duty_window_s,
                "admitted_s": round(self.admitted_s, 4)}
