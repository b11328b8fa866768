"""The work of one step, per request, in FLOPs: what cost attribution splits a step's time by.

A step runs one forward pass over the tokens the scheduler picked. Its wall time is shared by
the requests in it in proportion to the arithmetic each one caused (``server/cost.py`` does the
sharing); this module counts that arithmetic, split by the kind of token it is owed to::

    per new token          matmuls of every layer          2 x matmul params     -> its own kind
    per sampled row        the LM head                     2 x vocab x hidden    -> completion
    per (query, key) pair  QK^T and PV of every layer      4 x layers x q heads x head dim
                                                                                 -> the KEY's kind

A key's kind is where that token came from: ``cached`` (prompt tokens served from the prefix
cache), ``prompt`` (prompt tokens computed) or ``completion`` (generated tokens). Charging
attention to the key is what "cached tokens counted at their real cost" means: a cached token
costs no matmuls, but every later query still reads its K and V, so it is not free either, and
it is not a prompt token recomputed (the 67% overcharge users report elsewhere). A recomputed
prompt (after a preemption) is charged again: the machine really did that work.

Sliding-window layers are counted as full ones (an overestimate of long contexts' attention on
Gemma 3), and a draft model's own work is folded into the step's time, shared like the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import ModelConfig


def matmul_params(cfg: ModelConfig, lm_head: bool = True) -> int:
    """Weights of the matmuls one token runs through: q, k, v, o and the gated MLP of every layer
    (MoE layers: the router, top_k experts and the shared one), and the LM head (``lm_head``)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    total = cfg.vocab_size * cfg.hidden_size if lm_head else 0
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):
            moe = cfg.moe
            total += attention + cfg.hidden_size * (3 * moe.top_k * moe.expert_intermediate_size
                                                    + 3 * moe.shared_expert_intermediate_size + moe.num_experts)
        else:
            total += attention + 3 * cfg.hidden_size * cfg.intermediate_size
    return total


@dataclass
class SequenceWork:
    """FLOPs one request caused in one step (its samples together), by the kind of token they are owed to."""

    request_id: str
    prompt: float = 0.0
    cached: float = 0.0
    completion: float = 0.0

    @property
    def total(self) -> float:
        return self.prompt + self.cached + self.completion


def _keys_below(lo: int, hi: int, x: int) -> int:
    """Sum over query positions p in [lo, hi) of min(p + 1, x): keys of index < x each query reads."""
    if x <= 0 or hi <= lo:
        return 0
    m = min(max(x, lo), hi)  # queries p < m read all p + 1 of their keys below x
    return (m * (m + 1) - lo * (lo + 1)) // 2 + x * (hi - m)


@dataclass(frozen=True)
class WorkModel:
    token_flops: int
    """2 x the matmul parameters of the layers (one token through them)."""
    logit_flops: int
    """2 x vocab x hidden: one sampled row through the LM head."""
    pair_flops: int
    """4 x layers x query heads x head dim: one query reading one key's K and V."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> WorkModel:
        return cls(2 * matmul_params(cfg, lm_head=False), 2 * cfg.vocab_size * cfg.hidden_size,
                   4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)

    def sequence(self, work: SequenceWork, start: int, num_new: int, prompt_len: int, cached: int,
                 sampled_rows: int) -> None:
        """Add to ``work`` the FLOPs of one sample computing positions ``[start, start + num_new)``
        of a sequence whose first ``prompt_len`` tokens are its prompt, the first ``cached`` of
        them from the prefix cache, with ``sampled_rows`` rows through the LM head."""
        end = start + num_new
        prompt_queries = max(0, min(end, prompt_len) - start)
        work.prompt += self.token_flops * prompt_queries
        work.completion += self.token_flops * (num_new - prompt_queries) + self.logit_flops * sampled_rows
        cached = min(max(cached, 0), prompt_len)
        below_cached = _keys_below(start, end, cached)
        below_prompt = _keys_below(start, end, prompt_len)
        work.cached += self.pair_flops * below_cached
        work.prompt += self.pair_flops * (below_prompt - below_cached)
        work.completion += self.pair_flops * (_keys_below(start, end, end) - below_prompt)
