"""Which weights a pruning method zeroes: masks from scores, exactly as many as asked.

    prunable_parts(model)          every linear layer of the blocks, fused ones split into their
                                   projections (q, k, v of ``attn.qkv``; gate, up of ``mlp.gate_up``)
    row_mask(scores, fraction)     per output row, the ``floor(fraction * K)`` lowest scores pruned
    nm_mask(scores, n, m)          in every group of m consecutive inputs of a row, the m - n lowest
    lowest_mask(scores, count)     the ``count`` lowest of a whole tensor

A mask is a bool tensor shaped like the weight, True where the weight is kept. Scores of weights
already zero are never above those of live ones for the scores used here (|w| times something
non-negative), and :func:`row_mask` / :func:`nm_mask` break ties towards zeros, so a schedule's
later rounds keep earlier rounds' zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.errors import InvalidParameterError
from tokenmill.models.base import CausalLM


@dataclass(frozen=True)
class Part:
    """One projection: rows ``rows`` of the weight of ``module`` (a fused layer holds several)."""

    name: str
    """``layers.3.attn.q``, ``layers.3.mlp.down``: the unfused (HF) projection."""
    module: nn.Linear
    rows: slice

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight[self.rows]


def prunable_parts(model: CausalLM) -> list[Part]:
    """Every projection of the blocks' linear layers, in order (embedding and LM head excluded:
    pruning the vocabulary matrix costs quality for bytes that decode reads for every token anyway)."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    parts = []
    for i, block in enumerate(model.layers):
        attn, mlp = block.attn, block.mlp
        for name, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
            parts.append(Part(f"layers.{i}.attn.{name}", attn.qkv, slice(start, start + size)))
        parts.append(Part(f"layers.{i}.attn.o", attn.o, slice(0, attn.o.out_features)))
        inner = mlp.gate_up.out_features // 2
        parts.append(Part(f"layers.{i}.mlp.gate", mlp.gate_up, slice(0, inner)))
        parts.append(Part(f"layers.{i}.mlp.up", mlp.gate_up, slice(inner, 2 * inner)))
        parts.append(Part(f"layers.{i}.mlp.down", mlp.down, slice(0, mlp.down.out_features)))
    for part in parts:
        if type(part.module) is not nn.Linear:
            raise InvalidParameterError(f"prune: {part.name} is a {type(part.module).__name__}, not a float linear "
                                        "layer; prune the float model, then quantize")
    return parts


def lowest_mask(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Keep-mask of ``scores``' shape with exactly its ``count`` lowest entries False."""
    keep = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if count > 0:
        keep[torch.topk(scores.reshape(-1).float(), count, largest=False, sorted=False).indices] = False
    return keep.reshape(scores.shape)


def row_mask(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep-mask of scores [N, K]: in every row exactly ``floor(fraction * K)`` entries pruned, the lowest."""
    k = int(fraction * scores.shape[1])
    keep = torch.ones_like(scores, dtype=torch.bool)
    if k > 0:
        keep.scatter_(1, torch.topk(scores.float(), k, dim=1, largest=False, sorted=False).indices, False)
    return keep


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep-mask of scores [N, K] with exactly n kept in each group of m consecutive columns of a row."""
    rows, cols = scores.shape
    if cols % m:
        raise InvalidParameterError(f"an {n}:{m} pattern needs the input width ({cols}) to be a multiple of {m}")
    groups = scores.float().reshape(rows, cols // m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, torch.topk(groups, n, dim=2).indices, True)
    return keep.reshape(rows, cols)


def pattern_mask(scores: torch.Tensor, fraction: float, pattern: tuple[int, int] | None) -> torch.Tensor:
    """:func:`nm_mask` for an N:M pattern, else :func:`row_mask`."""
    return nm_mask(scores, *pattern) if pattern else row_mask(scores, fraction)


@torch.no_grad()
def apply_mask(part: Part, keep: torch.Tensor) -> None:
    """Zero the weights of ``part`` where ``keep`` is False."""
    part.module.weight[part.rows] *= keep.to(part.module.weight.dtype)


def sparsity_of(model: CausalLM) -> dict[str, float]:
    """Fraction of zero weights of each prunable projection."""
    return {p.name: float((p.weight == 0).float().mean()) for p in prunable_parts(model)}


def holds_pattern(weight: torch.Tensor, n: int, m: int) -> bool:
    """Whether every group of m consecutive inputs of every row has at most n nonzeros."""
    rows, cols = weight.shape
    return cols % m == 0 and bool(((weight != 0).reshape(rows, cols // m, m).sum(-1) <= n).all())
