"""llama.cpp's server direct and through edgegw, in one run, measured by ``edgegw bench``.

    .venv/bin/python bench/llamacpp.py [--concurrency 1 4 16] [--num-prompts 48] [--reps 2]
                                       [--input-len 32] [--output-len 16] [--json FILE]

Processes (each started here and stopped here by PID; traffic only on 127.0.0.1):

- llama-cpp-python's OpenAI server (the Makefile's test set-up installs it) on the bundled
  SmolLM2 GGUF, ``--n_threads 2``, with ``--interrupt_requests False``: with its default
  (True) any second request ends the generation in progress, so at a concurrency above 1
  the direct runs would cut their own streams; with False it serves one request at a time
  and the others wait inside it. ``OMP_WAIT_POLICY=PASSIVE`` (its threads otherwise spin
  while they wait, which on a shared machine costs seconds per answer);
- ``edgegw serve --upstream <llama.cpp> --cache off`` (the quick start, its defaults: no
  ``max_concurrency``, so the requests wait in llama.cpp as they do direct; no cache, so the
  repeated synthetic prompts are all answered by the server);
- the load generator: ``edgegw bench`` (``python -m gateway bench``), one process per run,
  streaming chat completions of ``--input-len`` words and ``--output-len`` tokens at
  temperature 0, with ``logit_bias`` forbidding the end-of-sequence token, so that every
  complete stream has exactly ``--output-len`` content events.

For each repetition and each concurrency, the direct run and the gateway run follow each
other (their order alternating between repetitions). Figures (medians over repetitions):
TTFT p50 and E2E p50 of each path, the gateway's added TTFT p50 (gateway minus direct), the
gateway's own time per request from its ``Server-Timing`` (its stages, not the upstream's),
and the streams lost (failed) or cut (fewer content events than asked) on each path.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_engine.config import default_model_path  # noqa: E402

MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not up within {timeout} s")


def _start(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench(base: str, concurrency: int, args: argparse.Namespace, folder: Path) -> dict:
    result = folder / f"run-{time.monotonic_ns()}.json"
    extra = {"temperature": 0, "logit_bias": {"2": -100}}  # token 2: <|im_end|>
    argv = [
        sys.executable, "-m", "gateway", "bench", "--base-url", base, "--model", MODEL,
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--extra-body", json.dumps(extra),
        "--warmup", "2", "--no-progress", "--save-result", str(result),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"edgegw bench exited {done.returncode}: {done.stderr[-3000:]}")
    run = json.loads(result.read_text())["runs"][0]
    tokens = run["samples"]["output_tokens"]
    errors = run["samples"]["error"]
    cut = sum(1 for n, e in zip(tokens, errors) if e is None and n < args.output_len)
    gateway = run.get("gateway")
    return {
        "ttft_p50_ms": run["ttft_ms"]["p50"],
        "e2e_p50_ms": run["e2e_ms"]["p50"],
        "failed": run["failed"],
        "errors": run["errors"],
        "cut": cut,
        "requests": run["requests"],
        "own_p50_ms": gateway["own_ms"]["p50"] if gateway else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    llama_port, gw_port = free_port(), free_port()
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    llama = _start([
        sys.executable, "-m", "llama_cpp.server", "--model", default_model_path(), "--model_alias", MODEL,
        "--n_threads", "2", "--n_threads_batch", "2", "--interrupt_requests", "False",
        "--host", "127.0.0.1", "--port", str(llama_port),
    ], folder / "llama.log", env)  # fmt: skip
    gateway = None
    try:
        direct = f"http://127.0.0.1:{llama_port}/v1"
        _wait(direct + "/models", llama, folder / "llama.log")
        gateway = _start([
            sys.executable, "-m", "gateway", "serve", "--upstream", direct, "--cache", "off",
            "--host", "127.0.0.1", "--port", str(gw_port),
        ], folder / "gateway.log")  # fmt: skip
        through = f"http://127.0.0.1:{gw_port}/v1"
        _wait(f"http://127.0.0.1:{gw_port}/readyz", gateway, folder / "gateway.log")
        runs: dict[tuple[int, str], list[dict]] = {}
        for rep in range(args.reps):
            for c in args.concurrency:
                order = [("direct", direct), ("gateway", through)]
                for name, base in order if rep % 2 == 0 else order[::-1]:
                    runs.setdefault((c, name), []).append(bench(base, c, args, folder))
                    print(f"rep {rep} c={c} {name}: {runs[(c, name)][-1]}", file=sys.stderr, flush=True)
    finally:
        if gateway is not None:
            _stop(gateway)
        _stop(llama)

    def med(c: int, name: str, key: str) -> float | None:
        values = [r[key] for r in runs[(c, name)] if r[key] is not None]
        return statistics.median(values) if values else None

    rows = []
    for c in args.concurrency:
        d, g = med(c, "direct", "ttft_p50_ms"), med(c, "gateway", "ttft_p50_ms")
        rows.append({
            "concurrency": c,
            "direct_ttft_p50_ms": d, "gateway_ttft_p50_ms": g, "added_ttft_p50_ms": g - d,
            "direct_e2e_p50_ms": med(c, "direct", "e2e_p50_ms"), "gateway_e2e_p50_ms": med(c, "gateway", "e2e_p50_ms"),
            "gateway_own_p50_ms": med(c, "gateway", "own_p50_ms"),
            "lost": {n: sum(r["failed"] for r in runs[(c, n)]) for n in ("direct", "gateway")},
            "cut": {n: sum(r["cut"] for r in runs[(c, n)]) for n in ("direct", "gateway")},
            "requests": {n: sum(r["requests"] for r in runs[(c, n)]) for n in ("direct", "gateway")},
            "errors": {n: [r["errors"] for r in runs[(c, n)] if r["errors"]] for n in ("direct", "gateway")},
        })  # fmt: skip
    print("| c | TTFT p50 direct | through edgegw | added | E2E p50 direct | through | edgegw's own p50 | lost / cut (direct, edgegw) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['direct_ttft_p50_ms']:.1f} ms | {r['gateway_ttft_p50_ms']:.1f} ms | "
            f"{r['added_ttft_p50_ms']:+.2f} ms | {r['direct_e2e_p50_ms']:.0f} ms | {r['gateway_e2e_p50_ms']:.0f} ms | "
            f"{r['gateway_own_p50_ms']:.3f} ms | {r['lost']['direct']}/{r['cut']['direct']}, {r['lost']['gateway']}/{r['cut']['gateway']} "
            f"of {r['requests']['gateway']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
