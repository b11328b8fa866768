"""KV blocks handed from one engine to another (disaggregated prefill/decode): the receiver serves
the prompt from them as prefix-cache hits, and answers exactly as if it had computed them."""

from __future__ import annotations

import pytest

from tests.server.conftest import build_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine import BlockHasher, export_blocks, import_blocks
from tokenmill.errors import InvalidParameterError

OPTIONS = {"dtype": "float32", "device": "cpu", "max_num_seqs": 2, "kv_cache_memory": 2**20,
           "prefix_hash_key": "shared"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_checkpoint(path, seed=3, tied=False)
    return str(path)


def run(llm: LLM, prompt: list[int]):
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0), request_id="r")
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [d for d in engine.step() if d.request_id == "r"]
    return [t for d in deltas for s in d.samples for t in s.token_ids], deltas[-1].num_cached_tokens


def test_imported_blocks_are_hits_and_change_no_token(tiny) -> None:
    prompt = [(i * 7) % 250 for i in range(70)]  # 4 full blocks of 16 and 6 tokens
    prefill, decode, fresh = LLM(tiny, **OPTIONS), LLM(tiny, **OPTIONS), LLM(tiny, **OPTIONS)
    expected, _ = run(prefill, prompt)
    hashes = BlockHasher("shared").chain(prompt, 16, None)
    payload = export_blocks(prefill.engine, hashes)
    assert payload.hashes == hashes and payload.kv.shape[2] == 4 and payload.nbytes > 0
    assert import_blocks(decode.engine, payload) == 4
    assert import_blocks(decode.engine, payload) == 0  # held already
    assert decode.engine.num_used_blocks == 0  # imported blocks are free (cached), not held
    tokens, cached = run(decode, prompt)
    assert cached == 64 and tokens == expected
    assert run(fresh, prompt) == (expected, 0)


def test_blocks_of_another_layout_are_refused(tiny) -> None:
    source = LLM(tiny, **OPTIONS)
    prompt = list(range(40))
    run(source, prompt)
    payload = export_blocks(source.engine, BlockHasher("shared").chain(prompt, 16, None))
    other = LLM(tiny, **{**OPTIONS, "kv_cache_dtype": "int8"})
    with pytest.raises(InvalidParameterError, match="do not fit"):
        import_blocks(other.engine, payload)
    assert export_blocks(source.engine, [123, 456]).kv.shape[2] == 0  # nothing held: an empty payload
