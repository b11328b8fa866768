"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights before W8A8.

A linear layer gives the same y = x W^T for x / s and W * s (column j of W times s_j), for
any positive per-input-channel s. A few input channels of an LLM's linear layers carry values
far larger than the rest, and they stretch every token's int8 grid; dividing them down by
s and letting the weight (quantized per output channel, so it hardly notices) carry the
factor evens the two out. With ``alpha`` in [0, 1], from calibration activations X:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

The division of x costs nothing at run time: it is folded into whatever produced x.

    consumer      its input                     x / s folded into
    attn.qkv      attn_norm(h)                  attn_norm.weight
    mlp.gate_up   ffn_norm(h)                   ffn_norm.weight
    mlp.down      act(gate) * up                the up rows of mlp.gate_up
    attn.o        softmax(q k^T / d) v          the v rows of attn.qkv (and their bias)
    lm_head       norm(h)                       the final norm.weight

Every fold is exact in real arithmetic, so the smoothed float model computes what the original
did (up to float rounding). Two cases need care:

- GQA: one v channel feeds the same channel of every query head of its group, so those
  ``n_heads / n_kv_heads`` input channels of attn.o share one s (their maxima are pooled).
- A tied LM head shares the embedding matrix, which the embedding lookup needs unscaled: the
  head gets its own scaled copy (an ``nn.Linear``), and the embedding is left alone.

Gemma 3's norms multiply by ``1 + w``, but tokenmill holds the multiplier itself (as GGUF does,
kept in float32), so scaling it is exact there too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.errors import UnsupportedModelError
from tokenmill.models.base import CausalLM
from tokenmill.models.layers import RMSNorm

MIN_RANGE = 1e-5
"""Floor of the activation and weight maxima: a channel never seen non-zero must not give s = 0."""


@dataclass
class Fold:
    """One consumer linear whose input is divided by s, and where that division is folded.

    Consumer input channel c is produced by channel ``index[c]`` of the producer's slice
    ``[offset, offset + size)`` (a norm's weight entries, or a linear's output rows);
    consumer channels sharing a producer channel share one s."""

    consumer: str
    """Module path of the linear whose input is smoothed (``layers.3.attn.qkv``, ``lm_head``)."""
    producer: nn.Module
    """The RMSNorm or nn.Linear whose output is that input (up to a linear map per channel)."""
    offset: int
    size: int
    index: torch.Tensor
    """Consumer input channel -> producer channel in 0..size-1, int64 [in_features]."""


def smoothing_folds(model: CausalLM, head: bool) -> list[Fold]:
    """The folds of every block (qkv, gate_up, down, o) and, when ``head``, of the LM head.

    Raises UnsupportedModelError for a block not built from tokenmill's shared layers."""
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads
    # o input channel h * head_dim + d comes from v channel (h // group) * head_dim + d
    channel = torch.arange(q_size)
    v_index = (channel // cfg.head_dim // group) * cfg.head_dim + channel % cfg.head_dim
    folds = []
    for i, block in enumerate(model.layers):
        for name in ("attn_norm", "ffn_norm", "attn", "mlp"):
            if not hasattr(block, name):
                raise UnsupportedModelError(f"SmoothQuant folds need attn_norm, ffn_norm, attn and mlp in each block; "
                                            f"{type(block).__name__} has no {name}")
        p, inner = f"layers.{i}.", block.mlp.down.in_features
        folds += [
            Fold(p + "attn.qkv", block.attn_norm, 0, cfg.hidden_size, torch.arange(cfg.hidden_size)),
            Fold(p + "mlp.gate_up", block.ffn_norm, 0, cfg.hidden_size, torch.arange(cfg.hidden_size)),
            Fold(p + "mlp.down", block.mlp.gate_up, inner, inner, torch.arange(inner)),
            Fold(p + "attn.o", block.attn.qkv, q_size + kv_size, kv_size, v_index)]
    if head:
        folds.append(Fold("lm_head", model.norm, 0, cfg.hidden_size, torch.arange(cfg.hidden_size)))
    return folds


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = max|X|^alpha / max|W|^(1 - alpha), per channel, float32."""
    a, w = act_absmax.float().clamp(min=MIN_RANGE), weight_absmax.float().clamp(min=MIN_RANGE)
    return a.pow(alpha) / w.pow(1 - alpha)


def pooled_max(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Per producer channel, the max of ``values`` over the consumer channels it feeds: [size]."""
    out = torch.zeros(size, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, index.to(values.device), values, reduce="amax", include_self=True)


def head_module(model: CausalLM) -> nn.Linear:
    """The LM head as a module of its own: for tied embeddings, a new nn.Linear holding a copy of
    the embedding matrix (so that scaling it leaves the embedding lookup alone)."""
    if model.lm_head is None:
        weight = model.embed.weight
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        model.lm_head = head
    return model.lm_head


@torch.no_grad()
def apply_fold(model: CausalLM, fold: Fold, act_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Divide the producer's channels by s and multiply the consumer's input columns by s, in
    float32 and written back in each parameter's dtype. -> s per consumer input channel [K]."""
    consumer = head_module(model) if fold.consumer == "lm_head" else model.get_submodule(fold.consumer)
    weight = consumer.weight
    s = smoothing_factors(pooled_max(act_absmax.float().to(weight.device), fold.index, fold.size),
                          pooled_max(weight.detach().float().abs().amax(dim=0), fold.index, fold.size), alpha)
    s_in = s[fold.index.to(s.device)]
    weight.copy_(weight.float() * s_in)
    rows = slice(fold.offset, fold.offset + fold.size)
    producer = fold.producer
    if isinstance(producer, RMSNorm):
        producer.weight[rows] = producer.weight[rows].float() / s
    else:
        producer.weight[rows] = producer.weight[rows].float() / s[:, None]
        if producer.bias is not None:
            producer.bias[rows] = producer.bias[rows].float() / s
    return s_in


def smooth(model: CausalLM, act_absmax: dict[str, torch.Tensor], alpha: float) -> None:
    """Apply the fold of every consumer in ``act_absmax`` ({consumer name: max |input| per
    channel, [K]}), in place. A tied LM head becomes a module of its own (:func:`head_module`)."""
    folds = smoothing_folds(model, "lm_head" in act_absmax)
    for fold in folds:
        if fold.consumer in act_absmax:
            apply_fold(model, fold, act_absmax[fold.consumer], alpha)
