"""Fixtures for the load generator's tests: ``bench(...)`` runs ``edgegw bench`` in this
process (against the fake upstreams of ``tests.fakes``) and hands back the exit status,
the result document it printed with ``--json``, and the tables it wrote."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from loadgen.cli import main
from loadgen.result import BenchResult


@dataclass
class Outcome:
    code: int
    result: BenchResult | None
    err: str  # the tables (on stderr with --json), notes and errors


@pytest.fixture
def bench(capsys):
    def run(*args: str) -> Outcome:
        code = main(["--no-progress", "--json", *args])
        captured = capsys.readouterr()
        result = BenchResult.model_validate(orjson.loads(captured.out)) if captured.out.strip() else None
        return Outcome(code, result, captured.err)

    return run


@pytest.fixture
def dataset(tmp_path):
    """Write JSONL lines (dicts) to a file and return its path."""

    def write(lines: list[dict], name: str = "data.jsonl") -> str:
        path = Path(tmp_path) / name
        path.write_bytes(b"\n".join(orjson.dumps(line) for line in lines) + b"\n")
        return str(path)

    return write


