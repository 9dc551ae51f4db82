"""Burst admission: a burst that reaches an idle engine goes in past the limit by its prompt
tokens, as many as the engine prefills within the TTFT target.

Why: the limit an idle engine takes a burst with is fitted to the traffic's *mean* prompt
(:meth:`~serve.admission.controller.Controller.idle_limit`), and a burst's own requests
differ in size (one image at ``num_crops=16`` is ~2,300 tokens, a text chat ~250): a burst of
smaller prompts than the mean fits more than the count. Only the gateway knows each
request's size before the engine. The controller computes the budget
(:meth:`~serve.admission.controller.Controller.burst_budget`) and the cap
(:meth:`~serve.admission.controller.Controller.burst_cap`); this module only admits by them
and never writes the limit.

Standard library only; the clock is injected (the simulator runs it on simulated time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def burst_window_s(ttft_target_s: float, interval_s: float) -> float:
    """Seconds a burst's window lasts (:class:`BurstAdmission` ``window_s``): the TTFT target
    (its prefill budget is what the engine prefills within it), or the autotuner's tick when
    that is longer (the controller sees at most one tick's arrivals before it can react)."""
    return max(ttft_target_s, interval_s)


@dataclass
class Burst:
    """Requests that reached an idle counter together.

    Attributes:
        opened_s: clock time the first of them was admitted, seconds.
        limit: the limit when it opened, requests.
        last_s: clock time of its last admission of known size, while a budget was set,
            before one of it had to wait, seconds: the window runs from there.
        waited: one of its requests had to wait (the limit, the cap or the budget held it).
        tokens, requests: prompt tokens and requests of known size admitted so far.
        held: the budget held a request back (the rest of the burst is late).
        first_arrival: the limiter's running count of arrivals when it opened, its first
            request included (:meth:`serve.admission.slots.SlotCounter.arrived`): those since
            are its arrivals.
    """

    opened_s: float
    limit: int
    last_s: float = float("-inf")
    waited: bool = False
    tokens: int = 0
    requests: int = 0
    held: bool = False
    first_arrival: int = 0


class BurstAdmission:
    """The open burst and its budget (see module docstring).

    A request that reaches an idle counter on arrival opens a burst (:meth:`open`); the
    burst stays open while its requests of known size keep arriving within ``window_s`` of
    the last one admitted before it (until one of it has to wait: then the window runs on
    from the last of them). Sustained traffic, which queues, never keeps a burst open, nor
    does traffic of unknown sizes. A burst sent at once reaches the gateway spread out by
    its intake, over more than a second on a loaded machine, hence a window and not an
    instant.

    Args:
        window_s: :func:`burst_window_s`, seconds.
        clock: monotonic clock, seconds.

    Attributes:
        budget: prompt tokens a burst may bring past the limit (None: no budget, admission
            by count only).
        cap: most requests in flight a burst may reach so (None: the ceiling).
        rate: the prefill rate the budget was computed from, prompt tokens/s (None: none):
            :meth:`deadline_tokens`.
    """

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self.clock = clock
        self.budget: int | None = None
        self.cap: int | None = None
        self.rate: float | None = None
        self._burst: Burst | None = None

    def current(self) -> Burst | None:
        """The open burst, after closing one whose window has ended (None: none open)."""
        burst = self._burst
        if burst is not None and self.clock() - max(burst.opened_s, burst.last_s) > \
                self.window_s:
            self._burst = None
            return None
        return burst

    def open(self, limit: int, arrivals: int) -> None:
        """A request reached an idle counter on arrival at ``limit``, the ``arrivals``-th
        (the limiter's running count): a burst opens now."""
        self._burst = Burst(self.clock(), limit, first_arrival=arrivals)

    def first_wave(self, arrivals: int, most: int) -> bool | None:
        """Whether the open burst is in its first wave: it brought at most ``most`` (the
        ceiling) arrivals of the limiter's running count ``arrivals`` (:attr:`Burst.
        first_arrival`), as many as plain vLLM takes at once. None: no burst open."""
        burst = self.current()
        if burst is None:
            return None
        return arrivals - burst.first_arrival + 1 <= most

    def deadline_tokens(self, burst: Burst, arrived_at: float) -> int:
        """Prompt tokens the budget grows by for a request of ``burst`` that arrived at
        ``arrived_at`` (clock seconds): :attr:`rate` x the seconds since the burst opened
        (rule ``burst_deadline``). The budget is what the engine prefills within the TTFT
        target from the burst's start; a request that arrived later meets its own target
        later, and the engine prefills FCFS, so the tokens ahead of it may be as many as it
        prefills by then (the feasibility test of a FCFS queue with deadlines). A burst sent
        at once reaches the gateway spread over its intake, a second or more on a loaded
        machine."""
        if not self.rate:
            return 0
        return int(self.rate * max(0.0, arrived_at - burst.opened_s))

    def admits_past(self, burst: Burst, tokens: int, in_flight: int, most: int,
                    extra: int = 0) -> bool:
        """Whether ``burst`` admits one more request of ``tokens`` prompt tokens although the
        count would queue it: while fewer than ``most`` (the ceiling, or :attr:`cap` when
        lower) are in flight, and the burst's prompt tokens, its own included, are at most
        :attr:`budget` plus ``extra`` (:meth:`deadline_tokens`). A request the budget
        refuses marks the burst ``held``."""
        if self.budget is None or tokens <= 0:
            return False
        if self.cap is not None:
            most = min(most, self.cap)
        if in_flight >= most:
            return False
        if burst.tokens + tokens > self.budget + extra:
            burst.held = True  # the rest of the burst is late
            return False
        return True

    def count(self, tokens: int) -> None:
        """One request of ``tokens`` prompt tokens (0: unknown) was admitted now: the open
        burst counts it, and its window runs on from it while the budget counts it."""
        burst = self.current()
        if burst is None or tokens <= 0:
            return
        burst.tokens += tokens
        burst.requests += 1
        if not burst.waited and self.budget is not None:
            burst.last_s = self.clock()

    @property
    def admitted(self) -> tuple[int, int] | None:
        """The open burst's prompt tokens and requests admitted so far (None: none open)."""
        burst = self.current()
        return None if burst is None else (burst.tokens, burst.requests)
