"""Verification: which of a sequence's drafted tokens the target keeps, and the token after them.

A drafting sequence's step returns ``k + 1`` rows of target logits: row i is the target's next-token
distribution after the draft's first i tokens. Every row is processed exactly as plain decoding
would process it at that position (penalties counting the draft tokens before it, the min_tokens
mask, temperature, top-k, top-p, min-p: ``SamplingState.after``), then:

    greedy row, or a draft without probabilities (a point mass: n-gram, a seeded request's
    coupled draft):  row i's own token y_i (argmax, or the draw plain decoding would make with
                     that position's uniform); the draft is kept while d_i == y_i, then y_n follows.
                     Output = what decoding without a draft produces, token for token.
    random row with the draft's distributions q (a draft model, unseeded request): modified
                     rejection sampling. d_i is kept with probability min(1, p_i(d_i) / q_i(d_i));
                     the first one refused is replaced by a draw from norm(max(0, p_i - q_i)).
                     Every token is distributed as under p (Leviathan et al. 2023, Chen et al. 2023).
    all kept:        the last row's token y_k (plain sampling at that position) follows.

1 to k + 1 tokens per sequence and step. The rows of every verifying sequence of a step are
processed in one batched sampler call.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tokenmill.engine.logits_processors import sample
from tokenmill.engine.sampler import Sampler, SampleResult, SamplingState, argmax_rows


@dataclass(slots=True)
class Verification:
    """One sequence's outcome."""

    samples: list[SampleResult]
    """The tokens to append: the kept draft tokens, then one more."""
    num_accepted: int
    """Drafted tokens kept (``len(samples) - 1``)."""


def verify(sampler: Sampler, logits: torch.Tensor,
           drafts: list[tuple[SamplingState, list[int], torch.Tensor | None]]) -> list[Verification]:
    """``logits``: ``len(draft) + 1`` rows per entry of ``drafts`` (state, draft tokens, their
    draft distributions ``[len(draft), V]`` or None), concatenated in order."""
    states = [state.after(draft[:i]) for state, draft, _ in drafts for i in range(len(draft) + 1)]
    raw, scores = sampler.scores(logits, states)
    own = _own_tokens(sampler, scores, states)
    firsts = list(itertools.accumulate((len(d) + 1 for _, d, _ in drafts), initial=0))
    rejecting = [i for i, (state, _, q) in enumerate(drafts) if q is not None and not state.greedy and drafts[i][1]]
    replaced = _rejection(sampler, scores, states, drafts, rejecting, firsts) if rejecting else {}
    rejecting_set = set(rejecting)
    tokens_of, used = [], []
    for i, (state, draft, _) in enumerate(drafts):
        row, k = firsts[i], len(draft)
        if i in replaced:
            n, token = replaced[i]
        elif i in rejecting_set:  # every drafted token kept: the last row's own token follows
            n, token = k, own[row + k]
        else:
            n = 0
            while n < k and draft[n] == own[row + n]:
                n += 1
            token = own[row + n]
        tokens_of.append(draft[:n] + [token])
        used.extend(range(row, row + n + 1))
    flat = [t for tokens in tokens_of for t in tokens]
    samples = iter(sampler.results(raw, flat, [states[r] for r in used], used))
    return [Verification([next(samples) for _ in tokens], len(tokens) - 1) for tokens in tokens_of]


def _own_tokens(sampler: Sampler, scores: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """Each row's token as plain decoding picks it: argmax for greedy rows, the draw with the row's
    (stream 0) uniform for random ones."""
    tokens = argmax_rows(scores)
    random = [i for i, s in enumerate(states) if not s.greedy]
    if random:
        index = torch.tensor(random, device=scores.device)
        u = torch.tensor(sampler.uniforms([states[i] for i in random]), dtype=torch.float32, device=scores.device)
        tokens[index] = sample(scores.index_select(0, index), u)
    return tokens.tolist()


def _rejection(sampler: Sampler, scores: torch.Tensor, states: list[SamplingState],
               drafts: list[tuple[SamplingState, list[int], torch.Tensor | None]], rejecting: list[int],
               firsts: list[int]) -> dict[int, tuple[int, int]]:
    """Modified rejection sampling of the ``rejecting`` entries, all at once -> entry -> (drafted
    tokens kept, the token after them) for those that refused one; an entry absent kept its whole
    draft (the last row's own token follows)."""
    device = scores.device
    rows = [firsts[i] + j for i in rejecting for j in range(len(drafts[i][1]))]
    index = torch.tensor(rows, device=device)
    tokens = torch.tensor([t for i in rejecting for t in drafts[i][1]], device=device)
    p = scores.index_select(0, index).softmax(-1)
    q = torch.cat([drafts[i][2][:len(drafts[i][1])] for i in rejecting]).to(device, torch.float32)
    at = torch.arange(len(rows), device=device)
    u = torch.tensor(sampler.uniforms([states[r] for r in rows], 1), dtype=torch.float64, device=device)
    kept = (u * q[at, tokens].double() < p[at, tokens].double()).tolist()
    first_refused, flat = {}, 0
    for i in rejecting:
        k = len(drafts[i][1])
        n = next((j for j in range(k) if not kept[flat + j]), k)
        if n < k:
            first_refused[i] = (n, flat + n)
        flat += k
    if not first_refused:
        return {}
    picked = torch.tensor([f for _, f in first_refused.values()], device=device)
    residual = (p.index_select(0, picked) - q.index_select(0, picked)).clamp_(min=0)
    empty = residual.sum(-1) <= 0  # p == q up to rounding: nothing to correct, draw from p
    if bool(empty.any()):
        residual[empty] = p.index_select(0, picked)[empty]
    residual_u = sampler.uniforms([states[rows[f]] for _, f in first_refused.values()], 2)
    drawn = sample(residual.log(), torch.tensor(residual_u, dtype=torch.float32, device=device)).tolist()
    return {i: (n, token) for (i, (n, _)), token in zip(first_refused.items(), drawn)}
