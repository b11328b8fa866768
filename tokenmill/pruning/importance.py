"""What structured pruning measures on calibration text before it removes anything.

One pass of the calibration sequences through the float model, with hooks:

    block influence of layer i   1 - mean cos(h_in, h_out) over tokens (ShortGPT, Men et al. 2024):
                                 a block that barely turns the residual stream does little
    head h of layer i            mean over tokens of || x_h W_o[:, h]^T ||: the size of what the
                                 head writes into the residual stream through the o-projection
    FFN channel c of layer i     mean |a_c| x ||W_down[:, c]||: the size of what the channel writes
                                 (a = act(gate) * up, the down projection's input)

and, when asked (``moments=True``), the second moments sum x x^T of the o and down projections'
inputs, from which structured pruning refits what those projections keep (``refit_columns``).

The scores are per layer; structured pruning keeps, in every layer, the best-scoring heads and
channels of that layer, with the same counts everywhere (HF configs hold one width).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from tokenmill.engine.model_runner import ModelRunner
from tokenmill.models.base import CausalLM


@dataclass
class Importance:
    """Per-layer scores from :func:`measure_importance`."""

    block_influence: list[float]
    """[num_layers]: 1 - mean cos(block input, block output)."""
    heads: torch.Tensor
    """[num_layers, num_heads]: mean norm of each q head's contribution."""
    channels: torch.Tensor
    """[num_layers, intermediate_size]: mean contribution of each FFN channel."""
    o_moments: list[torch.Tensor] | None = None
    """Per layer, float64 [num_heads * head_dim]^2: sum over tokens of x x^T, x the o projection's input."""
    down_moments: list[torch.Tensor] | None = None
    """Per layer, float64 [intermediate_size]^2: the same for the down projection's input."""

    def kv_groups(self, heads_per_group: int) -> torch.Tensor:
        """[num_layers, num_kv_heads]: the sum of each GQA group's head scores."""
        layers, heads = self.heads.shape
        return self.heads.reshape(layers, heads // heads_per_group, heads_per_group).sum(-1)

    def report(self, heads_per_group: int) -> list[dict]:
        """The per-layer / per-head sensitivity report (JSON-ready)."""
        out = []
        for i, bi in enumerate(self.block_influence):
            channels = self.channels[i].sort(descending=True).values
            out.append({"layer": i, "block_influence": round(bi, 6),
                        "head_importance": [round(float(v), 5) for v in self.heads[i]],
                        "kv_group_importance": [round(float(v), 5) for v in self.kv_groups(heads_per_group)[i]],
                        "channel_importance_mean": round(float(channels.mean()), 6),
                        "channel_importance_top_half_share": round(float(
                            channels[:len(channels) // 2].sum() / channels.sum().clamp_min(1e-30)), 4)})
        return out


@torch.inference_mode()
def measure_importance(model: CausalLM, samples: list[list[int]], progress: bool = True,
                       moments: bool = False) -> Importance:
    """Run ``samples`` (token ids) through the model and score layers, heads and channels (and with
    ``moments``, sum the o and down projections' input second moments)."""
    cfg = model.config
    layers, n_heads, d = cfg.num_layers, cfg.num_heads, cfg.head_dim
    cos_sum = torch.zeros(layers, dtype=torch.float64)
    heads = torch.zeros(layers, n_heads, dtype=torch.float64)
    channels = torch.zeros(layers, cfg.intermediate_size, dtype=torch.float64)
    tokens = 0
    o_moments = [torch.zeros(n_heads * d, n_heads * d, dtype=torch.float64) for _ in range(layers)] if moments else None
    down_moments = ([torch.zeros(cfg.intermediate_size, cfg.intermediate_size, dtype=torch.float64)
                     for _ in range(layers)] if moments else None)
    block_inputs: dict[int, torch.Tensor] = {}
    handles = []

    def on_block_in(i):
        def hook(module, args):
            block_inputs[i] = args[0]
        return hook

    def on_block_out(i):
        def hook(module, args, out):
            cos = torch.nn.functional.cosine_similarity(block_inputs.pop(i).float(), out.float(), dim=-1)
            cos_sum[i] += cos.double().sum().cpu()  # the sums live on the CPU, the model anywhere
        return hook

    def on_o(i, w_o):
        def hook(module, args):
            x = args[0].float().reshape(-1, n_heads, d)
            per_head = torch.einsum("thd,ohd->tho", x, w_o)  # [T, heads, hidden]: each head's write
            heads[i] += per_head.norm(dim=-1).double().sum(0).cpu()
            if o_moments is not None:
                flat = x.reshape(x.shape[0], -1)
                o_moments[i] += (flat.T @ flat).double().cpu()
        return hook

    def on_down(i, col_norms):
        def hook(module, args):
            a = args[0].float().reshape(-1, args[0].shape[-1])
            channels[i] += (a.abs().sum(0) * col_norms).double().cpu()
            if down_moments is not None:
                down_moments[i] += (a.T @ a).double().cpu()
        return hook

    for i, block in enumerate(model.layers):
        w_o = block.attn.o.weight.float().reshape(-1, n_heads, d)  # [hidden, heads, d]
        handles += [block.register_forward_pre_hook(on_block_in(i)), block.register_forward_hook(on_block_out(i)),
                    block.attn.o.register_forward_pre_hook(on_o(i, w_o)),
                    block.mlp.down.register_forward_pre_hook(on_down(i, block.mlp.down.weight.float().norm(dim=0)))]
    runner = ModelRunner.for_sequences(model, max(len(s) for s in samples))
    try:
        for ids in tqdm(samples, desc="importance", disable=not progress, unit="seq"):
            runner.hidden(ids)
            tokens += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    return Importance([float(1 - c / tokens) for c in cos_sum], (heads / tokens).float(), (channels / tokens).float(),
                      o_moments, down_moments)
