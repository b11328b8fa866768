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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from tokenmill.attention.paged import PagedAttentionMetadata, PagedKVCache
from tokenmill.config import layer_groups
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


class SequenceRunner:
    """Runs one whole sequence of up to ``max_len`` tokens through the model's own forward, over a
    throwaway paged KV cache whose blocks 1, 2, ... hold it (block 0 is the null block)."""

    def __init__(self, model: CausalLM, max_len: int, block_size: int = 16, kv_cache_dtype: str = "auto") -> None:
        self.model, self.block_size = model, block_size
        cfg, weight = model.config, model.embed.weight
        self.device = weight.device
        groups, self.windows = layer_groups(cfg)
        num_blocks = -(-max_len // block_size) + 1
        self.table = list(range(1, num_blocks))
        self.max_len = max_len
        self.cache = PagedKVCache(num_blocks, block_size, groups, cfg.num_kv_heads, cfg.head_dim, weight.dtype,
                                  self.device, kv_cache_dtype)

    def metadata(self, n: int) -> PagedAttentionMetadata:
        """The step metadata of a whole sequence of ``n`` tokens (positions 0..n-1)."""
        if not 0 < n <= self.max_len:
            raise InvalidParameterError(f"sequence of {n} tokens; this runner takes 1..{self.max_len}")
        return PagedAttentionMetadata.build([n], [n], [[self.table]] * len(self.windows), self.block_size,
                                            self.device)

    @torch.inference_mode()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """Final hidden states [len(ids), hidden] (before the final norm)."""
        meta = self.metadata(len(ids))
        return self.model(torch.tensor(ids, device=self.device), meta.positions(self.device), self.cache, meta)


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
               progress: bool = True, kv_cache_dtype: str = "auto") -> PerplexityResult:
    """Perplexity of ``model`` on the token sequence ``ids`` (at least 2 tokens).

    ``kv_cache_dtype`` ``int8``/``fp8``: attention reads keys and values as a quantized cache
    stores them (every token, the window's own included), so the figure is the quality of
    generating with that cache."""
    if len(ids) < 2:
        raise InvalidParameterError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    runner = SequenceRunner(model, min(context, len(ids)), kv_cache_dtype=kv_cache_dtype)
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
