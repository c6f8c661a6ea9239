"""``edgegw serve | check-config | explain`` (also ``python -m gateway``).

    edgegw serve --config configs/default.yaml
    edgegw serve --upstream http://127.0.0.1:8000 [--upstream URL ...] [--host H --port P] [--http2] [--cache memory]
    edgegw serve --model ./model.gguf
    edgegw check-config FILE
    edgegw explain --config FILE --ip PEER [--header 'Name: value' ...] --body FILE [--json]
    edgegw bench --base-url URL [...]   (the load generator: loadgen/)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator

import orjson
import uvicorn

from cache import CacheConfig
from gateway.node.app import create_app
from gateway.ingress import Server
from gateway.ingress.http1 import H1Protocol
from gateway.ingress.websocket import DrainingWebSocketProtocol
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

    check = commands.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("file", metavar="FILE")

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

    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_cli.run(args, argv)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "explain":
        return _explain(args)
    return _serve(args, parser)


def _check_config(path: str) -> int:
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    endpoints = sum(len(c.endpoints) for c in settings.clusters)
    print(f"{path}: ok ({len(settings.clusters)} cluster(s), {endpoints} endpoint(s))")
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
        settings = _override(settings, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    listen = settings.listen
    logging.basicConfig(level=listen.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_clients()
    if listen.workers > 1 or settings.engine_in_own_process:
        return Supervisor(settings, _serve_worker).run()  # gateway/workers.py
    config = uvicorn_config(settings, create_app(settings))
    redact_logs("uvicorn", "uvicorn.error", "uvicorn.access")  # no key in any log line, at any level
    server = _DrainingServer(config, listen, high_water=settings.limits.stream_buffer_bytes)
    server.run()
    return 0


def _serve_worker(settings: Settings, node: Node, sock: socket.socket) -> None:
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
    config = uvicorn_config(settings, create_app(settings, node=node))
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


def _override(settings: Settings, args: argparse.Namespace) -> Settings:
    """Apply the command line's --host/--port/--log-level, --cache and --model on top."""
    if args.cache and args.config:
        try:
            settings = settings.model_copy(update={"cache": CacheConfig.from_cli(args.cache)})
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if args.model:
        if not os.path.exists(args.model):
            raise ConfigError(f"--model: {args.model!r} does not exist")
        edge = settings.edge.model_copy(update={"enabled": True, "model": args.model})
        settings = settings.model_copy(update={"edge": edge})
    listen = settings.listen
    changes = {}
    if args.host:
        changes["host"] = args.host
    if args.port is not None:
        changes["port"] = args.port
    if args.log_level:
        changes["log_level"] = args.log_level
    if not changes:
        return settings
    return settings.model_copy(update={"listen": listen.model_copy(update=changes)})


class _DrainingServer(Server):
    """On SIGTERM/SIGINT, mark the gateway draining (readyz 503, new requests refused)
    while uvicorn stops accepting and lets in-flight streams finish; then exit 0.
    (``gateway.ingress.Server``: uvicorn's, plus the ``listen.tls`` / ``listen.http3`` listeners.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
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
