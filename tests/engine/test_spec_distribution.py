"""Speculative sampling keeps the output distribution: the engine's own drafting (a draft model's
guess, DraftModelProposer) and verification (spec/verify.py) with tiny random target and draft
models on an 8-token vocabulary, 100,000 draws for each sampling processor, against plain sampling
of the same target (two-sample chi-square on the first two generated tokens, p > 0.001).

The draft is the target with its weights perturbed: close enough that most guesses are kept, far
enough that many are refused, so both the acceptance test and the residual draw are exercised.
Fixed seeds: the test is deterministic.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from tests.model_utils import prompt_logits
from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.engine.sampler import Sampler, SamplingState
from tokenmill.engine.spec.draft_model import DraftModelProposer
from tokenmill.engine.spec.verify import verify
from tokenmill.models.registry import MODEL_CLASSES
from tokenmill.sampling_params import SamplingParams

V = 8
PROMPT = [1, 2, 3]
EOS = 5
DRAWS = 100_000


def _model(seed: int, base=None, noise: float = 0.0):
    cfg = ModelConfig(architecture="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    model = MODEL_CLASSES["llama"](cfg, PagedAttentionBackend())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if base is not None:
                p.copy_(dict(base.named_parameters())[name] + noise * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "embed" in name else 0.2))
    return model.eval()


@pytest.fixture(scope="module")
def models():
    """The context logits of the target and of its perturbed copy, the draft."""
    target = _model(0)
    draft = _model(1, base=target, noise=0.08)
    return _context_logits(target), _context_logits(draft)


def _context_logits(model) -> dict[tuple[int, ...], torch.Tensor]:
    """Logits after PROMPT, PROMPT + [a] and PROMPT + [a, b], for every a, b."""
    out: dict[tuple[int, ...], torch.Tensor] = {}
    for a in range(V):
        for b in range(V):
            rows = prompt_logits(model, PROMPT + [a, b])
            out[()], out[(a,)], out[(a, b)] = rows[len(PROMPT) - 1], rows[len(PROMPT)], rows[len(PROMPT) + 1]
    return out


def _rows(table, contexts) -> torch.Tensor:
    return torch.stack([table[tuple(c)] for c in contexts])


def _states(params: SamplingParams, n: int) -> list[SamplingState]:
    """n sequences at the same point: one state serves all (rows draw independently; unseeded)."""
    return [SamplingState.create(params, PROMPT, eos_token_ids=[EOS])] * n


def _plain(target, params: SamplingParams, n: int, seed: int) -> np.ndarray:
    """(first, second) generated token of n sequences sampled without speculation."""
    sampler, states = Sampler(V, seed=seed), _states(params, n)
    first = [r.token_id for r in sampler(_rows(target, [()] * n), states)]
    second = [r.token_id for r in sampler(_rows(target, [(a,) for a in first]), [s.after([a]) for s, a in
                                                                                zip(states, first)])]
    return np.array([first, second]).T


def _speculative(target, draft, params: SamplingParams, n: int, seed: int) -> tuple[np.ndarray, float]:
    """The same through a 2-token draft and its verification; a second token the verification did
    not give comes from the next (plain) step. -> tokens, fraction of drafted tokens kept."""
    sampler, states = Sampler(V, seed=seed), _states(params, n)
    proposer = DraftModelProposer.__new__(DraftModelProposer)  # its guessing, without a KV pool to run
    proposer.sampler, proposer.generator = sampler, torch.Generator().manual_seed(seed + 1)
    seqs = [SimpleNamespace(sampling=s) for s in states]
    guesses, probs = [[] for _ in range(n)], [[] for _ in range(n)]
    proposer._guess(seqs, guesses, probs, _rows(draft, [()] * n))
    proposer._guess(seqs, guesses, probs, _rows(draft, [(g[0],) for g in guesses]))
    contexts = [c for g in guesses for c in ((), (g[0],), (g[0], g[1]))]
    outcomes = verify(sampler, _rows(target, contexts), [(s, g, torch.stack(q)) for s, g, q in
                                                          zip(states, guesses, probs)])
    first = [o.samples[0].token_id for o in outcomes]
    missing = [i for i, o in enumerate(outcomes) if len(o.samples) < 2]
    second = [o.samples[1].token_id if len(o.samples) > 1 else -1 for o in outcomes]
    drawn = sampler(_rows(target, [(first[i],) for i in missing]), [states[i].after([first[i]]) for i in missing]) \
        if missing else []
    for i, r in zip(missing, drawn):
        second[i] = r.token_id
    kept = sum(o.num_accepted for o in outcomes) / (2 * n)
    return np.array([first, second]).T, kept


PROCESSORS = [
    {},
    {"temperature": 0.6},
    {"temperature": 1.4, "top_k": 3},
    {"top_p": 0.7},
    {"min_p": 0.15},
    {"repetition_penalty": 1.6, "presence_penalty": 0.5, "frequency_penalty": 0.4},
    {"min_tokens": 2},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3},
]


@pytest.mark.parametrize("params", PROCESSORS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "plain")
def test_speculative_sampling_draws_what_plain_sampling_draws(models, params):
    target, draft = models
    sp = SamplingParams(max_tokens=None, **params)
    plain = _plain(target, sp, DRAWS, seed=11)
    spec, kept = _speculative(target, draft, sp, DRAWS, seed=12)
    assert 0.2 < kept < 0.97, f"{kept:.3f} of the drafted tokens kept: one branch of the verification is idle"
    cells = lambda pairs: np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)  # noqa: E731
    table = np.stack([cells(plain), cells(spec)])
    seen = table.sum(0) > 0
    if params.get("min_tokens"):  # the stop token is masked in both positions
        assert table[:, EOS * V:(EOS + 1) * V].sum() == 0 and table[:, EOS::V].sum() == 0
    assert chi2_contingency(table[:, seen]).pvalue > 1e-3


def test_the_tokens_a_draft_proposes_are_drawn_from_the_probabilities_it_reports(models):
    """The q handed to verification is the distribution the guess came from (else rejection
    sampling corrects toward the wrong thing): guesses of 100,000 rows against q."""
    _, draft = models
    sampler = Sampler(V, seed=3)
    proposer = DraftModelProposer.__new__(DraftModelProposer)
    proposer.sampler, proposer.generator = sampler, torch.Generator().manual_seed(4)
    states = _states(SamplingParams(max_tokens=None, temperature=0.9, top_k=4), DRAWS)
    guesses, probs = [[] for _ in range(DRAWS)], [[] for _ in range(DRAWS)]
    proposer._guess([SimpleNamespace(sampling=s) for s in states], guesses, probs, _rows(draft, [()] * DRAWS))
    q = probs[0][0].double().numpy()
    assert (q > 0).sum() == 4 and np.allclose(probs[-1][0].numpy(), q)
    counts = np.bincount([g[0] for g in guesses], minlength=V)
    from scipy.stats import chisquare
    assert counts[q == 0].sum() == 0
    expected = DRAWS * q[q > 0] / q[q > 0].sum()
    assert chisquare(counts[q > 0], expected * counts.sum() / expected.sum()).pvalue > 1e-3
