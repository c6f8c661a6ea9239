"""The engine: ``Engine.generate(...)`` is an async iterator of ``Delta``s.

Lifecycle::

    engine = Engine(EngineConfig(model=None, dtype="float32"))   # loads the model (blocking)
    await engine.start()                                           # starts the step thread
    async for delta in engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(delta.text, end="")
    await engine.close()                                           # stops it; pending requests fail

(``generate`` starts the step thread itself if ``start()`` was not awaited.)

The model runs on its own thread, so the event loop never blocks on a forward pass.  Each
step the thread takes new requests and cancellations from an inbox, runs
schedule -> run -> postprocess, and hands each request's delta to that request's
``asyncio.Queue`` with ``loop.call_soon_threadsafe``.  It holds the scheduler's lock for
all of that but the model run itself, and each model run's wall time feeds the step cost
model (``StepCostModel``) that the scheduler sizes steps with (``edge.tpot_ms``) and
admission predicts with: a request whose first token cannot come before its deadline, or
whose class's time-per-output-token objective cannot be kept, is refused at once
(``EngineOverloadedError``, codes ``deadline_unattainable`` / ``tpot_unattainable``; see
``edge_engine.admission``).  That queue is bounded by flow
control, not by its size: a sequence whose reader has ``max_pending_outputs`` deltas unread
is paused by the scheduler (it keeps its KV blocks) and resumes once the reader drains below
the bound, so a client that stops reading costs a few blocks, not a growing queue.  A
request may carry a deadline (``time.monotonic()``): still waiting when it passes, it is
dropped without running and its iterator raises ``DeadlineExceededError`` -- at once, by a
watchdog thread that sleeps until the next deadline and takes the scheduler's lock while the
model runs, not at the end of a step that may take seconds on a busy node.  Closing the
iterator early (``aclose()``, task cancellation, a client that went away) posts a
cancellation: the sequence is removed and its blocks freed at the next step.  An exception inside a model step
fails the sequences of that step with ``EngineError`` and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields

import torch

from .admission import forecast
from .block_manager import BlockManager
from .config import EngineConfig
from .errors import (
    DeadlineExceededError,
    EngineClosedError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)
from .grammar import GrammarCompiler
from .grammar import available as grammar_available
from .kv_cache import available_memory_bytes, kv_bytes_per_block
from .loader import load_model
from .runner import ModelRunner, resolve_dtypes
from .runner import describe_dtype as _describe_dtype
from .sampling import SampleResult, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Delta, Priority, Sequence, StageTimes
from .step_cost import StepCostModel
from .tokenizer import IncrementalDetokenizer

__all__ = ["Engine", "EngineStats", "describe_dtype"]

logger = logging.getLogger("edge_engine")

_DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(slots=True)
class EngineStats:
    """A snapshot for the routing layer (``dataclasses.asdict`` / ``as_dict()`` for JSON)."""

    model: str
    device: str
    dtype: str  # the mode it runs (what edge.dtype: auto picked)
    dtype_reason: str  # why that mode: the configured dtype, and the kernels' state or ISA
    max_model_len: int
    num_waiting: int  # queue depth
    num_running: int
    num_paused: int  # running, but their readers are max_pending_outputs deltas behind
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int  # includes cached blocks nobody holds (evictable)
    num_kv_blocks_cached: int
    kv_cache_usage: float  # used / total
    block_size: int
    prefix_cache_hit_rate: float  # prompt tokens served from the cache / prompt tokens scheduled
    ttft_ms_p50: float | None  # median over the recent window
    tpot_ms_p50: float | None
    num_requests_finished: int
    num_preemptions: int
    num_step_failures: int
    num_deadline_drops: int  # waiting requests dropped unstarted because their deadline passed
    num_refused: int  # requests refused at admission: TTFT budget or TPOT objective predicted unattainable
    num_parked_rows: int  # row-steps left out of a step to keep a class's TPOT objective
    step_fixed_ms: float  # the step cost model: fixed cost per step
    step_per_row_ms: float  # per decode row
    step_per_token_ms: float  # per prefill token
    structured_output: bool = False  # it can hold outputs to a JSON schema or tool calls (a grammar library)

    def as_dict(self) -> dict:
        # the fields are plain values: no need for asdict's recursive copy (a node's workers
        # ask for this 20 times a second each)
        return {name: getattr(self, name) for name in _STATS_FIELDS}


_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: CUDA was asked for but torch.cuda.is_available() is False")
    return torch.device(name)


def describe_dtype(config: EngineConfig) -> tuple[str, str]:
    """(the mode an engine built from ``config`` would run, why), without loading the model:
    what ``edgegw check-config`` says of ``edge.dtype``.  Raises ValueError as ``Engine``
    would for a mode the device cannot run."""
    return _describe_dtype(config.dtype, _resolve_device(config.device))


def _on_fresh_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread of its own that ends with it; returns its result
    or raises.

    Why: torch's OpenMP runtime (libgomp) gives every thread that runs a parallel op a
    pool of worker threads for as long as that thread lives, and while the process holds
    more of them than CPUs it stops letting idle workers spin between parallel regions --
    waking them then costs more than the work: a batch-1 int4 decode step took 20 ms
    instead of 10 on 2 cores when the model had been built on the (long-lived) caller's
    thread.  Built here, the model leaves no pool behind; the step thread's is the only one.
    """
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn(*args, **kwargs)))
        except BaseException as exc:  # re-raised on the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=run, name="edge-engine-build")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def _parse_priority(priority: int | str) -> int:
    try:
        return int(Priority[priority.upper()]) if isinstance(priority, str) else int(Priority(priority))
    except (KeyError, ValueError):
        raise InvalidRequestError("priority must be 'interactive', 'standard' or 'batch'", "priority", "invalid_value") from None


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config if config is not None else EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = _resolve_device(config.device)
        _, _, kv_dtype = resolve_dtypes(config.dtype, self.device)  # a bad dtype/device pair fails before loading
        loaded = load_model(config.model_path)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.model_name or loaded.name
        self.model_path = loaded.path
        self.max_model_len = config.max_model_len or min(loaded.config.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN)
        self.block_size = config.block_size
        self.num_kv_blocks = self._num_kv_blocks(kv_dtype)
        self.runner = _on_fresh_thread(
            ModelRunner,
            loaded.config,
            loaded.weights,
            device=self.device,
            dtype=config.dtype,
            num_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
        )
        del loaded
        log = logger.warning if self.runner.dtype_reason.startswith("auto: float32, not int4") else logger.info
        log("edge engine %s on %s: dtype %s (%s)", self.model_name, self.device, self.runner.dtype_name, self.runner.dtype_reason)
        self.block_manager = BlockManager(self.num_kv_blocks, self.block_size, config.enable_prefix_caching)
        self.cost = StepCostModel()  # fitted on every model run
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_pending_outputs=config.max_pending_outputs,
            tpot_objectives=config.tpot_objectives,
            cost=self.cost,
        )
        self._eos_ids = set(self.tokenizer.eos_token_ids)
        # constrained decoding (response_format, tools): None where llguidance is missing
        structured = config.structured_output and grammar_available()
        self.grammar = GrammarCompiler(self.tokenizer, self.model_config.vocab_size) if structured else None
        self.jump_forward = True  # append the tokens a grammar forces without sampling them (bench/grammar.py turns it off to compare)
        _ = self.tokenizer.max_token_chars  # computed once, now rather than on the first request
        # the scheduler's state: held by the step thread except while the model runs, and by
        # the watchdog; taken before the inbox's lock when both are needed
        self._sched_lock = threading.Lock()
        # inbox, filled by the event loop, drained by the step thread
        self._inbox_lock = threading.Lock()
        self._cond = threading.Condition(self._inbox_lock)  # the step thread waits on it
        self._deadline_cond = threading.Condition(self._inbox_lock)  # the watchdog waits on it
        self._deadlines: list[tuple[float, int, Sequence]] = []  # heap of (deadline, seq_id, seq)
        self._pending_adds: list[Sequence] = []
        self._pending_aborts: list[Sequence] = []
        self._wakeup = False  # a paused sequence's reader caught up
        self._last_step_ran = True  # False: sleep until the inbox, a reader or a deadline says otherwise
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._stopping = False
        # what admission predicts with: the scheduler's load (after the step in flight) and
        # that step's (start, predicted seconds); replaced whole by the step thread
        self._load = self.scheduler.load()
        self._in_flight: tuple[float, float] | None = None
        self._closed = False
        # statistics
        self._ttfts: deque[float] = deque(maxlen=config.stats_window)
        self._tpots: deque[float] = deque(maxlen=config.stats_window)
        self.num_requests_finished = 0
        self.num_step_failures = 0
        self.num_deadline_drops = 0
        self.num_refused = 0

    def _num_kv_blocks(self, kv_dtype: torch.dtype) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.block_size, kv_dtype)
        num = int(available_memory_bytes(self.device) * config.kv_cache_memory_fraction // per_block)
        if config.max_kv_cache_tokens:
            num = min(num, config.max_kv_cache_tokens // self.block_size)
        if num < 2:
            raise ValueError("not enough free memory for a KV cache; set num_kv_blocks")
        return num

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the step thread (idempotent; also restarts an engine after ``close()``)."""
        if self._closed and self._thread is None:
            self._closed = False
            self._stopping = False
        self._start_thread()

    def _start_thread(self) -> None:
        if self._closed:
            raise EngineClosedError()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="edge-engine-step", daemon=True)
            self._thread.start()
            self._watchdog = threading.Thread(target=self._watch, name="edge-engine-deadlines", daemon=True)
            self._watchdog.start()

    async def close(self) -> None:
        """Stop the step thread; requests still in flight fail with ``EngineClosedError``."""
        self._closed = True
        with self._cond:
            self._stopping = True
            self._cond.notify()
            self._deadline_cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._watchdog is not None:
            await asyncio.to_thread(self._watchdog.join)
            self._watchdog = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and not self._closed

    # -- requests ------------------------------------------------------------------------
    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> int:
        """Check that a request can ever be served; returns its effective ``max_tokens``.

        Raises ``InvalidRequestError`` naming the parameter: a request that can never fit is
        refused now, never queued forever.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", prompt_param, "invalid_value")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", prompt_param, "invalid_value")
        limit = min(self.max_model_len, self.num_kv_tokens)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {n} tokens, leaving no room for a completion.",
                prompt_param,
                "context_length_exceeded",
            )
        if n >= self.num_kv_tokens:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the whole KV cache holds {self.num_kv_tokens}",
                prompt_param,
                "context_length_exceeded",
            )
        if params.max_tokens is None:
            return limit - n
        if n + params.max_tokens > limit:
            raise InvalidRequestError(
                f"{max_tokens_param} is too large: the prompt ({n} tokens) plus {params.max_tokens} "
                f"completion tokens exceed the context window of {limit} tokens",
                max_tokens_param,
                "context_length_exceeded",
            )
        return params.max_tokens

    def check_prompt_chars(self, num_chars: int, prompt_param: str = "prompt") -> None:
        """Refuse, before tokenising it, a prompt whose length in characters proves it cannot
        fit: it has at least ``ceil(num_chars / max_token_chars)`` tokens.  (A 3.9 MB prompt
        took ~3.3 s to tokenise only to be refused by ``validate``.)"""
        per_token = self.tokenizer.max_token_chars
        if per_token is None:
            return
        min_tokens = -(-num_chars // per_token)
        limit = min(self.max_model_len, self.num_kv_tokens)
        if min_tokens >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens; the prompt has {num_chars} "
                f"characters, i.e. at least {min_tokens} tokens, leaving no room for a completion.",
                prompt_param,
                "context_length_exceeded",
            )

    def check_capacity(
        self, num_prompt_tokens: int = 0, priority: int = Priority.INTERACTIVE, deadline: float | None = None
    ) -> None:
        """Raise ``EngineOverloadedError`` when the waiting queue is at its limit, or (given
        the request's prompt length) when its first token is predicted after ``deadline``
        (``deadline_unattainable``) or its class's time-per-output-token objective cannot be
        kept beside the work of its class and the more urgent ones (``tpot_unattainable``).
        The prediction (``edge_engine.admission.forecast``) reads the step cost model, so it
        follows the node's load."""
        if self._closed:
            raise EngineClosedError()
        with self._cond:
            queued = [(s.priority, s.num_prompt_tokens) for s in self._pending_adds]
        depth = self.scheduler.num_waiting + len(queued)
        if depth >= self.config.max_queue_len:
            ttft = statistics.median(self._ttfts) if self._ttfts else 1.0
            retry_after = max(1, math.ceil(ttft * depth / self.config.max_num_seqs))
            raise EngineOverloadedError(
                f"the edge engine's queue is full ({depth} waiting requests)", retry_after=min(retry_after, 60)
            )
        objectives = self.scheduler.tpot_objectives
        if num_prompt_tokens <= 0 or (deadline is None and priority not in objectives):
            return
        now = time.monotonic()
        left = 0.0
        in_flight = self._in_flight
        if in_flight is not None:  # a step late by x is taken to need x more
            elapsed = now - in_flight[0]
            left = abs(in_flight[1] - elapsed)
        load = self._load.with_queued(queued) if queued else self._load
        expect = forecast(load, self.cost, objectives, priority, num_prompt_tokens, left)
        if not expect.tpot_ok:
            self.num_refused += 1
            raise EngineOverloadedError(
                f"the edge engine cannot keep this request's tokens within {expect.tpot_limit * 1000:.0f} ms of each other "
                f"beside the work of its priority class (a step predicted at {expect.tpot * 1000:.0f} ms)",
                retry_after=max(1, min(60, math.ceil(expect.ttft))) if math.isfinite(expect.ttft) else 60,
                code="tpot_unattainable",
            )
        if deadline is not None and now + expect.ttft > deadline:
            self.num_refused += 1
            predicted = f"{expect.ttft * 1000:.0f} ms" if math.isfinite(expect.ttft) else "never, as things stand"
            raise EngineOverloadedError(
                f"the edge engine cannot start this request within its budget: its first token is predicted in "
                f"{predicted}, with {max(0.0, deadline - now) * 1000:.0f} ms left",
                retry_after=max(1, min(60, math.ceil(expect.ttft))) if math.isfinite(expect.ttft) else 60,
                code="deadline_unattainable",
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int | str = Priority.INTERACTIVE,
        deadline: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        queue: asyncio.Queue | None = None,
        admitted: bool = False,
    ) -> Sequence:
        """Validate and enqueue; returns the sequence whose deltas go to ``queue``.

        ``deadline`` is a ``time.monotonic()`` value: if the sequence has not started by
        then it is dropped with ``DeadlineExceededError``; a request predicted to miss it,
        or its class's TPOT objective, is refused (``check_capacity``) unless ``admitted``
        says that the caller's own ``check_capacity`` passed a moment ago.  The reader of ``queue`` must call
        ``consumed(seq)`` for each item it takes (flow control).  Most callers want
        ``generate``, which does; this is its non-iterator half.
        """
        params = params if params is not None else SamplingParams()
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        max_tokens = self.validate(prompt_ids, params)
        priority = _parse_priority(priority)
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExceededError()
        if admitted:
            self.check_capacity()
        else:
            self.check_capacity(len(prompt_ids), priority, deadline)
        seq = Sequence(
            prompt_ids,
            params,
            request_id=request_id or "",
            priority=priority,
            max_tokens=max_tokens,
            deadline=deadline,
        )
        seq.generator = torch.Generator(device=self.device)
        seq.generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        if params.grammar is not None:
            seq.constraint = params.grammar.matcher()
        seq.sink = (loop or asyncio.get_running_loop(), queue if queue is not None else asyncio.Queue())
        self._start_thread()
        with self._cond:
            self._pending_adds.append(seq)
            self._cond.notify()
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, seq.seq_id, seq))
                if self._deadlines[0][2] is seq:  # the watchdog's next wake-up moved earlier
                    self._deadline_cond.notify()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` at the next step and free its blocks (safe from any thread)."""
        with self._cond:
            self._pending_aborts.append(seq)
            self._cond.notify()

    def consumed(self, seq: Sequence) -> None:
        """The reader took one item of ``seq``'s queue; wakes the step thread when that
        brings a paused sequence back under ``max_pending_outputs``."""
        seq.num_outputs_consumed += 1
        if seq.num_pending_outputs == self.config.max_pending_outputs - 1:
            with self._cond:
                self._wakeup = True
                self._cond.notify()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int | str = Priority.INTERACTIVE,
        deadline: float | None = None,
        admitted: bool = False,
    ) -> AsyncIterator[Delta]:
        """Yield deltas until one carries ``finish_reason``.

        Raises ``InvalidRequestError`` / ``EngineOverloadedError`` on the first iteration when
        the request is refused, ``DeadlineExceededError`` if ``deadline`` (``time.monotonic()``)
        passes before the request starts, and ``EngineError`` if a model step fails.
        ``admitted``: see ``add_request``.
        """
        seq = self.add_request(
            prompt, params, request_id=request_id, priority=priority, deadline=deadline, admitted=admitted
        )
        queue: asyncio.Queue = seq.sink[1]
        done = False
        try:
            while True:
                item = await queue.get()
                self.consumed(seq)
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finish_reason is not None:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(seq)

    # -- the step thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                # after a step that scheduled nothing (all paused, or blocked on blocks held by
                # paused sequences), sleep until something changes (deadlines: the watchdog's)
                while not (
                    self._stopping
                    or self._pending_adds
                    or self._pending_aborts
                    or self._wakeup
                    or (self._last_step_ran and self.scheduler.has_work())
                ):
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                with self._sched_lock:
                    with self._cond:
                        adds, self._pending_adds = self._pending_adds, []
                        aborts, self._pending_aborts = self._pending_aborts, []
                        self._wakeup = False
                    for seq in adds:
                        self.scheduler.add(seq)
                    for seq in aborts:
                        if not seq.is_finished:
                            self.scheduler.finish(seq, "abort")
                    events = self._drop_expired()
                events += self.step()
            except Exception as exc:  # a bug outside the model call: fail what is running, keep going
                logger.exception("engine step failed")
                self.num_step_failures += 1
                self._last_step_ran = True
                with self._sched_lock:
                    events = self._fail_all(EngineError(f"engine step failed: {exc!r}"))
            try:
                self._deliver(events)
            except Exception:  # never let the step thread die: its requests would hang
                logger.exception("delivering engine outputs failed")
        # stopping: everything still queued or running fails
        with self._sched_lock:
            with self._cond:
                adds, self._pending_adds = self._pending_adds, []
            for seq in adds:
                self.scheduler.add(seq)
            events = self._fail_all(EngineClosedError("the edge engine was closed"))
        self._deliver(events)

    def _watch(self) -> None:
        """The watchdog: sleeps until the earliest deadline of a request not yet started,
        then answers every request whose deadline has passed and that is still waiting
        (in the inbox or the scheduler's queue) with ``DeadlineExceededError`` -- while the
        step thread is inside a model run, since it holds the scheduler's lock only
        between runs."""
        while True:
            with self._cond:
                while not self._stopping:
                    now = time.monotonic()
                    if self._deadlines and self._deadlines[0][0] <= now:
                        break
                    self._deadline_cond.wait(self._deadlines[0][0] - now if self._deadlines else None)
                if self._stopping:
                    return
            try:
                self.expire(time.monotonic())
            except Exception:  # never let the watchdog die: deadlines would wait for steps again
                logger.exception("the engine's deadline watchdog failed")

    def expire(self, now: float) -> int:
        """Answer (``DeadlineExceededError``) every request not yet started whose deadline
        is ``<= now``; returns how many.  The watchdog calls it; safe from any thread."""
        events: list[tuple[Sequence, object]] = []
        with self._sched_lock:
            with self._cond:
                due = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    due.append(heapq.heappop(self._deadlines)[2])
                for seq in due:
                    if seq.is_finished or seq.is_started:
                        continue
                    if seq in self._pending_adds:  # not seen by the step thread yet
                        self._pending_adds.remove(seq)
                    self.scheduler.finish(seq, "deadline")
                    events.append((seq, DeadlineExceededError()))
            self.num_deadline_drops += len(events)
            self._deliver_locked(events)
        return len(events)

    def _drop_expired(self) -> list[tuple[Sequence, object]]:
        expired = self.scheduler.remove_expired(time.monotonic())
        self.num_deadline_drops += len(expired)
        return [(seq, DeadlineExceededError()) for seq in expired]

    def _fail_all(self, error: EngineError) -> list[tuple[Sequence, object]]:
        events: list[tuple[Sequence, object]] = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(seq, "error")
            events.append((seq, error))
        return events

    def step(self) -> list[tuple[Sequence, object]]:
        """One schedule -> run -> postprocess round; returns (sequence, Delta | EngineError).

        Runs on the step thread; call it directly only on an engine whose thread is not
        started.  The scheduler's lock is held for the schedule and the postprocess, not for
        the model run, whose wall time feeds the step cost model.
        """
        with self._sched_lock:
            out = self.scheduler.schedule()
            self._last_step_ran = bool(out)
            self._load = self.scheduler.load(out if out else None)
            if not out:
                return []
            self._in_flight = (time.monotonic(), out.predicted_time)
        started = time.perf_counter()
        try:
            results = self.run_model(out)
        except Exception as exc:
            logger.exception("model step failed")
            error = EngineError(f"model step failed: {exc!r}")
            with self._sched_lock:
                self._in_flight = None
                self.num_step_failures += 1
                events: list[tuple[Sequence, object]] = []
                for seq, _ in out.scheduled:
                    self.scheduler.finish(seq, "error")
                    events.append((seq, error))
                self._load = self.scheduler.load()
            return events
        elapsed = time.perf_counter() - started
        with self._sched_lock:
            self._in_flight = None
            self.cost.observe(out.num_decode_rows, out.num_prefill_tokens, elapsed)
            now = time.monotonic()
            events = []
            for (seq, n), result in zip(out.scheduled, results):
                seq.num_computed_tokens += n
                self.block_manager.register_full_blocks(seq)
                if result is not None:
                    events.append((seq, self._append_token(seq, result, now)))
            self._load = self.scheduler.load()
        return events

    def run_model(self, out: SchedulerOutput) -> list:
        """The model run of one step (the step thread, no lock held): a seam for tests that
        need a step to last until they say so."""
        return self.runner.run(out.scheduled)

    def _append_token(self, seq: Sequence, result: SampleResult, now: float) -> Delta:
        params = seq.params
        token = result.token_id
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._ttfts.append(now - seq.arrival_time)
        seq.last_token_time = now
        finish: str | None = None
        can_stop = seq.num_output_tokens > params.min_tokens
        # a grammar ends the output itself: its end of sequence, or a token after which nothing may follow
        grammar_done = seq.constraint is not None and seq.constraint.advance(token)
        if (grammar_done and token in self._eos_ids) or (
            can_stop and ((token in self._eos_ids and not params.ignore_eos) or token in params.stop_token_ids)
        ):
            finish = "stop"
            seq.output_text += seq.detokenizer.flush()
        else:
            before = len(seq.output_text)
            seq.output_text += seq.detokenizer.add(token)
            if params.stop and can_stop and len(seq.output_text) > before:
                search_from = max(0, before - params.max_stop_len + 1)
                hits = [i for i in (seq.output_text.find(s, search_from) for s in params.stop) if i >= 0]
                if hits:
                    seq.output_text = seq.output_text[: min(hits)]
                    finish = "stop"
            if finish is None and grammar_done:
                finish = "stop"
                seq.output_text += seq.detokenizer.flush()
        token_ids = [token]
        if finish is None and seq.constraint is not None and self.jump_forward and not params.logprobs and not params.stop:
            finish = self._jump_forward(seq, token_ids)
        if finish is None and (seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            finish = "length"
            seq.output_text += seq.detokenizer.flush()
        if finish is None and params.stop:
            upto = max(seq.num_emitted_chars, len(seq.output_text) - params.max_stop_len + 1)
        else:
            upto = len(seq.output_text)
        text = seq.output_text[seq.num_emitted_chars : upto]
        seq.num_emitted_chars = max(seq.num_emitted_chars, upto)
        if params.logprobs:
            seq.logprobs.append(result)
        if finish is not None:
            self.scheduler.finish(seq, finish)
            self.num_requests_finished += 1
            if seq.num_output_tokens > 1 and seq.first_token_time is not None:
                self._tpots.append((now - seq.first_token_time) / (seq.num_output_tokens - 1))
        return Delta(
            request_id=seq.request_id,
            text=text,
            token_ids=token_ids,
            finish_reason=finish,
            logprobs=[result] if params.logprobs else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            times=StageTimes.of(seq, now) if finish is not None else None,
        )

    def _jump_forward(self, seq: Sequence, token_ids: list[int]) -> str | None:
        """Append the tokens ``seq``'s grammar forces next (a tool call's header, a schema's
        keys and punctuation) without sampling them: the next step computes their KV as one
        chunk, as a prefill does, and samples after them -- one step instead of one per
        token. Returns "stop" when they complete the grammar. Not with logprobs (forced
        tokens have none) nor stop strings (checked token by token)."""
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        for token in seq.constraint.forced_tokens()[: max(0, room)]:
            seq.token_ids.append(token)
            token_ids.append(token)
            if token in self._eos_ids:
                seq.constraint.advance(token)
                seq.output_text += seq.detokenizer.flush()
                return "stop"
            seq.output_text += seq.detokenizer.add(token)
            if seq.constraint.advance(token):
                seq.output_text += seq.detokenizer.flush()
                return "stop"
        return None

    def _deliver(self, events: list[tuple[Sequence, object]]) -> None:
        with self._sched_lock:
            self._deliver_locked(events)

    def _deliver_locked(self, events: list[tuple[Sequence, object]]) -> None:
        """Hand each item to its sequence's queue on that queue's event loop (the
        scheduler's lock held: the produced-count and the abort below are its state)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for seq, item in events:
            seq.num_outputs_produced += 1
            loop, queue = seq.sink
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                for seq, _ in events:
                    if seq.sink[0] is loop and not seq.is_finished:
                        self.scheduler.finish(seq, "abort")

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        ttfts, tpots = list(self._ttfts), list(self._tpots)
        fixed, per_row, per_token = self.cost.coefficients
        return EngineStats(
            model=self.model_name,
            device=str(self.device),
            dtype=self.runner.dtype_name,
            dtype_reason=self.runner.dtype_reason,
            max_model_len=self.max_model_len,
            num_waiting=self.scheduler.num_waiting + len(self._pending_adds),
            num_running=self.scheduler.num_running,
            num_paused=self.scheduler.num_paused,
            num_kv_blocks_total=bm.num_blocks,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_free=bm.num_free_blocks,
            num_kv_blocks_cached=bm.num_cached_blocks,
            kv_cache_usage=bm.num_used_blocks / bm.num_blocks,
            block_size=bm.block_size,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            ttft_ms_p50=statistics.median(ttfts) * 1000 if ttfts else None,
            tpot_ms_p50=statistics.median(tpots) * 1000 if tpots else None,
            num_requests_finished=self.num_requests_finished,
            num_preemptions=self.scheduler.num_preemptions,
            num_step_failures=self.num_step_failures,
            num_deadline_drops=self.num_deadline_drops,
            num_refused=self.num_refused,
            num_parked_rows=self.scheduler.num_parked_rows,
            step_fixed_ms=fixed * 1000,
            step_per_row_ms=per_row * 1000,
            step_per_token_ms=per_token * 1000,
            structured_output=self.grammar is not None,
        )

    def __repr__(self) -> str:
        return f"<Engine model={self.model_name!r} device={self.device} dtype={self.runner.dtype_name} blocks={self.num_kv_blocks}>"


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
