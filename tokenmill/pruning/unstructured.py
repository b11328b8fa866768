"""Unstructured and N:M pruning: magnitude, Wanda, SparseGPT. The model keeps its shapes.

    prune_magnitude(model, config)           |w|, per projection or over all of them at once
    prune_wanda(model, config, samples)      |w_ij| x ||x_j||_2 per output row
    prune_sparsegpt(model, config, samples)  masks chosen and errors compensated through H^-1

Wanda and SparseGPT calibrate block by block, as GPTQ does (``quantization/gptq.py``, whose
Hessian hooks and block runner they share): the calibration sequences' hidden states enter block
i, hooks on its linear layers measure their inputs, the block is pruned and runs again, pruned,
to give block i + 1 its inputs. So every block is pruned for the inputs it will really see.

Each returns {projection name: keep-mask}; with ``schedule_steps`` > 1 the rounds run in turn
and the masks are those of the last round (which include every earlier round's zeros).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from tokenmill.engine.model_runner import ModelRunner
from tokenmill.models.base import CausalLM
from tokenmill.pruning.config import MagnitudeConfig, SparseGPTConfig, SparsityConfig, WandaConfig
from tokenmill.pruning.masks import Part, apply_mask, lowest_mask, nm_mask, pattern_mask, prunable_parts
from tokenmill.quantization.calibration import MeanSquareHooks
from tokenmill.quantization.gptq import HessianHooks, dampen_, padded_hessian, run_block

Masks = dict[str, torch.Tensor]


def _rounds(config: SparsityConfig) -> list[float]:
    return [config.fraction_at(step) for step in range(1, config.schedule_steps + 1)]


@torch.no_grad()
def prune_magnitude(model: CausalLM, config: MagnitudeConfig, progress: bool = True) -> Masks:
    """Zero the smallest |w|: per projection (``scope="layer"``), or below one threshold over all
    projections (``"global"``: exactly ``floor(fraction x total)`` weights), or in each group of M."""
    parts = prunable_parts(model)
    masks: Masks = {}
    for fraction in _rounds(config):
        if config.pattern is not None:
            masks = {p.name: nm_mask(p.weight.abs(), *config.pattern) for p in parts}
        elif config.scope == "global":
            flat = torch.cat([p.weight.abs().reshape(-1).float() for p in parts])
            keep = lowest_mask(flat, int(fraction * flat.numel())).split([p.weight.numel() for p in parts])
            masks = {p.name: k.reshape(p.weight.shape) for p, k in zip(parts, keep)}
        else:
            masks = {p.name: lowest_mask(p.weight.abs(), int(fraction * p.weight.numel())) for p in parts}
        for part in tqdm(parts, desc=f"magnitude {fraction:.0%}", disable=not progress, unit="proj"):
            apply_mask(part, masks[part.name])
    return masks


def _by_block(model: CausalLM, samples: list[list[int]], desc: str, progress: bool, prune_block) -> None:
    """Run the calibration sequences block by block: ``prune_block(index, parts, hook_target)``
    gets each block after its inputs were measured; the pruned block then feeds the next."""
    runner = ModelRunner.for_sequences(model, max(len(s) for s in samples))
    device = model.embed.weight.device
    with torch.inference_mode():
        hidden = [model.embed_tokens(torch.tensor(s, device=device)) for s in samples]
    parts = prunable_parts(model)
    for index, block in enumerate(tqdm(model.layers, desc=desc, disable=not progress, unit="block")):
        prefix = f"layers.{index}."
        prune_block(index, [p for p in parts if p.name.startswith(prefix)],
                    lambda hooks_cls: _measure(model, runner, index, hidden, hooks_cls))
        hidden = run_block(model, runner, index, hidden)


def _measure(model: CausalLM, runner: ModelRunner, index: int, hidden: list[torch.Tensor], hooks_cls):
    """Block ``index`` over ``hidden`` with ``hooks_cls`` hooks on its linear modules -> the hooks."""
    block = model.layers[index]
    modules = {name: m for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    hooks = hooks_cls(modules)
    try:
        run_block(model, runner, index, hidden)
    finally:
        hooks.remove()
    return hooks, {id(m): name for name, m in modules.items()}


def prune_wanda(model: CausalLM, config: WandaConfig, samples: list[list[int]], progress: bool = True) -> Masks:
    """Wanda: in each output row, zero the weights with the smallest |w_ij| x ||x_j||_2."""
    masks: Masks = {}
    for fraction in _rounds(config):
        def prune_block(index: int, parts: list[Part], measure) -> None:
            hooks, names = measure(MeanSquareHooks)
            norms = {name: ms.sqrt() for name, ms in hooks.mean_squares().items()}
            with torch.no_grad():
                for part in parts:
                    scores = part.weight.abs().float() * norms[names[id(part.module)]][None, :]
                    masks[part.name] = pattern_mask(scores, fraction, config.pattern)
                    apply_mask(part, masks[part.name])
        _by_block(model, samples, f"wanda {config.sparsity}", progress, prune_block)
    return masks


def prune_sparsegpt(model: CausalLM, config: SparseGPTConfig, samples: list[list[int]],
                    progress: bool = True) -> Masks:
    """SparseGPT: per layer, masks by w^2 / [H^-1]_jj^2 and error compensation (see sparsegpt_prune)."""
    masks: Masks = {}
    for fraction in _rounds(config):
        def prune_block(index: int, parts: list[Part], measure) -> None:
            hooks, names = measure(HessianHooks)
            modules = {id(p.module): p.module for p in parts}
            for key, module in modules.items():
                weight, keep = sparsegpt_prune(module.weight, hooks.hessians[names[key]], fraction, config.pattern,
                                               config.damping, config.block_size)
                with torch.no_grad():
                    module.weight.copy_(weight)
                for part in parts:
                    if part.module is module:
                        masks[part.name] = keep[part.rows]
        _by_block(model, samples, f"sparsegpt {config.sparsity}", progress, prune_block)
    return masks


@torch.no_grad()
def sparsegpt_prune(weight: torch.Tensor, hessian: torch.Tensor, fraction: float, pattern: tuple[int, int] | None,
                    damping: float = 0.01, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian [K, K] (sum of x x^T) -> (pruned weight in weight's dtype, keep-mask).

    Columns go left to right in blocks of ``block_size``. A block's mask is chosen when the block
    begins (an N:M group's when the group begins), in each row the lowest w^2 / [H^-1]_jj^2 with
    the weights as updated so far; each pruned column's error (w - 0) / [H^-1]_jj then moves onto
    the later columns of its row along row j of the Cholesky factor of H^-1 (the OBS update).
    Every row loses exactly ``floor(fraction * K)`` weights (each block its share), or the N:M
    pattern's. Weights already zero stay zero."""
    w = weight.float().clone()
    n, k = w.shape
    h = padded_hessian(hessian, k)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    dampen_(h, damping)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    was_zero = w == 0
    keep = torch.ones_like(w, dtype=torch.bool)
    for start in range(0, k, block_size):
        end = min(start + block_size, k)
        w_block, h_block = w[:, start:end].clone(), h_inv[start:end, start:end]
        diag = torch.diag(h_block)
        err_block = torch.zeros_like(w_block)
        if pattern is None:
            count = int(fraction * end) - int(fraction * start)  # rows lose floor(fraction * K) in all
            forced = was_zero[:, start:end]
            keep[:, start:end] = _keep_lowest(w_block ** 2 / diag[None, :] ** 2, forced, count) & ~forced
        for i in range(end - start):
            if pattern is not None and i % pattern[1] == 0:
                group = slice(i, i + pattern[1])
                scores = w_block[:, group] ** 2 / diag[None, group] ** 2
                scores[was_zero[:, start:end][:, group]] = -1.0
                keep[:, start + i:start + i + pattern[1]] = nm_mask(scores, *pattern)
            col = w_block[:, i]
            pruned = col * keep[:, start + i]
            err = (col - pruned) / h_block[i, i]
            w_block[:, i:] -= err[:, None] * h_block[i, i:][None, :]
            w_block[:, i] = pruned  # exactly zero where pruned, whatever the rounding of the update
            err_block[:, i] = err
        w[:, start:end] = w_block
        w[:, end:] -= err_block @ h_inv[start:end, end:]
    return w.to(weight.dtype), keep


def _keep_lowest(scores: torch.Tensor, forced: torch.Tensor, count: int) -> torch.Tensor:
    """Keep-mask with the ``count`` lowest scores of each row pruned, ``forced`` entries first."""
    scores = scores.masked_fill(forced, -1.0)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if count > 0:
        keep.scatter_(1, torch.topk(scores, count, dim=1, largest=False, sorted=False).indices, False)
    return keep
