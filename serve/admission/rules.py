"""The named rules of the autotuner and the limiter, each of which can be switched off.

Every rule beyond plain AIMD (cut on overload, probe on demand, clamp to the bounds) must earn
its place: ``python -m bench.ablate`` switches each one off in turn and reruns the
simulator's trace suite over seeds, and a rule whose removal loses less than 2 % goodput on
every trace and profile is removed from the code (docs/admission.md has the
table, with the rules that went). Two rules are also guarantees, which goodput does not
show: ``burst_no_shed`` (a burst of at most ``max_num_seqs`` at an idle server is never
refused, as plain vLLM never refuses it; ``make bench``'s W4 target) and
``fair_below_share``, kept for that alone (a light tenant is not refused while another floods:
judged on the simulator's two-tenant trace, ``bench.trace.tenants_trace``). The switch is a
bench-only ``ControllerConfig.ablate`` set of these names (no setting exposes it); the
server always runs every rule.

Standard library only.
"""

from __future__ import annotations

#: Rule name -> what it does (one line, for the ablation table).
RULES: dict[str, str] = {
    "kv_cache_cut": "KV-cache usage at or over kv_high_ratio cuts the limit while requests "
                    "queue at the gateway",
    "slo_shed": "a request whose expected queue wait exceeds the TTFT target is refused at once",
    "queue_deadline": "a queued request of a tenant alone or over its share is refused once "
                      "less of the TTFT target is left than the recent time from admission "
                      "to a first token (the whole target before one is seen)",
    "kv_fit_probe": "a probe stops at the KV fit (running x kv_probe / KV usage)",
    "idle_restore": "an idle engine takes the idle limit (fits of recent traffic)",
    "kv_idle_fit": "the idle limit is what the KV cache holds at the recent mean size",
    "burst_budget": "a burst at an idle engine is admitted past the limit by prompt tokens",
    "burst_deadline": "a burst's prefill budget grows, for a request that arrived s seconds "
                      "after the burst opened, by what the engine prefills in s (its TTFT "
                      "deadline is that much later)",
    "burst_no_shed": "no SLO shedding while a burst at an idle engine is open, and no queue "
                     "deadline for its first max_num_seqs arrivals while it brings no more",
    "engine_queue_wait": "the engine queue holds at most rate x TTFT target requests "
                         "(none before a rate is known)",
    "probe_no_shed": "a queued request the next probe would admit is not shed for its "
                     "expected wait",
    "prefill_backlog": "in auto, a request enters the engine only while the predicted prefill "
                       "seconds of those admitted without a first token, plus its own, fit "
                       "the TTFT target",
    "prefill_shed": "in auto, while one tenant is active, a request that could meet the TTFT "
                    "target alone but not behind the prefill backlog and the queue ahead is "
                    "refused at once",
    "prefill_duty": "in auto, while streams decode (no burst at an idle engine open), the "
                    "prefill admitted over the last 2 TTFT targets stays within 1 - step / "
                    "ITL target of that time",
    "fair_below_share": "a tenant below its share of the slots is not shed for the engine "
                        "queue others filled",
}


def check(names: frozenset[str] | set[str]) -> frozenset[str]:
    """``names`` as a frozenset. Raises ValueError naming any that is not in :data:`RULES`."""
    unknown = sorted(set(names) - RULES.keys())
    if unknown:
        raise ValueError(f"unknown rule(s) {', '.join(unknown)}; known: {', '.join(RULES)}")
    return frozenset(names)
