"""GPTQ: INT4 group-wise weights whose rounding errors are compensated through the inputs' Hessian.

For a linear layer with inputs X, GPTQ rounds W one column at a time and spreads each column's
error over the columns not yet rounded, weighted by the inverse Hessian H^-1 (H = X^T X), so
that X W^T changes as little as possible (Frantar et al., "GPTQ", 2022, Algorithm 1, with lazy
block updates and the Cholesky form of H^-1). The result is stored exactly like round-to-nearest
INT4 (:class:`~tokenmill.quantization.linear.Int4Linear`), so only quantization time differs.

The model is calibrated block by block, in the dtype it will run in: the calibration sequences' hidden states enter block i,
hooks on its linear layers accumulate each one's H, the layers are quantized, and block i runs
again, now quantized, to give block i + 1 its inputs.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.models.base import CausalLM
from tokenmill.quantization.api import (
    QuantizeContext, Target, calibration_ids, cast_float_parameters, register, set_module)
from tokenmill.quantization.config import Int4GPTQConfig
from tokenmill.quantization.linear import (
    Int4Linear, Int8Linear, int4_group_params, int4_round, pack_int4, pad_to_groups)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, dtype: torch.dtype,
                  damping: float = 0.01, block_size: int = 128,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian [K, K] (sum of x x^T over calibration inputs) -> (q int32 [N, Kp] in
    0..15, scale, zero [N, Kp / group_size] in ``dtype``), with w ~ (q - 8) * scale + zero.

    Each group's (scale, zero) come from min-max of its columns as updated when the group begins."""
    w = pad_to_groups(weight, group_size).clone()
    n, k = w.shape
    h = torch.zeros(k, k, dtype=torch.float32, device=w.device)
    h[:hessian.shape[0], :hessian.shape[0]] = hessian.float()
    dead = torch.diag(h) == 0  # inputs that were always zero (padding included): any value will do
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(k, device=w.device) * damping * torch.mean(torch.diag(h))
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, k, dtype=torch.int32, device=w.device)
    groups = k // group_size
    scale = torch.zeros(n, groups, dtype=dtype, device=w.device)
    zero = torch.zeros(n, groups, dtype=dtype, device=w.device)
    block = -(-max(block_size, group_size) // group_size) * group_size  # whole groups per block
    for start in range(0, k, block):
        end = min(start + block, k)
        w_block, err_block, h_block = w[:, start:end].clone(), torch.zeros(n, end - start, device=w.device), \
            h_inv[start:end, start:end]
        for i in range(end - start):
            col = start + i
            if col % group_size == 0:
                g = col // group_size
                scale[:, g], zero[:, g] = int4_group_params(w_block[:, i:i + group_size], dtype)
            g = col // group_size
            q_col = int4_round(w_block[:, i:i + 1], scale[:, g], zero[:, g])[:, 0]
            dq = (q_col.float() - 8) * scale[:, g].float() + zero[:, g].float()
            q[:, col] = q_col
            err = (w_block[:, i] - dq) / h_block[i, i]
            w_block[:, i:] -= err[:, None] * h_block[i, i:][None, :]
            err_block[:, i] = err
        w[:, end:] -= err_block @ h_inv[start:end, end:]
    return q, scale, zero


def gptq_linear(target: Target, hessian: torch.Tensor, config: Int4GPTQConfig, dtype: torch.dtype) -> Int4Linear:
    q, scale, zero = gptq_quantize(target.weight, hessian, config.group_size, dtype, config.damping,
                                   config.block_size)
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


@register(Int4GPTQConfig)
def _int4_gptq(model: CausalLM, config: Int4GPTQConfig, targets: list[Target], ctx: QuantizeContext) -> None:
    from tokenmill.eval.perplexity import SequenceRunner

    samples = calibration_ids(ctx, config.num_samples, config.seq_len, config.method)
    by_name = {t.name: t for t in targets}  # their weights stay float32 when the model was
    cast_float_parameters(model, ctx.dtype)  # calibrate in the dtype the model will run in
    runner = SequenceRunner(model, max(len(s) for s in samples))
    device = model.embed.weight.device
    with torch.inference_mode():
        hidden = [model.embed_tokens(torch.tensor(s, device=device)) for s in samples]
    for index, block in enumerate(tqdm(model.layers, desc=f"GPTQ int4 g{config.group_size}",
                                       disable=not ctx.progress, unit="block")):
        linears = {n: m for n, m in block.named_modules(prefix=f"layers.{index}") if n in by_name}
        hooks = HessianHooks(linears)
        try:
            _run_block(model, runner, index, hidden)
        finally:
            hooks.remove()
        for name in linears:
            set_module(model, name, gptq_linear(by_name[name], hooks.hessians[name], config, ctx.dtype))
        hidden = _run_block(model, runner, index, hidden)
    if "lm_head" in by_name:
        head = by_name["lm_head"]
        if config.lm_head_int8:
            set_module(model, "lm_head", Int8Linear.from_float(head.weight, head.bias, ctx.dtype))
        else:
            with torch.inference_mode():
                final = torch.cat([model.norm(h) for h in hidden]).float()
            set_module(model, "lm_head", gptq_linear(head, final.T @ final, config, ctx.dtype))


@torch.inference_mode()
def _run_block(model: CausalLM, runner, index: int, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """Block ``index`` over each sequence's hidden states, as CausalLM.forward runs it."""
    out = []
    sliding = model.config.layer_type(index) == "sliding" and model.config.rope_local_theta
    rotary = model.rotary_local if sliding else model.rotary_global
    for h in hidden:
        meta = runner.metadata(h.shape[0])
        positions = meta.positions(h.device)
        out.append(model.layers[index](h, rotary(positions, h.dtype), runner.cache.layer(index), meta))
    return out
