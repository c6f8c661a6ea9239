"""The step cost model: an online fit of fixed + per decode row + per prefill token that
follows the node's load (no clock: the steps are given)."""

from __future__ import annotations

import random

import pytest

from edge_engine.step_cost import StepCostModel


def steps(model: StepCostModel, n: int, fixed: float, per_row: float, per_token: float, rng: random.Random, noise=0.0):
    for _ in range(n):
        rows = rng.randint(1, 32)
        tokens = rng.choice([0, 0, 0, 16, 64, 200])
        model.observe(rows, tokens, fixed + per_row * rows + per_token * tokens + rng.gauss(0, noise))


def test_the_fit_recovers_the_step_costs_it_is_shown():
    model = StepCostModel()
    steps(model, 300, 0.004, 0.0045, 0.0026, random.Random(1))
    fixed, per_row, per_token = model.coefficients
    assert fixed == pytest.approx(0.004, abs=0.002)
    assert per_row == pytest.approx(0.0045, rel=0.05) and per_token == pytest.approx(0.0026, rel=0.05)
    assert model.predict(16, 0) == pytest.approx(0.004 + 16 * 0.0045, rel=0.05)


def test_a_node_that_gets_twice_as_slow_moves_the_fit_within_tens_of_steps():
    model = StepCostModel()
    rng = random.Random(2)
    steps(model, 200, 0.004, 0.0045, 0.0026, rng)
    quiet = model.predict(32, 0)
    steps(model, 60, 0.008, 0.009, 0.0052, rng)  # a CPU hog took half the cores
    assert model.predict(32, 0) == pytest.approx(2 * quiet, rel=0.1)
    steps(model, 60, 0.004, 0.0045, 0.0026, rng)  # and went away
    assert model.predict(32, 0) == pytest.approx(quiet, rel=0.1)


def test_steps_that_only_show_one_batch_size_still_predict_nearby_ones_sensibly():
    model = StepCostModel()
    for _ in range(200):
        model.observe(32, 0, 0.150)  # 32 decode rows, always
    assert model.predict(32, 0) == pytest.approx(0.150, rel=0.01)
    assert 0.0 < model.predict(16, 0) < 0.150 and model.predict(1, 0) < model.predict(16, 0)
    assert all(c >= 0 for c in model.coefficients)


def test_no_coefficient_goes_negative_and_one_outlier_is_clipped():
    model = StepCostModel()
    for _ in range(50):
        model.observe(8, 0, 0.020)
        model.observe(1, 0, 0.030)  # fewer rows slower: noise that would make per_row negative
    assert all(c >= 0 for c in model.coefficients)
    model = StepCostModel()
    for _ in range(50):
        model.observe(8, 0, 0.020)
    model.observe(8, 0, 5.0)  # the first step's lazy set-up, a page-fault storm
    assert model.predict(8, 0) < 0.1
