"""The goodput rule, written once (pure): the server's accounting
(``serve.admission.middleware``) and the simulator (``bench/sim.py``) both judge requests
with it.

Goodput is DistServe's definition (Zhong et al., OSDI 2024; as ``vllm bench serve
--goodput``): a finished request counts when its TTFT <= the TTFT target and its mean
inter-token latency (TPOT) <= the ITL target, both as the client sees them (queue wait
included). A non-streamed answer has no visible first token, so it counts when its E2E latency
<= TTFT target + ITL target x (completion tokens - 1): the same budget spread over the whole
answer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SloTargets:
    """Per-request latency targets, seconds."""

    ttft_s: float
    itl_s: float


def streamed_good(ttft_s: float | None, mean_itl_s: float | None, slo: SloTargets) -> bool:
    """A finished streamed answer met both targets (``mean_itl_s`` None: one token)."""
    return ttft_s is not None and ttft_s <= slo.ttft_s and (
        mean_itl_s is None or mean_itl_s <= slo.itl_s)


def non_streamed_good(e2e_s: float | None, completion_tokens: int, slo: SloTargets) -> bool:
    """A finished non-streamed answer of ``completion_tokens`` arrived within the budget."""
    return e2e_s is not None and e2e_s <= slo.ttft_s + slo.itl_s * max(0, completion_tokens - 1)
