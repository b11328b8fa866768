"""Prefix-aware routing (policy.py) and the block hashes it matches: pure, no Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tokenmill.engine import BlockHasher
from tokenmill.scaleout.policy import (Decision, PrefixAwarePolicy, PrefixIndex, ReplicaView, RoundRobinPolicy,
                                       matched_blocks)


def test_matched_blocks_is_the_leading_run() -> None:
    assert matched_blocks([1, 2, 3, 4], {1, 2, 4}) == 2
    assert matched_blocks([1, 2, 3], {2, 3}) == 0
    assert matched_blocks([], {1}) == 0


def test_the_replica_where_the_first_token_comes_soonest_wins() -> None:
    """Blocks to prefill before the request's first token: the queue's work, then its own uncached blocks."""
    hashes = [10, 11, 12, 13]  # 4 full blocks and a partial one: 5 to prefill with no hit
    a, b, c = (ReplicaView("a", 0, frozenset({10, 11})), ReplicaView("b", 0, frozenset({10, 11, 12})),
               ReplicaView("c", 0, frozenset()))
    policy = PrefixAwarePolicy(seed=0)
    assert policy.choose(hashes, [a, b, c]) == Decision("b", "prefix", 3)
    assert policy.work_per_request == 2  # that request's uncached blocks: what a queued one costs
    # b holds the most, but 3 requests wait there (3 x 2 + 2 = 8 blocks ahead of the first token)
    # against a's 3 with a shorter match: a, passed over for its queue -> 'balance'
    busy_b = ReplicaView("b", 3, b.cached)
    assert policy.choose(hashes, [a, busy_b, c]) == Decision("a", "balance", 2)
    # equal estimates: the longer match, then the shorter queue
    tie = [ReplicaView("a", 1, frozenset({10})), ReplicaView("b", 0, frozenset({10}))]
    assert PrefixAwarePolicy(seed=0).choose(hashes, tie).replica_id == "b"
    # never more than max_imbalance busier than the idlest, whatever it holds
    far = [ReplicaView("a", 9, frozenset(hashes)), ReplicaView("b", 0, frozenset({10}))]
    assert PrefixAwarePolicy(max_imbalance=8, seed=0).choose(hashes, far) == Decision("b", "balance", 1)


def test_no_holder_falls_back_to_power_of_two_choices() -> None:
    policy = PrefixAwarePolicy(max_imbalance=0, seed=1)
    replicas = [ReplicaView(str(i), queue=i, cached=frozenset()) for i in range(4)]
    picks = [policy.choose([1, 2], replicas) for _ in range(400)]
    assert {d.reason for d in picks} == {"spread"}
    counts = {r.replica_id: sum(d.replica_id == r.replica_id for d in picks) for r in replicas}
    # two at random, the shorter queue wins: replica 0 wins whenever drawn (half the draws), 3 never
    assert counts["3"] == 0 and counts["0"] > counts["1"] > counts["2"] > 0


def test_round_robin_cycles_whatever_is_cached() -> None:
    policy = RoundRobinPolicy()
    replicas = [ReplicaView("b", 0, frozenset({1})), ReplicaView("a", 0, frozenset())]
    assert [policy.choose([1], replicas).replica_id for _ in range(4)] == ["a", "b", "a", "b"]


def test_index_follows_reports_and_forgets_unconfirmed_routes() -> None:
    index = PrefixIndex(optimistic_ttl=1.0)

    def held(rid: str, now: float) -> set[int]:
        view = index.views([rid], now)[0]
        return {h for h in range(10) if h in view.cached}
    index.report("a", [1, 2], queue=1)
    index.routed("a", [7, 8], now=10.0)
    views = index.views(["a", "b"], now=10.5)
    assert views[0].queue == 2 and held("a", 10.5) == {1, 2, 7, 8} and held("b", 10.5) == set()
    index.report("a", [2], queue=0, now=10.6)  # evicted 1; 7, 8 not confirmed yet but within the ttl
    assert held("a", 10.9) == {2, 7, 8}
    assert held("a", 11.5) == {2}  # past the ttl: only what it reported
    index.forget("a")
    assert held("a", 12.0) == set()


def test_index_estimates_the_prefill_work_queued_at_each_replica() -> None:
    index = PrefixIndex()
    index.routed("a", [1], now=0.0, work=4)
    index.routed("a", [2], now=0.0, work=6)
    assert index.views(["a"], now=0.1)[0].work_ahead == 10  # nothing reported yet: what was routed
    index.report("a", [1, 2], queue=1, now=0.2)  # no work figure: the oldest finished first
    assert index.views(["a"], now=0.3)[0].work_ahead == 6
    index.report("a", [1, 2], queue=3, now=0.4, work=2.5)  # its own figure replaces the estimate
    index.routed("a", [3], now=0.5, work=3)
    assert index.views(["a"], now=0.6)[0].work_ahead == 5.5


@dataclass
class Progress:
    """A request's progress as the front marks it (policy.RouteProgress)."""

    prefilled_at: float | None = None
    finished_at: float | None = None


def view(index: PrefixIndex, rid: str, now: float) -> tuple[int, float, set[int]]:
    v = index.views([rid], now)[0]
    return v.queue, v.work_ahead, {h for h in range(10) if h in v.cached}


def test_index_learns_of_a_tracked_requests_prefill_and_end_before_any_report() -> None:
    """A burst's follow-up after the first request ended must see the replica idle and holding the
    prefix, however late its reports come: the first request's work leaves at its first token, its
    place in the queue at its end, and its blocks count until a report taken after its prefill."""
    index = PrefixIndex(optimistic_ttl=1.0)
    first = Progress()
    index.routed("a", [1, 2, 3], now=0.0, work=4, progress=first)
    assert view(index, "a", 0.1) == (1, 4, {1, 2, 3})
    index.report("a", [], queue=1, now=0.2, work=4, taken=100.0)  # taken while it waited: counts it
    assert view(index, "a", 0.3) == (1, 4, {1, 2, 3})
    first.prefilled_at = 100.5
    assert view(index, "a", 0.6) == (1, 0, {1, 2, 3})  # the reported 4 blocks were its own
    first.finished_at = 101.0
    assert view(index, "a", 9.0) == (0, 0, {1, 2, 3})  # far past the ttl, no report since: still held
    index.report("a", [1, 2, 3], queue=1, now=9.1, work=0, taken=100.9)  # after its prefill, before its end
    assert view(index, "a", 9.2) == (0, 0, {1, 2, 3})
    index.report("a", [2], queue=0, now=9.5, work=0, taken=101.5)  # after its end, 1 and 3 evicted
    assert view(index, "a", 9.6) == (0, 0, {2})
    # a route whose prefill a report shows is the report's to answer for: eviction drops it
    second = Progress(prefilled_at=102.0)
    index.routed("a", [4], now=9.7, work=1, progress=second)
    index.report("a", [], queue=1, now=9.8, work=0, taken=102.5)
    assert view(index, "a", 9.9) == (1, 0, set())


def test_index_drops_tracked_routes_its_reports_no_longer_count() -> None:
    """A tracked request that ended unmarked (its caller gone) must not hold a place forever: once
    the replica's queue is shorter than the routes it had counted, the oldest go."""
    index = PrefixIndex(optimistic_ttl=1.0)
    lost, running = Progress(), Progress()
    index.routed("a", [1], now=0.0, work=2, progress=lost)
    index.routed("a", [2], now=0.1, work=2, progress=running)
    index.report("a", [], queue=2, now=0.2, work=4, taken=10.0)
    assert view(index, "a", 0.3) == (2, 4, {1, 2})
    index.report("a", [2], queue=1, now=0.4, work=0, taken=10.5)
    assert view(index, "a", 0.5) == (1, 0, {2})
    running.finished_at = 11.0
    assert view(index, "a", 0.6) == (0, 0, {2})


def test_block_hashes_agree_across_processes_with_one_key() -> None:
    """The front computes a request's hashes in its process, replicas theirs: with the same key they
    must agree, whatever each process's str-hash seed."""
    tokens = list(range(100))
    here = BlockHasher("secret").chain(tokens, 16, "tenant-a")
    unsalted = BlockHasher("secret").chain(tokens, 16, None)  # no salt (no API keys): hash(None) varies by process
    code = ("from tokenmill.engine import BlockHasher; h = BlockHasher('secret'); "
            "print([h.chain(list(range(100)), 16, 'tenant-a'), h.chain(list(range(100)), 16, None)])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert eval(out.stdout) == [here, unsalted]
    assert len(here) == 6
    assert BlockHasher("other").chain(tokens, 16, "tenant-a") != here
    assert BlockHasher("secret").chain(tokens, 16, "tenant-b")[0] != here[0]
    assert BlockHasher("secret").chain(tokens, 16, None)[0] != here[0]


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_an_engine_caches_the_blocks_the_front_predicts(tiny_dir, salt) -> None:
    """What a replica reports (cached_block_hashes) contains exactly the chain a front computes."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=2, kv_cache_memory=2**20,
              prefix_hash_key="k")
    engine = llm.engine
    prompt = list(range(40, 90))
    engine.add_request(prompt, SamplingParams(max_tokens=1), cache_salt=salt)
    while engine.has_unfinished_requests():
        engine.step()
    predicted = BlockHasher("k").chain(prompt, engine.config.cache.block_size, salt)
    assert len(predicted) == 3 and set(predicted) <= set(engine.cached_block_hashes())


def test_the_front_keys_a_request_by_its_tenant_and_adapter_as_the_engine_does() -> None:
    """RemoteEngine.block_hashes: the salt the engine uses (the tenant's, plus the adapter's content hash)."""
    from types import SimpleNamespace

    from tokenmill.engine import adapter_salt
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.scaleout.remote import RemoteEngine

    info = SimpleNamespace(model_name="m", block_size=16, adapters={"sql": "c0ffee"}, warm_step_seconds=0.0)
    front = RemoteEngine(handle=None, info=info, hasher=BlockHasher("k"))
    ids = list(range(50))
    assert front.block_hashes(ids, SamplingParams(), "tenant", None) == BlockHasher("k").chain(ids, 16, "tenant")
    assert front.block_hashes(ids, SamplingParams(), "tenant", "sql") == \
        BlockHasher("k").chain(ids, 16, adapter_salt("tenant", "c0ffee"))
    assert front.block_hashes(ids, SamplingParams(prompt_logprobs=1), "tenant", None) == []  # never cached
