"""The load generator's own cost: CPU per request of ``edgegw bench`` (``loadgen/``).

    .venv/bin/python bench/client_cost.py [--requests 4000] [--reps 3]

Starts ``bench/fast_upstream.py`` (raw asyncio + httptools, zero delays, 64-token answers)
pinned to core 1, and runs ``python -m loadgen`` pinned to core 0 against it, closed loop
at concurrency 1, 16 and 64, non-streaming and streaming (64 content chunks + finish +
usage-less ``[DONE]``). The figure is what the tool itself reports: its process CPU (user +
system, ``time.process_time``) over the run divided by the requests; its share of a core
and the p99 lag tell whether it kept up. Medians over ``--reps``; the upstream is the only
other process started, and it is stopped by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.processes import free_port, pinned, stop, wait_http  # noqa: E402

PY = sys.executable


def measure(port: int, requests: int, concurrency: int, stream: bool) -> dict:
    argv = pinned(0, [
        PY, "-m", "loadgen", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "bench-model",
        "--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--input-len", "64",
        "--stream" if stream else "--no-stream", "--no-progress", "--json",
    ])  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    run = json.loads(done.stdout)["runs"][0]
    client = run["client"]
    return {
        "cpu_ms": client["cpu_ms_per_request"],
        "share": client["cpu_share"],
        "lag_p99": client["lag_ms"]["p99"],
        "rps": run["request_throughput"],
        "failed": run["failed"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    upstream = subprocess.Popen(
        pinned(1, [PY, "bench/fast_upstream.py", "--port", str(port), "--tokens", "64"]),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_http(port, "/health", upstream, timeout=20)
        print("| answer | concurrency | loadgen CPU ms/request | its core share | lag p99 ms | req/s | failed |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for stream in (False, True):
            for concurrency in (1, 16, 64):
                reps = [measure(port, args.requests, concurrency, stream) for _ in range(args.reps)]
                med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
                cpu = [r["cpu_ms"] for r in reps]
                print(
                    f"| {'SSE, 64 chunks' if stream else 'JSON'} | {concurrency} | {med['cpu_ms']:.3f} ({min(cpu):.3f}–{max(cpu):.3f}) "
                    f"| {med['share'] * 100:.0f} % | {med['lag_p99']:.2f} | {med['rps']:.0f} | {sum(r['failed'] for r in reps)} |",
                    flush=True,
                )
    finally:
        stop(upstream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
