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

from dataclasses import dataclass

import torch

from tokenmill.engine.logits_processors import sample
from tokenmill.engine.sampler import Sampler, SampleResult, SamplingState


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
    rejecting = [q is not None and not state.greedy for state, _, q in drafts]
    accept_u = sampler.uniforms(states, 1) if any(rejecting) else None
    residual_u = sampler.uniforms(states, 2) if any(rejecting) else None
    out, row = [], 0
    for (state, draft, q), rejects in zip(drafts, rejecting):
        k = len(draft)
        if rejects:
            tokens = _rejection(scores[row:row + k + 1], draft, q[:k], accept_u[row:row + k],
                                residual_u[row:row + k], own[row + k])
        else:
            n = 0
            while n < k and draft[n] == own[row + n]:
                n += 1
            tokens = draft[:n] + [own[row + n]]
        used = list(range(row, row + len(tokens)))
        samples = sampler.results(raw[used], tokens, [states[i] for i in used])
        out.append(Verification(samples, len(tokens) - 1))
        row += k + 1
    return out


def _own_tokens(sampler: Sampler, scores: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """Each row's token as plain decoding picks it: argmax for greedy rows, the draw with the row's
    (stream 0) uniform for random ones."""
    tokens = scores.argmax(-1)
    random = [i for i, s in enumerate(states) if not s.greedy]
    if random:
        index = torch.tensor(random, device=scores.device)
        u = torch.tensor(sampler.uniforms([states[i] for i in random]), dtype=torch.float32, device=scores.device)
        tokens[index] = sample(scores.index_select(0, index), u)
    return tokens.tolist()


def _rejection(scores: torch.Tensor, draft: list[int], q: torch.Tensor, accept_u: list[float],
               residual_u: list[float], bonus: int) -> list[int]:
    """Modified rejection sampling of one sequence: ``scores`` its k + 1 processed rows, ``q`` the
    draft's k distributions. -> the kept draft tokens and the token after them."""
    p = scores.softmax(-1)
    q = q.to(p.device, torch.float32)
    k = len(draft)
    index = torch.tensor(draft, device=p.device)
    rows = torch.arange(k, device=p.device)
    p_d, q_d = p[rows, index].tolist(), q[rows, index].tolist()
    for i in range(k):
        if accept_u[i] * q_d[i] < p_d[i]:
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if not bool(residual.sum() > 0):  # p == q up to rounding: nothing to correct
            residual = p[i]
        token = int(sample(residual.log().unsqueeze(0), torch.tensor([residual_u[i]], dtype=torch.float32,
                                                                      device=p.device))[0])
        return draft[:i] + [token]
    return draft + [bonus]
