"""The engine with LoRA adapters: mixed batches, the max_loras limit, prefix-cache isolation,
loading and unloading with requests in flight, nothing held after requests end."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidParameterError
from tests.lora.helpers import random_adapter, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-engine")
    base = tiny_hf_model("llama", path / "base")
    for i in range(8):
        random_adapter(base, path / f"a{i}", seed=20 + i, r=4 + 4 * (i % 2))
    random_adapter(base, path / "other", seed=99)
    return path


def make_llm(model_dir, **options) -> LLM:
    options = {"dtype": "float32", "device": "cpu", "enable_lora": True, "kv_cache_memory": 2 << 20, **options}
    llm = LLM(str(model_dir / "base"), **options)
    for i in range(8):
        llm.load_lora(f"a{i}", str(model_dir / f"a{i}"))
    return llm


PROMPTS = [f"prompt {i}: " + "abc " * (i + 1) for i in range(9)]
ADAPTERS = [None] + [f"a{i}" for i in range(8)]


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_mixed_batch_equals_each_alone(model_dir):
    llm = make_llm(model_dir)
    together = ids(llm.generate(PROMPTS, GREEDY, lora=ADAPTERS))
    alone = [ids(llm.generate([p], GREEDY, lora=a))[0] for p, a in zip(PROMPTS, ADAPTERS)]
    assert together == alone
    assert len({tuple(t) for t in ids(llm.generate([PROMPTS[0]] * 9, GREEDY, lora=ADAPTERS))}) >= 8
    assert llm.engine.num_used_blocks == 0
    assert all(info.in_use == 0 for info in llm.engine.lora.list())


def test_no_more_adapters_per_step_than_max_loras(model_dir, monkeypatch):
    llm = make_llm(model_dir, max_loras=2)
    reference = ids(make_llm(model_dir).generate(PROMPTS, GREEDY, lora=ADAPTERS))
    seen = []
    activate = llm.engine.lora.activate
    monkeypatch.setattr(llm.engine.lora, "activate", lambda adapters: seen.append(
        len({id(a) for a in adapters})) or activate(adapters))
    assert ids(llm.generate(PROMPTS, GREEDY, lora=ADAPTERS)) == reference
    assert max(seen) == 2


def test_prefix_cache_is_per_adapter_content(model_dir):
    llm = make_llm(model_dir, max_num_seqs=1)
    prompt = "shared system prompt " * 4
    base = llm.generate([prompt], GREEDY)[0]
    first = llm.generate([prompt], GREEDY, lora="a0")[0]
    assert first.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    again = llm.generate([prompt], GREEDY, lora="a0")[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # other weights under the same name: no stale block is reused, and the output is the new adapter's
    llm.load_lora("a0", str(model_dir / "other"), replace=True)
    swapped = llm.generate([prompt], GREEDY, lora="a0")[0]
    assert swapped.num_cached_tokens == 0
    fresh = make_llm(model_dir)
    fresh.load_lora("other", str(model_dir / "other"))
    assert swapped.outputs[0].token_ids == fresh.generate([prompt], GREEDY, lora="other")[0].outputs[0].token_ids
    assert base.outputs[0].token_ids != first.outputs[0].token_ids


def test_load_and_unload_with_requests_in_flight(model_dir):
    """Running requests finish on the weights they started with, whatever happens to the name;
    new requests get the new weights or a clear error."""
    llm = make_llm(model_dir)
    expected = ids(make_llm(model_dir).generate(PROMPTS, GREEDY, lora=ADAPTERS))
    engine = llm.engine
    requests = [engine.add_request(p, GREEDY, lora=a) for p, a in zip(PROMPTS, ADAPTERS)]
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}

    def step():
        for delta in engine.step():
            for sample in delta.samples:
                outputs[delta.request_id].extend(sample.token_ids)

    for _ in range(3):
        step()
    assert engine.lora.unload("a1") == 1  # one request still uses it
    llm.load_lora("a2", str(model_dir / "other"), replace=True)
    with pytest.raises(InvalidParameterError, match="not loaded"):
        engine.add_request("x", GREEDY, lora="a1")
    while engine.has_unfinished_requests():
        step()
    assert [outputs[r.request_id] for r in requests] == expected
    assert engine.num_used_blocks == 0
    assert all(info.in_use == 0 for info in engine.lora.list())
    assert "a1" not in engine.lora


def test_abort_and_errors_release_everything(model_dir):
    llm = make_llm(model_dir)
    engine = llm.engine
    request = engine.add_request("hello " * 5, SamplingParams(max_tokens=50, n=3, seed=1), lora="a3")
    adapter = engine.lora.get("a3")
    assert engine.lora.users(adapter) == 3
    engine.step()
    engine.abort(request.request_id)
    assert engine.lora.users(adapter) == 0 and engine.num_used_blocks == 0
    with pytest.raises(InvalidParameterError, match="not loaded"):
        engine.add_request("x", GREEDY, lora="nope")
    without = LLM(str(model_dir / "base"), dtype="float32", device="cpu", kv_cache_memory=2 << 20)
    with pytest.raises(InvalidParameterError, match="enable_lora"):
        without.generate(["x"], GREEDY, lora="a0")


def test_adapters_dropped_from_memory_are_read_again(model_dir):
    llm = make_llm(model_dir, max_loras=2, max_cpu_loras=3)
    manager = llm.engine.lora
    assert sum(info.loaded for info in manager.list()) == 3
    loads = manager.num_loads
    out = ids(llm.generate(PROMPTS[:3], GREEDY, lora=["a0", "a1", "a0"]))
    assert manager.num_loads == loads + 2  # a0 and a1 had been dropped (LRU), read again from disk
    assert out == ids(make_llm(model_dir).generate(PROMPTS[:3], GREEDY, lora=["a0", "a1", "a0"]))


def test_bfloat16_mixed_batch_runs_close_to_alone(model_dir):
    """bfloat16 (the kernel path on CPU): mixing adapters in a batch changes no greedy token here."""
    llm = make_llm(model_dir, dtype="bfloat16")
    together = ids(llm.generate(PROMPTS, GREEDY, lora=ADAPTERS))
    alone = [ids(llm.generate([p], GREEDY, lora=a))[0] for p, a in zip(PROMPTS, ADAPTERS)]
    assert together == alone
    assert torch.get_default_dtype() == torch.float32


def test_shortlist_speculation_with_adapters_gives_each_adapters_output(model_dir, tmp_path, monkeypatch):
    """The shortlist draft is the base model: a sequence with an adapter drafts with the base, and its
    verification recomputes the drafted positions with the adapter (the draft's hidden states are
    the base model's, never reused for it). Every output is the adapter's, and nothing is held."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the vocabulary ranking's cache
    reference = ids(make_llm(model_dir).generate(PROMPTS, GREEDY, lora=ADAPTERS))
    spec = make_llm(model_dir, speculative={"method": "shortlist", "num_speculative_tokens": 3, "adaptive": False})
    assert ids(spec.generate(PROMPTS, GREEDY, lora=ADAPTERS)) == reference
    assert spec.engine.drafter.counters.num_draft_tokens > 0
    assert spec.engine.num_used_blocks == 0
