"""AsyncEngine: the engine thread survives a bad request and a failing step, enforces deadlines,
and every request that ends (finished, failed, expired, aborted) leaves no KV block behind."""

from __future__ import annotations

import asyncio
import gc
import time

from tokenmill import SamplingParams
from tokenmill.engine import OutputAccumulator, RequestOutput
from tokenmill.server.async_engine import AsyncEngine, EngineUpdate

GREEDY = SamplingParams(temperature=0, max_tokens=6)


async def last_update(queue: asyncio.Queue) -> tuple[EngineUpdate, RequestOutput]:
    """The update that ends a request, and its output folded from every delta before it."""
    acc = None
    while True:
        update = await asyncio.wait_for(queue.get(), 30)
        acc = acc or OutputAccumulator(update.request_id)
        if update.delta is not None:
            acc.add(update.delta)
        if update.finished:
            return update, acc.output


def run(engine: AsyncEngine, scenario) -> None:
    async def main() -> None:
        engine.start()
        try:
            await scenario()
        finally:
            engine.stop()

    asyncio.run(main())
    assert engine.engines["m"].num_used_blocks == 0 and not engine.engines["m"].has_unfinished_requests()
    assert gc.get_freeze_count() == 0  # a thread of its own (embedded use): the host's collector is left alone


def test_bad_request_and_deadline_do_not_stop_the_loop(tiny_llm) -> None:
    snapshots = []
    engine = AsyncEngine({"m": tiny_llm.engine}, on_snapshot=lambda name, snap: snapshots.append(snap))
    far = time.monotonic() + 60

    async def scenario() -> None:
        bad, good, late = asyncio.Queue(), asyncio.Queue(), asyncio.Queue()
        engine.add("m", "bad", [1, 2, 10**6], GREEDY, bad, far)
        engine.add("m", "late", [5, 6, 7], SamplingParams(max_tokens=240, ignore_eos=True), late,
                   time.monotonic() + 0.02)
        engine.add("m", "good", [1, 2, 3], GREEDY, good, far)
        failed, _ = await last_update(bad)
        assert failed.error == "invalid" and "vocabulary" in failed.message
        done, output = await last_update(good)
        assert done.error is None and len(output.outputs[0].token_ids) == 6
        assert done.delta.first_token_time >= done.delta.arrival_time and done.delta.scheduled_time is not None
        expired, output = await last_update(late)
        assert expired.error == "deadline" and len(output.outputs[0].token_ids) < 240

    run(engine, scenario)
    assert snapshots[-1].num_running == 0 and snapshots[-1].num_used_blocks == 0


def test_failing_step_fails_its_requests_and_the_loop_goes_on(tiny_llm, monkeypatch) -> None:
    engine = AsyncEngine({"m": tiny_llm.engine})
    far = time.monotonic() + 60
    real_step = tiny_llm.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(tiny_llm.engine, "step", flaky_step)

    async def scenario() -> None:
        first, second = asyncio.Queue(), asyncio.Queue()
        engine.add("m", "a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), first, far)
        failed, _ = await last_update(first)
        assert failed.error == "engine" and "injected failure" in failed.message
        engine.add("m", "b", [1, 2, 3], GREEDY, second, far)
        assert (await last_update(second))[0].error is None

    run(engine, scenario)


def test_abort_frees_blocks_before_the_next_step(tiny_llm) -> None:
    engine = AsyncEngine({"m": tiny_llm.engine})

    async def scenario() -> None:
        queue = asyncio.Queue()
        engine.add("m", "x", list(range(1, 100)), SamplingParams(max_tokens=150, ignore_eos=True), queue,
                   time.monotonic() + 60)
        await asyncio.wait_for(queue.get(), 30)  # it is running and holds blocks
        engine.abort("x")
        for _ in range(200):
            if engine.snapshots["m"].num_used_blocks == 0:
                break
            await asyncio.sleep(0.005)
        assert engine.snapshots["m"].num_used_blocks == 0

    run(engine, scenario)


def test_n_samples_arrive_together(tiny_llm) -> None:
    n = 2
    engine = AsyncEngine({"m": tiny_llm.engine})

    async def scenario() -> None:
        queue = asyncio.Queue()
        engine.add("m", "n", [1, 2, 3], SamplingParams(max_tokens=4, n=n, seed=3), queue, time.monotonic() + 60)
        _, output = await last_update(queue)
        assert [o.index for o in output.outputs] == list(range(n)) and all(o.token_ids for o in output.outputs)

    run(engine, scenario)


def serve_here(engine: AsyncEngine, http_main) -> int:
    """As ``tokenmill serve`` runs: the engine steps in this thread (``run_here``) while a second
    thread runs ``http_main()`` (a coroutine function) on its own event loop, then stops the engine
    (also when http_main failed: its error is raised here) -> the collector's freeze count once
    run_here returned (unfrozen after)."""
    import threading

    errors: list[BaseException] = []

    def http_side() -> None:
        while not engine.alive:
            time.sleep(0.01)
        try:
            asyncio.run(http_main())
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            errors.append(exc)
        finally:
            engine.stop()

    engine.will_run_here()
    gc.unfreeze()
    try:
        http = threading.Thread(target=http_side, name="http-side")
        http.start()
        engine.run_here()  # returns once http_main called stop()
        http.join(10)
        if errors:
            raise errors[0]
        assert not http.is_alive() and not engine.alive
        return gc.get_freeze_count()
    finally:
        gc.unfreeze()


def test_run_here_steps_in_the_calling_thread_until_stop(tiny_llm) -> None:
    """``tokenmill serve`` steps the engine in the main thread (where the model was loaded: one
    OpenMP pool) and serves HTTP from another: requests from that other thread's event loop are
    served by the caller's loop, start() is then a no-op and stop() ends run_here()."""
    import threading

    engine = AsyncEngine({"m": tiny_llm.engine})
    stepping_threads: set[str] = set()
    step = tiny_llm.engine.step

    def recording_step():
        stepping_threads.add(threading.current_thread().name)
        return step()

    tiny_llm.engine.step = recording_step
    results: list[RequestOutput] = []

    async def http_main() -> None:
        engine.start()  # what the app's lifespan does: nothing here
        queue: asyncio.Queue = asyncio.Queue()
        engine.add("m", "here-1", [5, 6, 7], GREEDY, queue, time.monotonic() + 30)
        update, output = await last_update(queue)
        assert update.error is None
        results.append(output)

    try:
        frozen = serve_here(engine, http_main)
    finally:
        del tiny_llm.engine.step
    assert frozen > 0  # the objects alive when it started serving (the model among them) are out of the collector's reach
    assert stepping_threads == {threading.current_thread().name}
    assert len(results) == 1 and len(results[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert tiny_llm.engine.num_used_blocks == 0


def test_a_model_detached_from_a_served_process_is_freed(tiny_dir, tiny_llm) -> None:
    """``run_here`` freezes what is alive once warm (out of the collector's reach); a model detached
    later is unfrozen and collected with it, its reference cycles included, not kept frozen forever."""
    import weakref

    from tokenmill import LLM

    other = LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=2, kv_cache_memory=16 * 16 * 2 * 2 * 2 * 32 * 4)
    other.engine.cycle = other.engine  # freed by the cyclic collector only
    gone = weakref.ref(other.engine)
    engine = AsyncEngine({"m": tiny_llm.engine, "gone": other.engine})
    del other

    async def http_main() -> None:
        assert await engine.detach("gone") == 0
        assert gone() is None  # collected in the engine thread's detach, before the freeze

    assert serve_here(engine, http_main) > 0
    assert list(engine.engines) == ["m"]
