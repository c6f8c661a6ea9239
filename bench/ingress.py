"""The gateway's ingress server as a measured choice: uvicorn with the gateway's own
HTTP/1.1 protocol (``gateway.ingress.http1``, what ``edgegw serve`` runs) against granian
(a Rust HTTP server with an ASGI interface) serving the same app, in one run.

granian is the bench's own set-up, not a dependency of the project:

    .venv/bin/python -m pip install --no-deps --target /tmp/granian-py granian==2.8.9
    .venv/bin/python bench/ingress.py --granian /tmp/granian-py [--reps 3] [--json FILE]

Processes (each started here, stopped here by PID; traffic only on 127.0.0.1): the fast
upstream (``bench/fast_upstream.py``) and this process's load generator on core 1, and the
two gateways on core 0, one after the other under each load (``bench/relay.py``'s loads and
client): granian with one worker, uvloop, the app built by ``gateway.node.app.create_app`` from
the same configuration. Reported: the gateway's CPU (process and children) per
non-streaming request and per relayed SSE event, medians over the repetitions, and
granian's as a ratio to uvicorn's. granian does not apply the listener limits of
``H1Protocol`` (header size and count, header timeout, connection limit); this measures
the cost of serving, not those.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from bench.processes import Child, free_port, pinned  # noqa: E402
from relay import GATEWAY_CORE, MODEL, OTHER_CORE, PY, TOKENS, gateway_config, run_phase, summarise  # noqa: E402

SHIM = '''import os
from gateway.node.app import create_app
from gateway.core.settings import load_settings


def app():
    return create_app(load_settings(os.environ["EDGEGW_CONFIG"]))
'''

# (name, concurrency, requests or streams, stream, seconds between tokens)
LOADS = [
    ("json-c1", 1, 1500, False, 0.0),
    ("json-c16", 16, 4000, False, 0.0),
    ("json-c64", 64, 6400, False, 0.0),
    ("sse-c64", 64, 640, True, 0.0),
    ("sse-c64-paced", 64, 192, True, 0.01),
]


def start(tmp: str, granian_dir: str) -> tuple[list[Child], dict[str, tuple[int, Child]]]:
    children: list[Child] = []
    fast_port = free_port()
    fast = Child("fast-upstream", pinned(OTHER_CORE, [PY, "bench/fast_upstream.py", "--port", str(fast_port), "--tokens", str(TOKENS), "--model", MODEL]), tmp)
    children.append(fast)
    fast.wait_http(fast_port, "/health")
    with open(os.path.join(tmp, "granian_app.py"), "w") as f:
        f.write(SHIM)
    targets = {}
    for name in ("uvicorn", "granian"):
        port = free_port()
        path = os.path.join(tmp, f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(gateway_config(fast_port, "http1", port), f)
        if name == "uvicorn":
            argv = [PY, "-m", "gateway", "serve", "--config", path]
        else:
            argv = [PY, "-m", "granian", "--interface", "asgi", "--factory", "--host", "127.0.0.1", "--port", str(port),
                    "--workers", "1", "--loop", "uvloop", "--no-ws", "--log-level", "warning", "granian_app:app"]
            os.environ["EDGEGW_CONFIG"] = path
            os.environ["PYTHONPATH"] = os.pathsep.join([tmp, granian_dir, ROOT])
        gw = Child(name, pinned(GATEWAY_CORE, argv), tmp)
        children.append(gw)
        gw.wait_http(port, "/readyz", timeout=60)
        targets[name] = (port, gw)
    return children, targets


async def measure(targets: dict[str, tuple[int, Child]], reps: int) -> dict:
    results: dict = {name: {load[0]: [] for load in LOADS} for name in targets}
    for rep in range(reps):
        for load, conc, n, stream, delay in LOADS:
            for name, (port, gw) in targets.items():  # alternating, load by load
                s = summarise(await run_phase(port, conc, n, stream, gw, delay), stream)
                value = s.get("cpu_us_per_event") if stream else s.get("cpu_ms_per_req")
                results[name][load].append({"cpu": value, "errors": s["errors"]})
                print(f"rep {rep + 1} {name:8} {load:14} err={s['errors']} cpu {value:.3f}", file=sys.stderr, flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--granian", required=True, metavar="DIR", help="a directory holding granian (pip install --target)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    os.sched_setaffinity(0, {OTHER_CORE})
    tmp = tempfile.mkdtemp(prefix="edgegw-ingress-")
    children: list[Child] = []
    try:
        children, targets = start(tmp, os.path.abspath(args.granian))
        results = asyncio.run(measure(targets, args.reps))
    finally:
        for c in reversed(children):
            c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"Medians over {args.reps} repetitions; gateways pinned to core {GATEWAY_CORE}, upstream and load generator on core {OTHER_CORE}.\n")
    print("| load | uvicorn + H1Protocol | granian | granian / uvicorn | failed |")
    print("|---|---:|---:|---:|---:|")
    for load, *_ in LOADS:
        u = statistics.median(r["cpu"] for r in results["uvicorn"][load])
        g = statistics.median(r["cpu"] for r in results["granian"][load])
        failed = sum(r["errors"] for name in results for r in results[name][load])
        unit = "µs/event" if load.startswith("sse") else "ms/request"
        print(f"| {load} | {u:.3f} {unit} | {g:.3f} {unit} | {g / u:.2f} | {failed} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
