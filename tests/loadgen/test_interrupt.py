"""Ctrl-C during a run: the partial report, a result marked interrupted, exit status 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from loadgen.result import load_result
from tests.conftest import ROOT


def test_ctrl_c_reports_what_completed(upstreams, tmp_path):
    fake = upstreams(ttft=0.05, tokens=2)
    path = tmp_path / "partial.json"
    argv = [
        sys.executable, "-m", "loadgen", "--base-url", fake.url + "/v1", "--num-prompts", "100000", "--max-concurrency", "2",
        "--input-len", "4", "--baseline", str(tmp_path / "unused.json"), "--save-result", str(path), "--no-progress",
    ]  # fmt: skip
    (tmp_path / "unused.json").write_bytes(b"")  # an unreadable baseline is refused before the run...
    refused = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not an edgegw bench result" in refused.stderr
    argv = argv[: argv.index("--baseline")] + argv[argv.index("--save-result") :]  # ...so run without one

    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(fake.requests) < 12:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted: reporting what completed" in err
    assert "INTERRUPTED: partial results" in out and "Latency (ms)" in out
    result = load_result(str(path))
    assert result.interrupted and result.runs[0].interrupted
    # 12 seen by the fake = the warm-up + what completed + at most 2 in flight, cancelled (not failures)
    assert 9 <= result.runs[0].completed < 100000 and result.runs[0].failed == 0
