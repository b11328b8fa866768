"""Layers shared by every model family: norms, rotary embedding, gated MLP, attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.kv_cache import PagedLayer
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.config import ModelConfig, RopeScaling
from tokenmill.kernels import dispatch
from tokenmill.lora.slots import LayerLoRA


def weight_key(weight: torch.Tensor) -> tuple:
    """Changes whenever the tensor's contents may have: replaced, modified in place, reshaped."""
    return weight.data_ptr(), weight._version, tuple(weight.shape)


def packed_bf16_weight(owner: nn.Module, weight: torch.Tensor, ops) -> torch.Tensor | None:
    """``weight`` [N, K] packed for ``ops.bf16_packed_linear``, kept on ``owner`` and packed again
    when the weight changes (in place or replaced); None where that kernel cannot take it
    (not bfloat16, odd K, no AVX-512 BF16 here)."""
    if weight.dtype != torch.bfloat16 or weight.shape[1] % 2 or not ops.bf16_linear_fast():
        return None
    key = weight_key(weight)
    cached = owner.__dict__.get("_packed_bf16")
    if cached is None or cached[0] != key:
        cached = (key, ops.bf16_pack(weight.detach()))
        owner.__dict__["_packed_bf16"] = cached
    return cached[1]


def packed_bf16_linear(owner: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
                       x: torch.Tensor, out_float32: bool = False) -> torch.Tensor | None:
    """x @ weight.T (+ bias) by tokenmill's bfloat16 CPU kernel over a packed copy of the weight
    kept on ``owner`` (tokenmill/kernels/cpu/bf16_linear.cpp): 2.6-4x oneDNN's speed at 1 row,
    1.3x at 32, the same at 2048, and a row's result independent of the other rows of the batch.
    None where it does not apply (not bfloat16, not CPU, gradients wanted, no AVX-512 BF16).
    ``out_float32``: the same bfloat16-rounded values, stored as float32 (logits)."""
    if x.dtype != torch.bfloat16:
        return None
    ops = dispatch.for_inference(x, weight)
    packed = packed_bf16_weight(owner, weight, ops) if ops is not None else None
    if packed is None:
        return None
    out = ops.bf16_packed_linear(x.reshape(-1, x.shape[-1]), packed, weight.shape[0],
                                 _NO_BIAS if bias is None else bias, out_float32=out_float32)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(module: nn.Module, x: torch.Tensor, out_float32: bool = False) -> torch.Tensor:
    """``module(x)``, by ``packed_bf16_linear`` for a dense bfloat16 ``nn.Linear`` on CPU (one
    without hooks: calibration observes the inputs of the modules it hooks). ``out_float32``: that
    kernel's output, if it runs, comes as float32 (the same rounded values; for logits)."""
    if type(module) is nn.Linear and not has_hooks(module):
        out = packed_bf16_linear(module, module.weight, module.bias, x, out_float32=out_float32)
        if out is not None:
            return out
    return module(x)


def prepack(module: nn.Module) -> None:
    """Pack a dense bfloat16 ``nn.Linear``'s weight for ``packed_bf16_linear`` now rather than on
    its first call (no-op where that kernel does not apply)."""
    if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
        ops = dispatch.for_inference(module.weight)
        if ops is not None:
            packed_bf16_weight(module, module.weight, ops)


def has_hooks(module: nn.Module) -> bool:
    """Whether forward hooks observe ``module`` (then its own forward must run)."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


_NO_BIAS = torch.empty(0)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32.

    ``cast_before_scale`` picks where the result returns to the input dtype, which matters in
    bfloat16: Llama multiplies the weight after casting back, Gemma before. Gemma's "1 + w"
    weights are stored here already offset (as GGUF stores them), so both just multiply.
    """

    def __init__(self, dim: int, eps: float, cast_before_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cast_before_scale = cast_before_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = dispatch.for_inference(x, self.weight)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps, self.cast_before_scale)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_before_scale:
            return self.weight * h.to(x.dtype)
        return (h * self.weight.float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of RoPE, [head_dim / 2], with Llama-3 frequency scaling when given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


ROPE_TABLE_POSITIONS = 8192
"""Positions below this read RoPE's (cos, sin) from a table computed once (on CPU); later ones
are computed per step."""


class Rotary(nn.Module):
    """Rotate-half (NeoX) RoPE. ``forward`` turns positions [T] into (cos, sin) [T, head_dim].

    On CPU, positions below ``ROPE_TABLE_POSITIONS`` are looked up in a table of the same values
    (the same elementwise operations over positions 0..n-1, n grown by powers of two as positions
    reach it): computing them took 5 operations, about 40 us, of every decode step."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type == "cpu" and self.inv_freq.device.type == "cpu" and positions.numel():
            end = int(positions.max()) + 1
            if end <= ROPE_TABLE_POSITIONS:
                cos, sin = self._table(end, dtype)
                return cos.index_select(0, positions), sin.index_select(0, positions)
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _table(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < end:
            n = min(ROPE_TABLE_POSITIONS, max(256, 1 << (end - 1).bit_length()))
            table = self._tables[dtype] = self._compute(torch.arange(n), dtype)
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul; ``lora``: the step's
    adapters, each token's low-rank update added to gate_up's and down's outputs."""

    def __init__(self, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        gate_up = linear(self.gate_up, x)
        if lora is not None:
            gate_up = lora.apply("mlp.gate_up", x, gate_up)
        ops = dispatch.for_inference(gate_up)
        if ops is not None and gate_up.dim() == 2:
            inner = ops.act_mul(gate_up, self.act != "silu")
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            inner = (F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")) * up
        out = linear(self.down, inner)
        return out if lora is None else lora.apply("mlp.down", inner, out)


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA, optional QKV bias and QK-norm.

    The KV storage of this layer, the step's metadata, the RoPE tables and the step's LoRA
    adapters (if any) come in as arguments; the backend does the cache write and the attention itself.
    """

    def __init__(self, cfg: ModelConfig, layer_index: int, backend: AttentionBackend,
                 norm_cast_before_scale: bool = True) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o = nn.Linear(q_size, cfg.hidden_size, bias=False)
        q_width, k_width = (self.head_dim, self.head_dim) if cfg.qk_norm_per_head else (q_size, kv_size)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, norm_cast_before_scale) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, norm_cast_before_scale) if cfg.qk_norm else None
        # OLMoE: QK-norm over the whole q and k projections, and q/k/v clamped, before RoPE
        self.whole_qk_norm = cfg.qk_norm and not cfg.qk_norm_per_head
        self.clip_qkv = cfg.clip_qkv
        self.norm_cast_before_scale = norm_cast_before_scale
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = cfg.sliding_window if cfg.layer_type(layer_index) == "sliding" else None
        self.backend = backend

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: PagedLayer, meta: PagedAttentionMetadata, lora: LayerLoRA | None = None) -> torch.Tensor:
        qkv = linear(self.qkv, x)
        if lora is not None:
            qkv = lora.apply("attn.qkv", x, qkv)
        if self.whole_qk_norm or self.clip_qkv is not None:
            return self._output(self._attend_unfused(qkv, rope, cache, meta), lora)
        ops = dispatch.for_inference(qkv, *(n.weight for n in (self.q_norm, self.k_norm) if n is not None))
        if ops is not None and qkv.dim() == 2:
            q, k, v = ops.qkv_rope(qkv, self.n_heads, self.n_kv_heads, self.head_dim, *rope,
                                   None if self.q_norm is None else self.q_norm.weight,
                                   None if self.k_norm is None else self.k_norm.weight,
                                   self.q_norm.eps if self.q_norm is not None else 0.0, self.norm_cast_before_scale)
            out = self.backend.forward(q, k, v, cache, meta, self.scale, self.sliding_window)
            return self._output(out, lora)
        return self._output(self._attend_unfused(qkv, rope, cache, meta), lora)

    def _attend_unfused(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: PagedLayer,
                        meta: PagedAttentionMetadata) -> torch.Tensor:
        """Split, QK-norm (per head, or over whole projections), clamp, RoPE, attend: the PyTorch path."""
        q, k, v = qkv.split(self.split, dim=-1)
        if self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(-1, self.n_heads, self.head_dim)
        k = k.reshape(-1, self.n_kv_heads, self.head_dim)
        v = v.reshape(-1, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.backend.forward(q, k, v, cache, meta, self.scale, self.sliding_window)

    def _output(self, attended: torch.Tensor, lora: LayerLoRA | None) -> torch.Tensor:
        """The o projection of the heads' outputs [T, heads, head_dim] (and its adapters' update)."""
        flat = attended.reshape(-1, self.n_heads * self.head_dim)
        out = linear(self.o, flat)
        return out if lora is None else lora.apply("attn.o", flat, out)
