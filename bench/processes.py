"""The benchmarks' processes: a free port, CPU pinning, start, wait until ready, stop.

Every benchmark starts its servers (the gateway, upstreams, reference proxies) as child
processes, pinned to a core so that the one measured does not share it with the load
generator. Only the processes started here are ever signalled, by their PID.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import time

import psutil

__all__ = ["ROOT", "Child", "free_port", "pinned", "stop", "wait_http", "wait_port"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(udp: bool = False) -> int:
    """A TCP port free on 127.0.0.1 (``udp``: free for UDP too, for a listener of both, such
    as HTTP/3 beside HTTPS)."""
    while True:
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            if not udp:
                return port
            try:
                other.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def pinned(core: int | str, argv: list[str]) -> list[str]:
    """``argv`` run on ``core`` (a CPU or a Linux CPU list) with ``taskset``, where there is
    one and more than one CPU; else ``argv`` as it is."""
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:
        return ["taskset", "-c", str(core), *argv]
    return argv


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until something listens on ``port`` (``RuntimeError`` if ``proc`` exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def wait_http(port: int, path: str, proc: subprocess.Popen, timeout: float = 30, log_path: str | None = None) -> None:
    """Until ``GET path`` on ``port`` answers 200 (``RuntimeError`` with the log, if given,
    when ``proc`` exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = open(log_path, errors="replace").read()[-3000:] if log_path else ""
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}\n{log}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            try:
                conn.request("GET", path)
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args} did not answer {path} on :{port}")


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM (a gateway drains), then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Child:
    """A process started by a benchmark, its output in ``<log_dir>/<name>.log``."""

    def __init__(self, name: str, argv: list[str], log_dir: str, cwd: str = ROOT, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            argv, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        )
        self.ps = psutil.Process(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_http(self, port: int, path: str, timeout: float = 30) -> None:
        wait_http(port, path, self.proc, timeout, self.log_path)

    def cpu(self) -> float:
        """CPU seconds of the process and of its children (a gateway's workers)."""
        total = 0.0
        for proc in [self.ps, *self.ps.children(recursive=True)]:
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def peak_rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return self.ps.memory_info().rss

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()
