"""Decode steps in one call on CPU: every layer of a step whose sequences all have one new token
run by tokenmill's ``DecodeStack`` (tokenmill/kernels/cpu/decoder.cpp) without returning to Python.

The stack calls the same kernels in the same order as the layer-by-layer path does on CPU
(``rms_norm``, the linear kernels, ``qkv_rope``, the KV write, ``paged_decode_attention``,
``act_mul``), so its hidden states are bit-identical to it; it removes the interpreter and
dispatch time between about 15 operations per layer, which at batch 1 was as long as the
matmuls themselves.

It applies to Llama-family and Gemma 3 blocks whose linears are dense (bfloat16 ones by the packed
kernel of ``layers.linear``) or describe themselves for the CPU kernels (a module with a
``cpu_kernel_spec()`` returning a :class:`~tokenmill.kernels.linear_spec.CpuLinearSpec`: the
quantized linears, INT4 only with tokenmill's CPU kernel), on a float32 or bfloat16 model, with the
paged-decode kernel available; anything else keeps the layer-by-layer path. The quantization
package is not imported here: a layer is asked for its spec, by duck typing.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.kernels import dispatch
from tokenmill.kernels.linear_spec import CpuLinearSpec, LinearKind
from tokenmill.models.layers import packed_bf16_weight, weight_key
from tokenmill.lora.slots import LoRABatch

ROPE_GLOBAL, ROPE_LOCAL = 0, 1
"""Indices of the (cos, sin) tables in :meth:`FusedDecoder.run`'s ``ropes``: global, then local
(sliding-window layers; the global table again for models without their own local RoPE)."""


def dense_linear_spec(module: nn.Linear, ops) -> CpuLinearSpec:
    """A dense ``nn.Linear`` as the stack runs it: by the packed bfloat16 kernel where
    ``layers.linear`` multiplies by it, else by ``at::linear``."""
    packed = packed_bf16_weight(module, module.weight, ops)  # what layers.linear multiplies by
    kind = LinearKind.DENSE if packed is None else LinearKind.BF16_PACKED
    return CpuLinearSpec(kind=kind, weight=module.weight if packed is None else packed,
                         out_features=module.out_features, in_features=module.in_features, bias=module.bias)


def linear_spec(module: nn.Module, ops) -> CpuLinearSpec | None:
    """How the stack runs ``module``, or None when it cannot: a dense ``nn.Linear``, or a module
    that describes itself (``cpu_kernel_spec()``, None when it has no CPU kernel here)."""
    if type(module) is nn.Linear:
        return dense_linear_spec(module, ops)
    describe = getattr(module, "cpu_kernel_spec", None)
    return describe() if callable(describe) else None


LORA_MODULES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
"""The stack's LoRA module indices (decoder.cpp's LoraModule)."""


class FusedDecoder:
    """A model's decoder layers bound to one KV cache, as one ``DecodeStack``."""

    def __init__(self, stack, plan_type: type, linears: tuple[nn.Module, ...],
                 plan_keys: list[tuple[int, int | None]], packed: list[nn.Module]) -> None:
        self.stack = stack
        self.plan_type = plan_type
        """The compiled module's DecodePlan: one per attention plan, handed to ``stack.run``."""
        self.linears = linears
        """The linear modules it was built from: a model whose modules were swapped since is rebuilt."""
        self.packed = [(m, weight_key(m.weight)) for m in packed]
        """Dense modules it holds a packed copy of, with their weight's key when packed: a weight
        changed since (in place or replaced) rebuilds it too."""
        self.plan_keys = plan_keys
        """(KV group, sliding window) of each attention plan the layers use."""
        self._lora_stacks: tuple[int, int] | None = None
        """(id, size) of the LoRA stacks last handed to the stack's set_lora (they grow as adapters
        target new modules; slots are assigned in place, which the stack sees without this)."""

    @classmethod
    def build(cls, model: nn.Module, kv_cache: PagedKVCache) -> FusedDecoder | None:
        """The stack for ``model`` (a CausalLM) over ``kv_cache``, or None when some part of it
        has no kernel here."""
        from tokenmill.models.gemma3 import Gemma3Block
        from tokenmill.models.llama import LlamaBlock

        ops = dispatch.for_tensors(model.embed.weight)
        if ops is None or not isinstance(kv_cache, PagedKVCache):
            return None
        cfg = model.config
        if not ops.supports_head_dim(cfg.head_dim) or cfg.moe is not None or cfg.clip_qkv is not None or (
                cfg.qk_norm and not cfg.qk_norm_per_head):
            return None
        stack = ops.DecodeStack(eps=cfg.rms_norm_eps, cast_before_scale=model.norm_cast_before_scale)
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
            specs = [linear_spec(m, ops) for m in modules]
            if any(s is None for s in specs):
                return None
            linears.extend(modules)
            packed.extend(m for m, spec in zip(modules, specs) if spec.kind is LinearKind.BF16_PACKED)
            norms = [block.attn_norm.weight, block.ffn_norm.weight]
            if type(block) is Gemma3Block:
                norms += [block.post_attn_norm.weight, block.post_ffn_norm.weight]
            qk_norms = [] if attn.q_norm is None else [attn.q_norm.weight, attn.k_norm.weight]
            layer = kv_cache.layer(i)
            cache = [layer.keys, layer.values] + ([layer.key_scales, layer.value_scales] if layer.quantized else [])
            key = (layer.group, attn.sliding_window)
            if key not in plan_keys:
                plan_keys.append(key)
            qkv, o, gate_up, down = (spec.native(ops) for spec in specs)
            rope = ROPE_LOCAL if cfg.layer_type(i) == "sliding" else ROPE_GLOBAL
            stack.add_layer(norms=norms, qk_norms=qk_norms, qkv=qkv, o=o, gate_up=gate_up, down=down,
                            heads=attn.n_heads, kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
                            gelu_tanh=mlp.act != "silu", rope=rope, plan=plan_keys.index(key), cache=cache)
        return cls(stack, ops.DecodePlan, tuple(linears), plan_keys, packed)

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
            meta: PagedAttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """h [B, hidden] embeddings of the new tokens -> hidden states after the last layer, with
        each token's LoRA update (``lora``) added to its projections' outputs where it has one."""
        plans = []
        for group, window in self.plan_keys:
            d = meta.plan(group, window).kernel_decodes()
            plans.append(self.plan_type(slots=meta.slot_mapping[group], block_tables=d.block_tables,
                                        key_start=d.key_start, key_end=d.key_end))
        if lora is None:
            return self.stack.run(h=h, ropes=ropes, plans=plans)
        self._set_lora(lora.stacks)
        return self.stack.run(h=h, ropes=ropes, plans=plans, lora_slots=lora.token_slots)

    def _set_lora(self, stacks) -> None:
        key = (id(stacks), len(stacks))
        if key == self._lora_stacks:
            return
        self.stack.clear_lora()
        for name, stack in stacks.items():
            _, layer, module = name.split(".", 2)
            self.stack.set_lora(layer=int(layer), module=LORA_MODULES.index(module), A=stack.A, B=stack.B,
                                part_starts=stack.part_starts, A_scale=stack.A_scale, B_scale=stack.B_scale)
        self._lora_stacks = key
