"""Decode steps in one call on CPU: every layer of a step whose sequences all have one new token
run by tokenmill's ``DecodeStack`` (tokenmill/kernels/cpu/decoder.cpp) without returning to Python.

The stack calls the same kernels in the same order as the layer-by-layer path does on CPU
(``rms_norm``, the linear kernels, ``qkv_rope``, the KV write, ``paged_decode_attention``,
``act_mul``), so its hidden states are bit-identical to it; it removes the interpreter and
dispatch time between about 15 operations per layer, which at batch 1 was as long as the
matmuls themselves.

It applies to Llama-family and Gemma 3 blocks whose linears are dense (bfloat16 ones by the packed
kernel of ``layers.linear``), :class:`Int8Linear` or
:class:`Int4Linear` with tokenmill's CPU kernel, on a float32 or bfloat16 model, with the
paged-decode kernel available; anything else keeps the layer-by-layer path.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.paged import PagedAttentionBackend, PagedAttentionMetadata, PagedKVCache
from tokenmill.kernels import cpu_ops
from tokenmill.models.layers import packed_bf16_weight, weight_key
from tokenmill.quantization.linear import Int4Linear, Int8Linear

DENSE, INT8, INT4, PACKED_BF16 = 0, 1, 2, 3


def _linear_spec(module: nn.Module, ops) -> tuple | None:
    """(kind, weight, scales, bias, group_size, out_features, padded_in) of a linear the stack can run."""
    if type(module) is nn.Linear:
        packed = packed_bf16_weight(module, module.weight, ops)  # what layers.linear multiplies by
        if packed is not None:
            return PACKED_BF16, packed, torch.empty(0), module.bias, 0, module.out_features, module.in_features
        return DENSE, module.weight, torch.empty(0), module.bias, 0, module.out_features, module.in_features
    if type(module) is Int8Linear:
        return INT8, module.qweight, module.scale, module.bias, 0, module.out_features, module.in_features
    if type(module) is Int4Linear and module._cpu_ops is not None:
        return (INT4, module._kernel_weight, module._scales_and_zeros, module.bias, module.group_size,
                module.out_features, module.padded_in)
    return None


class FusedDecoder:
    """A model's decoder layers bound to one KV cache, as one ``DecodeStack``."""

    def __init__(self, stack, linears: tuple[nn.Module, ...], plan_keys: list[tuple[int, int | None]],
                 packed: list[nn.Module]) -> None:
        self.stack = stack
        self.linears = linears
        """The linear modules it was built from: a model whose modules were swapped since is rebuilt."""
        self.packed = [(m, weight_key(m.weight)) for m in packed]
        """Dense modules it holds a packed copy of, with their weight's key when packed: a weight
        changed since (in place or replaced) rebuilds it too."""
        self.plan_keys = plan_keys
        """(KV group, sliding window) of each attention plan the layers use."""

    @classmethod
    def build(cls, model: nn.Module, kv_cache: PagedKVCache) -> FusedDecoder | None:
        """The stack for ``model`` (a CausalLM) over ``kv_cache``, or None when some part of it
        has no kernel here."""
        from tokenmill.models.gemma3 import Gemma3Block
        from tokenmill.models.llama import LlamaBlock

        ops = cpu_ops.load()
        dtype = model.embed.weight.dtype
        if (ops is None or model.embed.weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16)
                or not isinstance(kv_cache, PagedKVCache)):
            return None
        cfg = model.config
        if not ops.supports_head_dim(cfg.head_dim):
            return None
        stack = ops.DecodeStack(cfg.rms_norm_eps, model.norm_cast_before_scale)
        plan_keys: list[tuple[int, int | None]] = []
        linears: list[nn.Module] = []
        packed: list[nn.Module] = []
        for i, block in enumerate(model.layers):
            if type(block) not in (LlamaBlock, Gemma3Block):
                return None
            attn, mlp = block.attn, block.mlp
            backend = attn.backend
            if type(backend) is not PagedAttentionBackend or backend.use_cpu_kernel is False:
                return None
            modules = (attn.qkv, attn.o, mlp.gate_up, mlp.down)
            specs = [_linear_spec(m, ops) for m in modules]
            if any(s is None for s in specs):
                return None
            linears.extend(modules)
            packed.extend(m for m, spec in zip(modules, specs) if spec[0] == PACKED_BF16)
            norms = [block.attn_norm.weight, block.ffn_norm.weight]
            if type(block) is Gemma3Block:
                norms += [block.post_attn_norm.weight, block.post_ffn_norm.weight]
            qk_norms = [] if attn.q_norm is None else [attn.q_norm.weight, attn.k_norm.weight]
            layer = kv_cache.layer(i)
            cache = [layer.keys, layer.values] + ([layer.key_scales, layer.value_scales] if layer.quantized else [])
            key = (layer.group, attn.sliding_window)
            if key not in plan_keys:
                plan_keys.append(key)
            rope = 1 if cfg.layer_type(i) == "sliding" else 0
            stack.add_layer(norms, qk_norms, specs, attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.scale,
                            mlp.act != "silu", rope, plan_keys.index(key), cache)
        return cls(stack, tuple(linears), plan_keys, packed)

    def current_for(self, model: nn.Module) -> bool:
        """Whether the model still holds the linear modules this stack was built from, with the
        weights it packed unchanged."""
        # through _modules: nn.Module.__getattr__ made this check 0.5 ms of a 6 ms batch-1 step
        mods = []
        for block in model._modules["layers"]._modules.values():
            attn, mlp = block._modules["attn"]._modules, block._modules["mlp"]._modules
            mods += (attn["qkv"], attn["o"], mlp["gate_up"], mlp["down"])
        return (len(mods) == len(self.linears) and all(a is b for a, b in zip(mods, self.linears))
                and all(weight_key(m._parameters["weight"]) == key for m, key in self.packed))

    def run(self, h: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
            meta: PagedAttentionMetadata) -> torch.Tensor:
        """h [B, hidden] embeddings of the new tokens -> hidden states after the last layer."""
        plans = []
        for group, window in self.plan_keys:
            d = meta.plan(group, window).kernel_decodes()
            plans.append((meta.slot_mapping[group], d.block_tables, d.key_start, d.key_end))
        return self.stack.run(h, ropes, plans)
