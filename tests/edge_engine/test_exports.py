"""The public surface of edge_engine and its import boundary."""

from __future__ import annotations

import subprocess
import sys

import edge_engine


def test_all_names_exist():
    assert sorted(edge_engine.__all__) == edge_engine.__all__
    for name in edge_engine.__all__:
        assert getattr(edge_engine, name) is not None
    for name in ("Engine", "EngineConfig", "OpenAIServing", "EngineError", "InvalidRequestError", "EngineOverloadedError"):
        assert name in edge_engine.__all__


def test_edge_engine_imports_no_other_package_of_the_project():
    code = (
        "import sys, edge_engine, edge_engine.server; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'gateway', 'cache', 'routing'}); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
