"""Sliding-window perplexity, strided the way Hugging Face's perplexity guide does it.

Windows of ``context`` tokens start every ``stride`` tokens; each window scores only the tokens
the previous window did not, so every token but the first is scored exactly once, with up to
``context - stride`` tokens of left context that were themselves scored earlier:

    ids      t0 t1 t2 t3 t4 t5 t6 t7 t8 t9          context 6, stride 3
    window 1 [t0 t1 t2 t3 t4 t5]                    scores t1..t5
    window 2          [t3 t4 t5 t6 t7 t8]           scores t6..t8
    window 3                   [t6 t7 t8 t9]        scores t9

perplexity = exp(sum of the scored tokens' negative log-likelihoods / number scored). As in the
HF guide, a window never scores its own first token (nothing predicts it), so with
``stride == context`` the first token of every window goes unscored.

Each window runs from scratch through a :meth:`ModelRunner.for_sequences
<tokenmill.engine.model_runner.ModelRunner.for_sequences>` runner: the model's own forward over a
throwaway paged KV cache, the same code path as generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from tokenmill.engine.config import CacheConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.errors import InvalidParameterError
from tokenmill.models.base import CausalLM


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    tokens: int
    """Tokens scored (all but the first of the evaluated text)."""
    nll: float
    """Mean negative log-likelihood per scored token, in nats."""
    windows: int


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index) of each window over n tokens, HF-style."""
    if context <= 0 or not 0 < stride <= context:
        raise InvalidParameterError(f"need 0 < stride <= context, got context {context}, stride {stride}")
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n:
            break
    return out


@torch.inference_mode()
def perplexity(model: CausalLM, ids: list[int], context: int = 512, stride: int = 256,
               progress: bool = True, kv_cache_dtype: str = "auto",
               block_size: int = CacheConfig.block_size) -> PerplexityResult:
    """Perplexity of ``model`` on the token sequence ``ids`` (at least 2 tokens).

    ``kv_cache_dtype`` ``int8``/``fp8``: attention reads keys and values as a quantized cache
    stores them (every token, the window's own included), so the figure is the quality of
    generating with that cache. ``block_size``: tokens per block of the paged KV cache it runs over."""
    if len(ids) < 2:
        raise InvalidParameterError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    runner = ModelRunner.for_sequences(model, min(context, len(ids)), block_size, kv_cache_dtype)
    total, count = 0.0, 0
    spans = windows(len(ids), context, stride)
    for begin, end, first in tqdm(spans, desc="perplexity", disable=not progress, unit="window"):
        hidden = runner.hidden(ids[begin:end])
        logits = model.compute_logits(hidden[first - 1 - begin:end - 1 - begin])  # predict first..end-1
        targets = torch.tensor(ids[first:end], device=logits.device)
        total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").double().item()
        count += end - first
    nll = total / count
    return PerplexityResult(float(torch.tensor(nll).exp()), count, nll, len(spans))
