"""Validated configuration dataclasses.

Every config rejects unknown keys (``from_dict``) with a message that names them, and
checks its values on construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenmill.errors import InvalidParameterError
from tokenmill.options import option


def reject_unknown_keys(cls: type, data: dict[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidParameterError(
            f"{cls.__name__}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known keys are {', '.join(sorted(known))}"
        )


def config_by_method(classes: dict[str, type], data: dict[str, Any], what: str):
    """The config class ``classes[data["method"]]`` built from the other keys of ``data`` (unknown
    ones rejected, naming them): how a saved quantization or pruning config is read back."""
    data = dict(data)
    method = data.pop("method", None)
    if method not in classes:
        raise InvalidParameterError(f"unknown {what} method {method!r}; known methods are {', '.join(classes)}")
    reject_unknown_keys(classes[method], data)
    return classes[method](**data)


class Config:
    """Base of the option configs: ``from_dict`` refuses unknown keys, naming them."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        reject_unknown_keys(cls, data)
        return cls(**data)


@dataclass(frozen=True)
class LoadConfig(Config):
    """Which model to load, and where it computes."""

    title: ClassVar[str] = "model"

    model: str | None = option(
        None, "model name, GGUF file, HF or tokenmill-quantized directory, or HF hub repo id "
        "(default: smollm2-135m-instruct)", short="-m")
    dtype: str = option(
        "auto", "compute dtype: auto (a GGUF file on CPU: its quantized weights as stored, bfloat16 "
        "activations; a tokenmill-quantized directory: the dtype it was quantized for; else float32 on CPU and "
        "bfloat16 on CUDA; for quantize, bfloat16), float32, bfloat16 or float16 (CUDA); an explicit dtype loads a "
        "GGUF file dequantized to it")
    device: str = option("auto", "auto, cpu or cuda")
    bf16_copy_rows: int | None = option(
        None, "GGUF weights as stored: also keep each quantized linear dequantized to bfloat16 (+2 bytes a weight) "
        "and multiply calls of at least this many rows by that copy, where the bfloat16 GEMM is faster; 0: no "
        "copies; default: 24 for 4-bit codes and 12 for wider ones where the copies take at most 1/16 of the "
        "machine's memory, else none")
    int8_copies: bool = option(
        True, "GGUF weights as stored, CPUs with AVX-512 VNNI: also keep each 8-bit quantized linear (Q8_0: the "
        "shipped models' LM heads) as an int8 copy (+1 byte a weight) that bfloat16 calls below --bf16-copy-rows "
        "take, x in two int8 parts (closer to x than bfloat16 is); kept wherever the bfloat16 copies are")
    head_int8_activations: bool = option(
        True, "GGUF weights as stored, with int8 copies and the default --bf16-copy-rows: bfloat16 calls of the "
        "8-bit LM head from the bfloat16 copy's rows (12) up to 511 (12-511 rows sampled in a step) multiply its int8 "
        "copy by x in one int8 part per group, as llama.cpp does, instead of by the bfloat16 copy: Gemma 3's 262k-row "
        "head 5.5 ms instead of 15.2 at 16 rows, 20.8 instead of 34.2 at 64; logits' rms error 0.04 against the "
        "bfloat16 copy's 0.014 (a bfloat16 forward pass differs from float32 by 0.15)")
    int8_activations: bool = option(
        False, "GGUF weights as stored, CPUs with AVX-512 VNNI: every quantized linear keeps an int8 copy (+1 byte "
        "a weight) and multiplies its bfloat16 calls of 1 (4-bit codes: 8) to 511 rows by x in one int8 part per "
        "group, as llama.cpp does (Q8 activations): faster where the products bound a step (16 and more streams, "
        "speculative verification), lossy (the README's table gives its perplexity); off, only the LM head's "
        "many-row calls do (--head-int8-activations)")
    cache_dir: str | None = option(
        None, "where fetched models and tokenizers are kept (default: $XDG_CACHE_HOME/tokenmill or ~/.cache/tokenmill)")

    def __post_init__(self) -> None:
        if self.bf16_copy_rows is not None and (not isinstance(self.bf16_copy_rows, int) or self.bf16_copy_rows < 0):
            raise InvalidParameterError(f"bf16_copy_rows must be a whole number >= 0, got {self.bf16_copy_rows!r}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    """How much the context was extended."""
    low_freq_factor: float = 1.0
    """Wavelengths longer than original_max / low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than original_max / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pre-trained at."""


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts MLPs: a router picks ``top_k`` of ``num_experts`` gated MLPs per token
    (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; tokenmill.models.moe runs them)."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token runs through."""
    expert_intermediate_size: int
    """Inner width of one routed expert's MLP."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' weights to sum to 1 (Mixtral always; Qwen/OLMoE by config)."""
    scoring: str = "softmax"
    """Router scores: 'softmax' over all experts, or 'sigmoid' per expert."""
    shared_expert_intermediate_size: int = 0
    """Inner width of an expert every token runs through (Qwen2-MoE); 0 for none."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(gate(x)) (Qwen2-MoE)."""
    layers: tuple[int, ...] | None = None
    """Which layers are MoE (the others have a dense MLP of intermediate_size); None: all."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidParameterError(f"MoE top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.expert_intermediate_size <= 0:
            raise InvalidParameterError(f"MoE expert_intermediate_size must be positive, got "
                                        f"{self.expert_intermediate_size}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise InvalidParameterError(f"MoE scoring must be softmax or sigmoid, got {self.scoring!r}")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise InvalidParameterError("MoE shared_expert_gate needs a shared expert")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, independent of the file it came from."""

    architecture: str
    """Model family: 'llama' (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) or 'gemma3'."""
    vocab_size: int
    """Rows of the embedding / LM head."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """MLP inner width."""
    num_layers: int
    """Number of decoder blocks."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA/MQA when smaller than num_heads)."""
    head_dim: int
    """Width of one attention head."""
    max_position_embeddings: int
    """Context window in tokens."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base of global (full-attention) layers."""
    rope_local_theta: float | None = None
    """RoPE base of sliding-window layers (Gemma 3); None means rope_theta."""
    rope_scaling: RopeScaling | None = None
    """Llama-3 RoPE scaling, if any."""
    tie_word_embeddings: bool = True
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)."""
    sliding_window: int | None = None
    """Window of sliding-window layers, in tokens; None for none."""
    layer_types: tuple[str, ...] = ()
    """Per layer 'full' or 'sliding'; empty means all 'full'."""
    hidden_act: str = "silu"
    """MLP gate activation: 'silu' or 'gelu_tanh'."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this**-0.5 (Gemma 3); None means head_dim."""
    qk_norm_per_head: bool = True
    """QK-norm over each head (Qwen3, Gemma 3), or over the whole q and k projections (OLMoE)."""
    clip_qkv: float | None = None
    """q, k and v clamped to [-clip_qkv, clip_qkv] after projection (and QK-norm) (OLMoE)."""
    moe: MoESpec | None = None
    """Mixture-of-experts MLPs, if any."""
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ("llama", "gemma3"):
            raise InvalidParameterError(f"unknown architecture family {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidParameterError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise InvalidParameterError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if any(t not in ("full", "sliding") for t in self.layer_types):
            raise InvalidParameterError(f"layer_types entries must be 'full' or 'sliding': {self.layer_types}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise InvalidParameterError(f"unsupported hidden_act {self.hidden_act!r}")

        if self.moe is not None and self.moe.layers is not None and not set(self.moe.layers) <= set(
                range(self.num_layers)):
            raise InvalidParameterError(f"MoE layers {self.moe.layers} outside 0..{self.num_layers - 1}")

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full"

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and (self.moe.layers is None or i in self.moe.layers)


def layer_groups(cfg: ModelConfig) -> tuple[list[int], list[int | None]]:
    """KV group of each layer and the sliding window of each group.

    Layers of one attention type share block tables: a model with only global (or only
    sliding-window) layers has one group; Gemma 3 has two, global (0) and sliding (1), so the
    sliding layers can drop blocks that fell out of their window.
    """
    types = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    kinds = sorted(set(types), key=lambda t: t != "full")  # 'full' first when present
    windows = [cfg.sliding_window if kind == "sliding" else None for kind in kinds]
    return [kinds.index(t) for t in types], windows
