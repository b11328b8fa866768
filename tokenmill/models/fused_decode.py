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

Mixture-of-experts layers (:class:`~tokenmill.models.moe.SparseMoE`) run in the stack too, with
no-drop routing only: a model with a capacity factor set keeps the layer path. The stack hands
each step's routing back, and the model's ``ExpertStats`` counts it as the layers would (router
entropy: to float rounding).
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import nn

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.kernels import dispatch
from tokenmill.kernels.linear_spec import CpuLinearSpec, LinearKind
from tokenmill.models.layers import GatedMLP, packed_bf16_weight
from tokenmill.models.moe import SparseMoE
from tokenmill.models.moe_stats import ExpertStats
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


class _Registrations:
    """How many submodules and parameters have been assigned to any ``nn.Module`` of this process
    (PyTorch's global registration hooks: ``module.x = m``, ``add_module``, ``module.w =
    Parameter(...)``, ``register_parameter``). A stack checked against its model at some count
    holds while the count has not moved: no module or parameter of that model can have been
    swapped since without one. Walking the model's modules instead cost about 1.5 us a linear
    on every decode step (0.2 ms of a 5-7 ms batch-1 step of a 135M model), the weights streamed
    through the cache having evicted the module dicts. Writing into ``_modules`` or
    ``_parameters`` directly bypasses the hooks and is not seen."""

    count = 0
    installed = False

    @classmethod
    def install(cls) -> None:
        """Start counting (once per process, when the first stack is built: none needs the count before)."""
        if not cls.installed:
            torch.nn.modules.module.register_module_module_registration_hook(cls.bump)
            torch.nn.modules.module.register_module_parameter_registration_hook(cls.bump)
            cls.installed = True

    @classmethod
    def bump(cls, *_args) -> None:  # returns None: the hooks leave what is registered as it is
        cls.count += 1


def mlp_linears(mlp: nn.Module) -> list[nn.Module]:
    """The linear modules of a block's MLP, in the stack's order: gate_up and down of a gated MLP;
    of an MoE, each expert's, then the shared expert's."""
    if type(mlp) is not SparseMoE:
        return [mlp.gate_up, mlp.down]
    mlps = [*mlp.experts, *([] if mlp.shared is None else [mlp.shared])]
    return [m for e in mlps for m in (e.gate_up, e.down)]


def moe_supported(mlp: SparseMoE) -> bool:
    """Whether the stack computes ``mlp`` as its forward does: no capacity limit, gated-MLP
    experts of one activation, float32 router and shared gate."""
    mlps = [*mlp.experts, *([] if mlp.shared is None else [mlp.shared])]
    gates = [mlp.router, *([] if mlp.shared_gate is None else [mlp.shared_gate])]
    return (mlp.capacity_factor is None and all(type(e) is GatedMLP and e.act == mlps[0].act for e in mlps)
            and all(g.weight.dtype == torch.float32 for g in gates))


class FusedDecoder:
    """A model's decoder layers bound to one KV cache, as one ``DecodeStack``."""

    def __init__(self, stack, plan_type: type, linears: tuple[nn.Module, ...],
                 plan_keys: list[tuple[int, int | None]], packed: list[nn.Module],
                 moe: list[SparseMoE] = ()) -> None:
        self.stack = stack
        self.plan_type = plan_type
        """The compiled module's DecodePlan: one per attention plan, handed to ``stack.run``."""
        self.linears = linears
        """The linear modules it was built from: a model whose modules were swapped since is rebuilt."""
        self.packed = list(packed)
        """Dense modules it holds a packed copy of: a weight changed since (in place or replaced)
        rebuilds it too."""
        self.packed_weights = [m._parameters["weight"] for m in self.packed]
        """Their weights when packed, which the stack watches (``DecodeStack.unchanged``)."""
        stack.watch(self.packed_weights)
        self.plan_keys = plan_keys
        """(KV group, sliding window) of each attention plan the layers use."""
        self.moe = list(moe)
        """The MoE MLPs of the stack, in layer order (the rows of its routing outputs)."""
        self.gates = [w for m in self.moe for w in (m.router.weight, *([] if m.shared_gate is None
                                                                        else [m.shared_gate.weight]))]
        """The router and shared-gate weights the stack holds: replaced ones rebuild it."""
        distinct = len({m.layer_index for m in self.moe}) == len(self.moe)
        self._stats_layers = torch.tensor([m.layer_index for m in self.moe], dtype=torch.int64) \
            if self.moe and distinct else None
        """The MoE layers' indices in ExpertStats, for :meth:`_record` (None: record layer by layer)."""
        self._stats_offsets = (torch.arange(len(self.moe)) * self.moe[0].spec.num_experts).view(-1, 1, 1) \
            if self.moe else None
        """Row m of the step's expert ids offset by m * E: one bincount counts every layer."""
        _Registrations.install()
        self._checked_at = -1
        """``_Registrations.count`` when the model last held this stack's modules (``_walk``)."""
        self._lora_stacks: tuple[int, int] | None = None
        """(id, size) of the LoRA stacks last handed to the stack's set_lora (they grow as adapters
        target new modules; slots are assigned in place, which the stack sees without this)."""

    @classmethod
    def cached(cls, model: nn.Module, kv_cache, cache: weakref.WeakKeyDictionary) -> FusedDecoder | None:
        """``model``'s stack over ``kv_cache`` from ``cache`` (the model's own: KV cache -> stack, or
        None where none applies), built on first use and again when the model's linear modules change."""
        try:
            fused = cache.get(kv_cache, False)
        except TypeError:  # not weak-referenceable: not a PagedKVCache
            return None
        if fused is False or (fused is not None and not fused.current_for(model)):
            fused = cls.build(model, kv_cache)
            cache[kv_cache] = fused
        return fused

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
        if not ops.supports_head_dim(cfg.head_dim) or cfg.clip_qkv is not None or (
                cfg.qk_norm and not cfg.qk_norm_per_head):
            return None
        stack = ops.DecodeStack(eps=cfg.rms_norm_eps, cast_before_scale=model.norm_cast_before_scale)
        plan_keys: list[tuple[int, int | None]] = []
        linears: list[nn.Module] = []
        packed: list[nn.Module] = []
        moe: list[SparseMoE] = []
        for i, block in enumerate(model.layers):
            if type(block) not in (LlamaBlock, Gemma3Block):
                return None
            attn, mlp = block.attn, block.mlp
            backend = attn.backend
            if type(backend) is not PagedAttentionBackend or backend.use_cpu_kernel is False:
                return None
            is_moe = type(mlp) is SparseMoE
            if is_moe and not moe_supported(mlp):
                return None
            modules = (attn.qkv, attn.o, *mlp_linears(mlp))
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
            qkv, o, *mlp_natives = (spec.native(ops) for spec in specs)
            rope = ROPE_LOCAL if cfg.layer_type(i) == "sliding" else ROPE_GLOBAL
            act = (mlp.experts[0] if is_moe else mlp).act
            stack.add_layer(norms=norms, qk_norms=qk_norms, qkv=qkv, o=o,
                            gate_up=None if is_moe else mlp_natives[0], down=None if is_moe else mlp_natives[1],
                            heads=attn.n_heads, kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
                            gelu_tanh=act != "silu", rope=rope, plan=plan_keys.index(key), cache=cache)
            if is_moe:
                experts = len(mlp.experts)
                shared = mlp_natives[2 * experts:]
                stack.add_moe(router=mlp.router.weight.detach(), top_k=mlp.spec.top_k,
                              norm_topk_prob=mlp.spec.norm_topk_prob, sigmoid=mlp.spec.scoring == "sigmoid",
                              gate_up=mlp_natives[0:2 * experts:2], down=mlp_natives[1:2 * experts:2],
                              shared_gate_up=shared[0] if shared else None, shared_down=shared[1] if shared else None,
                              shared_gate=None if mlp.shared_gate is None else mlp.shared_gate.weight.detach())
                moe.append(mlp)
        return cls(stack, ops.DecodePlan, tuple(linears), plan_keys, packed, moe)

    def current_for(self, model: nn.Module) -> bool:
        """Whether the model still holds the linear modules this stack was built from, with the
        weights it packed unchanged (and its MoE layers the same routers, without a capacity limit)."""
        if any(m.capacity_factor is not None for m in self.moe):
            return False
        count = _Registrations.count
        if count != self._checked_at:
            if not self._walk(model):
                return False
            self._checked_at = count
        return self.stack.unchanged()

    def _walk(self, model: nn.Module) -> bool:
        """Whether the model holds the stack's linear modules, packed weights and MoE gates."""
        # through _modules: nn.Module.__getattr__ made this check 0.5 ms of a 6 ms batch-1 step; it
        # stays about 1.5 us a linear (cache misses: the step streamed the weights through the
        # cache), 0.8 ms for a 30-layer model with 8 experts a layer
        mods = []
        gates = []
        for block in model._modules["layers"]._modules.values():
            attn, mlp = block._modules["attn"]._modules, block._modules["mlp"]
            mods += (attn["qkv"], attn["o"])
            sub = mlp._modules
            experts = sub.get("experts")
            if experts is None:
                mods += (sub["gate_up"], sub["down"])
                continue
            for expert in experts._modules.values():
                em = expert._modules
                mods += (em["gate_up"], em["down"])
            gates.append(sub["router"]._parameters["weight"])
            shared, shared_gate = sub.get("shared"), sub.get("shared_gate")  # None: plain attributes
            if shared is not None:
                em = shared._modules
                mods += (em["gate_up"], em["down"])
            if shared_gate is not None:
                gates.append(shared_gate._parameters["weight"])
        # the weights it packed: the same parameters here, with the same contents (stack.unchanged)
        return (len(mods) == len(self.linears) and all(map(operator.is_, mods, self.linears))
                and len(gates) == len(self.gates) and all(map(operator.is_, gates, self.gates))
                and all(map(operator.is_, [m._parameters["weight"] for m in self.packed], self.packed_weights)))

    def run(self, h: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
            meta: PagedAttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """h [B, hidden] embeddings of the new tokens -> hidden states after the last layer, with
        each token's LoRA update (``lora``) added to its projections' outputs where it has one."""
        plans = []
        for group, window in self.plan_keys:
            d = meta.plan(group, window).kernel_decodes()
            plans.append(self.plan_type(slots=meta.slot_mapping[group], block_tables=d.block_tables,
                                        key_start=d.key_start, key_end=d.key_end))
        routing = {}
        stats = self.moe[0].stats if self.moe else None
        if stats is not None:
            spec = self.moe[0].spec
            routing = dict(routing_ids=torch.empty(len(self.moe), h.shape[0], spec.top_k, dtype=torch.int64),
                           routing_scores=torch.empty(len(self.moe), h.shape[0], spec.num_experts))
        if lora is None:
            out = self.stack.run(h=h, ropes=ropes, plans=plans, **routing)
        else:
            self._set_lora(lora.stacks)
            out = self.stack.run(h=h, ropes=ropes, plans=plans, lora_slots=lora.token_slots, **routing)
        if routing:
            self._record(stats, routing["routing_ids"], routing["routing_scores"])
        return out

    def _record(self, stats: ExpertStats, ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Each MoE layer's routing (ids [M, B, k], scores [M, B, E]) into the model's ExpertStats:
        all M layers at once (``record_layers``: 0.5 ms less of a 30-layer batch-1 step than a
        ``record`` per layer), or layer by layer where the layers do not share one."""
        if self._stats_layers is None or any(m.stats is not stats for m in self.moe) or (
                stats.routed.device != ids.device):
            for j, mlp in enumerate(self.moe):  # not one ExpertStats for every layer: each its own
                if mlp.stats is not None:
                    mlp.stats.record(mlp.layer_index, ids[j], None, scores[j])
            return
        stats.record_layers(self._stats_layers, self._stats_offsets, ids, scores)

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
