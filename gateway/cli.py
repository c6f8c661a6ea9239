"""``edgegw serve | check-config`` (also ``python -m gateway``).

    edgegw serve --config configs/default.yaml
    edgegw serve --upstream http://127.0.0.1:8000 [--upstream URL ...] [--host H --port P] [--http2]
    edgegw check-config FILE
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

import uvicorn

from gateway.app import create_app
from gateway.settings import ConfigError, Settings, load_settings, quickstart_settings

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
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])

    check = commands.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("file", metavar="FILE")

    args = parser.parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
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


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        if args.config and args.upstream:
            parser.error("use either --config or --upstream, not both")
        if args.config:
            settings = load_settings(args.config)
        elif args.upstream:
            settings = quickstart_settings(args.upstream, protocol="http2" if args.http2 else "http1")
        else:
            parser.error("give --config FILE or at least one --upstream URL")
        settings = _override_listen(settings, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    listen = settings.listen
    logging.basicConfig(level=listen.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(
        create_app(settings),
        host=listen.host,
        port=listen.port,
        workers=None,
        loop="auto",
        http="httptools",
        ws="auto",
        lifespan="on",
        log_level=listen.log_level,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=settings.limits.drain_timeout_s,
        timeout_keep_alive=75,
    )
    server = _DrainingServer(config)
    server.run()
    return 0


def _override_listen(settings: Settings, args: argparse.Namespace) -> Settings:
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


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, mark the gateway draining (readyz 503, new requests refused)
    while uvicorn stops accepting and lets in-flight streams finish; then exit 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()  # drained cleanly: exit 0, not by the signal

    def handle_exit(self, sig, frame) -> None:
        gateway = getattr(getattr(self.config.app, "state", None), "gateway", None)
        if gateway is not None:
            gateway.draining = True
        super().handle_exit(sig, frame)
