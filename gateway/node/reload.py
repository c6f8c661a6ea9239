"""Live configuration reload: SIGHUP, ``POST /admin/reload``, ``edgegw reload``, or a
changed configuration file (a mounted ConfigMap is swapped by symlink: ``Watch`` looks at
the file's inode, size and modification time, and at every ``keys_file``'s, every
``reload.interval_s``: one ``stat()`` each).

``Reloader.reload()`` reads the file again (with the command line's overrides on top) and:

- refuses a configuration that does not validate, logging the error (it names the key and
  line: ``config.yaml:12: tenants.0.keys: ...``); the running one stays, whole;
- applies at once what can change live: tenants and their keys (a revoked key is refused
  from the next request on), auth, rate limits, quotas, admin keys, forwarded headers, the
  limits read per request, admission, routing (policy, balancer, health, load, aliases,
  regions, GeoIP), clusters and endpoints (``gateway.pipeline.refleet``: added ones
  warmed, removed ones drained), the cache (a new cache when its settings changed; the old
  one closed once the requests admitted before the reload are done), usage, the log level
  and the access log;
- names in the log what it cannot change without a restart (``NOT_LIVE``): the listen
  addresses, the engine's model and memory, tracing, the SLO objectives, and the limits
  the listeners were built with. Those keep their running values.

Requests in flight are never cut: each request holds the configuration it was admitted
under (``gateway.admission.Generation``) and what only it still uses is closed when the
last such request has finished.

With ``listen.workers`` > 1 the supervising parent (``gateway.node.workers``) validates,
then sends SIGHUP to every worker and to the engine process, and watches the file itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from cache import CacheConfig
from gateway.admission import AdminKeys
from gateway.core.settings import ConfigError, Settings, load_settings
from gateway.pipeline import CacheLayer, refleet

__all__ = ["NOT_LIVE", "ConfigSource", "Outcome", "Reloader", "Watch", "apply", "apply_overrides", "changed_keys", "live_settings", "not_live"]

logger = logging.getLogger("edgegw.reload")

# what a running gateway cannot change: (section, keys) — () for the whole section
NOT_LIVE: dict[str, tuple[str, ...]] = {
    "listen": ("host", "port", "tls", "http3", "workers", "worker_timeout_s", "admin", "pid_file"),
    "limits": (
        "max_connections", "max_header_bytes", "max_header_count", "header_timeout_s", "drain_timeout_s",
        "stream_buffer_bytes", "startup_wait_s", "flood_interval_s", "max_stream_resets", "max_pings",
        "max_settings", "max_empty_frames", "max_control_frames", "max_frames_per_turn",
    ),
    "edge": (  # all but max_concurrency (the gateway's queue) and max_queue_len (the engine's bound)
        "enabled", "model", "name", "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory_fraction",
        "max_kv_cache_tokens", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_pending_outputs",
        "enable_prefix_caching", "num_threads", "process", "cpus",
    ),
    "tracing": (),
    "slo": (),
}


def apply_overrides(settings: Settings, args: argparse.Namespace | Any) -> Settings:
    """The command line's --host/--port/--log-level, --cache and --model on top of the file
    (``edgegw serve``, and again at every reload)."""
    if getattr(args, "cache", None) and getattr(args, "config", None):
        try:
            settings = settings.model_copy(update={"cache": CacheConfig.from_cli(args.cache)})
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if getattr(args, "model", None):
        if not os.path.exists(args.model):
            raise ConfigError(f"--model: {args.model!r} does not exist")
        edge = settings.edge.model_copy(update={"enabled": True, "model": args.model})
        settings = settings.model_copy(update={"edge": edge})
    changes = {}
    if getattr(args, "host", None):
        changes["host"] = args.host
    if getattr(args, "port", None) is not None:
        changes["port"] = args.port
    if getattr(args, "log_level", None):
        changes["log_level"] = args.log_level
    if getattr(args, "pid_file", None):
        changes["pid_file"] = args.pid_file
    if not changes:
        return settings
    return settings.model_copy(update={"listen": settings.listen.model_copy(update=changes)})


@dataclass(frozen=True)
class ConfigSource:
    """Where the configuration comes from: a file and the command line's overrides (plain
    data: it goes to each worker process)."""

    path: str | None
    overrides: dict = field(default_factory=dict)  # config, cache, model, host, port, log_level, pid_file

    def load(self) -> Settings:
        if self.path is None:
            raise ConfigError("no configuration file to read again (started without --config)")
        return apply_overrides(load_settings(self.path), argparse.Namespace(config=self.path, **self.overrides))

    def files(self, settings: Settings) -> list[str]:
        """The files a reload reads: the configuration and every keys_file."""
        files = [self.path] if self.path else []
        files += [t.keys_file for t in settings.tenants if t.keys_file]
        if settings.admin.keys_file:
            files.append(settings.admin.keys_file)
        return files


class Watch:
    """Tells when any of ``files`` changed since it last looked: inode, size, mtime (a
    ConfigMap's symlink swap changes the inode; an edit in place the others)."""

    def __init__(self, files: list[str]) -> None:
        self.files = list(files)
        self._seen = self._look()

    def _look(self) -> tuple:
        out = []
        for path in self.files:
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def changed(self) -> bool:
        seen = self._look()
        if seen == self._seen:
            return False
        self._seen = seen
        return True

    def follow(self, files: list[str]) -> None:
        """Watch ``files`` from now on (a reload may add or drop a keys_file)."""
        if files != self.files:
            self.files = list(files)
            self._seen = self._look()


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ (a list or a section that appears or goes is one
    key); values are never shown (they may be keys)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key) != new.get(key):
                if key in old and key in new:
                    out += changed_keys(old[key], new[key], f"{prefix}{key}.")
                else:
                    out.append(f"{prefix}{key}")
        return out
    return [prefix.rstrip(".")] if old != new else []


def not_live(keys: list[str]) -> list[str]:
    """Those of ``keys`` a running gateway cannot change."""
    out = []
    for key in keys:
        section, _, rest = key.partition(".")
        if section in NOT_LIVE and (not NOT_LIVE[section] or not rest or rest.split(".")[0] in NOT_LIVE[section]):
            out.append(key)
    return out


def live_settings(running: Settings, new: Settings) -> Settings:
    """``new`` with what cannot change live kept at its ``running`` value."""
    update: dict[str, Any] = {}
    for section, keys in NOT_LIVE.items():
        if not keys:
            update[section] = getattr(running, section)
            continue
        kept = {key: getattr(getattr(running, section), key) for key in keys}
        update[section] = getattr(new, section).model_copy(update=kept)
    return new.model_copy(update=update)


@dataclass
class Outcome:
    """What a reload did: ``ok``, the keys applied, those left for a restart, or the error."""

    ok: bool
    applied: list[str] = field(default_factory=list)
    restart: list[str] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict:
        return {"status": "reloaded" if self.ok else "refused", "applied": self.applied, "restart_needed": self.restart, "error": self.error}


class Reloader:
    """Reloads one process's gateway (``apply``: ``gateway.node.app.Gateway.reload``), one
    reload at a time; ``watch()`` is the file watcher's task."""

    def __init__(self, source: ConfigSource | None, running: Settings, apply) -> None:
        self.source = source
        self.running = running
        self._apply = apply  # async (new Settings) -> None
        self._lock = asyncio.Lock()
        self.reloads = 0  # reloads applied (tests wait on it)

    async def reload(self, why: str) -> Outcome:
        async with self._lock:
            return await self._reload(why)

    async def _reload(self, why: str) -> Outcome:
        where = self.source.path if self.source is not None and self.source.path else "(no file)"
        try:
            if self.source is None:
                raise ConfigError("no configuration file to read again (started without --config)")
            new = await asyncio.to_thread(self.source.load)
        except ConfigError as exc:
            logger.error("reload (%s) refused; the running configuration stays: %s", why, exc)
            return Outcome(False, error=str(exc))
        keys = changed_keys(self.running.model_dump(), new.model_dump())
        restart = not_live(keys)
        applied = [k for k in keys if k not in restart]
        if restart:
            logger.warning("reload (%s): not applied until a restart: %s", why, ", ".join(restart))
        if not applied:
            logger.info("reload (%s): %s: nothing to change live", why, where)
            return Outcome(True, [], restart)
        merged = live_settings(self.running, new)
        try:
            note = await self._apply(merged)
        except (ValueError, OSError, RuntimeError) as exc:
            logger.error("reload (%s) refused; the running configuration stays: %s", why, exc)
            return Outcome(False, restart=restart, error=str(exc))
        self.running = merged
        self.reloads += 1
        logger.info("reload (%s): %s: applied %s%s", why, where, ", ".join(_sections(applied)), f" ({note})" if note else "")
        return Outcome(True, applied, restart)

    async def watch(self, interval: float) -> None:
        """Reload when the configuration file or a keys_file changes."""
        if self.source is None or self.source.path is None:
            return
        watch = Watch(self.source.files(self.running))
        while True:
            await asyncio.sleep(interval)
            if watch.changed():
                await self.reload("file changed")
                watch.follow(self.source.files(self.running))


def _sections(keys: list[str]) -> list[str]:
    """``tenants``, ``clusters``, ``routing.policy``... : the keys, two levels deep at most."""
    out: list[str] = []
    for key in keys:
        short = ".".join(key.split(".")[:2])
        if short not in out:
            out.append(short)
    return out


async def apply(gateway, new: Settings) -> str:
    """Apply ``new`` (already ``live_settings``) to one process's ``gateway``
    (``gateway.node.app.Gateway``): everything that may fail is built first, then swapped in
    without awaiting; what only earlier requests use is closed once they are done. Returns a
    note on the endpoints for the log; raises ``ValueError``/``OSError``/``RuntimeError``
    with nothing changed."""
    old = gateway.settings
    admin_keys = AdminKeys(new.admin)  # reads admin.keys_file
    change = await refleet.prepare(gateway.fleet, new)
    layer = None
    if new.cache != old.cache:
        layer = CacheLayer(new.cache, gateway.metrics.registry, gateway.cache.metrics)
    try:
        old_limiter = gateway.gate.reload(new)  # reads the tenants' keys_files before changing anything
    except BaseException:
        await asyncio.gather(*(u.aclose() for u in change.built), return_exceptions=True)
        if layer is not None:
            await layer.aclose()
        raise
    # -- from here on, nothing fails and nothing awaits until everything is swapped in
    generation = gateway.gate.next_generation()
    if gateway.admin is not None:
        gateway.admin.keys = admin_keys
    refleet.commit(gateway.fleet, change)
    old_layer = None
    if layer is not None:
        old_layer, gateway.cache = gateway.cache, layer
        gateway.pipeline.cache = layer
    gateway.dispatcher.settings = new
    gateway.pipeline.ping = new.limits.keepalive_interval_s
    gateway.observer.access_log = new.listen.access_log
    gateway.usage.configure(new.usage)
    edge = gateway.fleet.edge
    engine = getattr(edge, "engine", None)  # in-process: its queue bound applies at once
    if engine is not None:
        engine.config.max_queue_len = new.edge.max_queue_len
    if new.listen.log_level != old.listen.log_level:
        logging.getLogger().setLevel(new.listen.log_level.upper())
    gateway.settings = new

    async def retire() -> None:
        try:
            await generation.drained()
        finally:  # also when the gateway stops first
            await refleet.retire(gateway.fleet, change)
            if old_limiter is not None:
                await old_limiter.aclose()
            if old_layer is not None:
                await old_layer.aclose()
            await gateway.usage.aclose_retired()

    gateway.retire(retire())
    if layer is not None:
        gateway.fleet.spawn(layer.start())
    return change.summary()
