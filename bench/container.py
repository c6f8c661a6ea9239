"""The container image's size and its start-to-ready time, against the same gateway started
on the host in the same run (a baseline measured side by side, as the machine is shared).

    python bench/container.py [--image localhost/edgegw:dev] [--runs 3]

Start-to-ready: from the start command (``podman run`` / ``edgegw serve``) until GET /readyz
answers 200 (the model loaded, the kernels loaded), polled every 50 ms. Both run the image's
configuration (deploy/container/config.yaml). Prints a JSON summary (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.processes import free_port  # noqa: E402

CONFIG = ROOT / "deploy" / "container" / "config.yaml"


def until_ready(url: str, limit_s: float = 900.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic()
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(url)


def container_once(podman: str, image: str) -> float:
    port, name = free_port(), f"edgegw-bench-{os.getpid()}"
    t0 = time.monotonic()
    subprocess.run([podman, "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", image],
                   check=True, capture_output=True)
    try:
        return until_ready(f"http://127.0.0.1:{port}/readyz") - t0
    finally:
        subprocess.run([podman, "rm", "-f", "-t", "0", name], capture_output=True)


def host_once() -> float:
    port = free_port()
    text = CONFIG.read_text().replace("host: 0.0.0.0", "host: 127.0.0.1").replace("port: 8000", f"port: {port}")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", f.name],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        return until_ready(f"http://127.0.0.1:{port}/readyz") - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        os.unlink(f.name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--image", default="localhost/edgegw:dev")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    podman = shutil.which("podman") or sys.exit("podman is not installed: scripts/install-podman.sh")
    inspect = json.loads(subprocess.run([podman, "image", "inspect", args.image], check=True, capture_output=True, text=True).stdout)[0]
    history = subprocess.run([podman, "history", "--format", "{{.Size}}\t{{.CreatedBy}}", args.image],
                             check=True, capture_output=True, text=True).stdout.splitlines()
    container, host = [], []
    for _ in range(args.runs):  # alternated, so both see the same load
        container.append(container_once(podman, args.image))
        host.append(host_once())
    summary = {
        "image": args.image,
        "image_bytes": inspect["Size"],
        "largest_layers": sorted(history, key=lambda line: -_bytes(line.split("\t")[0]))[:4],
        "container_ready_s": [round(x, 2) for x in container],
        "host_ready_s": [round(x, 2) for x in host],
        "container_ready_median_s": round(statistics.median(container), 2),
        "host_ready_median_s": round(statistics.median(host), 2),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _bytes(size: str) -> float:
    units = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    for unit in sorted(units, key=len, reverse=True):
        if size.endswith(unit):
            try:
                return float(size[: -len(unit)].strip()) * units[unit]
            except ValueError:
                return 0.0
    return 0.0


if __name__ == "__main__":
    raise SystemExit(main())
