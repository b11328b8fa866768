"""Batched logits transforms used by the sampler: penalties, filters, and the final draw.

Every function takes float32 logits ``[B, V]`` plus one value per row, so a batch
whose rows have different parameters is handled in one pass. Removed tokens are
set to ``-inf``; kept tokens keep their exact values, so a row's result depends
only on its own logits and parameters, never on the other rows of the batch.
"""

from __future__ import annotations

import itertools
import math

import torch

_FIRST_TOP_P_CANDIDATES = 256
"""Top-p first looks among this many best tokens (see apply_top_k_top_p)."""


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list: ``[len(token_ids), V]`` float32."""
    counts = torch.zeros(len(token_ids), vocab_size, device=device)
    lengths = torch.tensor([len(ids) for ids in token_ids], device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    cols = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long, device=device)
    counts.index_put_((rows, cols), torch.ones_like(cols, dtype=counts.dtype), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """Penalize repeated tokens in place (vLLM semantics); ``repetition``, ``frequency``, ``presence``: ``[B]``.

    Repetition (CTRL): a token seen in the prompt or the output has its logit divided by the
    penalty when positive, multiplied when not. Then (OpenAI) each output token's logit drops
    by ``count * frequency + (count > 0) * presence``.
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_ids, vocab_size, logits.device)
    if bool((repetition != 1).any()):
        seen = (token_counts(prompt_ids, vocab_size, logits.device) > 0) | (output_counts > 0)
        penalty = repetition.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency.unsqueeze(1) * output_counts + presence.unsqueeze(1) * (output_counts > 0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top-k tokens, then the smallest best-first prefix of them whose mass reaches top_p.

    ``top_k``: ``[B]`` int64 in ``[1, V]`` (V disables); ``top_p``: ``[B]`` in ``(0, 1]`` (1 disables).
    Top-p is measured on the distribution renormalized after top-k. A token is kept when
    the mass of the tokens ranked above it is below top_p, so the best token always stays.
    Ties are ranked as torch.topk orders them.

    Instead of sorting the whole vocabulary, this looks at the best K candidates (torch.topk):
    K covers every row's top-k, and a top-p row whose K candidates hold at least top_p of
    the mass has its whole kept set among them. Rows not covered retry with 16x more
    candidates, and go to a full sort (K = V) once K would pass V / 4. Peaked (real model)
    distributions finish at K = 256 or 4096; a near-uniform one pays the full sort.
    Returns a new tensor; the input is unchanged.
    """
    batch, vocab_size = logits.shape
    out = torch.full_like(logits, -math.inf)
    rows = torch.arange(batch, device=logits.device)
    k_cut = int(top_k.masked_fill(top_k >= vocab_size, 0).max())
    num = min(vocab_size, max(k_cut, _FIRST_TOP_P_CANDIDATES if bool((top_p < 1).any()) else 1))
    while rows.numel():
        values, ids, covered = _filter_candidates(logits.index_select(0, rows), top_k.index_select(0, rows),
                                                  top_p.index_select(0, rows), num)
        done = rows[covered]
        out.index_put_((done.unsqueeze(1).expand(-1, num), ids[covered]), values[covered])
        rows = rows[~covered]
        num = vocab_size if num * 64 > vocab_size else num * 16
    return out


def _filter_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k/top-p among the ``num`` best tokens: (kept values with -inf for dropped, ids, covered) per row."""
    values, ids = logits.topk(num, dim=-1)  # [B, num], best first
    ranks = torch.arange(num, device=logits.device)
    values = values.masked_fill(ranks >= top_k.unsqueeze(1), -math.inf)
    k_inside = top_k <= num
    log_norm = values.logsumexp(-1)
    if not bool(k_inside.all()):
        log_norm = torch.where(k_inside, log_norm, logits.logsumexp(-1))
    probs = (values - log_norm.unsqueeze(1)).exp()
    mass_above = probs.cumsum(-1) - probs
    p = top_p.unsqueeze(1)
    values = values.masked_fill((mass_above >= p) & (p < 1), -math.inf)
    covered = k_inside | (probs.sum(-1) >= top_p)
    return values, ids, covered


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens whose probability is below ``min_p`` (``[B]``) times the row's best.

    Compared in log space: keep ``logit >= max_logit + log(min_p)``; min_p = 0 keeps all.
    Renormalizing after top-k/top-p scales every kept probability alike, so min-p gives
    the same result before or after them.
    """
    threshold = logits.amax(-1) + min_p.log()
    logits.masked_fill_(logits < threshold.unsqueeze(1), -math.inf)


def sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``softmax(logits)`` by inverting the CDF at ``uniforms`` ``[B]`` in [0, 1).

    One uniform per row is all the randomness a draw consumes, so a seeded row's token depends
    only on its generator and its logits. Tokens with zero probability (masked) are never
    drawn: the search returns the first token whose cumulative sum exceeds the target, and
    a zero-probability token does not raise the sum. (A row with no finite logit has no
    valid token; it gets the last id rather than one past the vocabulary.)
    """
    cdf = logits.softmax(-1).cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
