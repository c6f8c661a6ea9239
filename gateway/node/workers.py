"""One node, every core: the supervising parent of ``listen.workers`` relay processes and
of the node's one edge engine process.

``Supervisor.run()`` is what ``edgegw serve`` does when ``listen.workers`` > 1 (or
``edge.process`` is set):

- it binds the public port once per worker slot, with ``SO_REUSEPORT``, and keeps those
  sockets open for its whole life: the kernel spreads new connections over the slots by
  their addresses, and connections that arrive while a slot's worker is being replaced wait
  in that slot's backlog instead of being refused;
- with the edge engine enabled, it starts the engine in a process of its own, listening on
  ``engine.sock`` in the node's private run directory (weights and KV cache exist once per
  node, whatever N is), and the workers at once: while the model loads they answer health
  checks and relay to the clusters, the engine counting as down (``/readyz`` says 503 on a
  node that has nothing else to serve); an engine that exits or does not answer within
  10 minutes on its first start stops the node (exit status 1); with ``edge.cpus`` the
  engine runs on those CPUs and the workers on the others;
- it starts each worker (``multiprocessing``'s spawn: a fresh interpreter, nothing
  inherited but the settings and the slot's socket), which runs the same app under uvicorn
  (``gateway.node.cli.uvicorn_config``);
- a worker whose event loop stops running (no heartbeat for ``listen.worker_timeout_s``:
  a request stuck in CPU work, a deadlock, a stopped process) is killed, and so replaced;
- a worker (or the engine) that exits is started again after a back-off that doubles
  while it keeps dying young (0.5 s up to 10 s), each time logged with its exit status;
  but a worker whose start-up failed (uvicorn's exit status 3: its lifespan raised, e.g. a
  configured GeoIP database that cannot be opened) stops the node with that status, as a
  single process would exit;
- SIGTERM or SIGINT: every worker is sent SIGTERM and drains (uvicorn's graceful shutdown,
  up to ``limits.drain_timeout_s``), then the engine; the parent exits 0. A child still
  running well past the drain time is killed.
- SIGHUP (or, with ``reload.watch``, a change of the configuration file or of a keys_file,
  which the parent looks at every ``reload.interval_s``): the parent reads the
  configuration again; refused (the log names the key and line), nothing changes; else it
  names what needs a restart, sends SIGHUP to every worker and to the engine, each of which
  applies it (``gateway.node.reload``; the engine its ``max_queue_len``), and starts
  replacement workers with it from then on.

Children run in their own process group (a terminal's Ctrl-C reaches the parent only, which
stops them in order: workers first, then the engine they stream from) and are sent SIGTERM
by the kernel if the parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from uvicorn.config import STARTUP_FAILURE

from gateway.node.reload import ConfigSource, Watch, changed_keys, live_settings, not_live
from gateway.node.siblings import Node
from gateway.core.settings import ConfigError, Settings, cpu_set

__all__ = ["Supervisor", "bind_slots", "run_engine", "split_cpus"]

logger = logging.getLogger("edgegw.workers")

_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 10.0
_YOUNG_S = 10.0  # a child that dies younger than this doubles its back-off
_ENGINE_START_S = 600.0  # loading the model (and building kernels) may take minutes the first time
_KILL_AFTER_S = 10.0  # past the drain timeout
_START_S = 60.0  # a worker's first beat may take this long (imports, the app's start-up)


def bind_slots(host: str, port: int, count: int, backlog: int = 2048) -> list[socket.socket]:
    """``count`` listening sockets on ``host:port`` sharing it with ``SO_REUSEPORT`` (port 0:
    the first one picks a free port, the others take the same)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            address = sock.getsockname()  # port 0 resolved: the next slots bind the same
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def run_engine(settings: Settings, path: str, source: ConfigSource | None = None) -> None:
    """The node's edge engine process: ``edge_engine.server`` over ``settings.edge``'s
    engine, on the Unix socket ``path``. Imported here, in the child only: the parent and
    the relay workers never load torch."""
    logging.basicConfig(level=settings.listen.log_level.upper(), format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    uvicorn = importlib.import_module("uvicorn")
    server = importlib.import_module("edge_engine.server")
    engine = importlib.import_module("edge_engine").Engine(settings.edge.engine_config())
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    config = uvicorn.Config(
        server.create_app(engine),
        uds=path,
        lifespan="on",
        log_level=settings.listen.log_level,
        access_log=False,
        timeout_graceful_shutdown=settings.limits.drain_timeout_s,
        timeout_keep_alive=3600,  # the workers' pools keep their connections
    )
    server = uvicorn.Server(config)
    _on_hangup(lambda: _reload_engine(engine, source))  # the parent passes reloads on
    server.run()


def _on_hangup(reload: Callable[[], None]) -> None:
    """SIGHUP calls ``reload`` (in the main thread, between two steps of the loop's work)."""
    signal.signal(signal.SIGHUP, lambda sig, frame: reload())


def _reload_engine(engine, source: ConfigSource | None) -> None:
    """What of a new configuration the engine process applies: its queue bound
    (``edge.max_queue_len``); its model and memory need a restart (the parent names them)."""
    if source is None:
        return
    try:
        new = source.load()
    except ConfigError as exc:
        logger.error("reload refused: %s", exc)
        return
    if engine.config.max_queue_len != new.edge.max_queue_len:
        engine.config.max_queue_len = new.edge.max_queue_len
        logger.info("reload: edge.max_queue_len %d", new.edge.max_queue_len)


def _child_main(target: Callable, parent: int, cpus: frozenset[int] | None, *args) -> None:
    """A child's first step: a process group of its own, SIGTERM when the parent dies, and
    its CPUs (``cpus``; None: the parent's); then ``target(*args)``. ``parent``: the
    supervisor's pid (it may itself be 1, as a container's first process)."""
    os.setpgrp()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        return  # the parent died before the line above (the child was handed to another)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before torch sizes its thread pool
    target(*args)


def split_cpus(settings: Settings) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """(the engine's CPUs, the relay workers' CPUs) from ``edge.cpus``, within the CPUs this
    process may use; (None, None) when the engine is not pinned. Raises ``ValueError`` when
    ``edge.cpus`` names CPUs this process may not use."""
    if settings.edge.cpus is None or not settings.engine_in_own_process:
        return None, None
    allowed = frozenset(os.sched_getaffinity(0))
    engine = cpu_set(settings.edge.cpus)
    if not engine <= allowed:
        raise ValueError(f"edge.cpus {settings.edge.cpus!r}: this process may run on CPUs {_cpu_list(allowed)} only")
    relay = allowed - engine
    if not relay:
        logger.warning("edge.cpus takes every CPU this process may use: the relay workers share them")
        return engine, None
    return engine, relay


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


class _Child:
    """One supervised process slot: what it runs, its current process and its back-off."""

    def __init__(self, name: str, target: Callable, args: tuple, heartbeat=None, cpus: frozenset[int] | None = None) -> None:
        self.name = name
        self.target = target
        self.args = args
        self.cpus = cpus  # where it runs (None: wherever the parent may)
        self.heartbeat = heartbeat  # a shared double: its event loop's last beat (gateway.node.Node.beat)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.started_at = 0.0
        self.backoff = 0.0
        self.restart_at: float | None = None
        self.last_exitcode: int | None = None  # how the last process ended (``exited``)

    def start(self, context) -> None:
        if self.heartbeat is not None:
            self.heartbeat.value = 0.0
        self.process = context.Process(
            target=_child_main, args=(self.target, os.getpid(), self.cpus, *self.args), name=f"edgegw {self.name}"
        )
        self.process.start()
        self.started_at = time.monotonic()
        self.restart_at = None
        logger.info("%s started (pid %d)", self.name, self.process.pid)

    @property
    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def kill_if_hung(self, now: float, timeout: float) -> None:
        """SIGKILL a process whose event loop has not beaten for ``timeout`` seconds (or, not
        yet started, for ``max(timeout, _START_S)``): the next round sees it ended and
        starts another, as for any death."""
        if self.heartbeat is None:
            return
        last = self.heartbeat.value
        silent = now - last if last else now - self.started_at - max(0.0, _START_S - timeout)
        if silent > timeout:
            logger.error(
                "%s (pid %d) is hung: its event loop has not run for %.1f s (listen.worker_timeout_s %g); killing it",
                self.name, self.process.pid, now - (last or self.started_at), timeout,
            )
            self.process.kill()
            self.process.join(5)

    def exited(self, now: float) -> float:
        """The process has ended unasked: when to start it again."""
        code = self.last_exitcode = self.process.exitcode
        young = now - self.started_at < _YOUNG_S
        self.backoff = min(_BACKOFF_MAX_S, self.backoff * 2) if young and self.backoff else _BACKOFF_FIRST_S
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        logger.warning("%s (pid %d) ended (%s); starting it again in %.1f s", self.name, self.process.pid, how, self.backoff)
        self.process.join(0)
        self.process = None
        self.restart_at = now + self.backoff
        return self.restart_at


class Supervisor:
    """Runs the node: ``worker(settings, node, sock)`` in ``listen.workers`` processes and,
    with the edge engine on, ``run_engine`` in one more. ``run()`` returns the exit status."""

    def __init__(self, settings: Settings, worker: Callable, source: ConfigSource | None = None) -> None:
        self.settings = settings
        self.worker = worker
        self.source = source  # where a reload reads the configuration (None: it cannot)
        self.context = multiprocessing.get_context("spawn")
        self._stopping = False
        self._hangup = False

    def run(self) -> int:
        settings = self.settings
        listen = settings.listen
        rundir = tempfile.mkdtemp(prefix="edgegw-")  # mode 0700: the node's sockets are private
        try:
            try:
                slots = bind_slots(listen.host, listen.port, listen.workers)
            except OSError as exc:
                logger.error("cannot bind %s:%d: %s", listen.host, listen.port, exc)
                return 1
            port = slots[0].getsockname()[1]
            self._wakeup, wakeup_write = os.pipe()
            os.set_blocking(self._wakeup, False)
            os.set_blocking(wakeup_write, False)
            previous_fd = signal.set_wakeup_fd(wakeup_write)  # a signal ends the wait at once
            previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._reload_asked)
            try:
                return self._supervise(rundir, slots, port)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                signal.set_wakeup_fd(previous_fd)
                os.close(self._wakeup)
                os.close(wakeup_write)
                for sock in slots:
                    sock.close()
        finally:
            shutil.rmtree(rundir, ignore_errors=True)

    def _stop(self, sig, frame) -> None:
        if not self._stopping:
            logger.info("%s: draining the workers", signal.Signals(sig).name)
        self._stopping = True

    def _reload_asked(self, sig, frame) -> None:
        self._hangup = True  # the loop reloads (the wakeup fd ends its wait)

    def _reload(self, why: str, children: list[_Child]) -> None:
        """Check the configuration again, then pass the reload to every child (module docstring)."""
        if self.source is None:
            logger.info("%s: no configuration file to read again (started without --config)", why)
            return
        try:
            new = self.source.load()
        except ConfigError as exc:
            logger.error("reload (%s) refused; the running configuration stays: %s", why, exc)
            return
        restart = not_live(changed_keys(self.settings.model_dump(), new.model_dump()))
        if restart:
            logger.warning("reload (%s): not applied until a restart: %s", why, ", ".join(restart))
        self.settings = live_settings(self.settings, new)
        for child in children:
            child.args = (self.settings, *child.args[1:])  # a replacement starts with it
            if child.is_alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signal.SIGHUP)
        logger.info("reload (%s): passed to %d process(es)", why, sum(c.is_alive for c in children))

    def _supervise(self, rundir: str, slots: list[socket.socket], port: int) -> int:
        settings = self.settings
        workers = settings.listen.workers
        try:
            engine_cpus, relay_cpus = split_cpus(settings)
        except ValueError as exc:
            logger.error("%s", exc)
            return 1
        if engine_cpus is not None:
            logger.info(
                "edge engine on CPUs %s, relay workers on %s",
                _cpu_list(engine_cpus), "the same" if relay_cpus is None else _cpu_list(relay_cpus),
            )
        engine = None
        loading = False  # the engine's first start is under way: the workers serve meanwhile
        if settings.edge.enabled:
            path = Node(0, workers, rundir).engine_socket
            engine = _Child("edge engine", run_engine, (settings, path, self.source), cpus=engine_cpus)
            engine.start(self.context)
            loading, load_deadline = True, time.monotonic() + _ENGINE_START_S
        children = []
        for i in range(workers):
            node = Node(i, workers, rundir, self.context.RawValue("d", 0.0))
            children.append(_Child(f"worker {i}", self.worker, (settings, node, slots[i], self.source), node.heartbeat, relay_cpus))
        for child in children:
            child.start(self.context)
        logger.info("edgegw: %d worker(s) on http://%s:%d", workers, settings.listen.host, port)
        everyone = [*children, *([engine] if engine else [])]
        status = 0
        watch = Watch(self.source.files(settings)) if self.source is not None and self.source.path else None
        next_look = time.monotonic() + settings.reload.interval_s
        while not self._stopping:
            now = time.monotonic()
            if self._hangup:
                self._hangup = False
                self._reload("SIGHUP", everyone)
            elif watch is not None and self.settings.reload.watch and now >= next_look:
                next_look = now + self.settings.reload.interval_s
                if watch.changed():
                    self._reload("file changed", everyone)
                    watch.follow(self.source.files(self.settings))
            if loading:
                if _answers(path):
                    loading = False
                    logger.info("edge engine ready (pid %d)", engine.process.pid)
                elif not engine.is_alive or now > load_deadline:
                    # a model that cannot load fails the same way every time: stop, as one process would
                    # (it may have been seen to end, and be waiting to start again, already)
                    code = engine.process.exitcode if engine.process is not None else engine.last_exitcode
                    why = f"exited while starting (exit status {code})" if not engine.is_alive else f"did not start within {_ENGINE_START_S:.0f} s"
                    logger.error("the edge engine %s: stopping the node", why)
                    self._stopping, status = True, 1
                    break
            for child in everyone:
                if child.process is None:
                    if child.restart_at is not None and now >= child.restart_at:
                        child.start(self.context)
                elif not child.process.is_alive():
                    if child.process.exitcode == STARTUP_FAILURE:  # its lifespan failed: so would the next one's
                        logger.error("%s could not start (see above): stopping the node", child.name)
                        self._stopping, status = True, STARTUP_FAILURE
                        break
                    child.exited(now)
                else:
                    child.kill_if_hung(now, settings.listen.worker_timeout_s)
            sentinels = [c.process.sentinel for c in everyone if c.process is not None]
            due = [c.restart_at for c in everyone if c.restart_at is not None]
            timeout = max(0.0, min(due) - time.monotonic()) if due else 1.0
            if self._wakeup in wait([*sentinels, self._wakeup], timeout=min(timeout, 0.1 if loading else min(1.0, self.settings.reload.interval_s))):
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wakeup, 512)
        self._terminate(children)
        if engine is not None:
            self._terminate([engine])
        return status

    def _terminate(self, children: list[_Child]) -> None:
        """SIGTERM to each, then wait for them to drain; SIGKILL past the drain timeout."""
        running = [c for c in children if c.is_alive]
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.limits.drain_timeout_s + _KILL_AFTER_S
        for child in running:
            child.process.join(max(0.0, deadline - time.monotonic()))
            if child.process.is_alive():
                logger.warning("%s (pid %d) did not drain in time: killed", child.name, child.process.pid)
                child.process.kill()
                child.process.join(5)


def _answers(path: str) -> bool:
    """Whether an HTTP server answers ``GET /health`` 200 on the Unix socket ``path``."""
    if not os.path.exists(path):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect(path)
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: engine\r\nconnection: close\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False
