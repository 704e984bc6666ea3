"""Runs the engine's step loop on one background thread and hands outputs to asyncio requests.

The engine is not thread-safe, so only the engine thread ever calls it: the event loop queues
adds and aborts under a lock, and the engine thread applies them between steps. Outputs travel
back through one asyncio.Queue per request via `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from server.metrics import ServerMetrics
from specdec.isolation import isolate
from specdec.models.heap import trim_heap

log = logging.getLogger("specdec.server")
# Isolations in a row that pin a failing step on no request before the loop fails them all.
MAX_UNPINNED = 3


class QueueFullError(Exception):
    """More requests wait for admission than the server is configured to hold."""

    def __init__(self, waiting: int, retry_after: int = 1) -> None:
        super().__init__(f"server busy: {waiting} requests already waiting; retry later")
        self.retry_after = retry_after


class ShuttingDownError(Exception):
    """The server is draining after SIGTERM and admits nothing new."""


class RequestFailedError(Exception):
    """The engine failed while running this request; other requests go on."""


@dataclass
class AbortedOutput:
    """The final output handed to a consumer whose request the server aborted (shutdown)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    spec: Any = None
    num_cached_tokens: int = 0
    arrival_time: float | None = None
    first_token_time: float | None = None
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    logprobs: Any = None
    finished: bool = True
    finish_reason: str = "abort"


class _Aborted:
    """Queue marker: the server aborted the request."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop, n_prompt: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = loop.create_future()
        self.n_prompt = n_prompt

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def resolve(self, exc: BaseException | None) -> None:
        def _set() -> None:
            if self.admitted.done():
                return
            if exc is None:
                self.admitted.set_result(None)
            else:
                self.admitted.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:
            pass


class RequestStream:
    """An admitted request's outputs. Iterate it; leaving early (or being cancelled, as on a
    client disconnect) aborts the request in the engine."""

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.owner = owner
        self.request_id = request_id
        self._stream = stream
        self.finished = False
        self.last: Any = None

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            while not self.finished:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise RequestFailedError(str(item)) from item
                if isinstance(item, _Aborted):
                    self.finished = True
                    yield self._aborted_output()
                    return
                self.last = item
                self.finished = bool(item.finished)
                yield item
        finally:
            if not self.finished:
                self.owner.abort(self.request_id)

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)

    def _aborted_output(self) -> AbortedOutput:
        last = self.last
        if last is None:
            return AbortedOutput(self.request_id, [], [], "")
        return AbortedOutput(self.request_id, list(last.prompt_token_ids), list(last.token_ids),
                             last.text, spec=last.spec,
                             num_cached_tokens=getattr(last, "num_cached_tokens", 0),
                             arrival_time=getattr(last, "arrival_time", None),
                             first_token_time=getattr(last, "first_token_time", None))


class AsyncEngine:
    """Owns the engine thread. `submit` admits a request (raising before any response is sent
    when the request cannot run); `generate` is submit plus iteration."""

    def __init__(self, engine: Any = None, max_waiting: int | None = None,
                 metrics: ServerMetrics | None = None,
                 build: Callable[[], Any] | None = None) -> None:
        """Give `engine`, or `build`, which the engine thread calls first to make it: then
        loading, warm-up and every step run on that one thread. On the CPU this matters: each
        thread that runs OpenMP work keeps its own team of worker threads, and with more of
        them than cores libgomp stops spinning between parallel regions, which made every
        kernel launch wait for a woken thread (a 1.5b decode step 15% slower)."""
        if (engine is None) == (build is None):
            raise ValueError("give an engine or a build function, not both")
        self.engine = engine
        self._build = build
        self.ready = threading.Event()  # set once the engine exists (or failed to build)
        self.build_error: BaseException | None = None
        self._max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._adds: list[tuple[str, Any, Any, _Stream]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._num_waiting = 0
        self._admitting = 0  # taken off _adds, not yet in the engine's count
        self._num_running = 0
        self._unpinned = 0  # isolations in a row that found no culprit
        self._stop = False
        self.draining = False
        self.stats: dict[str, Any] = {}
        if engine is not None:
            self.ready.set()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    @property
    def max_waiting(self) -> int:
        if self._max_waiting is not None:
            return self._max_waiting
        return _engine_max_waiting(self.engine) if self.engine is not None else 0

    # ---- event-loop side -------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, request_id: str, prompt: str | list[int], params: Any) -> RequestStream:
        """Queue a request and wait until the engine accepted it. Raises QueueFullError,
        ShuttingDownError, or the engine's ValueError for a request it cannot run."""
        n_prompt = len(prompt) if isinstance(prompt, list) else 0
        stream = _Stream(asyncio.get_running_loop(), n_prompt)
        with self._wake:
            if self.draining or self._stop:
                raise ShuttingDownError("server is shutting down")
            waiting = len(self._adds) + self._admitting + self._num_waiting
            if waiting >= self.max_waiting:
                raise QueueFullError(waiting)
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
            self._adds.append((request_id, prompt, params, stream))
            self._wake.notify()
        try:
            await stream.admitted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream)

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: Any) -> AsyncIterator[Any]:
        rs = await self.submit(request_id, prompt, params)
        async for out in rs:
            yield out

    def abort(self, request_id: str) -> None:
        """Forget the request now; the engine drops it and frees its blocks at its next step."""
        with self._wake:
            if self._streams.pop(request_id, None) is None:
                return
            self._aborts.append(request_id)
            self._wake.notify()

    async def shutdown(self, grace: float) -> None:
        """Stop admitting, let in-flight requests finish for up to `grace` seconds, then abort
        what is left (consumers see finish_reason "abort") and stop the engine thread."""
        with self._lock:
            self.draining = True
        deadline = time.monotonic() + grace
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._wake:
            left = list(self._streams.items())
            self._streams.clear()
            for rid, stream in left:
                self._aborts.append(rid)
                stream.put(_Aborted())
            self._wake.notify()
        if left:
            log.warning("aborted %d requests still running after %.1fs grace", len(left), grace)
            await asyncio.sleep(0.1)  # let the consumers write their final chunks
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # ---- engine-thread side ----------------------------------------------------------------

    def _run(self) -> None:
        if self._build is not None:
            try:
                self.engine = self._build()
            except BaseException as exc:  # reported by whoever waits on `ready`
                self.build_error = exc
                return
            finally:
                self.ready.set()
        fresh: set[str] = set()  # admitted since the last successful step
        busy = False
        while True:
            with self._wake:
                while not (self._stop or self._adds or self._aborts or busy):
                    self._wake.wait(timeout=1.0)
                if self._stop:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                self._admitting = len(adds)
            # Outside the lock: admitting may load a draft model, and the event loop must not
            # block on the lock meanwhile.
            for rid, prompt, params, stream in adds:
                self._admit(rid, prompt, params, stream, fresh)
            for rid in aborts:
                fresh.discard(rid)
                self._call_quietly(self.engine.abort_request, rid)
            with self._lock:
                self._num_waiting = self.engine.num_waiting
                self._admitting = 0
            try:
                was_busy, busy = busy, bool(self.engine.has_unfinished())
                if busy:
                    outputs = self.engine.step()
                    fresh.clear()
                    self._dispatch(outputs)
                elif was_busy:
                    trim_heap()  # idle now: what the steps freed goes back to the OS
            except Exception as exc:  # the loop must outlive any one request
                log.exception("engine step failed; running its requests apart")
                self._pin(exc, fresh)
                fresh.clear()
            self._refresh_gauges()

    def _admit(self, rid: str, prompt: Any, params: Any, stream: _Stream,
               fresh: set[str]) -> None:
        with self._lock:
            gone = rid not in self._streams
        if gone:  # aborted before the engine saw it
            stream.resolve(asyncio.CancelledError())
            return
        try:
            self.engine.add_request(rid, prompt, params)
        except Exception as exc:
            with self._lock:
                self._streams.pop(rid, None)
            stream.resolve(exc)
            return
        fresh.add(rid)
        self.metrics.prompt_tokens.inc(stream.n_prompt)
        stream.resolve(None)

    def _dispatch(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        for out in outputs:
            self.metrics.generation_tokens.inc(len(out.delta_token_ids or ()))
            with self._lock:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
            if out.finished:
                try:
                    self.metrics.observe_finished(out, now)
                except Exception:  # a metrics bug must not drop the output
                    log.exception("metrics for %s", out.request_id)
            if stream is None:
                continue
            if out.finish_reason == "error":  # this request's own work raised (Request.fail)
                stream.put(RuntimeError(getattr(out, "error", None) or "engine error"))
            else:
                stream.put(out)

    def _pin(self, exc: Exception, fresh: set[str]) -> None:
        """Find the request that makes steps raise and fail it alone (specdec.isolation). A
        fault that several isolations in a row pin on nobody fails the requests admitted since
        the last good step, or all of them, so that the loop cannot spin on it."""
        try:
            outputs, culprit = isolate(self.engine, exc)
        except Exception:
            log.exception("isolating the failed step failed")
            outputs, culprit = [], None
        self._dispatch(outputs)
        self._unpinned = 0 if culprit is not None else self._unpinned + 1
        if self._unpinned >= MAX_UNPINNED:
            self._unpinned = 0
            self._fail(fresh or set(self._snapshot_ids()), exc)

    def _fail(self, ids: set[str], exc: Exception) -> None:
        for rid in ids:
            self._call_quietly(self.engine.abort_request, rid)
            with self._lock:
                stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(RuntimeError(f"engine error: {exc}"))
                self.metrics.finished.labels("error").inc()

    def _snapshot_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def _refresh_gauges(self) -> None:
        try:
            self._num_waiting = self.engine.num_waiting
            self._num_running = self.engine.num_running
            self.stats = dict(self.engine.stats())
            self.metrics.observe_engine(self._num_running, self._num_waiting, self.stats)
        except Exception:
            log.exception("reading engine stats")

    @staticmethod
    def _call_quietly(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # e.g. aborting a request the engine already finished
            log.debug("ignored error from %s%r", getattr(fn, "__name__", fn), args, exc_info=True)


def _engine_max_waiting(engine: Any) -> int:
    cfg = getattr(engine, "config", None)
    sched = getattr(cfg, "scheduler", None)
    return int(getattr(sched, "max_waiting", 1024))
