"""The named rules of the autotuner and the limiter, each of which can be switched off.

Every rule beyond plain AIMD (cut on overload, probe on demand, clamp to the bounds) must earn
its place: ``python -m bench.ablate`` switches each one off in turn and reruns the
simulator's trace suite over seeds, and a rule whose removal loses less than 2 % goodput on
every trace and profile is removed from the code. The switch is a bench-only
``ControllerConfig.ablate`` set of these names (no setting exposes it); the server always
runs every rule.

Standard library only.
"""

from __future__ import annotations

#: Rule name -> what it does (one line, for the ablation table).
RULES: dict[str, str] = {
    "burst_grace": "no latency cut while a burst that reached an idle engine prefills; "
                   "raise to the idle limit if the rest is queued",
    "burst_grace_end": "the burst grace ends when requests still arrive two ticks later",
    "draining_hold": "no second latency/KV cut while the last cut drains (in flight > limit)",
    "cooldown": "no probe, and no second latency/KV cut, for cooldown_s after a cut",
    "gradient_cut": "a latency far over target cuts by target/measured (at most halving)",
    "itl_fit_cut": "an inter-token cut goes to the ITL fit instead of the ratio",
    "await_sample": "no probe until the signal that cut was measured at the new limit",
    "kv_fit_probe": "a probe stops at the KV fit (running x kv_high / KV usage)",
    "itl_fit": "the ITL fit (TPOT line) bounds probes and the idle limit",
    "idle_restore": "an idle engine takes the idle limit (fits of recent traffic)",
    "kv_idle_fit": "the idle limit is at most what the KV cache holds at the mean size",
    "ttft_fit": "the idle limit is at most the prompts prefilled within the TTFT target",
    "overload_limit": "the idle limit is at most where a sustained overload settled",
    "engine_queue_ttft": "a TTFT breach with requests in the engine queue is not overload",
    "window_restart": "a cut starts the latency windows afresh",
    "burst_budget": "a burst at an idle engine is admitted past the limit by prompt tokens",
    "burst_held_lower": "a burst the budget held back lowers a raise made during it",
    "burst_no_shed": "no SLO shedding while a burst at an idle engine is open",
    "engine_queue_wait": "the engine queue holds at most rate x TTFT target requests",
}


def check(names: frozenset[str] | set[str]) -> frozenset[str]:
    """``names`` as a frozenset. Raises ValueError naming any that is not in :data:`RULES`."""
    unknown = sorted(set(names) - RULES.keys())
    if unknown:
        raise ValueError(f"unknown rule(s) {', '.join(unknown)}; known: {', '.join(RULES)}")
    return frozenset(names)
