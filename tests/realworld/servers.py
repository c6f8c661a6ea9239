"""Real inference servers as child processes on 127.0.0.1, for tests/realworld/.

- ``LlamaServer``: llama-cpp-python's OpenAI-compatible server (``python -m
  llama_cpp.server``, installed by the Makefile's test set-up), on the bundled SmolLM2 GGUF.
- ``EngineServer``: the project's own engine server (``python -m edge_engine.server``).

Each logs to a file (stdout and stderr together) that tests read as the server's own
account of what it did; each is stopped by its PID. Both run OpenMP threads, which spin
while they wait by default: on a shared 2-core machine that makes a 6-token answer take
seconds instead of milliseconds (FACTS-style figures measured here under a load of 11: five
such answers 44 s spinning, 3 s with ``OMP_WAIT_POLICY=PASSIVE``), so they get PASSIVE unless
the environment says otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from edge_engine.config import default_model_path
from tests.conftest import ROOT
from tests.fakes import free_port

__all__ = ["EngineServer", "LlamaServer", "MODEL", "N_CTX"]

MODEL = "smollm2"  # the name both servers serve the model under (llama.cpp: --model_alias)
N_CTX = 512  # both servers' context: a prompt of a few hundred words is over it


class _Server:
    name = "server"

    def __init__(self, argv: list[str], folder: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = self.url + "/v1"
        self.log = folder / f"{self.name}-{self.port}.log"
        argv = [*argv, "--host", "127.0.0.1", "--port", str(self.port)]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 600) -> _Server:
        """Wait until it lists its model (loading it takes seconds; more on a busy machine, and
        the engine compiles its int4 kernels the first time on a machine: a minute or more)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.base + "/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not start within {timeout} s:\n{self.log.read_text()[-4000:]}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LlamaServer(_Server):
    """``python -m llama_cpp.server`` on the bundled GGUF, two threads, a 512-token context
    (``embedding``: it serves ``/v1/embeddings`` too).

    ``interrupt_requests`` is left at its default (True) unless asked: any new request, a
    ``GET /v1/models`` too, ends the generation in progress. It prints ``disconnected``
    whenever it stops a stream early (its client left, or another request interrupted it)."""

    name = "llama-cpp"

    def __init__(
        self, folder: Path, *, interrupt_requests: bool = True, n_ctx: int = N_CTX, threads: int = 2, embedding: bool = False
    ) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise RuntimeError("llama-cpp-python is not installed: `make test` installs it (the Makefile's test set-up)")
        argv = [
            sys.executable, "-m", "llama_cpp.server", "--model", default_model_path(), "--model_alias", MODEL,
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
            "--interrupt_requests", str(interrupt_requests), "--embedding", str(embedding),
        ]  # fmt: skip
        super().__init__(argv, folder)

    def disconnects(self) -> int:
        """How many streams it has stopped early, by its own log."""
        return self.log_text().count("Disconnected from client")


class EngineServer(_Server):
    """``python -m edge_engine.server`` on the same model, its CPU default (int4 on the
    file's own Q4_1 weights, float32's answers; float32 where its kernels cannot be built),
    two threads, a 512-token context, no TPOT objectives."""

    name = "edge-engine"

    def __init__(self, folder: Path, *, threads: int = 2) -> None:
        argv = [
            sys.executable, "-m", "edge_engine.server", "--dtype", "auto", "--model-name", MODEL,
            "--threads", str(threads), "--max-model-len", str(N_CTX),
            # the conformance suite tests answers, not scheduling: beside a CPU hog a one-row
            # step passed the 100 ms interactive objective and admission refused (503)
            "--no-tpot-objectives",
        ]  # fmt: skip
        super().__init__(argv, folder)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=5).json()
