"""Pruned bfloat16 linears stored without their zeros, multiplied by tokenmill's sparse CPU kernel.

A model pruned by unstructured or N:M pruning is a dense model with zeros. :func:`sparsify` swaps
each of its block linears that has enough zeros for a :class:`SparseBF16Linear`, which keeps only
the nonzero weights and one bit per weight (``sparse_bf16_pack``, tokenmill/kernels/cpu/
sparse_linear.cpp): 16 x density + 1 bits per weight instead of 16, 9 at 50%.

    swapped = sparsify(model)            # names of the swapped linears; the model is changed in place

The kernel expands each 32-weight vector in registers and multiplies exactly as the dense
bfloat16 kernel does, so a sparsified model's outputs (logits, greedy tokens, the one-call decode
stack's hidden states) are bit-identical to the pruned model's. Whether it is faster depends on
whether the weights come from DRAM (batch-1 decode: fewer bytes to stream) or from cache (many
rows: the expand is extra work); bench/sparse_linear.py measures both, and its results are in
bench/results/sparse_linear.json.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import dispatch
from tokenmill.kernels.linear_spec import CpuLinearSpec, LinearKind
from tokenmill.models.layers import has_hooks, weight_key

VECTOR = 32
"""bfloat16 elements per vector of the packed layout: 16 output channels x 2 input columns."""


def _sparse_ops(x: torch.Tensor | None = None):
    """The compiled kernels when ``sparse_bf16_linear`` runs here (for ``x``: a bfloat16 CPU input
    without gradients wanted), else None."""
    if x is None:
        ops = dispatch.cpu_ops()
    elif x.dtype != torch.bfloat16:
        return None
    else:
        ops = dispatch.for_inference(x)
    return ops if ops is not None and ops.sparse_linear_fast() else None


class SparseBF16Linear(nn.Module):
    """y = x W^T (+ b) for a sparse bfloat16 W [out_features, in_features], x [..., in_features].

    Buffers (``sparse_bf16_pack``'s, persistent): ``values`` bfloat16 [nnz + 32], the nonzeros of
    each 16-channel output tile in the dense packed layout's order; ``masks`` int32 [tiles,
    in_features / 2], which of each 32-element vector's weights are stored; ``offsets`` int64
    [tiles + 1], where each tile's values start. ``in_features`` is even."""

    def __init__(self, values: torch.Tensor, masks: torch.Tensor, offsets: torch.Tensor, in_features: int,
                 out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("values", values)
        self.register_buffer("masks", masks)
        self.register_buffer("offsets", offsets)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_dense(cls, linear: nn.Linear) -> SparseBF16Linear:
        """``linear``'s weight (bfloat16, on CPU, an even number of input columns) without its zeros."""
        weight = linear.weight.detach()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"SparseBF16Linear takes a bfloat16 CPU weight, got {weight.dtype} on {weight.device}")
        if linear.in_features % 2:
            raise ValueError(f"SparseBF16Linear needs an even in_features, got {linear.in_features}")
        ops = dispatch.cpu_ops()
        values, masks, offsets = ops.sparse_bf16_pack(weight) if ops is not None else pack(weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(values, masks, offsets, linear.in_features, linear.out_features, bias)

    @property
    def nonzeros(self) -> int:
        """Stored weights."""
        return int(self.offsets[-1])

    @property
    def density(self) -> float:
        """Stored weights / all weights (1 - sparsity)."""
        return self.nonzeros / (self.out_features * self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _sparse_ops(x)
        if ops is None:  # no kernel here (or float32 x, or gradients): correct, and as slow as dense
            return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        y = ops.sparse_bf16_linear(x.reshape(-1, self.in_features), self.values, self.masks, self.offsets, self.bias,
                                   self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The bfloat16 weight [out_features, in_features] rebuilt from the buffers (its zeros +0.0),
        once, then cached: what ``forward`` multiplies by where the kernel does not run."""
        key = tuple(weight_key(t) for t in (self.values, self.masks, self.offsets))
        cached = self.__dict__.get("_dense")
        if cached is None or cached[0] != key:  # the buffers replaced or loaded into since
            cached = (key, unpack(self.values, self.masks, self.offsets, self.out_features))
            self.__dict__["_dense"] = cached
        return cached[1]

    def cpu_kernel_spec(self) -> CpuLinearSpec | None:
        """This layer for the one-call CPU decode stack; None where the kernel does not run here
        (the model then keeps the layer-by-layer path)."""
        if _sparse_ops() is None:
            return None
        return CpuLinearSpec(kind=LinearKind.SPARSE_BF16, weight=self.values, scales=self.masks, offsets=self.offsets,
                             bias=self.bias, out_features=self.out_features, in_features=self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"density={self.density:.3f}")


def _vectors(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> its dense packed layout as vectors [tiles, K / 2, 32] (rows past N zeros)."""
    n, k = weight.shape
    tiles = -(-n // 16)
    padded = F.pad(weight, (0, 0, 0, tiles * 16 - n))
    return padded.view(tiles, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(tiles, k // 2, VECTOR)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sparse_bf16_pack`` in PyTorch operations, for a build without the CPU kernels (and as the
    tests' reference for the C++ one): the same three tensors, bit for bit."""
    vectors = _vectors(weight.detach())
    stored = (vectors.view(torch.int16) & 0x7FFF) != 0  # +0.0 and -0.0 are not stored
    bits = torch.arange(VECTOR, dtype=torch.int64)
    masks = ((stored.to(torch.int64) << bits).sum(-1) & 0xFFFFFFFF)
    masks = torch.where(masks >= 2 ** 31, masks - 2 ** 32, masks).to(torch.int32)
    offsets = F.pad(stored.flatten(1).sum(1).cumsum(0), (1, 0))
    values = torch.cat([vectors[stored], torch.zeros(VECTOR, dtype=torch.bfloat16)])
    return values, masks, offsets


def unpack(values: torch.Tensor, masks: torch.Tensor, offsets: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense bfloat16 weight [out_features, K] of ``pack``'s tensors (zeros as +0.0)."""
    tiles, k2 = masks.shape
    bits = torch.arange(VECTOR, dtype=torch.int64)
    stored = ((masks.to(torch.int64)[..., None] >> bits) & 1).bool()
    vectors = torch.zeros(tiles, k2, VECTOR, dtype=torch.bfloat16)
    vectors[stored] = values[:int(offsets[-1])]
    return vectors.view(tiles, k2, 16, 2).permute(0, 2, 1, 3).reshape(tiles * 16, 2 * k2)[:out_features].contiguous()


def sparsify(model: nn.Module, min_sparsity: float = 0.3) -> list[str]:
    """Swap every plain ``nn.Linear`` of ``model.layers`` whose weight has at least ``min_sparsity``
    zeros for a :class:`SparseBF16Linear`, in place; return the swapped names (``layers.3.mlp.down``).

    Only for a bfloat16 model on CPU with the sparse kernel here: anything else is left as it is
    (an empty list), since the layer would only run slower. The embedding and a tied or untied LM
    head are never swapped (they are not in ``model.layers``), nor linears with an odd
    ``in_features`` or hooks on them (calibration observes those)."""
    if not 0.0 <= min_sparsity <= 1.0:
        raise ValueError(f"min_sparsity must be in [0, 1], got {min_sparsity}")
    weight = model.embed.weight
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or _sparse_ops() is None:
        return []
    swapped = []
    for parent_name, parent in model.layers.named_modules(prefix="layers"):
        for name, child in list(parent.named_children()):
            if (type(child) is not nn.Linear or child.in_features % 2 or has_hooks(child)
                    or child.weight.dtype != torch.bfloat16):
                continue
            if float((child.weight == 0).float().mean()) < min_sparsity:
                continue
            setattr(parent, name, SparseBF16Linear.from_dense(child))
            swapped.append(f"{parent_name}.{name}")
    return swapped
