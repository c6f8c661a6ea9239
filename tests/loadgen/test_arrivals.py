"""The arrival process: the asked rate, Poisson's spread, burstiness, reproducibility."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from loadgen.arrivals import arrival_times


def gaps(rate: float, seed: int = 1, burstiness: float = 1.0, n: int = 20_000) -> list[float]:
    times = list(itertools.islice(arrival_times(rate, random.Random(seed), burstiness), n + 1))
    return [b - a for a, b in zip(times, times[1:])]


@pytest.mark.parametrize("rate", [0.5, 20.0, 5000.0])
def test_mean_gap_is_one_over_the_rate(rate):
    assert statistics.fmean(gaps(rate)) == pytest.approx(1 / rate, rel=0.03)


@pytest.mark.parametrize(
    "burstiness,cv",
    [pytest.param(1.0, 1.0, id="poisson"), pytest.param(0.25, 2.0, id="bursty"), pytest.param(4.0, 0.5, id="regular")],
)
def test_burstiness_sets_the_spread_of_the_gaps(burstiness, cv):
    g = gaps(10.0, burstiness=burstiness)
    assert statistics.fmean(g) == pytest.approx(0.1, rel=0.04)
    assert statistics.stdev(g) / statistics.fmean(g) == pytest.approx(cv, rel=0.06)


def test_first_request_is_due_at_once_and_the_same_seed_gives_the_same_times():
    a = list(itertools.islice(arrival_times(3.0, random.Random("7:0:arrivals")), 50))
    b = list(itertools.islice(arrival_times(3.0, random.Random("7:0:arrivals")), 50))
    c = list(itertools.islice(arrival_times(3.0, random.Random("7:1:arrivals")), 50))
    assert a[0] == 0.0 and a == b and a != c
    assert a == sorted(a)


def test_an_unlimited_rate_makes_everything_due_at_once():
    assert list(itertools.islice(arrival_times(float("inf"), random.Random(0)), 5)) == [0.0] * 5


@pytest.mark.parametrize("rate,burstiness", [(0, 1), (-1, 1), (1, 0)])
def test_rejects_non_positive_parameters(rate, burstiness):
    with pytest.raises(ValueError):
        next(arrival_times(rate, random.Random(0), burstiness))
