"""The serving engine: requests, scheduler, paged KV cache manager, model runner, sampler.

Its public API is ``__all__`` below; layers above it (the server, the benchmarks, the offline
``LLM``) use only these names (tests/test_import_contract.py enforces it for the server).
"""

from tokenmill.engine.config import (
    ENGINE_OPTIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    add_engine_options,
    free_memory,
)
from tokenmill.engine.block_pool import BlockHasher
from tokenmill.engine.kv_transfer import KVBlocks, export_blocks, import_blocks
from tokenmill.engine.limits import PromptLimits
from tokenmill.engine.llm_engine import LLMEngine, adapter_salt
from tokenmill.engine.outputs import (
    CompletionOutput,
    OutputAccumulator,
    RequestDelta,
    RequestOutput,
    SampleDelta,
    TokenLogprobs,
)
from tokenmill.engine.request import Request
from tokenmill.engine.stats import EngineSnapshot, StepStats
from tokenmill.engine.work import SequenceWork

__all__ = [
    "ENGINE_OPTIONS", "BlockHasher", "CacheConfig", "CompletionOutput", "EngineConfig", "EngineSnapshot",
    "KVBlocks", "LLMEngine", "OutputAccumulator", "PromptLimits", "Request", "RequestDelta", "RequestOutput",
    "SampleDelta", "SchedulerConfig", "SequenceWork", "SpeculativeConfig", "StepStats", "TokenLogprobs",
    "adapter_salt", "add_engine_options", "export_blocks", "free_memory", "import_blocks",
]
