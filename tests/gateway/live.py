"""A gateway that reads its configuration from a file and can read it again (a live reload),
run in a thread under the gateway's own server class (so that ``listen.admin`` opens), and
small waiting helpers. For the tests of reload, the admin listener and usage."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

from gateway.core.settings import load_settings
from gateway.ingress import Server
from gateway.node.app import create_app
from gateway.node.cli import uvicorn_config
from gateway.node.reload import ConfigSource
from tests.fakes import free_port

__all__ = ["FileGateway", "wait_for"]


def wait_for(check, timeout: float = 20, what: str = "condition") -> None:
    """Poll ``check`` until it is true, for ``timeout`` seconds at most (a bound, not a speed)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class FileGateway:
    """``config`` written to ``folder/config.yaml`` (listen.host/port filled in; ``admin``:
    also a ``listen.admin`` port), served from a thread; ``write`` replaces the file."""

    def __init__(self, config: dict, folder: Path, *, admin: bool = False) -> None:
        self.port = free_port()
        self.admin_port = free_port() if admin else None
        self.path = folder / "config.yaml"
        self.listen = {"host": "127.0.0.1", "port": self.port, **({"admin": {"port": self.admin_port}} if admin else {})}
        self.write(config)
        settings = load_settings(self.path)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}" if admin else None
        self.app = create_app(settings, source=ConfigSource(str(self.path)))
        self.server = Server(uvicorn_config(settings, self.app, log_level="error"), settings.listen)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"gateway-{self.port}")

    def write(self, config: dict) -> None:
        config = {"cache": {"backend": "off"}, **config, "listen": {**config.get("listen", {}), **self.listen}}
        text = yaml.safe_dump(config)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.path)  # at once, as a ConfigMap's swap

    @property
    def state(self):
        return self.app.gateway

    def start(self, timeout: float = 20) -> FileGateway:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout, "the gateway to start")
        assert self.server.started, "gateway did not start"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
