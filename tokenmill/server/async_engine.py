"""AsyncEngine: the served models' LLMEngines stepping in one thread, streaming to asyncio handlers.

::

    event loop (handlers)                         engine thread
    ─────────────────────                         ─────────────
    add(...)   ──► commands (lock) ──notify──►    wake; apply adds / aborts
    abort(id)  ──►                                expire deadlines
                                                  step() each model with unfinished work,
                                                  one step each in turn
    queue.get() ◄── loop.call_soon_threadsafe ◄── one EngineUpdate per RequestDelta
                                                  engine.snapshot() for metrics; sleep on
                                                  the condition when idle (no busy spin)

One thread steps every model (several models in one server: ``tokenmill serve --model A=... --model
B=...``): on 2 cores, two stepping threads would only fight over them (and over OpenMP's pools,
below), and one timeline is what the cost meter (server/cost.py) shares out: each step's interval
is charged to the requests it ran, waiting to ``idle``, loading a model at runtime to its own line.
Models are added (loaded, warmed up) and removed between steps, in this thread.

Only the engine thread touches an LLMEngine, through its public API (``tokenmill.engine``):
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

Garbage collection: where this loop runs the process (``run_here``), every object alive once the
models are loaded and warm, a quarter million of them for one model, is moved out of the collector's
reach (``gc.freeze``), and again whenever a model is attached or detached at runtime (unfrozen,
collected, frozen: a detached model's reference cycles are freed, not kept frozen forever). A full
collection of them took 10-100 ms while loading, each one during serving a stall of every stream's
next token; after the freeze a collection walks only what serving allocated since. Embedded use
(``start()``) leaves the host process's collector alone.
"""

from __future__ import annotations

import asyncio
import gc
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
from tokenmill.server.cost import IDLE, OVERHEAD, CostMeter, CostRecord, load_line

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
    adapter, or its model, was unloaded before the engine took it), 'model_unloaded' (its model was
    unloaded while it ran), 'engine' or 'shutdown'."""
    message: str = ""


@dataclass
class _Tracked:
    sink: Callable[[EngineUpdate], None]
    deadline: float
    model: str


class AsyncEngine:
    def __init__(self, engines: dict[str, LLMEngine],
                 on_snapshot: Callable[[str, EngineSnapshot], None] | None = None,
                 meter: CostMeter | None = None) -> None:
        """``engines``: the served models by name; ``on_snapshot(name, snapshot)`` after every loop
        iteration; ``meter``: where each step's time is charged (a meter at price 0 when None)."""
        self.engines = dict(engines)
        """Read by handlers (a model's LoRA manager, limits); changed only in the engine thread."""
        self.on_snapshot = on_snapshot
        self.meter = meter if meter is not None else CostMeter()
        self.snapshots = {name: engine.snapshot() for name, engine in self.engines.items()}
        self.warm_seconds: dict[str, float] = {}
        """Each model's warm-up time (kernels, one tiny generation)."""
        self.warm_step_seconds: dict[str, float] = {}
        """Each model's slowest warm-up step (a batch of one): the cost estimate before any measurement."""
        self._commands: list[Callable[[], None]] = []
        self._cond = threading.Condition()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = False
        self._on_warming: Callable[[str, bool], None] | None = None
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._driven_here = False
        self._running = threading.Event()
        self._done = threading.Event()

    # ---- event-loop side ------------------------------------------------------------------------
    def start(self) -> None:
        """Step the engines in a thread of their own; a no-op after :meth:`will_run_here`."""
        if not self._driven_here:
            self._thread.start()

    def will_run_here(self) -> None:
        """Announce that :meth:`run_here` will step the engines: from now on ``start()`` (the app's
        lifespan) does nothing. Call it before the app can start, so that no thread of its own
        ever steps them beside ``run_here``."""
        if self._thread.is_alive():
            raise RuntimeError("the engine already steps in its own thread")
        self._driven_here = True

    def run_here(self) -> None:
        """Step the engines in the calling thread until :meth:`stop` (``tokenmill serve`` calls it
        from the main thread, where the models were loaded; see the module docstring), after
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

    def warm_up_first(self, on_warming: Callable[[str, bool], None]) -> None:
        """Warm up in the engine thread before taking any command (call before :meth:`start`):
        ``on_warming(name, True)`` is called now for every model, ``on_warming(name, False)`` from
        the engine thread once its kernels are built or loaded and one tiny generation ran (or the
        warm-up failed: logged)."""
        self._on_warming = on_warming
        for name in self.engines:
            on_warming(name, True)

    @property
    def alive(self) -> bool:
        """Whether the engine loop runs (in whichever thread steps it)."""
        return self._running.is_set() and not self._done.is_set()

    def add(self, model: str, request_id: str, prompt_ids: list[int], params: SamplingParams, queue: asyncio.Queue,
            deadline: float, priority: int = 0, cache_salt: str | None = None, lora: str | None = None,
            record: CostRecord | None = None, hold_updates: bool = False) -> None:
        """Queue a request for ``model``; its updates go to ``queue`` (put from the engine thread,
        thread-safely). ``lora``: the name of the LoRA adapter it runs with; ``record``: where its
        cost is charged (opened when the engine takes it, closed when it leaves). ``hold_updates``
        (its client sees nothing before it finished) matters only to a remote engine, which may
        then retry it elsewhere (scaleout/remote.py); here every update goes out as it comes."""
        loop = asyncio.get_running_loop()

        def sink(update: EngineUpdate) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, update)

        self._submit(lambda: self._add(model, request_id, prompt_ids, params, priority, cache_salt, lora, deadline,
                                       sink, record))

    async def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` in the engine thread between two steps (what touches the engines' state
        outside a request: loading or unloading adapters and models) -> its result; its exception
        is raised here."""
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

    async def attach(self, name: str, build: Callable[[], LLMEngine]) -> float:
        """Build a model's engine in the engine thread (loading its weights: the other models wait
        meanwhile), warm it up and serve it as ``name`` -> the seconds it took (its cold start),
        charged to the meter's ``load:<name>`` line."""
        def load() -> float:
            start = time.perf_counter()
            self.meter.charge_line(IDLE)
            try:
                engine = build()
                self._warm_up(name, engine)
            finally:
                self.meter.charge_line(load_line(name))
            self.engines = {**self.engines, name: engine}
            self.snapshots[name] = engine.snapshot()
            self._freeze_garbage_collection()
            return time.perf_counter() - start
        return await self.call(load)

    async def detach(self, name: str) -> int:
        """Stop serving ``name``: its unfinished requests end with 'model_unloaded' (their KV freed,
        their costs closed) and its engine is dropped -> how many requests it ended."""
        def unload() -> int:
            ended = [rid for rid, t in self._tracked.items() if t.model == name]
            for request_id in ended:
                self._finish_with_error(request_id, "model_unloaded", f"the model {name!r} was unloaded")
            self.engines = {n: e for n, e in self.engines.items() if n != name}
            self.snapshots.pop(name, None)
            self._freeze_garbage_collection()
            return len(ended)
        return await self.call(unload)

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

    def _busy(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.engines.values())

    def _loop(self) -> None:
        if self._on_warming is not None:
            for name, engine in list(self.engines.items()):
                self._warm_up(name, engine)
            self._publish_snapshots()
            self._on_warming = None
        self._freeze_garbage_collection()
        self.meter.start()
        while True:
            with self._cond:
                waited = False
                while not self._commands and not self._busy() and not self._stopping:
                    waited = True
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            if waited:
                self.meter.charge_line(IDLE)
            for command in commands:
                command()
            if stopping:
                self._fail_all("shutdown", "the server is shutting down")
                self._publish_snapshots()
                return
            touched = self._expire_deadlines()
            busy = [(name, engine) for name, engine in self.engines.items() if engine.has_unfinished_requests()]
            for name, engine in busy:
                self._step(name, engine)
            if not busy and self._tracked:  # cannot happen by the engine's contract; never leave a handler hanging
                self._fail_all("engine", "the engine dropped the request")
            # a model's snapshot changes only when it stepped or a command or deadline reached it
            self._publish_snapshots(None if commands or not busy else touched | {name for name, _ in busy})

    def _freeze_garbage_collection(self) -> None:
        """Where this loop runs the process (``run_here``): every object alive now (the models, their
        modules and weights' wrappers, the app) out of the collector's reach, after one full collection
        of everything, the earlier frozen objects included (a detached model's cycles go then); see the
        module docstring."""
        if self._driven_here:
            gc.unfreeze()
            gc.collect()
            gc.freeze()

    def _warm_up(self, name: str, engine: LLMEngine) -> None:
        start = time.perf_counter()
        try:
            kernels = "none on this device"
            if engine.device.type == "cpu":
                kernels = "tokenmill C++" if dispatch.cpu_ops() is not None else "PyTorch path (off or unavailable)"
            ready = time.perf_counter()
            steps = engine.warm_up()
            if steps:
                self.warm_step_seconds[name] = max(step.seconds for step in steps)
            logger.info("warming up %s: kernels %s (%.2f s), first step %.3f s, %d steps, warm in %.2f s", name,
                        kernels, ready - start, steps[0].seconds if steps else 0.0, len(steps),
                        time.perf_counter() - start)
        except Exception:
            logger.exception("warm-up failed for %s after %.2f s; serving anyway", name, time.perf_counter() - start)
        finally:
            self.warm_seconds[name] = time.perf_counter() - start
            if self._on_warming is not None:
                self._on_warming(name, False)

    def _add(self, model, request_id, prompt_ids, params, priority, cache_salt, lora, deadline, sink, record) -> None:
        engine = self.engines.get(model)
        if engine is None:  # unloaded after the handler resolved the name
            sink(EngineUpdate(request_id, None, True, error="model_not_found",
                              message=f"the model {model!r} was unloaded"))
            return
        if record is not None:
            self.meter.open(record)
        try:
            engine.add_request(prompt_ids, params, request_id=request_id, priority=priority,
                               cache_salt=cache_salt, lora=lora)
        except UnknownAdapterError as exc:  # unloaded after the handler resolved the name
            self._refuse(request_id, sink, "model_not_found", str(exc))
            return
        except TokenmillError as exc:
            self._refuse(request_id, sink, "invalid", str(exc))
            return
        except Exception as exc:  # never let one request take the loop down
            logger.exception("add_request failed for %s", request_id)
            self._refuse(request_id, sink, "engine", f"{type(exc).__name__}: {exc}")
            return
        self._tracked[request_id] = _Tracked(sink, deadline, model)

    def _refuse(self, request_id: str, sink, error: str, message: str) -> None:
        self.meter.close(request_id)
        sink(EngineUpdate(request_id, None, True, error=error, message=message))

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and tracked.model in self.engines:
            self.engines[tracked.model].abort(request_id)
        self.meter.close(request_id)

    def _expire_deadlines(self) -> set[str]:
        """Abort the requests past their deadline -> the models they ran on."""
        now = time.monotonic()
        expired = [(r, t.model) for r, t in self._tracked.items() if t.deadline <= now]
        for request_id, _ in expired:
            self._finish_with_error(request_id, "deadline", "the request passed its deadline and was aborted")
        return {model for _, model in expired}

    def _fail_all(self, error: str, message: str, model: str | None = None) -> None:
        for request_id in [r for r, t in self._tracked.items() if model is None or t.model == model]:
            self._finish_with_error(request_id, error, message)

    def _finish_with_error(self, request_id: str, error: str, message: str) -> None:
        tracked = self._tracked.pop(request_id)
        if tracked.model in self.engines:
            self.engines[tracked.model].abort(request_id)
        self.meter.close(request_id)
        tracked.sink(EngineUpdate(request_id, None, True, error=error, message=message))

    def _step(self, name: str, engine: LLMEngine) -> None:
        try:
            deltas = engine.step()
        except Exception as exc:
            logger.exception("engine step of %s failed; failing the requests it held", name)
            self.meter.charge_line(OVERHEAD)
            self._fail_all("engine", f"the engine failed: {type(exc).__name__}: {exc}", model=name)
            return
        self.meter.charge_step(name, engine.stats[-1].work if engine.stats else ())
        for delta in deltas:
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:
                continue
            record = self.meter.record(delta.request_id)
            if record is not None:
                record.cached_tokens = delta.num_cached_tokens
                record.completion_tokens += delta.num_new_tokens
            if delta.finished:
                del self._tracked[delta.request_id]
                self.meter.close(delta.request_id)
            tracked.sink(EngineUpdate(delta.request_id, delta, delta.finished))

    def _publish_snapshots(self, names: set[str] | None = None) -> None:
        """Take and hand out the snapshots of the models ``names`` (None: every one)."""
        for name, engine in list(self.engines.items()):
            if names is not None and name not in names:
                continue
            snapshot = self.snapshots[name] = engine.snapshot()
            if self.on_snapshot is not None:
                try:
                    self.on_snapshot(name, snapshot)
                except Exception:
                    logger.exception("snapshot callback failed")
