"""``edgegw serve | check-config | explain | bench | build-kernels`` (also ``python -m gateway``).

    edgegw serve --config configs/default.yaml
    edgegw serve --upstream http://127.0.0.1:8000 [--upstream URL ...] [--host H --port P] [--http2] [--cache memory]
    edgegw serve --model ./model.gguf
    edgegw check-config FILE
    edgegw build-kernels [--verbose]   (compile the edge engine's CPU kernels for this machine)
    edgegw explain --config FILE --ip PEER [--header 'Name: value' ...] --body FILE [--json]
    edgegw reload [--pid-file FILE | --url ADMIN_URL | --config FILE] [--key-env NAME]
    edgegw bench --base-url URL [...]   (the load generator: loadgen/)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator

import httpx
import orjson
import uvicorn

from gateway.node.app import create_app
from gateway.ingress import Server
from gateway.ingress.http1 import H1Protocol
from gateway.ingress.websocket import DrainingWebSocketProtocol
from gateway.node.reload import ConfigSource, apply_overrides
from gateway.node.siblings import Node
from gateway.observe import redact_logs
from gateway.core.settings import ConfigError, Settings, load_settings, quickstart_settings
from gateway.node.workers import Supervisor
from loadgen import cli as bench_cli
from routing import ClusterSpec, RoutingError, describe
from routing import explain as explain_route

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgegw", description="An edge-aware latency gateway for LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", metavar="FILE", help="YAML configuration (see configs/default.yaml)")
    serve.add_argument(
        "--upstream",
        metavar="URL",
        action="append",
        default=[],
        help="an OpenAI-compatible server to front (repeatable); its models come from GET /v1/models",
    )
    serve.add_argument("--host", help="address to bind (overrides the config)")
    serve.add_argument("--port", type=int, help="port to bind (overrides the config)")
    serve.add_argument("--http2", action="store_true", help="talk HTTP/2 to the --upstream servers (h2c or ALPN)")
    serve.add_argument(
        "--cache",
        metavar="BACKEND",
        help="exact-response cache: memory (the default with --upstream) | off | redis://HOST:PORT/DB | tiered+redis://HOST:PORT/DB",
    )
    serve.add_argument(
        "--model",
        metavar="PATH",
        help="serve this local GGUF file or Hugging Face directory from the in-process edge engine",
    )
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--pid-file", metavar="FILE", help="write the serving process's pid here (edgegw reload --pid-file)")

    reload = commands.add_parser("reload", help="make a running gateway read its configuration again")
    reload.add_argument("--pid-file", metavar="FILE", help="send SIGHUP to the pid in this file (listen.pid_file)")
    reload.add_argument("--url", metavar="ADMIN_URL", help="POST <ADMIN_URL>/admin/reload (the admin listener, or the public port with admin.keys)")
    reload.add_argument("--config", metavar="FILE", help="the running configuration: its listen.pid_file, else its listen.admin address")
    reload.add_argument("--key-env", metavar="NAME", default="EDGEGW_ADMIN_KEY", help="environment variable holding an admin key (default: EDGEGW_ADMIN_KEY)")

    check = commands.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("file", metavar="FILE")
    check.add_argument(
        "--on-this-machine", action="store_true",
        help="also fail when the edge engine's mode cannot run here (no CUDA, kernels not built); "
        "without it that is a warning: the file may be meant for another machine (a GPU node, an image)",
    )

    explain = commands.add_parser(
        "explain", help="print the routing decision for a request, without sending anything"
    )
    explain.add_argument("--config", metavar="FILE", required=True, help="YAML configuration")
    explain.add_argument("--ip", metavar="PEER_ADDR", required=True, help="the socket peer's address")
    explain.add_argument(
        "--header",
        metavar="'Name: value'",
        action="append",
        default=[],
        help="a request header (repeatable), e.g. 'X-Forwarded-For: 198.51.100.7'",
    )
    explain.add_argument("--body", metavar="FILE", required=True, help="the JSON request body ('-': stdin)")
    explain.add_argument("--json", action="store_true", help="print the decision as a JSON object")

    bench_cli.add_arguments(commands.add_parser("bench", help="measure any OpenAI-compatible server; gate on latency"))

    kernels = commands.add_parser(
        "build-kernels",
        help="compile the edge engine's CPU kernels (int4 modes) for this installation, into TORCH_EXTENSIONS_DIR",
    )
    kernels.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")

    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_cli.run(args, argv)
    if args.command == "check-config":
        return _check_config(args.file, args.on_this_machine)
    if args.command == "build-kernels":
        return _build_kernels(args.verbose)
    if args.command == "explain":
        return _explain(args)
    if args.command == "reload":
        return _reload(args, parser)
    return _serve(args, parser)


def _check_config(path: str, on_this_machine: bool = False) -> int:
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    endpoints = sum(len(c.endpoints) for c in settings.clusters)
    print(f"{path}: ok ({len(settings.clusters)} cluster(s), {endpoints} endpoint(s))")
    if settings.edge.enabled:
        try:
            mode, why = _edge_engine().describe_dtype(settings.edge.engine_config())
        except ImportError as exc:  # a relay-only install: no torch
            print(f"edge.dtype: {settings.edge.dtype} (the edge engine is not installed here: {exc})")
        except ValueError as exc:
            if on_this_machine:
                print(f"error: edge.dtype: {exc}", file=sys.stderr)
                return 1
            print(f"warning: edge.dtype: {exc} (on this machine; the file is valid)", file=sys.stderr)
        else:
            print(f"edge.dtype: {settings.edge.dtype} -> {mode} ({why})")
    return 0


def _edge_engine():
    """edge_engine, imported only by the commands that need it (it imports torch)."""
    return importlib.import_module("edge_engine")


def _build_kernels(verbose: bool) -> int:
    """``edgegw build-kernels``: compile the edge engine's kernels now (``make install`` and
    the container build run it), so that no node compiles them when it starts or serves."""
    try:
        kernels = importlib.import_module("edge_engine.kernels")
    except ImportError as exc:
        print(f"error: the edge engine is not installed ({exc}): pip install 'edgegw[engine]'", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        path = kernels.build(verbose=verbose)
    except kernels.KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    state = kernels.status()
    if not state.available:
        print(f"error: built in {path}, but {state.reason}", file=sys.stderr)
        return 1
    print(f"edge engine kernels: {path} ({time.monotonic() - started:.0f} s); this CPU runs {state.describe()}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    """Routing's decision for one request: client address, location, region, target,
    fallbacks, reasons. No sockets are opened and the edge engine is not loaded; health
    is fresh (nothing measured, every breaker closed)."""
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    headers: dict[str, str] = {}
    for raw in args.header:
        name, sep, value = raw.partition(":")
        if not sep or not name.strip():
            print(f"error: --header {raw!r}: expected 'Name: value'", file=sys.stderr)
            return 2
        headers[name.strip().lower()] = value.strip()
    try:
        if args.body == "-":
            raw_body = sys.stdin.buffer.read()
        else:
            with open(args.body, "rb") as file:
                raw_body = file.read()
    except OSError as exc:
        print(f"error: --body {args.body}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        body = orjson.loads(raw_body)
    except orjson.JSONDecodeError as exc:
        print(f"error: --body {args.body}: not valid JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(body, dict):
        print(f"error: --body {args.body}: must be a JSON object", file=sys.stderr)
        return 2
    clusters = [ClusterSpec(c.name, tuple(c.models), tuple(e.url for e in c.endpoints)) for c in settings.clusters]
    try:
        decision = explain_route(
            settings.routing,
            clusters,
            args.ip,
            headers,
            body,
            time.monotonic(),
            edge_model=settings.edge.served_name if settings.edge.enabled else None,
        )
    except RoutingError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, RuntimeError) as exc:  # a missing or unreadable GeoIP database
        print(f"error: routing.geoip_db {settings.routing.geoip_db!r}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps(decision.to_dict(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(describe(decision))
    return 0


def _reload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``edgegw reload``: SIGHUP to the pid in a pid file, or ``POST /admin/reload``."""
    pid_file, url = args.pid_file, args.url
    if not pid_file and not url:
        if not args.config:
            parser.error("give --pid-file FILE, --url ADMIN_URL or --config FILE")
        try:
            settings = load_settings(args.config)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        listen = settings.listen
        if listen.pid_file:
            pid_file = listen.pid_file
        elif listen.admin is not None:
            host = listen.admin.host or listen.host
            host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
            url = f"http://{host if ':' not in host else f'[{host}]'}:{listen.admin.port}"
        else:
            print(f"error: {args.config} has neither listen.pid_file nor listen.admin: use --pid-file or --url", file=sys.stderr)
            return 2
    if pid_file:
        try:
            pid = int(open(pid_file).read().strip())
            os.kill(pid, signal.SIGHUP)
        except (OSError, ValueError) as exc:
            print(f"error: {pid_file}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
            return 1
        print(f"sent SIGHUP to pid {pid}: the gateway's log says what was reloaded")
        return 0
    key = os.environ.get(args.key_env)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.post(url.rstrip("/") + "/admin/reload", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(f"error: POST {url.rstrip('/')}/admin/reload: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(response.text + "\n")
    return 0 if response.status_code < 300 else 1


class _PidFile:
    """``listen.pid_file``: the serving process's pid, removed at exit (if it is still ours)."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __enter__(self) -> _PidFile:
        if self.path:
            with open(self.path, "w") as file:
                file.write(f"{os.getpid()}\n")
        return self

    def __exit__(self, *exc) -> None:
        if self.path:
            with contextlib.suppress(OSError, ValueError):
                if int(open(self.path).read().strip()) == os.getpid():
                    os.unlink(self.path)


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        if args.config and args.upstream:
            parser.error("use either --config or --upstream, not both")
        if args.config:
            settings = load_settings(args.config)
        elif args.upstream:
            settings = quickstart_settings(args.upstream, protocol="http2" if args.http2 else "http1", cache=args.cache)
        elif args.model:
            settings = quickstart_settings([], cache=args.cache)
        else:
            parser.error("give --config FILE, --upstream URL or --model PATH")
        settings = apply_overrides(settings, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    overrides = {k: getattr(args, k) for k in ("cache", "model", "host", "port", "log_level", "pid_file")}
    source = ConfigSource(args.config, overrides) if args.config else None  # what a reload reads again
    listen = settings.listen
    logging.basicConfig(level=listen.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_clients()
    with _PidFile(listen.pid_file):
        if listen.workers > 1 or settings.engine_in_own_process:
            return Supervisor(settings, _serve_worker, source).run()  # gateway/workers.py
        config = uvicorn_config(settings, create_app(settings, source=source))
        redact_logs("uvicorn", "uvicorn.error", "uvicorn.access")  # no key in any log line, at any level
        server = _DrainingServer(config, listen, high_water=settings.limits.stream_buffer_bytes)
        server.run()
    return 0


def _serve_worker(settings: Settings, node: Node, sock: socket.socket, source: ConfigSource | None = None) -> None:
    """One relay worker of a node (``gateway.node.workers.Supervisor`` runs it in a process of
    its own): the same app as a single-process gateway, on the slot's socket ``sock`` and on
    the worker's own Unix socket in the node's run directory."""
    listen = settings.listen
    logging.basicConfig(
        level=listen.log_level.upper(), format=f"%(asctime)s %(levelname)s worker {node.index} %(name)s: %(message)s"
    )
    _quiet_clients()
    private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = node.worker_socket(node.index)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by the worker this one replaces
    private.bind(path)
    private.listen(128)
    config = uvicorn_config(settings, create_app(settings, node=node, source=source))
    redact_logs("uvicorn", "uvicorn.error", "uvicorn.access")
    server = _DrainingServer(config, listen, high_water=settings.limits.stream_buffer_bytes, reuse_port=True)
    server.run(sockets=[sock, private])


def _quiet_clients() -> None:
    """httpx logs every request it sends at INFO: the gateway's probes and model discovery
    would fill the log. Its warnings still show (``--log-level debug`` shows the rest)."""
    if logging.getLogger().level > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def uvicorn_config(settings: Settings, app, **overrides) -> uvicorn.Config:
    """How ``edgegw serve`` runs ``app`` under uvicorn (the tests run it the same way, with
    ``overrides`` of ``uvicorn.Config``'s arguments)."""
    listen = settings.listen
    options = dict(
        host=listen.host,
        port=listen.port,
        workers=None,
        loop="auto",
        http=H1Protocol.with_limits(settings.limits),  # uvicorn's httptools + header limits and timeout
        ws=DrainingWebSocketProtocol,  # uvicorn's, but an open socket drains like a stream
        lifespan="on",
        log_level=listen.log_level,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=settings.limits.drain_timeout_s,
        timeout_keep_alive=75,
        limit_concurrency=settings.limits.max_connections,
        proxy_headers=False,  # X-Forwarded-For is honoured by routing, from trusted proxies only
    )
    return uvicorn.Config(app, **{**options, **overrides})


def _hangup_handler(server: uvicorn.Server):
    """SIGHUP, in the main thread while ``server`` runs: a configuration reload on its event
    loop (``gateway.node.reload``), never the end of the process. Returns the handler it
    replaced (None: not the main thread)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    tasks: set[asyncio.Task] = set()

    def reload() -> None:
        gateway = getattr(server.config.app, "gateway", None)
        if gateway is None or server.should_exit:
            logging.getLogger("edgegw").info("SIGHUP: not reloading (%s)", "shutting down" if server.should_exit else "nothing to reload")
            return
        task = loop.create_task(gateway.reloader.reload("SIGHUP"))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    try:
        return signal.signal(signal.SIGHUP, lambda sig, frame: loop.call_soon_threadsafe(reload))
    except ValueError:  # not the main thread
        return None


class _DrainingServer(Server):
    """On SIGTERM/SIGINT, mark the gateway draining (readyz 503, new requests refused)
    while uvicorn stops accepting and lets in-flight streams finish; then exit 0. SIGHUP
    reloads the configuration.
    (``gateway.ingress.Server``: uvicorn's, plus the ``listen.tls`` / ``listen.http3`` listeners.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            hangup = _hangup_handler(self)
            try:
                yield
            finally:
                if hangup is not None:
                    signal.signal(signal.SIGHUP, hangup)
                self._captured_signals.clear()  # drained cleanly: exit 0, not by the signal

    def handle_exit(self, sig, frame) -> None:
        gateway = getattr(self.config.app, "gateway", None)
        if gateway is not None:
            if not gateway.gate.draining:
                logging.getLogger("edgegw").info(
                    "draining: %d request(s) in flight may finish, for up to %g s (limits.drain_timeout_s)",
                    gateway.gate.in_flight,
                    self.config.timeout_graceful_shutdown,
                )
            gateway.gate.drain()
        super().handle_exit(sig, frame)
