"""The engine's configuration: scheduler, KV cache, and the engine itself.

Each option is declared once here, with its default and help (see tokenmill/options.py), and
``LLM(...)``, ``tokenmill serve``, ``tokenmill bench offline`` take exactly these, by these names.
Values are checked on construction; an unknown key is refused with its name.

``kv_cache_memory`` means the same everywhere: below 1 it is a fraction of the device's free
memory, 1 or more is a number of bytes.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from tokenmill.attention.kv_quant import KV_CACHE_DTYPES, check_kv_cache_dtype
from tokenmill.config import Config
from tokenmill.errors import InvalidParameterError
from tokenmill.lora.config import LoRAConfig
from tokenmill.options import add_option_group, from_namespace, option, split_options


@dataclass(frozen=True)
class SchedulerConfig(Config):
    """How each step's token budget is filled (see scheduler.py)."""

    title: ClassVar[str] = "scheduler"

    max_num_seqs: int = option(64, "most sequences the engine runs at once")
    max_num_batched_tokens: int = option(2048, "token budget of one step (decodes and prompt chunks together)")
    max_prefill_chunk: int = option(0, "most prompt tokens one sequence may take in a step; 0 means the whole budget")
    enable_chunked_prefill: bool = option(
        True, "cut prompts that do not fit the step's remaining budget; off: a prompt waits until it fits whole")
    policy: Literal["priority", "fcfs"] = option(
        "priority", "order of service: (priority, arrival time), lower first; or arrival time alone (fcfs)")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_prefill_chunk < 0:
            raise InvalidParameterError(
                f"max_num_seqs ({self.max_num_seqs}) and max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= 1 and max_prefill_chunk ({self.max_prefill_chunk}) >= 0")
        if self.policy not in ("fcfs", "priority"):
            raise InvalidParameterError(f"unknown scheduling policy {self.policy!r}; use priority or fcfs")


@dataclass(frozen=True)
class CacheConfig(Config):
    """How big the paged KV pool is and how it is cut into blocks."""

    title: ClassVar[str] = "KV cache"

    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory: float | int = option(
        0.1, "KV cache size: a fraction of free memory when below 1, else bytes")
    enable_prefix_caching: bool = option(True, "reuse the cached KV blocks of identical prompt prefixes")
    kv_cache_dtype: str = option(
        "auto", "how keys and values are stored: auto (the model's dtype), int8 or fp8 (e4m3), each row with a "
        "float16 scale: about 1.9x the tokens of bfloat16", choices=KV_CACHE_DTYPES)
    prefix_hash_key: str | None = option(
        None, "a secret that makes prefix-cache block hashes equal in every process given it (a scale-out router "
              "matches requests to replicas' cached blocks by them); unset: random per process")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InvalidParameterError(f"block_size must be >= 1, got {self.block_size}")
        if isinstance(self.kv_cache_memory, bool) or not self.kv_cache_memory > 0:
            raise InvalidParameterError(
                f"kv_cache_memory must be > 0 (a fraction below 1, or bytes), got {self.kv_cache_memory}")
        check_kv_cache_dtype(self.kv_cache_dtype)

    def budget_bytes(self, device: torch.device) -> int:
        """The pool's byte budget: kv_cache_memory bytes, or that fraction of free memory when below 1."""
        if self.kv_cache_memory >= 1:
            return int(self.kv_cache_memory)
        return int(self.kv_cache_memory * free_memory(device))


SPECULATIVE_METHODS = ("ngram", "draft", "eagle", "layerskip", "shortlist")


@dataclass(frozen=True)
class SpeculativeConfig(Config):
    """Speculative decoding (engine/spec/): a proposer drafts tokens, the target verifies them."""

    title: ClassVar[str] = "speculative decoding"

    speculative_method: str | None = option(
        None, "draft tokens that the model verifies in the step's batch (output distributed as without): ngram "
              "(prompt lookup: what followed the newest n-gram earlier in the sequence), draft (a smaller model "
              "with the same tokenizer: --draft-model), eagle (a head trained by `tokenmill spec train-heads`: "
              "--draft-model DIR), layerskip (the model's own first layers and head), shortlist (the model's own "
              "layers and its head cut to the tokens it writes most: --draft-vocab-size); off by default",
        choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = option(4, "most tokens drafted for a sequence in one step")
    speculative_adaptive: bool = option(
        True, "size each step's drafts from the measured acceptance rate and step cost, down to none under load; "
              "off: always draft the most that fits")
    prompt_lookup_min: int = option(2, "ngram: the shortest n-gram looked up")
    prompt_lookup_max: int = option(4, "ngram: the longest n-gram looked up (tried first)")
    draft_model: str | None = option(
        None, "draft: the draft model (a known name, GGUF file, HF or tokenmill-quantized directory); it must "
              "share the model's tokenizer. eagle: the head's directory")
    layer_skip_layers: int = option(0, "layerskip: how many of the model's first layers the draft runs; 0 means half")
    draft_vocab_size: int = option(
        16384, "shortlist: how many of the tokens the model writes most its draft head keeps (ranked once from "
               "its own answers to chat prompts, then read from the cache directory)")

    KEYS: ClassVar[dict[str, str]] = {
        "method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
        "adaptive": "speculative_adaptive", "prompt_lookup_min": "prompt_lookup_min",
        "prompt_lookup_max": "prompt_lookup_max", "model": "draft_model", "draft_model": "draft_model",
        "layer_skip_layers": "layer_skip_layers", "draft_vocab_size": "draft_vocab_size"}
    """``LLM(speculative={...})``'s keys (vLLM's, plus ours) and the options they set."""

    @classmethod
    def options_of(cls, speculative: dict[str, Any]) -> dict[str, Any]:
        """``{"method": "ngram", "num_speculative_tokens": 4}`` as the flat options it stands for."""
        if not isinstance(speculative, dict):
            raise InvalidParameterError(f"speculative must be a dict such as {{'method': 'ngram'}}, got {speculative!r}")
        unknown = sorted(set(speculative) - set(cls.KEYS))
        if unknown:
            raise InvalidParameterError(f"speculative: unknown key(s) {', '.join(unknown)}; known: {', '.join(cls.KEYS)}")
        if "model" in speculative and "draft_model" in speculative:
            raise InvalidParameterError("speculative: give the draft as model or as draft_model, not both")
        return {cls.KEYS[k]: v for k, v in speculative.items()}

    def __post_init__(self) -> None:
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise InvalidParameterError(f"unknown speculative_method {self.speculative_method!r}; use one of "
                                        f"{', '.join(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens < 1:
            raise InvalidParameterError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidParameterError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                        f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if (self.speculative_method in ("draft", "eagle")) != (self.draft_model is not None):
            raise InvalidParameterError("speculative_method draft or eagle needs draft_model (and draft_model needs "
                                        f"one of them); got method {self.speculative_method!r}, "
                                        f"draft_model {self.draft_model!r}")
        if self.layer_skip_layers < 0:
            raise InvalidParameterError(f"layer_skip_layers must be >= 0, got {self.layer_skip_layers}")
        if self.draft_vocab_size < 1:
            raise InvalidParameterError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")


@dataclass(frozen=True)
class EngineConfig(Config):
    """Everything LLMEngine takes besides the model."""

    title: ClassVar[str] = "engine"

    max_model_len: int | None = option(None, "context window in tokens (default: the model's own)")
    seed: int | None = option(None, "seed of the random draws of requests that bring no seed of their own")
    keep_large_buffers: bool = option(
        True, "on CPU, keep freed buffers up to 512 MiB (logits, activations) for the next step instead of "
              "returning them to the OS each time (glibc mallopt; see tokenmill/allocator.py)")
    moe_capacity_factor: float | None = option(
        None, "MoE models: each expert takes at most ceil(factor * tokens * top_k / experts) of a step's "
              "assignments, the rest dropped (counted; the token's residual carries it). Default: exact no-drop "
              "routing, as HF transformers computes")
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidParameterError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise InvalidParameterError(f"moe_capacity_factor must be > 0, got {self.moe_capacity_factor}")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """From flat options (``max_num_seqs=8, kv_cache_memory=2**30, ...``); unknown names are refused."""
        return cls.from_parts(*split_options(options, *ENGINE_OPTIONS))

    @classmethod
    def from_parts(cls, own: dict[str, Any], scheduler: dict[str, Any], cache: dict[str, Any],
                   speculative: dict[str, Any], lora: dict[str, Any]) -> EngineConfig:
        """From the option dicts of each class of ENGINE_OPTIONS, in its order (``split_options``)."""
        return cls(**own, scheduler=SchedulerConfig(**scheduler), cache=CacheConfig(**cache),
                   speculative=SpeculativeConfig(**speculative), lora=LoRAConfig(**lora))

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EngineConfig:
        return from_namespace(cls, args, scheduler=from_namespace(SchedulerConfig, args),
                              cache=from_namespace(CacheConfig, args),
                              speculative=from_namespace(SpeculativeConfig, args),
                              lora=from_namespace(LoRAConfig, args))


ENGINE_OPTIONS = (EngineConfig, SchedulerConfig, CacheConfig, SpeculativeConfig, LoRAConfig)
"""The classes whose fields are the engine's flat options, in the order entry points list them."""


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (EngineConfig, SchedulerConfig, CacheConfig), one argument group each."""
    for cls in ENGINE_OPTIONS:
        add_option_group(parser, cls)


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
