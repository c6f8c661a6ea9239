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
``asyncio.Queue`` with ``loop.call_soon_threadsafe``.  That queue is bounded by flow
control, not by its size: a sequence whose reader has ``max_pending_outputs`` deltas unread
is paused by the scheduler (it keeps its KV blocks) and resumes once the reader drains below
the bound, so a client that stops reading costs a few blocks, not a growing queue.  A
request may carry a deadline (``time.monotonic()``): still waiting when it passes, it is
dropped without running and its iterator raises ``DeadlineExceededError``.  Closing the
iterator early (``aclose()``, task cancellation, a client that went away) posts a
cancellation: the sequence is removed and its blocks freed at the next step.  An exception inside a model step
fails the sequences of that step with ``EngineError`` and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
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
from .sampling import SampleResult, SamplingParams
from .scheduler import Scheduler
from .sequence import Delta, Priority, Sequence, StageTimes
from .tokenizer import IncrementalDetokenizer

__all__ = ["Engine", "EngineStats"]

logger = logging.getLogger("edge_engine")

_DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(slots=True)
class EngineStats:
    """A snapshot for the routing layer (``dataclasses.asdict`` / ``as_dict()`` for JSON)."""

    model: str
    device: str
    dtype: str
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
    if isinstance(priority, str):
        try:
            return int(Priority[priority.upper()])
        except KeyError:
            raise InvalidRequestError("priority must be 'interactive' or 'batch'", "priority", "invalid_value") from None
    return int(priority)


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
        self.block_manager = BlockManager(self.num_kv_blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_pending_outputs=config.max_pending_outputs,
        )
        self._eos_ids = set(self.tokenizer.eos_token_ids)
        # constrained decoding (response_format, tools): None where llguidance is missing
        self.grammar = GrammarCompiler(self.tokenizer, self.model_config.vocab_size) if grammar_available() else None
        self.jump_forward = True  # append the tokens a grammar forces without sampling them (bench/grammar.py turns it off to compare)
        _ = self.tokenizer.max_token_chars  # computed once, now rather than on the first request
        # inbox, filled by the event loop, drained by the step thread
        self._cond = threading.Condition()
        self._pending_adds: list[Sequence] = []
        self._pending_aborts: list[Sequence] = []
        self._wakeup = False  # a paused sequence's reader caught up
        self._last_step_ran = True  # False: sleep until the inbox, a reader or a deadline says otherwise
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        # statistics
        self._ttfts: deque[float] = deque(maxlen=config.stats_window)
        self._tpots: deque[float] = deque(maxlen=config.stats_window)
        self.num_requests_finished = 0
        self.num_step_failures = 0
        self.num_deadline_drops = 0

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

    async def close(self) -> None:
        """Stop the step thread; requests still in flight fail with ``EngineClosedError``."""
        self._closed = True
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

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

    def check_capacity(self) -> None:
        """Raise ``EngineOverloadedError`` when the waiting queue is at its limit."""
        if self._closed:
            raise EngineClosedError()
        depth = self.scheduler.num_waiting + len(self._pending_adds)
        if depth >= self.config.max_queue_len:
            ttft = statistics.median(self._ttfts) if self._ttfts else 1.0
            retry_after = max(1, math.ceil(ttft * depth / self.config.max_num_seqs))
            raise EngineOverloadedError(
                f"the edge engine's queue is full ({depth} waiting requests)", retry_after=min(retry_after, 60)
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
    ) -> Sequence:
        """Validate and enqueue; returns the sequence whose deltas go to ``queue``.

        ``deadline`` is a ``time.monotonic()`` value: if the sequence has not started by
        then it is dropped with ``DeadlineExceededError``.  The reader of ``queue`` must call
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
        self.check_capacity()
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExceededError()
        seq = Sequence(
            prompt_ids,
            params,
            request_id=request_id or "",
            priority=_parse_priority(priority),
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
    ) -> AsyncIterator[Delta]:
        """Yield deltas until one carries ``finish_reason``.

        Raises ``InvalidRequestError`` / ``EngineOverloadedError`` on the first iteration when
        the request is refused, ``DeadlineExceededError`` if ``deadline`` (``time.monotonic()``)
        passes before the request starts, and ``EngineError`` if a model step fails.
        """
        seq = self.add_request(prompt, params, request_id=request_id, priority=priority, deadline=deadline)
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
                # paused sequences), sleep until something changes or a deadline comes due
                while not (
                    self._stopping
                    or self._pending_adds
                    or self._pending_aborts
                    or self._wakeup
                    or (self._last_step_ran and self.scheduler.has_work())
                ):
                    deadline = self.scheduler.next_deadline()
                    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if not self._cond.wait(timeout) and timeout is not None:
                        break  # a deadline came due
                if self._stopping:
                    break
                adds, self._pending_adds = self._pending_adds, []
                aborts, self._pending_aborts = self._pending_aborts, []
                self._wakeup = False
            try:
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
                events = self._fail_all(EngineError(f"engine step failed: {exc!r}"))
            try:
                self._deliver(events)
            except Exception:  # never let the step thread die: its requests would hang
                logger.exception("delivering engine outputs failed")
        # stopping: everything still queued or running fails
        with self._cond:
            adds, self._pending_adds = self._pending_adds, []
        for seq in adds:
            self.scheduler.add(seq)
        self._deliver(self._fail_all(EngineClosedError("the edge engine was closed")))

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

        Runs on the step thread; call it directly only on an engine whose thread is not started.
        """
        out = self.scheduler.schedule()
        self._last_step_ran = bool(out)
        if not out:
            return []
        try:
            results = self.runner.run(out.scheduled)
        except Exception as exc:
            logger.exception("model step failed")
            self.num_step_failures += 1
            error = EngineError(f"model step failed: {exc!r}")
            events: list[tuple[Sequence, object]] = []
            for seq, _ in out.scheduled:
                self.scheduler.finish(seq, "error")
                events.append((seq, error))
            return events
        now = time.monotonic()
        events = []
        for (seq, n), result in zip(out.scheduled, results):
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
            if result is not None:
                events.append((seq, self._append_token(seq, result, now)))
        return events

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
        return EngineStats(
            model=self.model_name,
            device=str(self.device),
            dtype=self.runner.dtype_name,
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
            structured_output=self.grammar is not None,
        )

    def __repr__(self) -> str:
        return f"<Engine model={self.model_name!r} device={self.device} dtype={self.runner.dtype_name} blocks={self.num_kv_blocks}>"


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
