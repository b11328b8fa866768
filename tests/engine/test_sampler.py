"""The batched sampler: distributions, seeds, penalties, min_tokens, logprobs, prompt logprobs.

Distribution tests draw many samples in one call (a large batch of identical rows) and
compare frequencies with the filtered distribution computed here, independently, in numpy.
Every test uses fixed seeds, so the chi-square checks are deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenmill.engine import sampler as sampler_module
from tokenmill.engine.logits_processors import apply_penalties, apply_top_k_top_p
from tokenmill.engine.sampler import Sampler, SamplingState, compute_prompt_logprobs
from tokenmill.sampling_params import SamplingParams

LOGITS = [2.0, 1.6, 1.1, 0.7, 0.2, -0.2, -0.9, -1.4, -2.2, -math.inf]
"""Fixed logits of a 10-token vocabulary; the last token is masked."""


def state(prompt: list[int] | None = None, **params) -> SamplingState:
    return SamplingState.create(SamplingParams(max_tokens=None, **params), prompt or [])


def reference_probs(logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> np.ndarray:
    """The filtered distribution, written plainly: sort, cut, renormalize at each step."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.isfinite(x)
    if top_k:
        keep[order[top_k:]] = False
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    mass_above = 0.0
    for token in order:
        if mass_above >= top_p:
            keep[token] = False
        mass_above += probs[token]
    probs = np.where(keep, probs, 0.0)
    keep &= probs >= min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def draw(logits: list[float], count: int, seed: int = 0, **params) -> np.ndarray:
    """``count`` samples of one row's distribution, drawn in a single batched call."""
    row = torch.tensor(logits, dtype=torch.float32)
    results = Sampler(len(logits), seed=seed)(row.repeat(count, 1), [state(**params)] * count)
    return np.array([r.token_id for r in results])


@pytest.mark.parametrize("params", [
    {"temperature": 0.5},
    {"temperature": 1.5},
    {"top_k": 3},
    {"top_p": 0.8},
    {"min_p": 0.1},
    {"temperature": 0.8, "top_k": 6, "top_p": 0.9, "min_p": 0.25},
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_sampled_frequencies_match_the_filtered_distribution(params: dict) -> None:
    count = 40_000
    expected = reference_probs(LOGITS, **params)
    counts = np.bincount(draw(LOGITS, count, **params), minlength=len(LOGITS))
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was sampled"
    assert chisquare(counts[kept], count * expected[kept]).pvalue > 1e-3


def test_top_k_top_p_matches_a_full_sort_on_flat_and_peaked_rows() -> None:
    """The candidate shortcut (top 256, then 4096, then all) keeps exactly what a full sort keeps."""
    gen = torch.Generator().manual_seed(0)
    vocab = 5000
    scales = [0.1, 0.5, 2.0, 6.0, 0.3, 3.0]
    logits = torch.stack([torch.randn(vocab, generator=gen) * s for s in scales])
    top_k = torch.tensor([vocab, vocab, 40, vocab, 3000, 1])
    top_p = torch.tensor([0.9, 0.95, 0.8, 0.5, 0.99, 0.3])
    kept = torch.isfinite(apply_top_k_top_p(logits, top_k, top_p))
    only_top_p = torch.tensor([0, 1, 3])  # without a top-k row the search starts at 256 candidates
    kept[only_top_p] = torch.isfinite(apply_top_k_top_p(logits[only_top_p], top_k[only_top_p], top_p[only_top_p]))
    for row in range(len(scales)):
        expected = reference_probs(logits[row].tolist(), top_k=int(top_k[row]) % vocab, top_p=float(top_p[row]))
        assert kept[row].tolist() == (expected > 0).tolist(), f"row {row}"


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    logits[5, [7, 3, 30]] = 100.0
    results = Sampler(50)(logits, [state(temperature=0) for _ in range(6)])
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()
    assert results[5].token_id == 3


@pytest.mark.parametrize("params", [{"top_p": 1e-6}, {"min_p": 1.0}, {"temperature": 1e-5}, {"top_k": 1},
                                    {"temperature": 1e-300, "top_k": 5}])
def test_filters_that_leave_one_token_pick_the_best(params: dict) -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(2)) * 3
    logits[:, ::2] = -math.inf
    results = Sampler(300, seed=3)(logits, [state(**params) for _ in range(64)])
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()


def test_masked_tokens_are_never_sampled() -> None:
    logits = torch.zeros(2000, 64)
    logits[:, 1::2] = -math.inf
    for params in ({}, {"top_p": 0.9}, {"top_k": 40, "temperature": 2.0}, {"min_p": 0.5}):
        tokens = draw(logits[0].tolist(), 2000, **params)
        assert (tokens % 2 == 0).all(), params


def test_top_k_beyond_the_vocabulary_changes_nothing() -> None:
    assert (draw(LOGITS, 500, seed=5, top_k=1000) == draw(LOGITS, 500, seed=5)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_sample_like_their_float32_values(dtype: torch.dtype) -> None:
    logits = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    params = [{"temperature": 0}, {"top_p": 0.8, "seed": 1}, {"top_k": 20, "seed": 2, "logprobs": 2}, {"seed": 3}]
    low = Sampler(1000)(logits, [state(**p) for p in params])
    high = Sampler(1000)(logits.float(), [state(**p) for p in params])
    assert low == high


def seeded_tokens(position: int, others: list[dict], steps: int, seed: int = 7) -> list[int]:
    """The tokens a seeded top-p row draws at ``position`` in a batch with ``others``."""
    sampler = Sampler(50, seed=123)
    row_gen, other_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(position)
    states = [state(**p) for p in others]
    states.insert(position, state(seed=seed, top_p=0.95, temperature=1.3))
    tokens = []
    for _ in range(steps):
        logits = torch.randn(len(states), 50, generator=other_gen)
        logits[position] = torch.randn(50, generator=row_gen)
        results = sampler(logits, states)
        tokens.append(results[position].token_id)
        for s, r in zip(states, results):
            s.output_token_ids.append(r.token_id)
    return tokens


def test_a_seeded_row_draws_the_same_tokens_in_any_batch() -> None:
    others = [{}, {"seed": 99, "top_k": 5}, {"temperature": 0}, {"top_p": 0.5, "repetition_penalty": 1.3}]
    alone = seeded_tokens(0, [], steps=20)
    assert seeded_tokens(0, others, steps=20) == alone
    assert seeded_tokens(2, others, steps=20) == alone
    assert seeded_tokens(4, others[::-1], steps=20) == alone
    assert seeded_tokens(0, [], steps=20, seed=8) != alone


def naive_penalties(logits: list[float], prompt: list[int], output: list[int], repetition: float,
                    frequency: float, presence: float) -> list[float]:
    out = list(logits)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= output.count(token) * frequency + presence
    return out


def test_penalties_match_a_naive_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=gen) * 3
    prompts, outputs = [[1, 2, 2, 30], [], [5]], [[2, 7, 7, 7, 39], [0, 0, 1], []]
    settings = [(1.3, 0.5, 0.2), (0.8, -0.4, 1.5), (2.0, 2.0, -2.0)]
    penalized = logits.clone()
    apply_penalties(penalized, prompts, outputs, *(torch.tensor(col) for col in zip(*settings)))
    for row, (rep, freq, pres) in enumerate(settings):
        expected = naive_penalties(logits[row].tolist(), prompts[row], outputs[row], rep, freq, pres)
        assert penalized[row].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_penalties_steer_greedy_decoding() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, -1.0], [3.0, 2.9, 1.0, -1.0], [-0.5, -0.6, -3.0, -4.0]])
    states = [state([0], temperature=0, repetition_penalty=1.2), state(temperature=0, frequency_penalty=0.1),
              state([0], temperature=0, repetition_penalty=1.5)]
    states[1].output_token_ids = [0, 0]
    assert [r.token_id for r in Sampler(4)(logits, states)] == [1, 1, 1]
    assert [r.token_id for r in Sampler(4)(logits, [state(temperature=0)] * 3)] == [0, 0, 0]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    blocked = SamplingState.create(params, [1], eos_token_ids=[2])
    ignoring = SamplingState.create(params.clone(ignore_eos=True), [1], eos_token_ids=[2])
    assert blocked.stop_ids == {2, 5} and ignoring.stop_ids == {5}
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 1.0, 0.0]])
    tokens = []
    for _ in range(5):
        tokens.append(Sampler(8)(logits, [blocked])[0].token_id)
        blocked.output_token_ids.append(tokens[-1])
    assert tokens == [6, 6, 6, 2, 2]


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = (torch.randn(4, 200, generator=torch.Generator().manual_seed(6)) * 2).to(torch.bfloat16)
    states = [state([3], temperature=0, logprobs=0, repetition_penalty=2.0),
              state(top_p=0.9, temperature=0.5, logprobs=5, seed=1), state(), state(top_k=3, logprobs=20)]
    results = Sampler(200, seed=0)(logits, states)
    expected = logits.float().log_softmax(-1)
    for row, (result, s) in enumerate(zip(results, states)):
        if s.params.logprobs is None:
            assert result.logprob is None and result.top_logprobs is None
            continue
        assert result.logprob == pytest.approx(expected[row, result.token_id].item(), abs=1e-6)
        values, ids = expected[row].topk(s.params.logprobs)
        assert [t for t, _ in result.top_logprobs] == ids.tolist()
        assert [v for _, v in result.top_logprobs] == pytest.approx(values.tolist(), abs=1e-6)
        assert [v for _, v in result.top_logprobs] == sorted((v for _, v in result.top_logprobs), reverse=True)


MIXED = [{"temperature": 0}, {"temperature": 0, "repetition_penalty": 1.5, "logprobs": 3}, {"top_k": 5, "seed": 1},
         {"top_p": 0.8, "seed": 2, "temperature": 0.7}, {"min_p": 0.2, "seed": 3},
         {"top_p": 0.9, "top_k": 20, "frequency_penalty": 1.0, "presence_penalty": 0.5, "seed": 4, "logprobs": 1}]


def test_a_mixed_batch_equals_each_row_sampled_alone() -> None:
    gen = torch.Generator().manual_seed(8)
    steps = [torch.randn(len(MIXED), 100, generator=gen) * 3 for _ in range(8)]
    batch = [state([1, 2, 3], **p) for p in MIXED]
    together = []
    for logits in steps:
        together.append(Sampler(100)(logits, batch))
        for s, r in zip(batch, together[-1]):
            s.output_token_ids.append(r.token_id)
    for row, params in enumerate(MIXED):
        alone = state([1, 2, 3], **params)
        for step, logits in enumerate(steps):
            result = Sampler(100)(logits[row:row + 1], [alone])[0]
            assert result == together[step][row], (row, step)
            alone.output_token_ids.append(result.token_id)


def test_padding_columns_past_the_vocabulary_are_ignored() -> None:
    logits = torch.zeros(3, 16)
    logits[:, 10:] = 50.0
    results = Sampler(10)(logits, [state(temperature=0), state(top_p=0.5), state(logprobs=2)])
    assert all(r.token_id < 10 for r in results)
    assert results[2].logprob == pytest.approx(-math.log(10))
    with pytest.raises(ValueError):
        Sampler(20)(logits, [state()] * 3)


@pytest.mark.parametrize("chunk", [None, 500])
def test_prompt_logprobs_match_a_direct_computation(chunk: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk is not None:
        monkeypatch.setattr(sampler_module, "_PROMPT_LOGPROB_CHUNK", chunk)
    logits = torch.randn(9, 100, generator=torch.Generator().manual_seed(9)).to(torch.float16)
    prompt = [5, 17, 3, 99, 0, 17, 42, 8, 1]
    entries = compute_prompt_logprobs(logits, prompt, top_n=4)
    assert len(entries) == len(prompt) and entries[0] is None
    assert compute_prompt_logprobs(logits[:-1], prompt, top_n=4) == entries
    for i in range(1, len(prompt)):
        row = logits[i - 1].double().numpy()
        expected = row - row.max() - np.log(np.exp(row - row.max()).sum())
        best = np.argsort(-expected, kind="stable")[:4]
        assert entries[i]["logprob"] == pytest.approx(expected[prompt[i]], abs=1e-5)
        assert [t for t, _ in entries[i]["top"]] == best.tolist()
        assert [v for _, v in entries[i]["top"]] == pytest.approx(expected[best].tolist(), abs=1e-5)
    assert compute_prompt_logprobs(logits, [7], top_n=2) == [None]
