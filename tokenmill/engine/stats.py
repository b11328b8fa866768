"""What the engine reports about itself: per-step statistics and a snapshot of its state."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.work import SequenceWork
from tokenmill.models.moe_stats import MoEStepStats


@dataclass
class StepStats:
    """What one step did, for metrics and benchmarks."""

    num_running: int
    """Sequences holding KV after the step."""
    num_waiting: int
    num_scheduled: int
    num_batched_tokens: int
    num_sampled: int
    kv_used_blocks: int
    """Blocks held by sequences, all KV groups together."""
    kv_tokens: int
    """Tokens whose KV the running sequences hold (so kv_used_blocks * block_size - kv_tokens slots are idle)."""
    kv_usage: float
    prefix_hit_tokens: int
    num_preempted: int
    seconds: float
    num_draft_tokens: int = 0
    """Drafted tokens verified in the step (speculative decoding)."""
    num_accepted_tokens: int = 0
    """Of those, the ones kept."""
    moe: MoEStepStats | None = None
    """An MoE model's routing in the step: tokens per expert, dropped, router entropy."""
    work: tuple[SequenceWork, ...] = ()
    """FLOPs each scheduled request caused, by kind of token (engine/work.py): what a step's time is shared by."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state between steps (``LLMEngine.snapshot()``); counters are cumulative."""

    num_running: int = 0
    """Sequences holding KV."""
    num_waiting: int = 0
    """Sequences waiting for their first (or, after a preemption, next) slot."""
    num_used_blocks: int = 0
    """KV blocks held by sequences, all groups together."""
    kv_usage: float = 0.0
    """Fraction of the KV pool in use."""
    prefix_queries: int = 0
    """Prompt blocks looked up in the prefix cache."""
    prefix_hits: int = 0
    """Of those, blocks found."""
    num_preemptions: int = 0
    """Sequences preempted so far."""
    spec_draft_tokens: int = 0
    """Drafted tokens verified so far (speculative decoding)."""
    spec_accepted_tokens: int = 0
    """Of those, the ones kept."""
    spec_drafts: int = 0
    """Verifications so far: one per drafting sequence and step."""
    spec_accepted_per_position: tuple[int, ...] = ()
    """[j]: verifications that kept the drafted token at position j (0-based)."""
    num_running_adapters: int = 0
    """Distinct LoRA adapters among the running sequences."""
    num_loaded_adapters: int = 0
    """LoRA adapters registered by name."""
    moe: MoEStepStats | None = None
    """An MoE model's routing so far (tokens per layer and expert, dropped, entropy); None for a dense model."""
