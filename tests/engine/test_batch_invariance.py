"""Batch composition must not change results: greedy outputs (float32) of 64 varied prompts
submitted together equal each prompt run alone, with prefix caching on and off, chunked prefill
at several chunk sizes, and a KV budget small enough to force preemptions. At least 60 of 64
identical, and at every divergence the two competing tokens are a near-tie (logprobs within 1e-3)."""

from __future__ import annotations

import gc

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tests.model_utils import save_byte_tokenizer

pytestmark = pytest.mark.real_model

MAX_TOKENS = 10
PREFIXES = [
    "You are a helpful assistant who answers questions about geography, history and science. "
    "Answer briefly and precisely, in plain English, without lists.\n\n",
    "The following is a conversation between a curious student and a patient teacher. The teacher "
    "explains each idea step by step and checks that the student understood before moving on.\n\n",
    "def tokenize(text):\n    \"\"\"Split text into words and punctuation.\"\"\"\n    words = []\n",
    "Once upon a time, in a kingdom by the sea, there lived an old fisherman and his three daughters. ",
]
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name a prime number.",
             "Who wrote Hamlet?", "How do plants make food?", "What is 12 times 12?",
             "Describe a cat.", "Where is Mount Everest?"]


def prompts() -> list[str]:
    varied = [p + q for p in PREFIXES for q in QUESTIONS]  # 32 sharing four prefixes
    varied += [q for q in QUESTIONS]  # 8 short ones
    varied += [f"Write number {i}: " + "one two three " * (i % 7 + 1) for i in range(24)]  # 24 of many lengths
    return varied


def compare(alone, together, near_tie: float = 1e-3) -> int:
    """How many outputs are identical; every other one must first differ at a near-tie (logprobs of
    the two tokens within ``near_tie``)."""
    identical = 0
    for a, b in zip(alone, together):
        a, b = a.outputs[0], b.outputs[0]
        if a.token_ids == b.token_ids:
            identical += 1
            continue
        pos = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top = dict(a.logprobs[pos].top)
        assert b.token_ids[pos] in top, f"divergence at {pos}: {b.token_ids[pos]} not in the top-5 {top}"
        gap = top[a.token_ids[pos]] - top[b.token_ids[pos]]
        assert abs(gap) <= near_tie, f"divergence at {pos} is no near-tie: logprob gap {gap:.2e}"
    return identical


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def run_alone(model: str, texts: list[str]) -> list:
    """Each prompt in a batch of its own: one sequence at a time (max_num_seqs=1)."""
    reference = LLM(model, dtype="float32", device="cpu", max_num_seqs=1)
    outputs = reference.generate(texts, PARAMS, use_tqdm=False)
    assert max(s.num_running for s in reference.engine.stats) == 1
    return outputs


def run_together(model: str, texts: list[str], alone: list, name: str, kwargs: dict) -> None:
    """All prompts in one generate call; with prefix caching, a second identical call runs on
    the cached prefixes (the first cannot hit: blocks are cached once their KV is written)."""
    llm = LLM(model, dtype="float32", device="cpu", **kwargs)
    runs = 2 if kwargs.get("enable_prefix_caching", True) else 1
    for _ in range(runs):
        identical = compare(alone, llm.generate(texts, PARAMS))
        print(f"\n{model} [{name}]: {identical}/64 identical to alone")
        assert identical >= 60, f"{name}: only {identical}/64 identical"
    stats = list(llm.engine.stats)
    assert llm.engine.num_used_blocks == 0
    if "kv_cache_memory" in kwargs:
        assert sum(s.num_preempted for s in stats) > 0, f"{name}: the small KV budget forced no preemption"
    if kwargs.get("max_num_batched_tokens", 2048) < 100:
        assert max(s.num_batched_tokens for s in stats) <= kwargs["max_num_batched_tokens"]
    hits = sum(s.prefix_hit_tokens for s in stats)
    assert (hits > 0) == (runs == 2), f"{name}: {hits} prefix-cache hit tokens"
    del llm
    gc.collect()


SMOLLM_CONFIGS = {
    "prefix caching on": {},
    "prefix caching off, chunks of 77": {"enable_prefix_caching": False, "max_num_batched_tokens": 77},
    "chunks of 32": {"max_num_batched_tokens": 32},
    "preemptions": {"kv_cache_memory": 40 * 16 * 30 * 2 * 3 * 64 * 4},  # 40 blocks of 16 tokens
}


@pytest.fixture(scope="module")
def smollm2_alone():
    return run_alone("smollm2-135m-instruct", prompts())


@pytest.mark.parametrize("name", sorted(SMOLLM_CONFIGS))
def test_smollm2_batch_invariance(name, smollm2_alone):
    run_together("smollm2-135m-instruct", prompts(), smollm2_alone, name, SMOLLM_CONFIGS[name])


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-gemma3")
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=24, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        eos_token_id=256, bos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30)  # peaked logits: greedy choices are not coin flips
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return str(path)


GEMMA_BLOCK_BYTES = 16 * 2 * 32 * 4  # one block of one layer: 16 tokens x (k + v) x 1 head x 32 dims x float32
GEMMA_CONFIGS = {
    "prefix caching on": {},
    "prefix caching off": {"enable_prefix_caching": False},
    "chunks of 29": {"max_num_batched_tokens": 29},
    "preemptions": {"kv_cache_memory": 4 * 48 * GEMMA_BLOCK_BYTES},  # ~48 blocks per group
}


@pytest.fixture(scope="module")
def gemma3_alone(tiny_gemma3):
    return run_alone(tiny_gemma3, prompts())


@pytest.mark.parametrize("name", sorted(GEMMA_CONFIGS))
def test_tiny_gemma3_batch_invariance(name, tiny_gemma3, gemma3_alone):
    run_together(tiny_gemma3, prompts(), gemma3_alone, name, GEMMA_CONFIGS[name])


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    """A tiny Mixtral (6 experts, top-2): in exact no-drop routing, a token's experts and their
    weights depend on that token alone."""
    from tests.models.moe_helpers import tiny_moe_model

    path = tmp_path_factory.mktemp("tiny-mixtral")
    model = tiny_moe_model("mixtral", path)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10)  # peaked logits: greedy choices are not coin flips
    model.save_pretrained(path)
    return str(path)


MIXTRAL_BLOCK_BYTES = 3 * 16 * 2 * 2 * 16 * 4  # 3 layers x 16 tokens x (k + v) x 2 heads x 16 dims x float32
MIXTRAL_CONFIGS = {
    "prefix caching on": {},
    "prefix caching off": {"enable_prefix_caching": False},
    "chunks of 29": {"max_num_batched_tokens": 29},
    "preemptions": {"kv_cache_memory": 48 * MIXTRAL_BLOCK_BYTES},
}


@pytest.fixture(scope="module")
def mixtral_alone(tiny_mixtral):
    return run_alone(tiny_mixtral, prompts())


@pytest.mark.parametrize("name", sorted(MIXTRAL_CONFIGS))
def test_tiny_mixtral_batch_invariance(name, tiny_mixtral, mixtral_alone):
    run_together(tiny_mixtral, prompts(), mixtral_alone, name, MIXTRAL_CONFIGS[name])
