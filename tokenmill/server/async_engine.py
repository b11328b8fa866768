"""AsyncEngine: an LLMEngine stepping in its own thread, streaming to asyncio handlers.

::

    event loop (handlers)                         engine thread
    ─────────────────────                         ─────────────
    add(...)   ──► commands (lock) ──notify──►    wake; apply adds / aborts
    abort(id)  ──►                                expire deadlines
                                                  step() if anything is unfinished
    queue.get() ◄── loop.call_soon_threadsafe ◄── one EngineUpdate per RequestDelta
                                                  engine.snapshot() for metrics; sleep on
                                                  the condition when idle (no busy spin)

Only the engine thread touches the LLMEngine, through its public API (``tokenmill.engine``):
``add_request``, ``abort``, ``step`` (which hands out deltas: what each request gained) and
``snapshot``. A request whose ``add_request`` raises gets
an error update (the loop goes on); a failing ``step`` fails the requests it held (they are
aborted, their blocks freed) and the loop goes on. An abort takes effect before the next
step, so an aborted request's KV blocks are free within one step.

Which thread steps (:meth:`AsyncEngine.start` or :meth:`AsyncEngine.run_here`): ``tokenmill serve``
steps the engine in the process's main thread (``run_here``) and serves HTTP from a second thread.
That is where the model was loaded, and it must be: OpenMP (libgomp, which PyTorch and tokenmill's
kernels use) keeps one pool of worker threads per thread that starts parallel regions, and once the
process holds more such threads than cores, every pool's workers stop spinning between regions
and sleep instead (libgomp's throttled spin count). A decode step starts a few hundred regions, so
each then pays a futex wake-up: measured on 2 cores, SmolLM2 bfloat16 decode went from 6.1 ms
per token (engine in the loading thread) to 13.0 ms (a second thread, after the loading thread had
used OpenMP once), the whole gap between the server and the offline engine. Tests and embedded
use keep ``start()``, a thread of the engine's own.

Warm-up (:meth:`AsyncEngine.warm_up_first`, which the server's state asks for): before its first
command the engine thread builds or loads the CPU kernels (``dispatch.cpu_ops()``, on a CPU
engine) and runs ``LLMEngine.warm_up()``, one tiny generation, then reports itself warm. Until
then the server answers ``/ready`` and generation requests with 503 ``warming_up``
(:mod:`tokenmill.server.warmup`), so no request's deadline is spent waiting for a compile. A
failed warm-up is logged and the loop serves anyway (requests then fail with their own errors).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine import EngineSnapshot, LLMEngine, RequestDelta
from tokenmill.errors import TokenmillError
from tokenmill.kernels import dispatch
from tokenmill.lora.manager import UnknownAdapterError
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.server")


@dataclass
class EngineUpdate:
    """What the handler of one engine request hears: a step's delta, or the error that ended it."""

    request_id: str
    delta: RequestDelta | None
    """What the request gained in a step; None for an error update."""
    finished: bool
    error: str | None = None
    """Why it ended without finishing: 'deadline', 'invalid' (bad input), 'model_not_found' (its LoRA
    adapter was unloaded before the engine took it), 'engine' or 'shutdown'."""
    message: str = ""


@dataclass
class _Tracked:
    sink: Callable[[EngineUpdate], None]
    deadline: float


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_snapshot: Callable[[EngineSnapshot], None] | None = None) -> None:
        self.engine = engine
        self.on_snapshot = on_snapshot
        self.snapshot = engine.snapshot()
        self._commands: list[Callable[[], None]] = []
        self._cond = threading.Condition()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = False
        self._on_warming: Callable[[bool], None] | None = None
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._driven_here = False
        self._running = threading.Event()
        self._done = threading.Event()

    # ---- event-loop side ------------------------------------------------------------------------
    def start(self) -> None:
        """Step the engine in a thread of its own; a no-op after :meth:`will_run_here`."""
        if not self._driven_here:
            self._thread.start()

    def will_run_here(self) -> None:
        """Announce that :meth:`run_here` will step the engine: from now on ``start()`` (the app's
        lifespan) does nothing. Call it before the app can start, so that no thread of its own
        ever steps the engine beside ``run_here``."""
        if self._thread.is_alive():
            raise RuntimeError("the engine already steps in its own thread")
        self._driven_here = True

    def run_here(self) -> None:
        """Step the engine in the calling thread until :meth:`stop` (``tokenmill serve`` calls it
        from the main thread, where the model was loaded; see the module docstring), after
        :meth:`will_run_here`. The app's lifespan ``stop()`` ends this call."""
        if not self._driven_here:
            raise RuntimeError("call will_run_here() before the app starts, then run_here()")
        self._run()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._driven_here:
            self._done.wait(timeout)
        elif self._thread.is_alive():
            self._thread.join(timeout)

    def warm_up_first(self, on_warming: Callable[[bool], None]) -> None:
        """Warm up in the engine thread before taking any command (call before :meth:`start`):
        ``on_warming(True)`` is called now, ``on_warming(False)`` from the engine thread once the
        kernels are built or loaded and one tiny generation ran (or the warm-up failed: logged)."""
        self._on_warming = on_warming
        on_warming(True)

    @property
    def alive(self) -> bool:
        """Whether the engine loop runs (in whichever thread steps it)."""
        return self._running.is_set() and not self._done.is_set()

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, queue: asyncio.Queue,
            deadline: float, priority: int = 0, cache_salt: str | None = None, lora: str | None = None) -> None:
        """Queue a request; its updates go to ``queue`` (put from the engine thread, thread-safely).
        ``lora``: the name of the LoRA adapter it runs with."""
        loop = asyncio.get_running_loop()

        def sink(update: EngineUpdate) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, update)

        self._submit(lambda: self._add(request_id, prompt_ids, params, priority, cache_salt, lora, deadline, sink))

    async def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` in the engine thread between two steps (what touches the engine's state
        outside a request: loading or unloading adapters) -> its result; its exception is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(result=None, error: BaseException | None = None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        def command() -> None:
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(settle, None, exc)
                return
            loop.call_soon_threadsafe(settle, result)

        self._submit(command)
        return await future

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        self._running.set()
        try:
            self._loop()
        finally:
            self._done.set()

    def _loop(self) -> None:
        if self._on_warming is not None:
            self._warm_up()
        while True:
            with self._cond:
                while not self._commands and not self.engine.has_unfinished_requests() and not self._stopping:
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                command()
            if stopping:
                self._fail_all("shutdown", "the server is shutting down")
                self._publish_snapshot()
                return
            self._expire_deadlines()
            if self.engine.has_unfinished_requests():
                self._step()
            elif self._tracked:  # cannot happen by the engine's contract; never leave a handler hanging
                self._fail_all("engine", "the engine dropped the request")
            self._publish_snapshot()

    def _warm_up(self) -> None:
        start = time.perf_counter()
        try:
            kernels = "none on this device"
            if self.engine.device.type == "cpu":
                kernels = "tokenmill C++" if dispatch.cpu_ops() is not None else "PyTorch path (off or unavailable)"
            ready = time.perf_counter()
            steps = self.engine.warm_up()
            logger.info("warming up: kernels %s (%.2f s), first step %.3f s, %d steps, warm in %.2f s", kernels,
                        ready - start, steps[0].seconds if steps else 0.0, len(steps), time.perf_counter() - start)
        except Exception:
            logger.exception("warm-up failed after %.2f s; serving anyway", time.perf_counter() - start)
        finally:
            self._publish_snapshot()
            on_warming, self._on_warming = self._on_warming, None
            on_warming(False)

    def _add(self, request_id, prompt_ids, params, priority, cache_salt, lora, deadline, sink) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id, priority=priority,
                                    cache_salt=cache_salt, lora=lora)
        except UnknownAdapterError as exc:  # unloaded after the handler resolved the name
            sink(EngineUpdate(request_id, None, True, error="model_not_found", message=str(exc)))
            return
        except TokenmillError as exc:
            sink(EngineUpdate(request_id, None, True, error="invalid", message=str(exc)))
            return
        except Exception as exc:  # never let one request take the loop down
            logger.exception("add_request failed for %s", request_id)
            sink(EngineUpdate(request_id, None, True, error="engine", message=f"{type(exc).__name__}: {exc}"))
            return
        self._tracked[request_id] = _Tracked(sink, deadline)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._tracked.pop(request_id, None)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, t in self._tracked.items() if t.deadline <= now]:
            self._finish_with_error(request_id, "deadline", "the request passed its deadline and was aborted")

    def _fail_all(self, error: str, message: str) -> None:
        for request_id in list(self._tracked):
            self._finish_with_error(request_id, error, message)

    def _finish_with_error(self, request_id: str, error: str, message: str) -> None:
        tracked = self._tracked.pop(request_id)
        self.engine.abort(request_id)
        tracked.sink(EngineUpdate(request_id, None, True, error=error, message=message))

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it held")
            self._fail_all("engine", f"the engine failed: {type(exc).__name__}: {exc}")
            return
        for delta in deltas:
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:
                continue
            if delta.finished:
                del self._tracked[delta.request_id]
            tracked.sink(EngineUpdate(delta.request_id, delta, delta.finished))

    def _publish_snapshot(self) -> None:
        self.snapshot = self.engine.snapshot()
        if self.on_snapshot is not None:
            try:
                self.on_snapshot(self.snapshot)
            except Exception:
                logger.exception("snapshot callback failed")
