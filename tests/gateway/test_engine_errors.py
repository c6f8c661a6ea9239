"""The edge engine's errors in the gateway's terms: one table for both backends, and every
error class the engine has is in it."""

from __future__ import annotations

import inspect

import orjson
import pytest

import edge_engine.errors as engine_errors
from edge_engine.errors import (
    DeadlineExceededError,
    EngineClosedError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)
from gateway.replies import ENGINE_ERRORS, engine_error, engine_error_of


def engine_error_classes() -> list[type[EngineError]]:
    return [c for _, c in inspect.getmembers(engine_errors, inspect.isclass) if issubclass(c, EngineError)]


def test_every_engine_error_class_is_mapped():
    classes = engine_error_classes()
    assert len(classes) >= 5
    assert set(classes) <= set(ENGINE_ERRORS), set(classes) - set(ENGINE_ERRORS)


EXAMPLES = [
    pytest.param(InvalidRequestError("max_tokens is too large", param="max_tokens", code="context_length_exceeded"), 400, id="invalid"),
    pytest.param(EngineOverloadedError("the queue is full", retry_after=3), 503, id="overloaded"),
    pytest.param(EngineOverloadedError("first token predicted late", retry_after=2, code="deadline_unattainable"), 503, id="unattainable-ttft"),
    pytest.param(EngineOverloadedError("tokens predicted too far apart", retry_after=1, code="tpot_unattainable"), 503, id="unattainable-tpot"),
    pytest.param(DeadlineExceededError(), 504, id="deadline"),
    pytest.param(EngineClosedError(), 503, id="closed"),
    pytest.param(EngineError("a step raised", code="engine_failure"), 502, id="internal"),
]


@pytest.mark.parametrize("exc, status", EXAMPLES)
def test_the_engine_process_answer_maps_as_the_in_process_error_does(exc, status):
    """What the engine server sends for ``exc`` (its ``to_dict`` and status, Retry-After for
    an overloaded queue) comes back as the same engine error, then the same gateway error."""
    local = engine_error(exc)
    assert local.status == status
    retry_after = str(exc.retry_after).encode() if isinstance(exc, EngineOverloadedError) else None
    remote = engine_error(engine_error_of(exc.status_code, orjson.dumps(exc.to_dict()), retry_after))
    assert (type(remote), remote.status, remote.code, remote.param, remote.message, remote.retry_after) == (
        type(local), local.status, local.code, local.param, local.message, local.retry_after,
    )


def test_a_body_that_is_not_the_engines_still_maps_by_status():
    error = engine_error(engine_error_of(502, b"<html>bad gateway</html>", None))
    assert error.status == 502 and "502" in error.message
