"""edgegw's load generator (``edgegw bench``): measure any OpenAI-compatible server and gate
a release on its latency.

It speaks only HTTP to a base URL, so it measures edgegw, vLLM, SGLang, LiteLLM or a
hosted API alike, and it imports nothing from the gateway. When the server is an edgegw,
its ``Server-Timing``, ``x-edgegw-route`` and ``x-cache`` headers add the gateway's own
time per stage, the routes taken and the cache's share to the report.

Vocabulary (one word, one thing):

- *request spec*: the bytes of one request and its intended sizes (``types.RequestSpec``);
- *record*: what one request measured (``types.RequestRecord``);
- *run*: one pass over the workload (``runner.Run``), summarised as a ``RunSummary``;
- *result*: the document of a benchmark: parameters, environment, runs, medians, gate
  (``result.BenchResult``, the JSON of ``--save-result``);
- *metric*: one flat named figure of a result, e.g. ``p95_ttft_ms`` (the gate's unit);
- *gate*: this result's medians against a baseline result's (``gate.compare``).

Layers, each importing only those above it: ``types`` → ``http`` (the raw asyncio +
httptools client) → ``openai`` (request bytes, SSE/JSON readers) → ``workload`` and
``arrivals`` → ``result`` → ``stats`` → ``progress`` → ``runner`` → ``bench`` →
``gate``, ``report``, ``charts``/``plot`` → ``cli``.

Beside those layers, two modules that the project's tests and benchmarks share and the
CLI never imports: ``fake_upstream`` (a scripted fake OpenAI-compatible server: timing,
failures, the quirks of real servers; needs hypercorn for HTTP/2) and ``floods`` (raw
HTTP/2 and HTTP/3 clients that flood a listener).

Use from Python::

    config = BenchConfig(base_url="http://127.0.0.1:8080/v1", model="auto", num_prompts=200, request_rate=20)
    result = asyncio.run(run_bench(config, asyncio.Event()))
    print(render(result)); save_result(result, "last.json")
"""

from loadgen.bench import BenchConfig, BenchError, run_bench
from loadgen.gate import GateError, compare, resolve_metrics
from loadgen.report import render, render_gate
from loadgen.result import BenchResult, ResultError, RunSummary, load_result, save_result

__all__ = [
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "GateError",
    "ResultError",
    "RunSummary",
    "compare",
    "load_result",
    "render",
    "render_gate",
    "resolve_metrics",
    "run_bench",
    "save_result",
]
