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
}
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
HF_TOP: dict[str, str] = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}

_GGUF_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)$")


def gguf_name(name: str) -> str | None:
    """Canonical name of a GGUF tensor, or None when tokenmill does not use it."""
    if m := _GGUF_RE.match(name):
        layer, part, kind = m.groups()
        return f"layers.{layer}.{GGUF_NAMES[part]}.{kind}" if part in GGUF_NAMES else None
    stem, _, kind = name.rpartition(".")
    return f"{GGUF_TOP[stem]}.{kind}" if stem in GGUF_TOP else None


def hf_name(name: str, family: str) -> str | None:
    """Canonical name of an HF checkpoint tensor, or None when tokenmill does not use it."""
    name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
    table = HF_LAYER_NAMES_GEMMA3 if family == "gemma3" else HF_LAYER_NAMES_LLAMA
    if m := _HF_RE.match(name):
        layer, part, kind = m.groups()
        return f"layers.{layer}.{table[part]}.{kind}" if part in table else None
    stem, _, kind = name.rpartition(".")
    return f"{HF_TOP[stem]}.{kind}" if stem in HF_TOP else None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Llama q/k weights (interleaved -> rotate-half RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


FUSED_INTO = {"attn.q": ("attn.qkv", 0), "attn.k": ("attn.qkv", 1), "attn.v": ("attn.qkv", 2),
              "mlp.gate": ("mlp.gate_up", 0), "mlp.up": ("mlp.gate_up", 1)}
"""Unfused projection -> (the fused module it joins, its place in that module's rows)."""
FUSED_PARTS = {"attn.qkv": 3, "mlp.gate_up": 2}
"""Fused module -> how many projections it joins."""


def fuse(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Join q/k/v into ``attn.qkv`` and gate/up into ``mlp.gate_up``; pass other tensors through."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    pattern = re.compile(r"^(layers\.\d+)\.(attn\.[qkv]|mlp\.gate|mlp\.up)\.(weight|bias)$")
    for name, tensor in tensors:
        m = pattern.match(name)
        if not m:
            yield name, tensor
            continue
        prefix, part, kind = m.groups()
        fused, index = FUSED_INTO[part]
        key = f"{prefix}.{fused}.{kind}"
        pending.setdefault(key, {})[index] = tensor
        if len(pending[key]) == FUSED_PARTS[fused]:
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
