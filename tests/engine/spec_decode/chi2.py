"""Chi-square bounds for the distribution tests (no scipy here)."""

from __future__ import annotations

import math


def chi2_limit(df: int, z: float = 3.29) -> float:
    """The chi-square quantile at p ~ 0.9995 (Wilson-Hilferty): a true match fails 1 run in 2,000."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def two_sample_stat(a: dict[int, int], b: dict[int, int], min_count: int = 10) -> tuple[float, int]:
    """(statistic, degrees of freedom) of two equal-sized samples' counts; rare categories pooled."""
    keys = set(a) | set(b)
    rare = [k for k in keys if a.get(k, 0) + b.get(k, 0) < min_count]
    cells = [(a.get(k, 0), b.get(k, 0)) for k in keys if k not in rare]
    pooled = (sum(a.get(k, 0) for k in rare), sum(b.get(k, 0) for k in rare))
    if sum(pooled):
        cells.append(pooled)
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    return stat, max(len(cells) - 1, 1)
