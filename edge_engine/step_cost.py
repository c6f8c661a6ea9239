"""What one engine step costs, learnt from the steps the engine runs (plain Python).

    seconds ~= fixed + per_row * decode_rows + per_token * prefill_tokens

``decode_rows`` are the sequences of the step that compute one token (a decode), and
``prefill_tokens`` the tokens of its prefill chunks.  The three coefficients are an
exponentially weighted least-squares fit over the measured steps (each new step weighs
``1 / forgetting`` times the one before it: the last ~20 steps count, so a node that gets
busier -- another process taking a core -- moves the fit within them), pulled gently
towards a prior (a hundredth of one step's weight) so that a direction the recent steps do
not explore (say, 32 decode rows every step: only ``fixed + 32 * per_row`` is seen) keeps a
sensible split; no coefficient goes below zero.

The scheduler sizes its steps with ``predict`` (which rows fit a time-per-output-token
objective, how large a prefill chunk may be) and the engine's admission predicts a
request's time to first token with it.  Tests give a fitted model known steps, or freeze it
(``observe`` is never called: the prior is the model).
"""

from __future__ import annotations

__all__ = ["StepCostModel"]

# The features are raw counts: a step of 32 rows has x = (1, 32, 0), so when the steps seen
# show only their sum, the ridge puts what they add over the prior almost all on the
# per-row (or per-token) term, not on the fixed cost -- which is where it belongs on this
# engine (a decode step costs ~5 ms a row), and a one-row step keeps being predicted cheap.


class StepCostModel:
    """``predict(decode_rows, prefill_tokens)`` in seconds; ``observe(...)`` a measured step."""

    __slots__ = ("_prior", "_forgetting", "_prior_weight", "_xtx", "_xty", "_theta", "num_samples")

    def __init__(
        self,
        fixed: float = 0.005,
        per_row: float = 0.002,
        per_token: float = 0.001,
        *,
        forgetting: float = 0.95,
        prior_weight: float = 0.01,
    ) -> None:
        assert 0.0 < forgetting <= 1.0 and prior_weight > 0.0
        assert fixed >= 0.0 and per_row >= 0.0 and per_token >= 0.0
        self._prior = [fixed, per_row, per_token]
        self._forgetting = forgetting
        self._prior_weight = prior_weight
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._theta = list(self._prior)
        self.num_samples = 0

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(fixed, per_row, per_token) in seconds."""
        a, b, c = self._theta
        return a, b, c

    def predict(self, decode_rows: int, prefill_tokens: int) -> float:
        a, b, c = self._theta
        return a + b * decode_rows + c * prefill_tokens

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """A step of ``decode_rows`` decodes and ``prefill_tokens`` prefill tokens took
        ``seconds``.  One outlier (the first steps' lazy set-up, a page-fault storm) is
        clipped to four times the prediction plus 10 ms; a lasting slowdown still moves the
        fit, clip after clip (a few steps to follow a node that got ten times slower)."""
        if seconds < 0.0 or (decode_rows == 0 and prefill_tokens == 0):
            return
        seconds = min(seconds, 4.0 * self.predict(decode_rows, prefill_tokens) + 0.010)
        x = (1.0, float(decode_rows), float(prefill_tokens))
        lam = self._forgetting
        for i in range(3):
            row = self._xtx[i]
            for j in range(3):
                row[j] = lam * row[j] + x[i] * x[j]
            self._xty[i] = lam * self._xty[i] + x[i] * seconds
        self.num_samples += 1
        self._theta = self._solve()

    def _solve(self) -> list[float]:
        """Ridge towards the prior, with the coefficients that come out negative fixed at
        zero and the rest solved again (an active set: at most three rounds)."""
        w = self._prior_weight
        free = [0, 1, 2]
        theta = [0.0, 0.0, 0.0]
        while free:
            a = [[self._xtx[i][j] + (w if i == j else 0.0) for j in free] for i in free]
            b = [self._xty[i] + w * self._prior[i] for i in free]
            solution = _gauss(a, b)
            if solution is None:
                return list(self._theta)
            negative = [k for k, v in zip(free, solution) if v < 0.0]
            if not negative:
                for k, v in zip(free, solution):
                    theta[k] = v
                return theta
            free = [k for k in free if k not in negative]
        return theta

    def __repr__(self) -> str:
        a, b, c = self.coefficients
        return f"<StepCostModel fixed={a * 1e3:.2f}ms per_row={b * 1e3:.3f}ms per_token={c * 1e3:.3f}ms samples={self.num_samples}>"


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve ``a x = b`` (small, symmetric positive definite) by elimination; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
