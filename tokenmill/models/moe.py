"""Mixture-of-experts MLP: a router picks ``top_k`` experts per token, each expert a gated MLP.

    x [T, hidden] -> router logits [T, experts] -> scores (softmax or sigmoid, float32)
      -> top-k (weights, expert ids), renormalised where the architecture says so
      -> (capacity mode) assignments past an expert's capacity dropped
      -> assignments grouped by expert: one gathered [rows, hidden] block per active expert,
         its MLP run once over the block (its linears: bf16 / int8 / int4 kernels, as any linear)
      -> each row (widened to float32) scaled by its weight and added back in token order, experts
         in ascending order, into a float32 sum
      (+ the shared expert, scaled by sigmoid(shared_gate(x)) where there is a gate), then
      rounded once to the model dtype

No-drop mode (the default) computes what HF transformers does. With a capacity factor c
(Switch Transformer), each expert takes at most ceil(c * T * top_k / experts) assignments of the
step; first choices are served before second choices, then tokens in order (GShard's priority).
A dropped assignment adds nothing: the token's residual stream carries it past the layer, and
:class:`ExpertStats` counts it. Drops depend on what else is in the batch, so only no-drop
mode is batch invariant.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import MoESpec
from tokenmill.models.layers import GatedMLP, prepack


class Gate(nn.Module):
    """A small projection kept in float32 (a router's logits, a shared expert's gate):
    ``x @ weight.T`` computed in float32, returned as float32. Not an nn.Linear, so quantization
    leaves it alone, as every MoE recipe does."""

    def __init__(self, hidden: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


def route(logits: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, experts] -> (top-k weights [T, k] float32, expert ids [T, k] int64,
    scores [T, experts] float32)."""
    scores = logits.float().softmax(-1) if spec.scoring == "softmax" else logits.float().sigmoid()
    weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids, scores


def capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Assignments one expert takes in a step of ``tokens`` tokens (Switch Transformer)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def kept_assignments(ids: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Which of the assignments ``ids`` [T, k] fit their expert's capacity ``cap``: bool [T, k].
    Priority: every token's first choice before any second choice, then tokens in order."""
    by_rank = ids.t().reshape(-1)  # rank-major: all first choices, then all second choices ...
    onehot = F.one_hot(by_rank, num_experts)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # how many earlier assignments went to the same expert
    return (place < cap).view(ids.shape[1], ids.shape[0]).t()


def routing_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Per-token entropy (nats) of the router's distribution over experts, [T]."""
    p = scores / scores.sum(-1, keepdim=True)
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


class SparseMoE(nn.Module):
    """The MoE MLP of one layer: router, routed experts, optional shared expert and its gate.

    ``capacity_factor`` None is exact no-drop routing; ``stats`` (set by the model) records each
    step's tokens per expert, dropped assignments and router entropy."""

    def __init__(self, hidden: int, spec: MoESpec, act: str, layer_index: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer_index = layer_index
        self.router = Gate(hidden, spec.num_experts)
        self.experts = nn.ModuleList(GatedMLP(hidden, spec.expert_intermediate_size, act)
                                     for _ in range(spec.num_experts))
        self.shared = GatedMLP(hidden, spec.shared_expert_intermediate_size, act) \
            if spec.shared_expert_intermediate_size else None
        self.shared_gate = Gate(hidden, 1) if spec.shared_expert_gate else None
        self.capacity_factor: float | None = None
        self.stats = None

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. (``lora``: adapters never target MoE MLPs; the loader
        refuses them, so there is nothing to apply here.)"""
        spec = self.spec
        tokens = x.shape[0]
        weights, ids, scores = route(self.router(x), spec)
        keep = None
        if self.capacity_factor is not None and tokens:
            keep = kept_assignments(ids, spec.num_experts, capacity(self.capacity_factor, tokens, spec.top_k,
                                                                    spec.num_experts))
        if self.stats is not None:
            self.stats.record(self.layer_index, ids, keep, scores)
        out = self.run_experts(x, weights, ids, keep)  # float32
        if self.shared is not None:
            shared = self.shared(x).float()
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out.to(x.dtype)

    def prepare(self) -> None:
        """Ready every expert's weights for its kernel now (bfloat16 packing), not on the first
        token routed to it, which would stall that step."""
        for mlp in [*self.experts, *([self.shared] if self.shared is not None else [])]:
            for module in (mlp.gate_up, mlp.down):
                prepack(module)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over each token's (kept) assignments of weight * expert(x), grouped by expert, in
        float32 [T, hidden]: each expert's rows in the model dtype, widened, scaled by their
        float32 weight and added in ascending expert order."""
        tokens, k = ids.shape
        flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
        flat_tok = torch.arange(tokens, device=x.device).repeat_interleave(k)
        if keep is not None:
            kept = keep.reshape(-1)
            flat_ids, flat_w, flat_tok = flat_ids[kept], flat_w[kept], flat_tok[kept]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.spec.num_experts).tolist()
        rows_tok, rows_w = flat_tok[order], flat_w[order]
        gathered = x[rows_tok]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            end = start + n
            y = self.experts[expert](gathered[start:end]).float() * rows_w[start:end, None]
            out.index_add_(0, rows_tok[start:end], y)
            start = end
        return out
