"""The layering as import contracts (pyproject.toml ``[tool.importlinter]``): gateway's rooms
import only down the data path, the lower packages import no gateway and none of each
other, and nothing imports in a circle. A cycle or an upward import fails here the day it
appears."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_LINT = "import sys; from importlinter import cli; sys.exit(cli.lint_imports(no_cache=True, no_logo=True))"


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    """import-linter over the packages under ``root``, with ``root``'s pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", _LINT], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_project_keeps_its_import_contracts():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "importer, imported",
    [
        pytest.param("gateway/pipeline/flow.py", "gateway.admission.gate", id="pipeline-imports-admission"),
        pytest.param("gateway/core/deadline.py", "gateway.observe.metrics", id="core-imports-a-room"),
        pytest.param("routing/policy.py", "gateway.core.errors", id="routing-imports-gateway"),
        pytest.param("gateway/core/sse.py", "gateway.core.context", id="a-cycle"),
    ],
)
def test_the_contracts_catch_an_import_against_them(tmp_path, importer, imported):
    """The same contracts over a copy of the packages with one import added that breaks them."""
    for package in ("gateway", "routing", "cache", "edge_engine", "loadgen"):
        for path in (ROOT / package).rglob("*.py"):
            target = tmp_path / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
    added = tmp_path / importer
    added.write_text(added.read_text() + textwrap.dedent(f"\n\nimport {imported}  # noqa\n"))
    if imported == "gateway.core.context":  # context already imports sse's neighbours; make the circle explicit
        context = tmp_path / "gateway/core/context.py"
        context.write_text(context.read_text() + "\n\nimport gateway.core.sse  # noqa\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    result = lint(tmp_path)
    assert result.returncode != 0 and "0 broken" not in result.stdout, result.stdout + result.stderr
