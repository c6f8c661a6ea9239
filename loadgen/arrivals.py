"""When each request is due: an open-loop arrival process, pure and seeded.

``--request-rate R`` makes arrivals a Poisson process of rate R: independent exponential
gaps of mean 1/R. ``--burstiness b`` generalises the gaps to a gamma distribution of shape
b and the same mean (b = 1 is Poisson; b < 1 burstier, b > 1 more regular), as
``vllm bench serve`` does. An infinite rate makes every request due at once; the
concurrency limit, if any, then paces them (a closed loop).

Open loop matters for latency: a closed loop slows down with the server, so a slower
release is offered less load and hides part of its slowdown ("coordinated omission").
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

__all__ = ["arrival_times"]


def arrival_times(rate: float, rng: random.Random, burstiness: float = 1.0) -> Iterator[float]:
    """Seconds after the start at which each request is due; the first at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("the request rate and burstiness must be positive")
    due = 0.0
    if math.isinf(rate):
        while True:
            yield due
    scale = 1.0 / (rate * burstiness)  # gamma(shape b, scale 1/(R·b)) has mean 1/R
    while True:
        yield due
        due += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, scale)
