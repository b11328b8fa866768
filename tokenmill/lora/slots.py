"""The adapters resident for serving, stacked per projection, and one step's token -> adapter map.

The model holds q/k/v as one fused ``attn.qkv`` linear and gate/up as ``mlp.gate_up``
(tokenmill.loading.weights); each fused module gets one stack over all slots::

    A  [slots, parts, R, in]     part p's A of the adapter in slot s (zeros where it has none)
    B  [slots, out, R]           row o: the B row (scaling folded in) of the part that owns o
    part_starts  [parts + 1]     q | k | v (or gate | up) row boundaries in ``out``

so a step computes, per token t of slot s, ``y[t] += B[s] @ (A[s, part(o)] @ x[t])``: the base
GEMM runs once over the whole batch, then each token's low-rank update with its own adapter
(``lora_add``: the C++ kernel on CPU, the PyTorch loop below elsewhere). R is the largest rank
the slots take (``max_lora_rank``); lower-rank adapters are zero-padded, which adds exact zeros.

A stack is allocated the first time an adapter targeting its module takes a slot; a module no
resident adapter targets costs nothing per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tokenmill.config import ModelConfig
from tokenmill.kernels import dispatch
from tokenmill.loading.weights import FUSED_INTO
from tokenmill.lora.adapter import LoRAAdapter, projection_shape

FUSED_MODULES = {"attn.qkv": ("attn.q", "attn.k", "attn.v"), "attn.o": ("attn.o",),
                 "mlp.gate_up": ("mlp.gate", "mlp.up"), "mlp.down": ("mlp.down",)}
"""The model's linear module (its name inside a layer) -> the projections it joins, in row order."""


@dataclass
class ModuleStack:
    """One fused module's stacked adapter weights over all slots."""

    A: torch.Tensor
    """[slots, parts, R, in], the model dtype."""
    B: torch.Tensor
    """[slots, out, R], the model dtype."""
    part_starts: torch.Tensor
    """int64 [parts + 1], on CPU."""
    part_bounds: list[int]
    """The same, as a list."""
    A_scale: torch.Tensor | None = None
    """int8 ``A``: float32 [slots, parts, R], each row's scale; else None."""
    B_scale: torch.Tensor | None = None
    """int8 ``B``: float32 [slots, out], each row's scale; else None."""


class LoRASlots:
    """``num_slots`` places for adapters' weights, in the model's dtype on its device, or with
    ``int8``: int8 with a float32 scale per row of A (over ``in``) and of B (over R), half the
    bytes a decode step reads from memory for them (symmetric round-to-nearest, 127 levels)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str, int8: bool = False) -> None:
        self.cfg, self.num_slots, self.max_rank, self.dtype, self.int8 = cfg, num_slots, max_rank, dtype, int8
        self.device = torch.device(device)
        self.modules: dict[str, ModuleStack] = {}
        """``layers.3.attn.qkv`` -> its stack, for the modules some adapter has targeted."""
        self.adapters: list[LoRAAdapter | None] = [None] * num_slots
        """The adapter each slot holds."""

    def _stack(self, module: str) -> ModuleStack:
        stack = self.modules.get(module)
        if stack is None:
            parts = FUSED_MODULES[module.split(".", 2)[2]]
            shapes = [projection_shape(self.cfg, p) for p in parts]
            bounds = [0]
            for out, _ in shapes:
                bounds.append(bounds[-1] + out)
            kw = {"dtype": torch.int8 if self.int8 else self.dtype, "device": self.device}
            stack = ModuleStack(torch.zeros(self.num_slots, len(parts), self.max_rank, shapes[0][1], **kw),
                                torch.zeros(self.num_slots, bounds[-1], self.max_rank, **kw),
                                torch.tensor(bounds, dtype=torch.long), bounds)
            if self.int8:
                stack.A_scale = torch.zeros(self.num_slots, len(parts), self.max_rank, device=self.device)
                stack.B_scale = torch.zeros(self.num_slots, bounds[-1], device=self.device)
            self.modules[module] = stack
        return stack

    def assign(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter``'s weights into ``slot`` (whatever it held is cleared first)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank {self.max_rank}")
        self.clear(slot)
        for key, (a, b) in adapter.weights.items():
            prefix, projection = key.rsplit(".", 2)[0], key.split(".", 2)[2]
            module, part = FUSED_INTO.get(projection, (projection, 0))
            stack = self._stack(f"{prefix}.{module}")
            r, lo, hi = a.shape[0], stack.part_bounds[part], stack.part_bounds[part + 1]
            if self.int8:
                a, stack.A_scale[slot, part, :r] = quantize_rows(a)
                b, stack.B_scale[slot, lo:hi] = quantize_rows(b)
            stack.A[slot, part, :r].copy_(a)
            stack.B[slot, lo:hi, :r].copy_(b)
        self.adapters[slot] = adapter

    def clear(self, slot: int) -> None:
        """Zero ``slot``'s weights in every stack."""
        if self.adapters[slot] is None:
            return
        for stack in self.modules.values():
            for t in (stack.A, stack.B, stack.A_scale, stack.B_scale):
                if t is not None:
                    t[slot].zero_()
        self.adapters[slot] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.modules.values()
                   for t in (s.A, s.B, s.A_scale, s.B_scale) if t is not None)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, n] -> (int8 [rows, n], float32 scale [rows]): w ~ q * scale, symmetric, by rows."""
    w = w.float()
    scale = w.abs().amax(dim=-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class LoRABatch:
    """One step's map from token to slot, and the slots' weights: what the layers apply.

    ``stacks``: ``layers.3.attn.qkv`` -> its stack (:attr:`LoRASlots.modules`, or a trainer's
    parameters); ``token_slots``: int32 [T], -1 for tokens of requests without an adapter."""

    def __init__(self, stacks: Mapping[str, ModuleStack], token_slots: torch.Tensor) -> None:
        self.stacks, self.token_slots = stacks, token_slots
        self._segments: list[tuple[int, torch.Tensor]] | None = None

    def layer(self, index: int) -> LayerLoRA:
        return LayerLoRA(self, index)

    def segments(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, indices of its tokens) for each slot present: the PyTorch path's loop."""
        if self._segments is None:
            present = torch.unique(self.token_slots[self.token_slots >= 0]).tolist()
            self._segments = [(s, (self.token_slots == s).nonzero().flatten()) for s in present]
        return self._segments


@dataclass(frozen=True)
class LayerLoRA:
    """A step's adapters as one decoder layer sees them."""

    batch: LoRABatch
    index: int

    def apply(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (module ``attn.qkv`` ... of this layer computed on ``x``, [T, out]) plus each token's
        low-rank update; in place when nothing records gradients, else a new tensor."""
        stack = self.batch.stacks.get(f"layers.{self.index}.{module}")
        if stack is None:
            return y
        return lora_add(x, y, self.batch, stack)


def lora_add(x: torch.Tensor, y: torch.Tensor, batch: LoRABatch, stack: ModuleStack) -> torch.Tensor:
    """y[t] += B[s] (A[s, part] x[t]) for every token t with slot s >= 0 (see the module docstring)."""
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    ops = dispatch.for_inference(x2, stack.A, stack.B)
    if ops is not None and y2.dtype == x2.dtype and not (torch.is_grad_enabled() and y2.requires_grad):
        ops.lora_add(x=x2, y=y2, slots=batch.token_slots, A=stack.A, B=stack.B, part_starts=stack.part_starts,
                     A_scale=stack.A_scale, B_scale=stack.B_scale)
        return y
    out = y2.clone() if torch.is_grad_enabled() and (y2.requires_grad or x2.requires_grad) else y2
    parts, rank = stack.A.shape[1], stack.A.shape[2]
    bounds = stack.part_bounds
    for slot, rows in batch.segments():
        a, b = stack.A[slot].float(), stack.B[slot].float()
        if stack.A_scale is not None:
            a, b = a * stack.A_scale[slot][..., None], b * stack.B_scale[slot][:, None]
        h = x2[rows].float() @ a.reshape(parts * rank, -1).T  # [m, parts * R]
        for p in range(parts):
            lo, hi = bounds[p], bounds[p + 1]
            delta = h[:, p * rank:(p + 1) * rank] @ b[lo:hi].T
            out[rows, lo:hi] = (out[rows, lo:hi].float() + delta).to(out.dtype)
    return out.view(y.shape)
