"""Speculative decoding in the engine (engine/spec/): the n-gram proposer, the KV rollback of
rejected tokens, and greedy output identical to speculation off on varied prompts, with every
block given back."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.engine.test_batch_invariance import compare
from tests.server.conftest import build_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine import SpeculativeConfig
from tokenmill.engine.block_pool import BlockHasher
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.spec.ngram import NgramProposer
from tokenmill.errors import InvalidParameterError


# ---------------------------------------------------------------------------------------- proposer

def test_ngram_proposes_what_followed_the_latest_earlier_match():
    p = NgramProposer(min_n=2, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9
    ids = [7, 1, 2, 3, 4, 1, 2, 3, 9, 1, 2]
    assert p.lookup(ids, 3) == [3, 9, 1]  # "1 2" last seen at 5 (the latest), followed by 3 9 1
    assert p.lookup(ids + [3], 2) == [9, 1]  # "1 2 3" (the longest n first) at 5
    assert p.lookup([5, 6, 7, 8], 4) == []  # no repeat: no draft
    assert p.lookup(ids, 0) == [] and p.lookup([1], 3) == []
    assert p.lookup([4, 4, 4, 4], 5) == [4]  # the match may overlap the suffix; at most what follows it


def test_ngram_prefers_the_occurrence_that_shares_the_longer_context():
    """A recurring n-gram: the occurrence whose preceding tokens match the sequence's further back
    is the one being copied, even when a later one exists; among equals, the latest."""
    p = NgramProposer()  # n-grams of 2-4 tokens
    #      0  1  2  3  4  5   6  7  8  9 10 11 12  13 14 15 16 17 18 19
    ids = [9, 8, 1, 2, 3, 4, 20, 7, 6, 1, 2, 3, 4, 21, 9, 8, 1, 2, 3, 4]
    assert p.lookup(ids, 2) == [20, 7]  # "9 8" before "1 2 3 4" at 2 as before the suffix: not 21 (at 9)
    ids[14] = 5  # now "8 1 2 3 4" at 2 and "6 1 2 3 4" at 9: 2 still shares one more token
    assert p.lookup(ids, 1) == [20]
    ids[15] = 0  # neither shares a token beyond the 4-gram: the latest
    assert p.lookup(ids, 1) == [21]
    # the same rule in a tenant's earlier outputs (lookup_in)
    bigrams = NgramProposer(min_n=2, max_n=2)
    text = np.array([5, 6, 1, 2, 30, 7, 1, 2, 40])
    assert bigrams.lookup_in([text], [9, 6, 1, 2], 2) == [30, 7]  # "6" before "1 2" at 2, "7" at 6
    assert bigrams.lookup_in([text], [8, 8, 1, 2], 2) == [40]  # no context shared: the latest


def test_ngram_checks_its_range():
    with pytest.raises(InvalidParameterError, match="min_n <= max_n"):
        NgramProposer(3, 2)
    with pytest.raises(InvalidParameterError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(InvalidParameterError, match="unknown speculative_method 'medusa'"):
        SpeculativeConfig(speculative_method="medusa")


# ---------------------------------------------------------------------------------------- KV rollback

def test_truncate_gives_back_the_blocks_past_the_kept_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    ids = list(range(1, 30))
    assert kv.allocate_slots("s", ids, 6)  # 2 blocks
    kv.cache_blocks("s", ids, 6)  # block 0 full: cached
    free = kv.num_free_blocks
    assert kv.allocate_slots("s", ids, 7)  # a draft: 13 tokens, 4 blocks
    assert kv.num_free_blocks == free - 2
    kv.truncate("s", 8)  # kept up to 8: 2 blocks
    assert kv.num_computed_tokens("s") == 8 and len(kv.block_table("s")) == 2 and kv.num_free_blocks == free
    with pytest.raises(ValueError, match="cannot truncate"):
        kv.truncate("s", 3)  # into the cached block
    with pytest.raises(ValueError, match="cannot truncate"):
        kv.truncate("s", 9)  # past what was computed
    kv.truncate("gone", 0)  # unknown: a no-op


def test_uncount_keeps_the_blocks_for_the_next_allocation():
    """A draft that is the model itself writes KV past the computed tokens and counts back
    (uncount): the blocks stay, and the step's allocation of the same tokens takes them again."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    ids = list(range(1, 30))
    assert kv.allocate_slots("s", ids, 5)
    kv.cache_blocks("s", ids, 5)  # block 0 cached
    assert kv.allocate_slots("s", ids, 6)  # 11 tokens: 3 blocks
    table, free = list(kv.block_table("s")), kv.num_free_blocks
    kv.uncount("s", 5)
    assert kv.num_computed_tokens("s") == 5 and kv.block_table("s") == table and kv.num_free_blocks == free
    assert kv.allocate_slots("s", ids, 4) and kv.block_table("s") == table  # the same blocks, none new
    with pytest.raises(ValueError, match="cannot count back"):
        kv.uncount("s", 3)  # into the cached block
    with pytest.raises(ValueError, match="cannot count back"):
        kv.uncount("s", 10)  # past what was counted
    kv.uncount("gone", 0)  # unknown: a no-op


# ---------------------------------------------------------------------------------------- the engine

PROMPTS = 64


def _prompts(tokenizer) -> list[list[int]]:
    """64 varied prompts from the corpus (Shakespeare): plain continuations of 16-160 tokens, and
    passages to copy (the model repeats them: long drafts kept)."""
    from tokenmill.eval.corpus import fetch_corpus

    text = fetch_corpus().read_text(encoding="utf-8")
    rng = random.Random(0)
    out = []
    for i in range(PROMPTS):
        at = rng.randrange(0, len(text) - 4000)
        ids = tokenizer.encode(text[at:at + 3000])[:rng.randrange(16, 160)]
        if i % 2:
            passage = tokenizer.decode(ids[:rng.randrange(12, 40)])
            ids = tokenizer.encode(f"Repeat this text exactly.\n\n{passage}\n\nThe text again:\n\n{passage[:20]}")
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-spec")
    build_tiny_checkpoint(path)
    return path


def _params(i: int, max_tokens: int) -> SamplingParams:
    """Greedy, and seeded sampling with filters, penalties and min_tokens; some with logprobs."""
    logprobs = 1 if i % 5 == 0 else None
    kind = i % 4
    if kind in (0, 2):
        return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)
    if kind == 1:
        return SamplingParams(temperature=0.7, top_p=0.95, top_k=40, seed=i, max_tokens=max_tokens, logprobs=logprobs)
    return SamplingParams(temperature=0.5, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2, min_tokens=8,
                          seed=i, max_tokens=max_tokens, logprobs=logprobs)


def _generate(llm: LLM, prompts, max_tokens: int = 32):
    return llm.generate(prompts, [_params(i, max_tokens) for i in range(len(prompts))], use_tqdm=False)


def test_greedy_output_is_identical_to_speculation_off():
    """SmolLM2 in float32, 64 varied prompts (EOS and stop handling included), greedy and seeded
    sampling (top-k, top-p, min-p, penalties, min_tokens): every output token, text and logprob the
    same with n-gram speculation as without."""
    plain = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_num_seqs=32)
    spec = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_num_seqs=32, speculative_method="ngram",
               num_speculative_tokens=4)
    prompts = _prompts(plain.tokenizer)
    expected, got = _generate(plain, prompts), _generate(spec, prompts)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text and g.outputs[0].finish_reason == e.outputs[0].finish_reason
        if e.outputs[0].logprobs is not None:
            assert [t.token_id for t in g.outputs[0].logprobs] == [t.token_id for t in e.outputs[0].logprobs]
            assert [t.logprob for t in g.outputs[0].logprobs] == pytest.approx(
                [t.logprob for t in e.outputs[0].logprobs], abs=1e-4)
    drafter = spec.engine.drafter
    # the test means something: drafts were both kept and rejected, and steps were saved
    c = drafter.counters
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert len(spec.engine.stats) < len(plain.engine.stats)
    assert spec.engine.num_used_blocks == 0 and plain.engine.num_used_blocks == 0


def test_aborting_a_drafting_request_frees_its_blocks(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", speculative_method="ngram")
    engine = llm.engine
    engine.add_request([5, 6, 7] * 30, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), request_id="r")
    for _ in range(6):
        engine.step()
    c = engine.drafter.counters
    assert c.num_draft_tokens > 0 and engine.num_used_blocks > 0
    snap = engine.snapshot()  # what /metrics reads
    assert (snap.spec_draft_tokens, snap.spec_accepted_tokens) == (c.num_draft_tokens, c.num_accepted_tokens)
    engine.abort("r")
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_a_request_that_opts_out_never_drafts(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", speculative_method="ngram")
    prompt = [3, 4] * 40
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False),
                 use_tqdm=False)
    assert llm.engine.drafter.counters.num_draft_tokens == 0
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.engine.drafter.counters.num_draft_tokens > 0


def test_the_speculative_dict_sets_the_options(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu",
              speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    config = llm.engine.config.speculative
    assert (config.speculative_method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 3)
    with pytest.raises(InvalidParameterError, match="unknown key.*draft_tensor_parallel_size.*known: method"):
        LLM(str(tiny_dir), speculative={"method": "ngram", "draft_tensor_parallel_size": 1})
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens given both"):
        LLM(str(tiny_dir), speculative={"num_speculative_tokens": 2}, num_speculative_tokens=3)


def test_a_draft_takes_only_what_every_running_sequence_leaves():
    """Two decoding sequences, one free block: the more important one's draft waits until both have
    their next token's slot, then takes what is left (here nothing, so it is dropped); nobody is
    preempted for a draft."""
    from tokenmill.engine.config import SchedulerConfig
    from tokenmill.engine.request import Sequence
    from tokenmill.engine.sampler import SamplingState
    from tokenmill.engine.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks (block 0 is the null block)
    sched = Scheduler(SchedulerConfig(), kv)
    seqs = []
    for name, priority in (("a", 0), ("b", 1)):
        ids = list(range(1, 5))  # a full block each
        seq = Sequence(name, 0, ids, SamplingState.create(SamplingParams(max_tokens=20), ids), detokenizer=None,
                       priority=priority)
        sched.add(seq)
        seqs.append(seq)
    out = sched.schedule()  # both prompts: 1 block each
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.append_token(9)
    assert kv.num_free_blocks == 2
    a, b = seqs
    a.draft_token_ids = [9, 9, 9, 9, 9]  # would need 2 more blocks
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens, i.num_draft) for i in out.scheduled] == [("a", 4, 3), ("b", 1, 0)]
    assert not out.preempted and a.draft_token_ids == [9, 9, 9] and kv.num_free_blocks == 0


# ---------------------------------------------------------------------------------------- model drafts

@pytest.fixture(scope="module")
def draft_dir(tiny_dir, tmp_path_factory):
    """The tiny target with an untied head whose rows are shuffled for a third of the vocabulary: a
    draft that agrees with the target on most tokens and is wrong on the rest."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-draft")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, path / name)
    config = json.loads((tiny_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    tensors = load_file(tiny_dir / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(5)
    order = torch.arange(embed.shape[0])
    moved = torch.randperm(embed.shape[0], generator=g)[:embed.shape[0] // 3]
    order[moved] = moved[torch.randperm(len(moved), generator=g)]
    save_file({**tensors, "lm_head.weight": embed[order].contiguous()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path


def test_the_prefix_cache_holds_only_blocks_of_kept_tokens(tiny_dir, draft_dir):
    """Refused draft tokens never reach the prefix cache: every block hash it holds after drafts
    were both kept and refused is a block of some request's prompt and output."""
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", prefix_hash_key="k",
              speculative={"method": "draft", "draft_model": str(draft_dir), "num_speculative_tokens": 3,
                           "adaptive": False})
    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(8)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    c = llm.engine.drafter.counters
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    block_size = llm.engine.config.cache.block_size
    written = set()
    for prompt, out in zip(prompts, outputs):
        written |= set(BlockHasher("k").chain(prompt + out.outputs[0].token_ids, block_size))
    cached = set(llm.engine.cached_block_hashes())
    assert len(cached) > len(prompts) and cached <= written
    assert llm.engine.num_used_blocks == 0


MIXED = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
         SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=40, ignore_eos=True, logprobs=2),
         SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=40, ignore_eos=True),
         SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5, seed=4, max_tokens=40, min_tokens=30)]


@pytest.mark.parametrize("speculative", [{"method": "draft"}, {"method": "layerskip", "layer_skip_layers": 1}],
                         ids=["draft", "layerskip"])
def test_model_drafts_give_the_output_of_speculation_off(tiny_dir, draft_dir, speculative):
    """Greedy and seeded sampling (penalties, filters, min_tokens, logprobs) through a draft model
    and through the target's own first layer: token for token what speculation off gives."""
    if speculative["method"] == "draft":
        speculative = {**speculative, "draft_model": str(draft_dir)}
    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(8)]
    params = [MIXED[i % len(MIXED)] for i in range(len(prompts))]
    plain = LLM(str(tiny_dir), dtype="float32", device="cpu")
    spec = LLM(str(tiny_dir), dtype="float32", device="cpu", speculative={**speculative, "num_speculative_tokens": 3,
                                                                          "adaptive": False})
    expected, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        if e.outputs[0].logprobs is not None:
            assert [t.logprob for t in g.outputs[0].logprobs] == pytest.approx(
                [t.logprob for t in e.outputs[0].logprobs], abs=1e-4)
    c = spec.engine.drafter.counters
    assert 0 < c.num_accepted_tokens <= c.num_draft_tokens
    if speculative["method"] == "draft":  # (the tiny target's first layer alone already agrees with it)
        assert c.num_accepted_tokens < c.num_draft_tokens
    assert spec.engine.num_used_blocks == 0 and spec.engine.drafter.proposer.num_used_blocks == 0


def test_unseeded_sampling_with_a_draft_model_runs_rejection_sampling_and_frees_everything(tiny_dir, draft_dir):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu",
              speculative={"method": "draft", "model": str(draft_dir), "num_speculative_tokens": 4, "adaptive": False})
    engine = llm.engine
    for i in range(12):  # the tiny target repeats the last token: some of these the draft gets wrong
        params = SamplingParams(temperature=0.9 if i % 2 else 0.7, top_p=1.0 if i % 2 else 0.8, max_tokens=300,
                                ignore_eos=True)
        engine.add_request(list(range(20 * i, 20 * i + 20)), params, f"r{i}")
    for _ in range(8):
        engine.step()
    c = engine.drafter.counters
    assert c.num_drafts > 0 and 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert engine.drafter.proposer.num_used_blocks > 0 and sum(c.accepted_per_position) == c.num_accepted_tokens
    for i in range(12):  # their draft KV goes back at once, not at the next step
        engine.abort(f"r{i}")
    assert engine.num_used_blocks == 0 and engine.drafter.proposer.num_used_blocks == 0


def test_a_draft_loads_in_the_targets_activation_dtype(draft_dir):
    """dtype "auto": an HF-directory draft computes in the target's activation dtype (beside a GGUF
    target run as stored, bfloat16), not in float32; an explicit dtype is kept."""
    import torch

    from tokenmill.loader import load_draft

    assert load_draft(str(draft_dir), "auto", "cpu", None, torch.bfloat16).model.embed.weight.dtype == torch.bfloat16
    assert load_draft(str(draft_dir), "auto", "cpu", None, torch.float32).model.embed.weight.dtype == torch.float32
    assert load_draft(str(draft_dir), "float32", "cpu", None, torch.bfloat16).model.embed.weight.dtype == torch.float32


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_dir):
    with pytest.raises(InvalidParameterError, match="does not share the target's tokenizer: vocabulary of 49152"):
        LLM(str(tiny_dir), dtype="float32", device="cpu",
            speculative={"method": "draft", "model": "smollm2-135m-instruct"})
    with pytest.raises(InvalidParameterError, match="speculative_method draft or eagle needs draft_model"):
        LLM(str(tiny_dir), speculative={"method": "draft"})
    with pytest.raises(InvalidParameterError, match="layer_skip_layers must be in 1..1 for a 2-layer model, got 2"):
        LLM(str(tiny_dir), speculative={"method": "layerskip", "layer_skip_layers": 2})


# ---------------------------------------------------------------------------------------- draft sizing

def test_draft_sizes_follow_the_measured_step_cost():
    """Flat step cost (a memory-bound step): every sequence drafts its cap. Cost growing with every
    token (compute bound, many streams): no drafts. In between: only the likely tokens."""
    from tokenmill.engine.spec.drafter import Drafter
    from tokenmill.engine.spec.ngram import NgramProposer

    def sizes(cost_per_token: float, base: float, rate: float, n: int = 4):
        d = Drafter(SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=4), NgramProposer())
        d._steps = 1  # not a probing step
        for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256, 320):
            d.step_cost.observe(tokens, 10.0)  # a first step at a size paying one-off costs: outvoted
            for _ in range(2):
                d.step_cost.observe(tokens, base + cost_per_token * tokens)
        seqs = [type("S", (), {"seq_id": f"s{i}"})() for i in range(n)]
        for s in seqs:
            for _ in range(20):  # first kept with probability `rate`, each next one too
                d.acceptance.observe(s.seq_id, 4, 0)
                d.acceptance.observe(s.seq_id, 4, 2)
            assert d.acceptance.rates(s.seq_id) == pytest.approx((0.5, 0.5), abs=0.06)
            if rate != 0.5:
                d.acceptance._per_seq[s.seq_id] = [rate, 1 - rate, rate, 1 - rate]
        return d._sizes(seqs, [4] * n, n, n)

    assert sizes(0.0, 0.02, 0.75) == [4] * 4  # flat: draft it all
    assert sizes(0.002, 0.001, 0.5, n=64) == [0] * 64  # every token costs as much as a step: none
    mid = sizes(0.003, 0.01, 0.5)  # acceptance 2/3: the first token of each pays, the second does not
    assert all(0 < k < 4 for k in mid)


def test_acceptance_is_learned_for_the_first_token_and_for_each_next_one_given_the_last():
    """Prompt lookups come all or nothing (in a copied run every token is kept, else the first is
    wrong): such a sequence's fourth draft token is worth as much as its first, and it drafts its
    whole cap where a sequence that keeps half of each continuation stops at two."""
    from tokenmill.engine.spec.cost import Acceptance
    from tokenmill.engine.spec.drafter import Drafter
    from tokenmill.engine.spec.ngram import NgramProposer

    acc = Acceptance()
    for _ in range(30):
        acc.observe("runs", 4, 4)
        acc.observe("runs", 4, 0)
        acc.observe("halves", 4, 2)
    assert acc.rates("runs") == pytest.approx((0.5, 1.0), abs=0.06)
    assert acc.rates("halves") == pytest.approx((1.0, 0.5), abs=0.01)
    assert acc.rates("new") == acc.rates("newer")  # the pooled estimates, both sequences in them
    acc.observe("x", 0, 0)  # nothing drafted: nothing learned
    assert "x" not in acc._per_seq

    d = Drafter(SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=4), NgramProposer())
    d._steps = 1
    for tokens in range(1, 12):
        for _ in range(2):
            d.step_cost.observe(tokens, 0.01 + 0.004 * tokens)
    d.acceptance = acc
    one = [type("S", (), {"seq_id": name})() for name in ("runs", "halves")]
    assert [d._sizes([s], [4], 1, 1) for s in one] == [[4], [2]]


def test_the_step_cost_curve_follows_new_measurements():
    """The curve interpolates between measured sizes (median of the recent ones, from the second), and a
    new measurement moves it at once (its sorted points are kept only between measurements)."""
    from tokenmill.engine.spec.cost import CostCurve

    curve = CostCurve()
    for size, seconds in ((4, 0.010), (4, 0.010), (12, 0.030), (12, 0.030)):
        curve.observe(size, seconds)
    assert curve(8) == pytest.approx(0.020) and curve(2) == 0.010 and curve(40) == 0.030
    for _ in range(3):
        curve.observe(12, 0.050)
    assert curve(12) == 0.050 and curve(8) == pytest.approx(0.030)
    grows = CostCurve(grows=True)  # a self-draft's passes: above the largest measured size, in proportion
    for size, seconds in ((4, 0.010), (4, 0.010), (16, 0.030), (16, 0.030)):
        grows.observe(size, seconds)
    assert grows(64) == pytest.approx(0.120) and grows(8) == pytest.approx(0.01 + 0.02 * 4 / 12) and grows(2) == 0.010


def _drive(gain, n: int, steps: int, plain_seconds: float, drafting: tuple[int, float, int]) -> list[bool]:
    """Run ``steps`` decode steps of ``n`` sequences through the realised check: a plain step takes
    ``plain_seconds``, a drafting one produces ``drafting[0]`` tokens in ``drafting[1]`` seconds,
    verifying ``drafting[2]`` drafted tokens. Returns which steps drafted."""
    modes = []
    for _ in range(steps):
        drafts = gain.drafts(n)
        modes.append(drafts)
        produced, seconds, verified = drafting if drafts else (n, plain_seconds, 0)
        gain.observe(n, drafts, produced, seconds, verified)
    return modes


def _probe_starts(modes: list[bool]) -> list[int]:
    return [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]


def test_the_realised_check_drafts_where_it_pays_and_stops_where_it_loses():
    """Plain steps measure the cost first; where drafting steps produce more tokens per second than
    plain ones it keeps drafting, with a plain step every REFRESH_EVERY; where they produce fewer
    (a verification dearer than the tokens it brings), the verdict is confirmed against fresh plain
    steps, then only probes of PROBE_STEPS draft: every PROBE_EVERY steps while the loss is small,
    further and further apart while it is large."""
    from tokenmill.engine.spec.gain import (PLAIN_MEDIAN_OF, PROBE_EVERY, PROBE_EVERY_MAX, PROBE_STEPS, REFRESH_EVERY,
                                            RealisedGain)

    gain = RealisedGain()
    wins = _drive(gain, 1, 200, plain_seconds=0.005, drafting=(3, 0.008, 4))  # x1.9 at batch 1
    assert wins[:2] == [False, False] and all(wins[2:2 + REFRESH_EVERY])
    assert wins.count(False) <= 2 + 200 // REFRESH_EVERY and gain.gain(1) > 1.5

    near = _drive(gain, 64, 1000, plain_seconds=0.06, drafting=(150, 0.15, 200))  # x0.94 at 64 streams
    assert near[:3] == [False, False, True] and 0.9 < gain.gain(64) < 1.0
    # the first drafting step loses: PLAIN_MEDIAN_OF fresh plain steps, a probe, then one every PROBE_EVERY
    assert near[3:3 + PLAIN_MEDIAN_OF + PROBE_STEPS] == [False] * PLAIN_MEDIAN_OF + [True] * PROBE_STEPS
    gaps = {b - a for a, b in zip(_probe_starts(near)[1:], _probe_starts(near)[2:])}
    assert gaps == {PROBE_EVERY + PROBE_STEPS}  # losing 6% never lengthens the wait

    far = _drive(gain, 32, 6000, plain_seconds=0.04, drafting=(40, 0.08, 64))  # x0.62 at 32 streams
    starts = _probe_starts(far)
    gaps = [b - a for a, b in zip(starts[1:], starts[2:])]  # after the confirmation
    assert gaps[0] == 2 * PROBE_EVERY + PROBE_STEPS and gaps == sorted(gaps)  # each losing probe: a longer wait
    assert gaps[-1] == PROBE_EVERY_MAX + PROBE_STEPS and len(starts) > 6  # ... up to a cap, never stopping
    assert sum(far) <= 1 + PROBE_STEPS * len(starts)
    assert _drive(gain, 1, 1, 0.005, (3, 0.008, 4)) == [True]  # each batch size keeps its own verdict

    recovers = _drive(gain, 32, PROBE_EVERY_MAX + 200, plain_seconds=0.04, drafting=(120, 0.06, 128))  # repetitive now
    assert recovers[-100:].count(True) >= 100 - (100 // REFRESH_EVERY + 1) and gain.gain(32) > 1.5


def test_a_loss_measured_against_a_stale_plain_step_is_measured_again():
    """A noisy host: plain steps measured on a fast moment (5 ms), then the host slows down by half,
    plain and drafting steps alike. Against the old plain cost drafting looks losing (x0.94); the
    check measures plain steps afresh before it believes that, and drafting resumes (x1.9)."""
    from tokenmill.engine.spec.gain import PLAIN_MEDIAN_OF, PROBE_STEPS, RealisedGain

    gain = RealisedGain()
    _drive(gain, 1, 30, plain_seconds=0.005, drafting=(3, 0.008, 4))
    slow = _drive(gain, 1, 200, plain_seconds=0.010, drafting=(3, 0.016, 4))
    assert slow.count(False) <= PLAIN_MEDIAN_OF + 200 // 32 + 1 and gain.gain(1) > 1.5
    assert slow[:PLAIN_MEDIAN_OF + 1 + PROBE_STEPS].count(True) >= PROBE_STEPS


def test_one_refused_draft_at_batch_1_does_not_stop_drafting():
    """At batch 1 a step is one sample of what a draft brings: a draft refused outright after a dozen
    kept ones (1 token for the price of 4.7 plain steps) leaves the gain above 1 (it used to pull a
    four-step average under 1)."""
    from tokenmill.engine.spec.gain import RealisedGain

    gain = RealisedGain()
    _drive(gain, 1, 14, plain_seconds=0.0067, drafting=(5, 0.0245, 4))  # x1.37
    gain.observe(1, True, 1, 0.0245, 4)
    assert 1.1 < gain.gain(1) < 1.37 and gain.drafts(1)


def test_the_realised_gain_is_a_ratio_of_sums_with_one_off_costs_capped():
    """Half the drafting steps keep their whole draft (5 tokens for 1.6 plain steps), half keep none
    (1 token for 1.6): x1.9 and x0.6, together x1.25 (a mean of logs would say x1.07). A first step
    paying a one-off second counts as at most CLIP times its rows at the plain price."""
    from tokenmill.engine.spec.gain import CLIP, RealisedGain

    gain = RealisedGain()
    _drive(gain, 1, 2, 0.005, (1, 0.008, 4))
    gain.observe(1, True, 1, 1.0, 4)  # one-off: capped at CLIP * 5 plain steps
    assert gain.gain(1) == pytest.approx(1 / (CLIP * 5)) and not gain.drafts(1)  # confirmed first
    drafted = 0
    for _ in range(400):
        if gain.drafts(1):
            gain.observe(1, True, 5 if drafted % 2 else 1, 0.008, 4)
            drafted += 1
        else:
            gain.observe(1, False, 1, 0.005)
    assert gain.gain(1) == pytest.approx(3 * 0.005 / 0.008, rel=0.1) and drafted > 350


def test_a_probe_drafts_whatever_the_draft_length_model_says():
    """Where the realised check has turned drafting off, its probes must verify something: the
    draft-length model's estimates (lowered by the refusals that turned it off) learn nothing while
    nothing is drafted, and a probe that verifies nothing leaves the verdict as it was, for good. So
    in a probe every eligible sequence drafts at least one token."""
    from types import SimpleNamespace

    from tokenmill.engine.request import SequenceStatus
    from tokenmill.engine.spec.drafter import Drafter
    from tokenmill.engine.spec.proposer import Draft

    asked = []

    class Model:  # a draft model: sized first, then asked for that many tokens
        cheap = False

        def propose(self, seqs, sizes):
            asked.append(list(sizes))
            return [Draft(token_ids=[7] * k) for k in sizes]

        def release(self, seq_id):
            pass

    d = Drafter(SpeculativeConfig(speculative_method="layerskip", num_speculative_tokens=4), Model())
    for tokens in range(1, 12):
        for _ in range(2):
            d.step_cost.observe(tokens, 0.01)
    for _ in range(2):
        d.draft_cost.observe(1, 0.05)  # a draft pass costs five steps: the model drafts nothing
    seqs = [SimpleNamespace(seq_id=f"s{i}", status=SequenceStatus.RUNNING, num_tokens=10, num_computed_tokens=9,
                            output_token_ids=[1], sampling=SimpleNamespace(params=SamplingParams(max_tokens=50)))
            for i in range(2)]
    _drive(d.realised, 2, 2, 0.01, (2, 0.01, 2))  # plain measured
    d.realised.observe(2, True, 2, 0.05, 2)  # a drafting step that lost: confirmation, then a probe
    while not d.realised.drafts(2):
        d.realised.observe(2, False, 2, 0.01)
    d._steps = 1
    d.propose(seqs, max_model_len=100, budget=64)
    assert asked == [[1, 1]] and all(s.draft_token_ids == [7] for s in seqs)
    asked.clear()
    assert d._sizes(seqs, [4, 4], 2, 2) == [0, 0]  # outside a probe the model's sizes stand


def test_drafting_steps_that_find_nothing_neither_win_nor_lose():
    """An answer's opening often matches nothing to look up: such steps are plain steps plus the
    lookups, slower or faster than the plain median by noise alone. They must not turn drafting off
    (they did: a run of them pulled the recent average under 1, and the probes' waits doubled); their
    lookups' time is charged to the next step that verified something."""
    from tokenmill.engine.spec.gain import RealisedGain

    gain = RealisedGain()
    _drive(gain, 1, 20, 0.005, (3, 0.008, 4))
    before = gain.gain(1)
    for _ in range(30):
        gain.observe(1, True, 1, 0.0056, 0, proposer_seconds=0.0001)  # 12% over the plain step, nothing verified
    assert gain.gain(1) == before  # still winning: no probe waits
    gain.observe(1, True, 3, 0.008, 4, proposer_seconds=0.0001)
    once = gain.gain(1)
    gain.observe(1, True, 3, 0.008, 4)
    assert once < before and once < gain.gain(1)  # the 3 ms of lookups charged to that one step, once
    # where lookups never find anything (64 streams of open text) and cost 2 ms a 60 ms step, they
    # are charged a plain step's worth at a time, for nothing: drafting turns itself off
    _drive(gain, 64, 20, 0.06, (100, 0.07, 64))
    assert gain.gain(64) >= 1.0
    for _ in range(400):
        gain.observe(64, gain.drafts(64), 64, 0.062, 0, proposer_seconds=0.002)
    assert gain.gain(64) < 1.0 and not gain.drafts(64)


def test_the_realised_check_compares_at_the_same_batch_size():
    """As sequences finish the batch shrinks: a drafting step is compared with plain steps near its
    own size (within 1/8), and a size with none nearby measures plain first."""
    from tokenmill.engine.spec.gain import PlainCost, RealisedGain

    cost = PlainCost()
    cost.observe(64, 0.06)
    assert cost(64) is None  # one step may carry one-off costs
    cost.observe(64, 0.07)
    cost.observe(64, 0.50)
    assert cost(64) == 0.07  # the median of the recent ones
    assert cost(60) == pytest.approx(0.07 * 60 / 64) and cost(70) == 0.07  # scaled down only
    assert cost(40) is None and cost(80) is None
    gain = RealisedGain()
    _drive(gain, 64, 40, 0.06, (150, 0.09, 200))
    assert gain.drafts(64) and not gain.drafts(40)


def test_plain_steps_skip_the_proposer(tiny_dir):
    """Where the realised check runs a plain step, the proposer is not even asked (its lookups are
    part of what drafting costs); with adaptive drafting off every step drafts."""
    from tokenmill.engine.spec.gain import PLAIN_MIN_SAMPLES

    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", speculative_method="ngram")
    drafter = llm.engine.drafter
    calls = []
    propose = drafter.proposer.propose
    drafter.proposer.propose = lambda seqs, k: calls.append(len(seqs)) or propose(seqs, k)
    prompt = [3, 4] * 40
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    decode_steps = sum(s.num_batched_tokens == s.num_scheduled + s.num_draft_tokens for s in llm.engine.stats)
    assert 0 < len(calls) <= decode_steps - PLAIN_MIN_SAMPLES  # the first steps measure plain decoding
    assert drafter.counters.num_accepted_tokens > 0
    fixed = LLM(str(tiny_dir), dtype="float32", device="cpu", speculative_method="ngram",
                speculative_adaptive=False)
    calls.clear()
    fixed.engine.drafter.proposer.propose = lambda seqs, k: calls.append(len(seqs)) or propose(seqs, k)
    fixed.generate([prompt], params, use_tqdm=False)
    decode_steps = sum(s.num_batched_tokens == s.num_scheduled + s.num_draft_tokens for s in fixed.engine.stats)
    assert len(calls) >= decode_steps - 1  # every decoding step but the one that finishes on max_tokens


def test_ngram_drafts_from_the_same_tenants_recent_outputs_only():
    """A sequence with no match of its own looks in what its tenant's last sequences produced;
    another tenant's text is never searched."""
    from tokenmill.engine.request import Sequence
    from tokenmill.engine.sampler import SamplingState

    def seq(ids, out, salt):
        s = Sequence("r", 0, ids, SamplingState.create(SamplingParams(), ids), detokenizer=None, cache_salt=salt)
        for t in out:
            s.append_token(t)
        return s

    p = NgramProposer(min_n=2, max_n=3)
    p.finished(seq([1, 2, 3], [40, 41, 42, 43, 44, 45], "tenant-a"))
    asking_a = seq([9, 8, 41, 42], [], "tenant-a")
    asking_b = seq([9, 8, 41, 42], [], "tenant-b")
    assert [d.token_ids for d in p.propose([asking_a, asking_b], [3, 3])] == [[43, 44, 45], []]
    p.finished(seq([1, 2, 3], [41, 42, 50], "tenant-b"))
    p.forget_history("tenant-a")  # one tenant's memory goes, the other's stays
    assert [d.token_ids for d in p.propose([asking_a, asking_b], [3, 3])] == [[], [50]]
    p.forget_history()
    assert [d.token_ids for d in p.propose([asking_a, asking_b], [3, 3])] == [[], []]


BF16_NEAR_TIE = 0.25
"""A bfloat16 near-tie: logprobs within four bfloat16 steps of a logit in [8, 16). bfloat16 logits
carry 8 significant bits, so the float32 rule (1e-3) is below their resolution, and prompt rows are
not computed alike in the two runs: chunked prefill splits prompts differently once sequences finish
at other steps, and the prefill and decode attention kernels round differently (measured: 48 of 64
identical, divergences 0 to 0.25 apart; running every verification as decode rows, the decode
kernel's arithmetic, leaves it at 48)."""


def test_bfloat16_divergences_are_near_ties():
    """SmolLM2 in bfloat16, the 64 prompts greedy: output with n-gram speculation equals speculation
    off, or differs first where the two tokens are a bfloat16 near-tie; at least 44 of 64 identical."""
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5)
    plain = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", max_num_seqs=16)
    spec = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", max_num_seqs=16,
               speculative={"method": "ngram", "adaptive": False})
    prompts = _prompts(plain.tokenizer)
    identical = compare(plain.generate(prompts, params), spec.generate(prompts, params), BF16_NEAR_TIE)
    assert identical >= 44, f"only {identical}/64 identical"
    assert spec.engine.drafter.counters.num_accepted_tokens > 0 and spec.engine.num_used_blocks == 0


def test_verification_reads_the_steps_logits_in_place():
    """A step's drafting sequences verify on the step's own logits rows: a view where their rows are a
    run (a 64-stream verification of Gemma 3 is 300 MB of logits: copying them, twice, took longer
    than the forward pass), one gather where plain rows sit between them."""
    from tokenmill.engine.sampler import take_rows

    logits = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    run = take_rows(logits, [1, 2, 3])
    assert run.data_ptr() == logits[1].data_ptr() and torch.equal(run, logits[1:4])
    assert torch.equal(take_rows(logits, [0, 2, 5]), logits[[0, 2, 5]]) and take_rows(logits, []).shape == (0, 4)
    assert take_rows(logits, list(range(6))).data_ptr() == logits.data_ptr()
