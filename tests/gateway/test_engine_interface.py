"""The edge engine's two backends (in this process, and the node's engine process behind a
Unix socket) implement the one interface the pipeline uses, ``gateway.engine.EdgeEngine``:
every member, with the same parameters, coroutines where it has coroutines."""

from __future__ import annotations

import inspect

import pytest

from gateway.engine import EdgeEngine
from gateway.engine.local import EdgeBackend
from gateway.engine.process import EdgeClient

MEMBERS = sorted(
    name for name in {*vars(EdgeEngine), *EdgeEngine.__annotations__} if not name.startswith("_")
)


def test_the_interface_is_what_the_pipeline_asks_of_the_engine():
    assert MEMBERS == ["aclose", "check", "gauges", "is_running", "model_name", "reply", "snapshot", "stats", "structured_output"]


@pytest.mark.parametrize("backend", [EdgeBackend, EdgeClient], ids=["in-process", "engine-process"])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_backend_has_each_member_with_its_signature(backend, name):
    wanted = getattr(EdgeEngine, name, None)
    if name in EdgeEngine.__annotations__ and wanted is None:  # an attribute: set in __init__
        assert name in inspect.getsource(backend.__init__), f"{backend.__name__} sets no {name}"
        return
    got = getattr(backend, name)
    if isinstance(wanted, property):
        assert isinstance(got, property), f"{backend.__name__}.{name} is not a property"
        return
    assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), name
    assert list(inspect.signature(got).parameters) == list(inspect.signature(wanted).parameters), name
