"""Step cost models for tests: a fit that the engine's measured steps do not move, so a test
says what the engine believes a step costs, whatever this shared machine's clock says."""

from __future__ import annotations

from edge_engine.step_cost import StepCostModel


class FrozenCost(StepCostModel):
    """``fixed + per_row * rows + per_token * tokens`` seconds, as given; ``observe`` learns nothing."""

    __slots__ = ()

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        pass


def freeze(engine, fixed: float = 0.0, per_row: float = 0.0, per_token: float = 0.0) -> FrozenCost:
    """Give ``engine`` (its scheduler and its admission) a frozen step cost model."""
    cost = FrozenCost(fixed, per_row, per_token)
    engine.cost = engine.scheduler.cost = cost
    return cost
