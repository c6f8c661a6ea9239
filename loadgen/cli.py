"""``edgegw bench`` (also ``python -m loadgen``): the command line of the load generator.

    edgegw bench --base-url http://127.0.0.1:8080/v1 [--model auto]
                 [--num-prompts N | --duration S] [--request-rate R] [--max-concurrency C]
                 [--stream | --no-stream] [--dataset FILE.jsonl | --input-len N --output-len N [--range-ratio F]]
                 [--api-key K] [--header 'Name: value' ...] [--goodput ttft:MS tpot:MS e2e:MS]
                 [--repeat K] [--save-result FILE.json] [--plot FILE.png|FILE.html] [--json]
                 [--baseline FILE.json [--max-regression 0.10] [--metric p95_ttft_ms,p95_e2e_ms]]

Exit status: 0 done (and the gate passed), 1 the gate failed or no request completed,
2 a usage or set-up error (bad option, unreachable server, failed warm-up, unreadable
baseline), 130 interrupted (the partial report is printed; the gate is not applied).
The option names follow ``vllm bench serve`` where it has one.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import resource
import signal
import sys
from typing import TextIO

import orjson

try:  # a faster event loop for the client when installed (uvicorn[standard] brings it)
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

from loadgen.bench import BenchConfig, BenchError, run_bench
from loadgen.gate import DEFAULT_METRICS, GateError, check_baseline, compare, resolve_metrics
from loadgen.openai import ENDPOINTS
from loadgen.plot import plot
from loadgen.report import render
from loadgen.result import BenchResult, ResultError, load_result, save_result

__all__ = ["add_arguments", "main", "run"]

EXIT_OK, EXIT_REGRESSED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_SECRET_OPTIONS = ("--api-key",)
_LOOP_FACTORY = uvloop.new_event_loop if uvloop is not None else None
_PIECE_CHARS = 1024  # at most 4096 bytes of UTF-8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        metavar="URL",
        default=os.environ.get("OPENAI_BASE_URL"),
        help="the server's OpenAI base URL, path prefix included, e.g. http://127.0.0.1:8080/v1 (default: $OPENAI_BASE_URL)",
    )
    target.add_argument("--endpoint", choices=list(ENDPOINTS), default="chat", help="chat: {base}/chat/completions (default); completions: {base}/completions")
    target.add_argument("--model", metavar="NAME", help="the model to ask (e.g. 'auto' for edgegw's alias); default: the first of GET {base}/models")
    target.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY"), help="sent as 'Authorization: Bearer K' (default: $OPENAI_API_KEY)")
    target.add_argument("--header", metavar="'Name: value'", action="append", default=[], help="an extra request header (repeatable)")
    target.add_argument("--extra-body", metavar="JSON", help='fields merged into every request body, e.g. \'{"temperature": 0, "ignore_eos": true}\'')
    target.add_argument("--insecure", action="store_true", help="https: do not verify the server's certificate")
    target.add_argument("--ca-cert", metavar="FILE", help="https: verify the server against this CA bundle")
    target.add_argument("--timeout", type=float, metavar="S", default=300.0, help="seconds for a whole answer (default 300)")

    load = parser.add_argument_group("load")
    size = load.add_mutually_exclusive_group()
    size.add_argument("--num-prompts", type=int, metavar="N", help="requests per run (default 1000)")
    size.add_argument("--duration", type=float, metavar="S", help="send requests for S seconds instead, then wait for the last ones")
    load.add_argument("--request-rate", type=float, metavar="R", default=math.inf, help="requests per second, Poisson arrivals (default inf: all at once)")
    load.add_argument("--burstiness", type=float, metavar="B", default=1.0, help="gamma shape of the arrival gaps (1 = Poisson, <1 burstier)")
    load.add_argument("--max-concurrency", type=int, metavar="C", help="at most C requests in flight")
    load.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="SSE streaming (default) or whole answers")
    load.add_argument("--dataset", metavar="FILE.jsonl", help="one JSON object a line: prompt or messages, optional max_tokens and extra_body")
    load.add_argument("--input-len", type=int, metavar="N", default=256, help="synthetic prompt length in words ≈ tokens (default 256)")
    load.add_argument("--output-len", type=int, metavar="N", default=128, help="max_tokens of synthetic requests (default 128)")
    load.add_argument("--range-ratio", type=float, metavar="F", default=0.0, help="vary both lengths uniformly by ±F (0 ≤ F < 1)")
    load.add_argument("--seed", type=int, metavar="N", default=0, help="seeds prompts and arrivals (default 0)")
    load.add_argument("--warmup", type=int, metavar="N", default=1, help="requests sent first, one at a time, not measured (default 1)")
    load.add_argument("--repeat", type=int, metavar="K", default=1, help="runs; figures and the gate use the medians (default 1)")

    out = parser.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=[], help="SLO bounds, e.g. ttft:500 tpot:50 e2e:10000")
    out.add_argument("--save-result", metavar="FILE.json", help="write the result document")
    out.add_argument("--plot", metavar="FILE", action="append", default=[], help="TTFT/E2E distributions and latency over time: .png or .html (repeatable)")
    out.add_argument("--json", action="store_true", help="print the result document on stdout (the tables go to stderr)")
    out.add_argument("--no-progress", action="store_true", help="no live progress on stderr")

    gate = parser.add_argument_group("regression gate")
    gate.add_argument("--baseline", metavar="FILE.json", help="compare with this saved result; exit 1 on a regression")
    gate.add_argument("--max-regression", type=float, metavar="F", default=0.10, help="allowed relative worsening of each metric (default 0.10)")
    gate.add_argument("--metric", metavar="NAMES", default=",".join(DEFAULT_METRICS), help=f"metrics to compare (default {','.join(DEFAULT_METRICS)})")
    gate.add_argument("--max-error-rate", type=float, metavar="F", default=0.01, help="allowed share of failed requests (default 0.01)")


def parse_headers(raw: list[str]) -> dict[str, str]:
    headers = {}
    for item in raw:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {item!r}: expected 'Name: value'")
        headers[name.strip().lower()] = value.strip()
    return headers


def parse_goodput(raw: list[str]) -> dict[str, float]:
    bounds = {}
    for item in raw:
        name, sep, value = item.replace("=", ":").partition(":")
        try:
            bounds[name.strip().lower()] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: expected NAME:MILLISECONDS, e.g. ttft:500") from None
        if not sep:
            raise ValueError(f"--goodput {item!r}: expected NAME:MILLISECONDS, e.g. ttft:500")
    return bounds


def masked_argv(argv: list[str]) -> list[str]:
    """The command line as saved: API key and header values replaced by ``***``."""
    out, hide_next = [], None
    for arg in argv:
        if hide_next == "value":
            out.append("***")
        elif hide_next == "header":
            out.append(arg.partition(":")[0] + ": ***")
        elif arg.startswith(tuple(f"{o}=" for o in _SECRET_OPTIONS)):
            out.append(arg.partition("=")[0] + "=***")
        elif arg.startswith("--header="):
            out.append("--header=" + arg[len("--header=") :].partition(":")[0] + ": ***")
        else:
            out.append(arg)
        hide_next = "value" if arg in _SECRET_OPTIONS else "header" if arg == "--header" else None
    return out


def config_from_args(args: argparse.Namespace, argv: list[str]) -> BenchConfig:
    if not args.base_url:
        raise ValueError("give --base-url (or set OPENAI_BASE_URL)")
    headers = {}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    headers.update(parse_headers(args.header))
    extra: dict = {}
    if args.extra_body:
        try:
            extra = orjson.loads(args.extra_body)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--extra-body: not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    base_url = args.base_url
    if args.base_url.split("://", 1)[-1].rstrip("/").count("/") == 0:
        print(f"note: --base-url {base_url} has no path; using {base_url.rstrip('/')}/v1 as OpenAI clients do", file=sys.stderr)
        base_url = base_url.rstrip("/") + "/v1"
    return BenchConfig(
        base_url=base_url,
        endpoint=args.endpoint,
        model=args.model,
        num_prompts=args.num_prompts,
        duration=args.duration,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        stream=args.stream,
        dataset=args.dataset,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
        timeout=args.timeout,
        warmup=args.warmup,
        repeat=args.repeat,
        goodput_ms=parse_goodput(args.goodput),
        headers=headers,
        extra_body=extra,
        verify_tls=not args.insecure,
        ca_file=args.ca_cert,
        progress=not args.no_progress,
        command=["edgegw", "bench", *masked_argv(argv)],
    )


def _raise_file_limit() -> None:
    """Each request in flight holds a socket: allow as many as the hard limit does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))
        except (ValueError, OSError):
            pass


async def _bench_until_stopped(config: BenchConfig) -> BenchResult:
    """The benchmark, with Ctrl-C wired to ``stop`` (a second Ctrl-C quits at once)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def interrupt() -> None:
        if stop.is_set():
            task.cancel()
            return
        stop.set()
        print("\ninterrupted: reporting what completed (Ctrl-C again to quit at once)", file=sys.stderr)

    try:
        loop.add_signal_handler(signal.SIGINT, interrupt)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        pass
    try:
        return await run_bench(config, stop)
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError, ValueError):
            pass


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the benchmark the parsed ``args`` describe; ``argv`` (default: ``sys.argv``)
    is only saved, masked, in the result's environment."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    try:
        config = config_from_args(args, argv)
        metrics = resolve_metrics(args.metric)
        baseline = load_result(args.baseline) if args.baseline else None
        if baseline is not None:
            check_baseline(baseline, metrics, args.baseline)
        for path in args.plot:
            if os.path.splitext(path)[1].lower() not in (".png", ".html", ".htm"):
                raise ValueError(f"--plot {path}: expected a .png or .html file")
        if args.max_regression < 0 or not 0 <= args.max_error_rate <= 1:
            raise ValueError("--max-regression must not be negative and --max-error-rate must be in [0, 1]")
    except (ValueError, GateError, ResultError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _raise_file_limit()
    try:
        with asyncio.Runner(loop_factory=_LOOP_FACTORY) as runner:
            result = runner.run(_bench_until_stopped(config))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if baseline is not None and result.runs and not result.interrupted:
        try:
            gate = compare(baseline, result, metrics, args.max_regression, args.max_error_rate, args.baseline)
        except GateError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        result = result.model_copy(update={"gate": gate})
    return _deliver(result, args)


def emit(stream: TextIO, text: str) -> None:
    """Write all of ``text``. Under ``PYTHONUNBUFFERED`` (or ``-u``) ``sys.stdout`` is a
    text layer straight on the file descriptor, and a write that a busy pipe takes only in
    part loses the rest without an error (seen: a 360 KB ``--json`` cut at 64 KB with exit
    status 0). Pieces of at most 4 KB are written whole by a pipe (POSIX ``PIPE_BUF``)."""
    for start in range(0, len(text), _PIECE_CHARS):
        stream.write(text[start : start + _PIECE_CHARS])
    stream.flush()


def _deliver(result: BenchResult, args: argparse.Namespace) -> int:
    """Report, save, plot; then the exit status."""
    report = render(result)
    if args.json:
        emit(sys.stderr, report)
        emit(sys.stdout, orjson.dumps(result.model_dump(mode="json"), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        emit(sys.stdout, report)
    try:
        if args.save_result:
            save_result(result, args.save_result)
        for path in args.plot:
            plot(result, path)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if result.interrupted:
        return EXIT_INTERRUPTED
    if result.gate is not None and not result.gate.passed:
        return EXIT_REGRESSED
    if not any(run.completed for run in result.runs):
        print("error: no request completed", file=sys.stderr)
        return EXIT_REGRESSED
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="edgegw bench",
        description="Measure any OpenAI-compatible server: latency, throughput, goodput; gate against a baseline.",
    )
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(parser.parse_args(argv), argv)
