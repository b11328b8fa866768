"""GPTQ: INT4 group-wise weights whose rounding errors are compensated through the inputs' Hessian.

For a linear layer with inputs X, GPTQ rounds W one column at a time and spreads each column's
error over the columns not yet rounded, weighted by the inverse Hessian H^-1 (H = X^T X), so
that X W^T changes as little as possible (Frantar et al., "GPTQ", 2022, Algorithm 1, with lazy
block updates and the Cholesky form of H^-1). The result is stored exactly like round-to-nearest
INT4 (:class:`~tokenmill.quantization.linear.Int4Linear`), so only quantization time differs.

Two refinements, both on by default in :class:`~tokenmill.quantization.config.Int4GPTQConfig`:
act-order (columns by decreasing H diagonal, with static groups so that the stored layout is
unchanged) and each group's (scale, zero) by a range search whose error is weighted by the H
diagonal (llama.cpp's imatrix idea) instead of min-max.

The model is calibrated block by block, in the dtype it will run in: the calibration sequences' hidden states enter block i,
hooks on its linear layers accumulate each one's H, the layers are quantized, and block i runs
again, now quantized, to give block i + 1 its inputs.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.engine.model_runner import ModelRunner
from tokenmill.kernels import dispatch
from tokenmill.models.base import CausalLM
from tokenmill.quantization.calibration import calibration_ids
from tokenmill.quantization.config import Int4GPTQConfig
from tokenmill.quantization.linear import (
    Int4Linear, Int8Linear, int4_group_params, int4_search_params, pack_int4, pad_to_groups)
from tokenmill.quantization.targets import QuantizeContext, Target, cast_float_parameters, detached, set_module


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, dtype: torch.dtype,
                  damping: float = 0.01, block_size: int = 128, act_order: bool = False, range_search: bool = False,
                  activation_weighted: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian [K, K] (sum of x x^T over calibration inputs) -> (q int32 [N, Kp] in
    0..15, scale, zero [N, Kp / group_size] in ``dtype``), with w ~ (q - 8) * scale + zero.

    Without ``act_order``, columns go left to right and each group's (scale, zero) come from its
    columns as updated when the group begins (the paper's form). With it, columns go in order of
    decreasing H diagonal and the groups are static: every group's parameters come from the
    original weights first, so a group's columns can be rounded in any order. ``range_search``:
    the parameters by :func:`~tokenmill.quantization.linear.int4_search_params`, with
    ``activation_weighted`` each column's error weighted by its H diagonal (the inputs' mean
    square, as llama.cpp's imatrix)."""
    w = pad_to_groups(weight, group_size).clone()
    n, k = w.shape
    h = padded_hessian(hessian, k)
    dead = torch.diag(h) == 0  # inputs that were always zero (padding included): any value will do
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    importance = torch.diag(h).clone()
    params = GroupParams(k // group_size, group_size, dtype, range_search, importance if activation_weighted else None)
    if act_order:
        params.fix_all(w)
        order = torch.argsort(importance, descending=True, stable=True)
    else:
        order = torch.arange(k, device=w.device)
    w, h = w[:, order], h[order][:, order]
    dampen_(h, damping)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = _gptq_columns(w, h_inv, order, params, block_size)
    return q[:, torch.argsort(order)], params.scale, params.zero


def dampen_(h: torch.Tensor, damping: float) -> torch.Tensor:
    """``h`` (a square second-moment matrix) plus ``damping`` x its mean diagonal on the diagonal,
    in place: GPTQ's dampening, which keeps a solve or Cholesky factor well posed."""
    h.diagonal().add_(damping * h.diagonal().mean().clamp_min(torch.finfo(h.dtype).tiny))
    return h


def padded_hessian(hessian: torch.Tensor, k: int) -> torch.Tensor:
    """``hessian`` as float32 [k, k], zero rows and columns for the padded inputs."""
    h = torch.zeros(k, k, dtype=torch.float32, device=hessian.device)
    h[:hessian.shape[0], :hessian.shape[0]] = hessian.float()
    return h


class GroupParams:
    """The (scale, zero) [N, groups] of one layer, fixed all at once (static groups) or group by group
    as GPTQ reaches each group's first column."""

    def __init__(self, groups: int, group_size: int, dtype: torch.dtype, range_search: bool,
                 importance: torch.Tensor | None) -> None:
        self.group_size, self.dtype, self.range_search = group_size, dtype, range_search
        self.importance, self.groups = importance, groups
        self.scale: torch.Tensor = torch.empty(0)
        self.zero: torch.Tensor = torch.empty(0)
        self.static = False

    def compute(self, w: torch.Tensor, columns: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameters of groups w [N, groups, group_size], whose columns are ``columns`` of the layer."""
        if not self.range_search:
            return int4_group_params(w, self.dtype)
        weights = None if self.importance is None else self.importance[columns].view(1, -1, self.group_size)
        return int4_search_params(w, self.dtype, weights)

    def fix_all(self, w: torch.Tensor) -> None:
        """Static groups: every group's parameters from ``w`` [N, Kp] as it is now."""
        self.scale, self.zero = self.compute(w.view(w.shape[0], -1, self.group_size), slice(None))
        self.static = True

    def begin(self, w_group: torch.Tensor, group: int) -> None:
        """Dynamic groups: group ``group``'s parameters from its current columns w_group [N, group_size]."""
        if self.static:
            return
        if self.scale.numel() == 0:
            self.scale = torch.zeros(w_group.shape[0], self.groups, dtype=self.dtype, device=w_group.device)
            self.zero = torch.zeros_like(self.scale)
        cols = slice(group * self.group_size, (group + 1) * self.group_size)
        scale, zero = self.compute(w_group[:, None], cols)
        self.scale[:, group], self.zero[:, group] = scale[:, 0], zero[:, 0]


def _gptq_columns(w: torch.Tensor, h_inv: torch.Tensor, order: torch.Tensor, params: GroupParams,
                  block_size: int) -> torch.Tensor:
    """GPTQ's loop (Algorithm 1) over the columns of w [N, Kp], already in quantization order
    (original column ``order[j]`` at position j), with h_inv the upper Cholesky factor of the
    permuted inverse Hessian: each column is rounded and its error, scaled by the factor's row,
    pushed onto the columns after it, within the block at once and onto later blocks in one
    matmul per block. -> q int32 [N, Kp] in the permuted order.

    Within a block, the columns go in segments whose groups' parameters are known: the whole block
    with static groups, one group at a time with dynamic ones (each group's parameters from its
    columns as updated so far). A segment runs in the CPU kernel ``gptq_columns`` (float32 on CPU),
    else in :func:`_columns`, the same loop in PyTorch."""
    n, k = w.shape
    gs = params.group_size
    groups = order // gs
    q = torch.zeros(n, k, dtype=torch.int32, device=w.device)
    block = -(-max(block_size, gs) // gs) * gs  # whole groups per block
    ops = dispatch.for_tensors(w, h_inv) if w.dtype == h_inv.dtype == torch.float32 else None
    run = _columns if ops is None else ops.gptq_columns
    for start in range(0, k, block):
        end = min(start + block, k)
        w_block, h_block = w[:, start:end].clone(), h_inv[start:end, start:end].contiguous()
        err_block = torch.zeros(n, end - start, device=w.device)
        levels = torch.zeros(n, end - start, device=w.device)  # q - 8, as int4_round rounds
        step = end - start if params.static else gs
        for i in range(0, end - start, step):
            j = min(i + step, end - start)
            if not params.static:  # dynamic groups: the order is the identity, i a group's first column
                params.begin(w_block[:, i:j], (start + i) // gs)
            cols = groups[start + i:start + j]
            scale, zero = params.scale[:, cols].float().contiguous(), params.zero[:, cols].float().contiguous()
            run(w_block, h_block, scale, zero, i, j, levels, err_block)
        q[:, start:end] = (levels + 8).to(torch.int32)
        w[:, end:] -= err_block @ h_inv[start:end, end:]
    return q


def _columns(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, begin: int, end: int,
             levels: torch.Tensor, err: torch.Tensor) -> None:
    """Columns begin..end of one block w [N, B] (updated in place), h [B, B] its block of the
    Cholesky factor, scale and zero [N, end - begin] float32 the parameters of each column's group:
    levels q - 8 and the scaled errors into ``levels`` and ``err`` [N, B] (the kernel's contract)."""
    diagonal = h.diagonal().tolist()
    for i in range(begin, end):
        s, z, w_col = scale[:, i - begin], zero[:, i - begin], w[:, i]
        u = torch.round((w_col - z) / s).clamp_(-8, 7)
        levels[:, i] = u
        e = (w_col - (u * s + z)).div_(diagonal[i])
        w[:, i + 1:].sub_(e[:, None] * h[i, i + 1:][None, :])
        err[:, i] = e


def gptq_linear(target: Target, hessian: torch.Tensor, config: Int4GPTQConfig, dtype: torch.dtype) -> Int4Linear:
    q, scale, zero = gptq_quantize(target.weight, hessian, config.group_size, dtype, config.damping,
                                   config.block_size, config.act_order, config.range_search,
                                   config.activation_weighted)
    bias = None if target.bias is None else target.bias.to(dtype)
    return Int4Linear(pack_int4(q), scale, zero, target.weight.shape[1], bias).prepare()


class HessianHooks:
    """Forward pre-hooks accumulating H = sum x x^T (float32) of the inputs of some linear layers."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.hessians: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            h = self.hessians.get(name)
            self.hessians[name] = x.T @ x if h is None else h.addmm_(x.T, x)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def quantize_gptq(model: CausalLM, config: Int4GPTQConfig, targets: list[Target], ctx: QuantizeContext) -> None:
    """The int4-gptq handler: calibrate and quantize the blocks one by one (see the module docstring),
    then the LM head (INT8 with ``lm_head_int8``, else GPTQ on the final norm's outputs)."""
    samples = calibration_ids(ctx, config.num_samples, config.seq_len, config.method)
    by_name = {t.name: t for t in detached(targets)}  # their weights stay float32 when the model was
    cast_float_parameters(model, ctx.dtype)  # calibrate in the dtype the model will run in
    runner = ModelRunner.for_sequences(model, max(len(s) for s in samples))
    device = model.embed.weight.device
    with torch.inference_mode():
        hidden = [model.embed_tokens(torch.tensor(s, device=device)) for s in samples]
    for index, block in enumerate(tqdm(model.layers, desc=f"GPTQ int4 g{config.group_size}",
                                       disable=not ctx.progress, unit="block")):
        linears = {n: m for n, m in block.named_modules(prefix=f"layers.{index}") if n in by_name}
        hooks = HessianHooks(linears)
        try:
            run_block(model, runner, index, hidden)
        finally:
            hooks.remove()
        for name in linears:
            set_module(model, name, gptq_linear(by_name[name], hooks.hessians[name], config, ctx.dtype))
        hidden = run_block(model, runner, index, hidden)
    if "lm_head" in by_name:
        head = by_name["lm_head"]
        if config.lm_head_int8:
            set_module(model, "lm_head", Int8Linear.from_float(head.weight, head.bias, ctx.dtype, config.range_search))
        else:
            with torch.inference_mode():
                final = torch.cat([model.norm(h) for h in hidden]).float()
            set_module(model, "lm_head", gptq_linear(head, final.T @ final, config, ctx.dtype))


@torch.inference_mode()
def run_block(model: CausalLM, runner: ModelRunner, index: int, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """Block ``index`` over each sequence's hidden states, as CausalLM.forward runs it."""
    out = []
    sliding = model.config.layer_type(index) == "sliding" and model.config.rope_local_theta
    rotary = model.rotary_local if sliding else model.rotary_global
    for h in hidden:
        meta = runner.sequence_metadata(h.shape[0])
        positions = meta.positions(h.device)
        out.append(model.layers[index](h, rotary(positions, h.dtype), runner.cache.layer(index), meta))
    return out
