"""Single-flight: identical cacheable requests in flight at once are coalesced.

One request (the leader) goes upstream; the others (followers) follow its chunks as they
arrive, each at its own pace: the leader appends to a shared chunk list that followers read
by index (bounded by the response size), so a slow follower never makes the leader wait.

In-process, joins of the same key share one `_State`. Across replicas (with a Redis URL):

- the first joiner of a key in a process takes a Redis lock in one atomic round trip
  (`SET lock token NX PX lock_ttl GET`); the holder is the leader,
- the leader's chunks go to a Redis stream `...:stream:<key>:<token>` (XADD with MAXLEN,
  PEXPIRE) from a background writer, so the leader never waits on Redis; the writer
  heartbeats the lock every lock_ttl/3 and ends with a done or abort marker, then drops
  the lock,
- in another process, the first joiner finds the holder's token and a background pump
  XREAD BLOCKs the stream into that process's local `_State`, which all its local joiners
  follow,
- a leader that dies stops heartbeating: once the lock is gone without a terminal marker,
  followers get `FlightAborted`; so do they when Redis fails mid-flight.

A leader that leaves without `finish` (an upstream error, a broken stream, a client
disconnect cancelling its task) aborts the flight; followers then get `FlightAborted` and
go upstream themselves. Nothing is stored by an aborted flight. Use::

    async with await flights.join(key) as flight:
        if flight.is_leader:
            async for chunk in upstream(): await flight.publish(chunk); ...
            await flight.finish(entry)
        else:
            async for chunk in flight.follow(include_usage=...): ...
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cache.base import Entry
from cache.circuit import Circuit
from cache.errors import FlightAborted
from cache.metrics import CacheMetrics
from cache.redis import REDIS_FAILURES, connect
from cache.replay import _chunk_base, _loads, is_usage_chunk, json_to_chunks, usage_chunk, usage_of

logger = logging.getLogger("edgegw.cache")

_REFRESH = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
)
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('del', KEYS[1]) else return 0 end"
)


class _State:
    """One key's flight in this process: the shared chunk list and its outcome."""

    def __init__(self, key: str, on_end: Any) -> None:
        self.key = key
        self.chunks: list[bytes] = []
        self.status = "running"  # running | done | aborted
        self.entry: Entry | None = None
        self.reason = ""
        self.scope = "local"  # local | redis (this process follows a remote leader)
        # the leader's Redis writer queue, when this process leads while holding the lock
        self.writer: asyncio.Queue[tuple[str, Any]] | None = None
        self._changed = asyncio.Event()
        self._on_end = on_end

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def append(self, chunk: bytes) -> None:
        if self.status == "running":
            self.chunks.append(chunk)
            if self.writer is not None:
                self.writer.put_nowait(("c", chunk))
            self._notify()

    def finish(self, entry: Entry) -> None:
        if self.status == "running":
            self.status, self.entry = "done", entry
            if self.writer is not None:
                self.writer.put_nowait(("d", entry))
            self._notify()
            self._on_end(self)

    def abort(self, reason: str) -> None:
        """Synchronous, so it is safe under cancellation; the Redis marker is written by
        the writer task."""
        if self.status == "running":
            self.status, self.reason = "aborted", reason
            if self.writer is not None:
                self.writer.put_nowait(("a", reason))
            self._notify()
            self._on_end(self)

    async def changed(self) -> None:
        await self._changed.wait()

    def __repr__(self) -> str:
        return f"<_State {self.key} {self.status} chunks={len(self.chunks)} scope={self.scope}>"


class Flight:
    """One request's handle on a flight: the leader's or a follower's."""

    def __init__(self, flights: SingleFlight, state: _State, is_leader: bool) -> None:
        self.key = state.key
        self.is_leader = is_leader
        self._flights = flights
        self._state = state

    def __repr__(self) -> str:
        role = "leader" if self.is_leader else "follower"
        return f"<Flight {self.key} {role} {self._state.status} chunks={len(self._state.chunks)}>"

    @property
    def status(self) -> str:
        return self._state.status

    # -- leader -------------------------------------------------------------------------
    async def publish(self, chunk: bytes) -> None:
        """Hand one chunk payload (JSON bytes of an SSE data event) to the followers."""
        self._publish_nowait(chunk)

    def _publish_nowait(self, chunk: bytes) -> None:
        if not self.is_leader:
            raise RuntimeError("only the leader publishes")
        if self._state.status != "running":
            return
        self._state.append(chunk)

    async def finish(self, entry: Entry) -> None:
        """The response completed: followers get the rest and `entry`."""
        if not self.is_leader:
            raise RuntimeError("only the leader finishes")
        state = self._state
        if state.status != "running":
            return
        published = len(state.chunks)
        if entry.chunks is not None and len(entry.chunks) > published:
            for chunk in entry.chunks[published:]:
                self._publish_nowait(chunk)
        state.finish(entry)

    async def abort(self, reason: str = "aborted") -> None:
        """The response failed: followers get `FlightAborted` and go upstream themselves."""
        self._abort_nowait(reason)

    def _abort_nowait(self, reason: str) -> None:
        if self.is_leader:
            self._state.abort(reason)

    async def release(self, exc: BaseException | None = None) -> None:
        """End this handle; a leader that did not finish aborts the flight. Never awaits,
        so it is safe under cancellation."""
        if self.is_leader and self._state.status == "running":
            if isinstance(exc, asyncio.CancelledError):
                reason = "leader cancelled"
            elif exc is not None:
                reason = f"leader failed: {type(exc).__name__}"
            else:
                reason = "leader left without finishing"
            self._abort_nowait(reason)

    async def __aenter__(self) -> Flight:
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        await self.release(exc)

    # -- follower -----------------------------------------------------------------------
    async def follow(self, include_usage: bool | None = None) -> AsyncIterator[bytes]:
        """The leader's chunk payloads, from the first, as they arrive.

        `include_usage=None` yields them as published. True/False apply the replay rule:
        usage chunks only when True, and then one is synthesised from the entry's usage if
        the leader's stream had none. A leader that answered with a JSON body (nothing
        streamed) is converted to chunks at the end. Raises `FlightAborted`."""
        state = self._state
        i = 0
        saw_usage = False
        while True:
            if i < len(state.chunks):
                chunk = state.chunks[i]
                i += 1
                if include_usage is not None and is_usage_chunk(chunk):
                    if not include_usage:
                        continue
                    saw_usage = True
                yield chunk
                continue
            if state.status == "aborted":
                raise FlightAborted(state.reason)
            if state.status == "done":
                break
            await state.changed()
        entry = state.entry
        assert entry is not None
        if i == 0 and entry.body is not None and entry.chunks is None:
            for chunk in json_to_chunks(entry.kind, entry.body, bool(include_usage)):
                yield chunk
            return
        if include_usage and not saw_usage:
            usage = usage_of(entry)
            if usage is not None:
                first = _loads(state.chunks[0]) if state.chunks else None
                yield usage_chunk(_chunk_base(entry.kind, first or {}), usage)

    async def wait(self) -> Entry:
        """The leader's final entry (for a JSON answer). Raises `FlightAborted`."""
        state = self._state
        while state.status == "running":
            await state.changed()
        if state.status == "aborted":
            raise FlightAborted(state.reason)
        assert state.entry is not None
        return state.entry


class SingleFlight:
    """Coalesces identical in-flight requests; across replicas when given a Redis URL."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        namespace: str = "edgegw",
        lock_ttl: float = 10.0,
        stream_ttl: float = 60.0,
        timeout: float = 0.05,
        connect_timeout: float = 0.2,
        cooldown: float = 5.0,
        block: float | None = None,
        max_stream_len: int = 100_000,
        metrics: CacheMetrics | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.namespace = namespace
        self.lock_ttl = lock_ttl
        self.stream_ttl = stream_ttl
        self.timeout = timeout
        self.block = block if block is not None else min(1.0, lock_ttl / 2)
        self.max_stream_len = max_stream_len
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self.circuit = Circuit(cooldown)
        self._flights: dict[str, _State] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._redis = self._blocking = None
        if redis_url is not None:
            self._redis = connect(redis_url, timeout, connect_timeout)
            # XREAD BLOCK needs a socket timeout longer than the block; bounded by wait_for
            self._blocking = connect(redis_url, self.block + 5, connect_timeout)

    def __repr__(self) -> str:
        where = self.redis_url or "in-process"
        return f"<SingleFlight {where} in_flight={len(self._flights)}>"

    def __len__(self) -> int:
        return len(self._flights)

    def lock_key(self, key: str) -> str:
        return f"{self.namespace}:sf:lock:{key}"

    def stream_key(self, key: str, token: str) -> str:
        return f"{self.namespace}:sf:stream:{key}:{token}"

    def _ended(self, state: _State) -> None:
        if self._flights.get(state.key) is state:
            del self._flights[state.key]

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _redis_failed(self, op: str, exc: BaseException) -> None:
        self.circuit.failure()
        self.metrics.error("singleflight", op)
        logger.warning("single-flight redis %s failed (%s: %s)", op, type(exc).__name__, exc)

    async def join(self, key: str) -> Flight:
        """Join the flight for `key`: lead it (go upstream) or follow it."""
        state = self._flights.get(key)
        if state is not None and state.status == "running":
            self.metrics.coalesced(state.scope)
            return Flight(self, state, is_leader=False)
        state = _State(key, self._ended)
        self._flights[key] = state
        if self._redis is None or not self.circuit.allow():
            return Flight(self, state, is_leader=True)
        token = uuid.uuid4().hex
        try:
            owned, holder = await self._acquire(key, token)
        except BaseException:
            self.circuit.abandon()  # cancelled: no verdict on Redis
            state.abort("cancelled while joining")
            raise
        if holder is None:  # we hold the lock, or Redis failed and we lead without it
            if owned and state.status == "running":
                state.writer = asyncio.Queue()
                self._spawn(self._write(state, token, state.writer))
            return Flight(self, state, is_leader=True)
        state.scope = "redis"
        self.metrics.coalesced("redis")
        self._spawn(self._pump(state, holder))
        return Flight(self, state, is_leader=False)

    async def _acquire(self, key: str, token: str) -> tuple[bool, str | None]:
        """Take the lock: (True, None) when ours, (False, holder's token) when another
        leader has it, (False, None) when Redis failed (lead without coalescing)."""
        assert self._redis is not None
        px = max(1, int(self.lock_ttl * 1000))
        for _ in range(3):
            try:
                old = await asyncio.wait_for(
                    self._redis.set(self.lock_key(key), token, nx=True, px=px, get=True),
                    self.timeout,
                )
            except REDIS_FAILURES as exc:
                self._redis_failed("lock", exc)
                return False, None
            self.circuit.success()
            if old is None:
                return True, None
            holder = old.decode()
            if holder != token:
                return False, holder
        return False, None

    async def _write(
        self, state: _State, token: str, queue: asyncio.Queue[tuple[str, Any]]
    ) -> None:
        """The leader's Redis writer: chunks → XADD, heartbeat the lock, terminal marker.
        Runs as its own task, so a cancelled leader never stops the abort marker."""
        assert self._redis is not None
        key = state.key
        lock, stream = self.lock_key(key), self.stream_key(key, token)
        lock_px = max(1, int(self.lock_ttl * 1000))
        stream_px = max(1, int(self.stream_ttl * 1000))
        write_timeout = max(self.timeout * 10, 0.5)
        seq = 0
        done = False
        while not done:
            try:
                item = await asyncio.wait_for(queue.get(), self.lock_ttl / 3)
                batch = [item]
            except asyncio.TimeoutError:
                batch = []  # nothing new: just heartbeat the lock
            while not queue.empty():
                batch.append(queue.get_nowait())
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for op, value in batch:
                        if op == "c":
                            pipe.xadd(stream, {"c": value, "i": seq},
                                      maxlen=self.max_stream_len, approximate=True)
                            seq += 1
                        elif op == "d":
                            fields: dict[str, Any] = {"d": value.kind, "t": repr(value.created_at)}
                            if seq == 0 and value.body is not None:
                                fields["b"] = value.body
                            pipe.xadd(stream, fields)
                            done = True
                            break
                        else:
                            pipe.xadd(stream, {"a": value or "aborted"})
                            done = True
                            break
                    if batch:
                        pipe.pexpire(stream, stream_px)
                    if done:
                        pipe.eval(_RELEASE, 1, lock, token)
                    else:
                        pipe.eval(_REFRESH, 1, lock, token, lock_px)
                    await asyncio.wait_for(pipe.execute(), write_timeout)
            except REDIS_FAILURES as exc:
                self._redis_failed("publish", exc)
                await self._give_up(lock, stream, token)
                return

    async def _give_up(self, lock: str, stream: str, token: str) -> None:
        """The leader's stream cannot be written: tell remote followers at once (an abort
        marker, the lock dropped), on a fresh connection (the failed one may only have been
        stale: a restarted Redis). If Redis is really gone, their own reads fail just as fast;
        either way no follower waits for the lock to expire."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xadd(stream, {"a": "the leader lost Redis"})
                pipe.pexpire(stream, max(1, int(self.stream_ttl * 1000)))
                pipe.eval(_RELEASE, 1, lock, token)
                await asyncio.wait_for(pipe.execute(), self.timeout * 2)
        except REDIS_FAILURES:
            pass

    async def _pump(self, state: _State, token: str) -> None:
        """Follow a remote leader's stream into this process's `_State`."""
        assert self._redis is not None and self._blocking is not None
        lock, stream = self.lock_key(state.key), self.stream_key(state.key, token)
        block_ms = max(1, int(self.block * 1000))
        last = "0-0"
        try:
            while state.status == "running":
                resp = await asyncio.wait_for(
                    self._blocking.xread({stream: last}, count=512, block=block_ms),
                    self.block + self.timeout + 1.0,
                )
                if not resp:
                    holder = await asyncio.wait_for(self._redis.get(lock), self.timeout)
                    if holder is not None and holder.decode() == token:
                        continue  # leader alive, just slow
                    resp = await asyncio.wait_for(
                        self._redis.xread({stream: last}, count=512), self.timeout
                    )
                    if not resp:
                        state.abort("leader lost")
                        return
                for _, entries in resp:
                    for entry_id, fields in entries:
                        last = entry_id
                        if not self._apply(state, fields):
                            return
        except REDIS_FAILURES as exc:
            self._redis_failed("follow", exc)
            state.abort("redis error while following")
        except asyncio.CancelledError:
            state.abort("follower closed")
            raise

    def _apply(self, state: _State, fields: dict[bytes, bytes]) -> bool:
        """Apply one stream entry to `state`; False once the flight has ended."""
        if b"c" in fields:
            if int(fields[b"i"]) != len(state.chunks):
                state.abort("stream gap")  # trimmed under us: not faithful any more
                return False
            state.append(fields[b"c"])
            return True
        if b"d" in fields:
            kind = fields[b"d"].decode()
            created_at = float(fields[b"t"])
            if b"b" in fields:
                entry = Entry(kind=kind, body=fields[b"b"], created_at=created_at)
            else:
                entry = Entry(kind=kind, chunks=list(state.chunks), created_at=created_at)
            state.finish(entry)
            return False
        state.abort(fields.get(b"a", b"aborted").decode())
        return False

    async def close(self, grace: float = 1.0) -> None:
        """Abort flights still running, let writers flush for up to `grace` s, close Redis."""
        for state in list(self._flights.values()):
            state.abort("shutting down")
        pumps = [t for t in self._tasks if not t.done()]
        if pumps:
            _, pending = await asyncio.wait(pumps, timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=grace)
        for client in (self._redis, self._blocking):
            if client is not None:
                try:
                    await asyncio.wait_for(client.aclose(), grace)
                except REDIS_FAILURES:
                    pass
