"""Statistics of ``make bench``'s blocked, paired comparison of servers ("arms") (pure, stdlib).

Design after Kalibera & Jones, "Rigorous benchmarking in reasonable time" (ISMM 2013): the
run is a sequence of **blocks**; in each block every arm measures every cell once, in an order
balanced over blocks (:func:`balanced_orders`), so a slow spell of the machine hits the arms
alike. A comparison is **paired** within a block (:func:`paired_log_ratios`,
:func:`paired_differences`), and its uncertainty comes from the spread of those per-block
values across blocks: a Student-t interval of their mean (:func:`t_interval`) and, as a
cross-check that assumes no normality, a percentile bootstrap over blocks
(:func:`bootstrap_interval`). A ratio's interval is ``exp`` of its log-ratio interval
(:func:`exp_interval`), so ``ours/raw`` and ``raw/ours`` are symmetric.

Intervals are ``(estimate, lo, hi)`` tuples of floats in the unit of the values (a log-ratio
interval is unitless; a difference of milliseconds is in ms).

``blocks`` (:data:`Blocks`) maps a block's key (e.g. ``(run, block)``) to
``{cell: {arm: metrics}}``, where ``metrics`` maps a metric's name to a number or ``None``.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Interval = tuple[float, float, float]
Metrics = Mapping[str, Any]
Blocks = Mapping[Any, Mapping[str, Mapping[str, Metrics]]]
#: A metric: its key in a segment's ``metrics``, or a function of those metrics (``None`` when
#: the segment lacks it).
MetricOf = str | Callable[[Metrics], "float | None"]


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method).

    Source: Press et al., *Numerical Recipes*, 3rd ed. (2007), section 6.4, ``betacf``.
    Raises ArithmeticError if it does not converge (it does in < 100 terms for the
    arguments :func:`t_cdf` passes).
    """
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence at a={a}, b={b}, x={x}")


def incomplete_beta(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function ``I_x(a, b)`` for ``a, b > 0``, ``0 <= x <= 1``.

    Source: Numerical Recipes, 3rd ed., section 6.4 (the symmetry ``I_x(a,b) = 1 - I_{1-x}(b,a)``
    keeps the continued fraction in its fast-converging range).
    """
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student-t cumulative distribution function with ``df > 0`` degrees of freedom.

    Source: Abramowitz & Stegun (1964), 26.7.1 with 26.5.27:
    ``P(T <= t) = 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2`` for ``t >= 0``, symmetric below 0.
    """
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection of t_cdf).

    Accurate to ~1e-12 relative, e.g. ``t_quantile(0.95, 9) = 1.8331`` (any t table).
    Raises ValueError unless ``0 < p < 1`` and ``df > 0``.
    """
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def _sample(values: Sequence[float], level: float, what: str) -> list[float]:
    """The values as floats, checked: at least 2, all finite, and ``0 < level < 1``."""
    xs = [float(v) for v in values]
    if len(xs) < 2:
        raise ValueError(f"{what} needs at least 2 values (one per block), got {len(xs)}")
    if not all(math.isfinite(v) for v in xs):
        raise ValueError(f"{what} needs finite values, got {xs}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"{what} needs 0 < level < 1, got {level}")
    return xs


def t_interval(values: Sequence[float], level: float = 0.90) -> Interval:
    """Mean of the per-block ``values`` and its two-sided Student-t confidence interval.

    ``mean -+ t_{(1+level)/2, n-1} * s / sqrt(n)`` (``s``: sample standard deviation).
    Kalibera & Jones (ISMM 2013), section 3: the t-interval over independent blocks.
    Raises ValueError with fewer than 2 values, a non-finite value or a level outside (0, 1).
    """
    xs = _sample(values, level, "t_interval")
    mean = statistics.fmean(xs)
    half = t_quantile((1.0 + level) / 2.0, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return mean, mean - half, mean + half


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Quantile ``q`` of sorted values, linear between order statistics (Hyndman & Fan type 7)."""
    pos = q * (len(ordered) - 1)
    i = min(int(pos), len(ordered) - 2)
    return ordered[i] + (pos - i) * (ordered[i + 1] - ordered[i])


def bootstrap_interval(values: Sequence[float], level: float = 0.90, resamples: int = 2000,
                       seed: int = 0) -> Interval:
    """Mean of the per-block ``values`` and its percentile-bootstrap confidence interval.

    Resamples the blocks with replacement ``resamples`` times (``random.Random(seed)``:
    deterministic) and takes the ``(1-level)/2`` and ``(1+level)/2`` quantiles of the
    resampled means. Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), ch. 13;
    over blocks as in Kalibera & Jones (ISMM 2013), section 4. Raises ValueError as
    :func:`t_interval` does, or when ``resamples < 2``.
    """
    xs = _sample(values, level, "bootstrap_interval")
    if resamples < 2:
        raise ValueError(f"bootstrap_interval needs resamples >= 2, got {resamples}")
    rng, n = random.Random(seed), len(xs)
    means = sorted(statistics.fmean(rng.choices(xs, k=n)) for _ in range(resamples))
    return (statistics.fmean(xs), _quantile(means, (1.0 - level) / 2.0),
            _quantile(means, (1.0 + level) / 2.0))


def exp_interval(interval: Interval) -> Interval:
    """A ratio's interval from its log-ratio interval: ``exp`` of each end (and estimate)."""
    return tuple(math.exp(v) for v in interval)  # type: ignore[return-value]


def metric_value(metrics: Metrics | None, metric: MetricOf) -> float | None:
    """A segment's metric as a float; ``None`` when the segment or metric is absent or null."""
    if metrics is None:
        return None
    value = metric(metrics) if callable(metric) else metrics.get(metric)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _pairs(blocks: Blocks, cell: str, metric: MetricOf, arm: str, base: str):
    """``(arm value, base value)`` per block where both are present, in the blocks' order."""
    for arms in blocks.values():
        segs = arms.get(cell, {})
        a, b = metric_value(segs.get(arm), metric), metric_value(segs.get(base), metric)
        if a is not None and b is not None:
            yield a, b


def paired_log_ratios(blocks: Blocks, cell: str, metric: MetricOf, arm: str,
                      base: str = "raw") -> list[float]:
    """``log(arm / base)`` of ``metric`` in ``cell``, one per block where both are positive."""
    return [math.log(a / b) for a, b in _pairs(blocks, cell, metric, arm, base) if a > 0 and b > 0]


def paired_differences(blocks: Blocks, cell: str, metric: MetricOf, arm: str,
                       base: str = "raw") -> list[float]:
    """``arm - base`` of ``metric`` in ``cell`` (its unit), one per block where both exist."""
    return [a - b for a, b in _pairs(blocks, cell, metric, arm, base)]


def balanced_orders(n_blocks: int, arms: Sequence[str],
                    rng: random.Random) -> list[tuple[str, ...]]:
    """The arms' order in each of ``n_blocks`` blocks, balanced over cycles of permutations.

    Each run of ``len(arms)!`` consecutive blocks starting at a multiple of it holds every
    permutation exactly once, in an order shuffled per cycle by ``rng`` (so no arm always
    follows another, and a drift in the machine's speed cancels over a cycle: Kalibera &
    Jones, ISMM 2013, on randomized execution order). Call it once per cell so each cell has
    its own sequence. Raises ValueError on repeated arms or a negative ``n_blocks``.
    """
    if len(set(arms)) != len(arms) or n_blocks < 0:
        raise ValueError(f"balanced_orders needs distinct arms and n_blocks >= 0, "
                         f"got {list(arms)}, {n_blocks}")
    perms = list(itertools.permutations(arms))
    orders: list[tuple[str, ...]] = []
    while len(orders) < n_blocks:
        cycle = perms[:]
        rng.shuffle(cycle)
        orders.extend(cycle)
    return orders[:n_blocks]
