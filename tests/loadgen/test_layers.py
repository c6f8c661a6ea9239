"""loadgen stands alone: it works against any URL, so it never imports the gateway's
packages, and its public names exist."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import loadgen
from tests.conftest import ROOT


def test_loadgen_imports_none_of_the_gateways_packages():
    modules = [f"loadgen.{m.name}" for m in pkgutil.iter_modules(loadgen.__path__) if m.name != "__main__"]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'gateway', 'routing', 'cache', 'edge_engine', 'torch', 'httpx', 'matplotlib'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_exports():
    for name in loadgen.__all__:
        assert hasattr(loadgen, name), name
    assert sorted(loadgen.__all__) == loadgen.__all__
