"""Checkpoint tensors -> tokenmill parameter names.

Every source (GGUF, HF safetensors) is first renamed to one canonical, unfused naming
(``layers.3.attn.q.weight``, ``layers.3.mlp.gate.weight`` ...); :func:`fuse` then joins
q/k/v and gate/up into the fused projections the model holds.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import torch

GGUF_NAMES: dict[str, str] = {
    "attn_norm": "attn_norm", "attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v",
    "attn_output": "attn.o", "attn_q_norm": "attn.q_norm", "attn_k_norm": "attn.k_norm",
    "ffn_norm": "ffn_norm", "ffn_gate": "mlp.gate", "ffn_up": "mlp.up", "ffn_down": "mlp.down",
    "post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_ffn_norm",
    "ffn_gate_inp": "mlp.router", "ffn_gate_shexp": "mlp.shared.gate", "ffn_up_shexp": "mlp.shared.up",
    "ffn_down_shexp": "mlp.shared.down", "ffn_gate_inp_shexp": "mlp.shared_gate",
}
GGUF_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
"""llama.cpp's stacked expert tensors [experts, out, in]: one per projection of a layer's routed experts."""
GGUF_TOP: dict[str, str] = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}

HF_LAYER_NAMES: dict[str, str] = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v", "self_attn.o_proj": "attn.o", "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm", "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
}
# The norm after attention is the pre-MLP norm in Llama, a post-attention norm in Gemma 3.
HF_LAYER_NAMES_LLAMA = {**HF_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"}
HF_LAYER_NAMES_GEMMA3 = {**HF_LAYER_NAMES, "post_attention_layernorm": "post_attn_norm",
                         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffn_norm"}
HF_MOE_NAMES: dict[str, str] = {
    "block_sparse_moe.gate": "mlp.router", "mlp.gate": "mlp.router", "mlp.shared_expert_gate": "mlp.shared_gate",
    "mlp.shared_expert.gate_proj": "mlp.shared.gate", "mlp.shared_expert.up_proj": "mlp.shared.up",
    "mlp.shared_expert.down_proj": "mlp.shared.down",
}
"""Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE: the router, and Qwen2-MoE's shared expert and its gate."""
HF_EXPERT_PARTS: dict[str, str] = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                                   "down_proj": "down", "gate_up_proj": "gate_up"}
"""One routed expert's projections: Mixtral's w1/w3/w2, the others' gate/up/down_proj; gate_up_proj
is one expert's slice of transformers' fused 3-D layout (see :func:`split_stacked_experts`)."""
_HF_LAYER_NAMES_LLAMA_MOE = {**HF_LAYER_NAMES_LLAMA, **HF_MOE_NAMES}
HF_TOP: dict[str, str] = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}

_GGUF_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)$")
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_HF_STACKED_RE = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(gate_up_proj|down_proj)$")


def gguf_name(name: str) -> str | None:
    """Canonical name of a GGUF tensor, or None when tokenmill does not use it (stacked experts:
    see GGUF_EXPERTS, one GGUF tensor for many canonical ones)."""
    if m := _GGUF_RE.match(name):
        layer, part, kind = m.groups()
        return f"layers.{layer}.{GGUF_NAMES[part]}.{kind}" if part in GGUF_NAMES else None
    stem, _, kind = name.rpartition(".")
    return f"{GGUF_TOP[stem]}.{kind}" if stem in GGUF_TOP else None


def hf_name(name: str, family: str) -> str | None:
    """Canonical name of an HF checkpoint tensor, or None when tokenmill does not use it."""
    name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
    table = HF_LAYER_NAMES_GEMMA3 if family == "gemma3" else _HF_LAYER_NAMES_LLAMA_MOE
    if m := _HF_EXPERT_RE.match(name):
        layer, expert, part = m.groups()
        return f"layers.{layer}.mlp.experts.{expert}.{HF_EXPERT_PARTS[part]}.weight" if part in HF_EXPERT_PARTS else None
    if m := _HF_RE.match(name):
        layer, part, kind = m.groups()
        return f"layers.{layer}.{table[part]}.{kind}" if part in table else None
    stem, _, kind = name.rpartition(".")
    return f"{HF_TOP[stem]}.{kind}" if stem in HF_TOP else None


def split_stacked_experts(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' fused 3-D expert tensors (``...experts.gate_up_proj`` [experts, 2 * inner,
    hidden], ``...experts.down_proj`` [experts, hidden, inner]) -> one weight per expert, named as
    the per-expert layout names them (``...experts.3.gate_up_proj.weight``); other tensors pass."""
    for name, tensor in tensors:
        m = _HF_STACKED_RE.match(name)
        if m is None:
            yield name, tensor
            continue
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D [experts, out, in] tensor, got shape {tuple(tensor.shape)}")
        prefix, part = m.groups()
        for expert in range(tensor.shape[0]):
            yield f"{prefix}.{expert}.{part}.weight", tensor[expert]


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Llama q/k weights (interleaved -> rotate-half RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


FUSED_INTO = {"attn.q": ("attn.qkv", 0), "attn.k": ("attn.qkv", 1), "attn.v": ("attn.qkv", 2),
              "mlp.gate": ("mlp.gate_up", 0), "mlp.up": ("mlp.gate_up", 1)}
"""Unfused projection -> (the fused module it joins, its place in that module's rows)."""
FUSED_PARTS = {"attn.qkv": 3, "mlp.gate_up": 2}
"""Fused module -> how many projections it joins."""


_FUSABLE = re.compile(r"^(layers\.\d+)\.(attn\.[qkv]|mlp\.gate|mlp\.up)\.(weight|bias)$")
_FUSABLE_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.(?:experts\.\d+|shared))\.(gate|up)\.(weight)$")


def fuse(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Join q/k/v into ``attn.qkv`` and gate/up into ``mlp.gate_up`` (an MoE expert's or shared
    expert's gate/up into its ``gate_up``); pass other tensors through."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        if m := _FUSABLE.match(name):
            prefix, part, kind = m.groups()
            fused, index = FUSED_INTO[part]
            need = FUSED_PARTS[fused]
        elif m := _FUSABLE_EXPERT.match(name):  # layers.0.mlp.experts.3.gate.weight -> ...experts.3.gate_up.weight
            prefix, part, kind = m.groups()
            fused, index, need = "gate_up", ("gate", "up").index(part), 2
        else:
            yield name, tensor
            continue
        key = f"{prefix}.{fused}.{kind}"
        pending.setdefault(key, {})[index] = tensor
        if len(pending[key]) == need:
            parts = pending.pop(key)
            yield key, torch.cat([parts[i] for i in range(len(parts))], dim=0)
    if pending:
        raise KeyError(f"incomplete fused projections: {sorted(pending)}")


def map_tensors(tensors: Iterable[tuple[str, torch.Tensor]], rename: Callable[[str], str | None],
                transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename (dropping unused tensors) and optionally transform each tensor."""
    for name, tensor in tensors:
        canonical = rename(name)
        if canonical is not None:
            yield canonical, transform(canonical, tensor) if transform else tensor
