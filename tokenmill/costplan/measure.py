"""Measure every candidate configuration with the offline benchmark, loading each weights setting once.

    for each (model, weights):          load (or load float32 and quantize), once
        quality                         perplexity on held-out corpus text (when asked)
        for each (max_num_seqs, speculation):
            engine                      a fresh LLMEngine over the loaded weights: its own KV pool,
                                        scheduler and drafter, nothing else rebuilt
            run                         tokenmill.benchmark.offline.run_offline on the workload

Every engine config is built (and so validated) before anything is loaded, so a bad option fails
in a second rather than after minutes of measuring. The workload's prompts depend only on its seed
and the model's vocabulary: every configuration of a model sees the same requests.
"""

from __future__ import annotations

import gc
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tokenmill.benchmark.hardware import HardwareCeilings
from tokenmill.benchmark.offline import OfflineConfig, run_offline
from tokenmill.config import ModelConfig
from tokenmill.costplan.config import FLOAT_WEIGHTS, Candidate, SearchSpace, check_workload
from tokenmill.device import resolve_device
from tokenmill.engine import EngineConfig, LLMEngine
from tokenmill.loader import load_draft, load_model
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.models.builder import LoadedModel
from tokenmill.paths import default_cache_dir

DRAFT_METHODS = ("draft", "eagle")
"""The speculative methods that read draft_model."""
QUALITY_CONTEXT, QUALITY_STRIDE = 512, 256
"""Perplexity windows, as ``tokenmill quantize``'s quality check slides them."""


@dataclass(frozen=True)
class Measurement:
    """One candidate's offline run, and the perplexity of its weights when measured."""

    candidate: Candidate
    run: dict
    """run_offline's result: model, config, summary (throughput, latency distributions in ms, MBU, MFU)."""
    perplexity: float | None = None
    """On the first SearchSpace.quality_tokens tokens of the eval corpus; None when not measured."""


@dataclass
class EngineUnderTest:
    """What run_offline reads of an ``LLM``: an engine built over weights already loaded, so that one
    load serves every max_num_seqs and speculation setting."""

    engine: LLMEngine
    model_name: str
    model_config: ModelConfig
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def build(cls, loaded: LoadedModel, device: torch.device, config: EngineConfig,
              draft: LoadedModel | None) -> EngineUnderTest:
        weight = loaded.model.embed.weight
        return cls(LLMEngine(loaded, device, config, draft), loaded.source.name, loaded.config, loaded.tokenizer,
                   weight.device, weight.dtype)


def engine_configs(candidates: list[Candidate], options: dict[str, Any]) -> dict[Candidate, EngineConfig]:
    """Each candidate's engine config: the shared engine ``options`` with its max_num_seqs and
    speculation (draft_model only where the method reads it, so that plans can mix draft and off)."""
    return {c: EngineConfig.from_options(**_own_draft(options, c.speculative_method), max_num_seqs=c.max_num_seqs,
                                         speculative_method=c.speculative_method) for c in candidates}


def _own_draft(options: dict[str, Any], method: str | None) -> dict[str, Any]:
    return options if method in DRAFT_METHODS else {**options, "draft_model": None}


def load_weights(model: str, weights: str, device: torch.device, cache_dir: Path) -> LoadedModel:
    """``model`` with ``weights`` (see SearchSpace.weights): as stored, in a float dtype, or quantized here."""
    if weights == "native":
        return load_model(model, "auto", device, cache_dir)
    if weights in FLOAT_WEIGHTS:
        return load_model(model, weights, device, cache_dir)
    from tokenmill.quantization import config_from_dict, quantize
    from tokenmill.quantization.api import load_float32

    loaded = load_float32(model, device, cache_dir)
    return quantize(loaded, config_from_dict({"method": weights}), dtype="bfloat16", progress=False,
                    cache_dir=cache_dir)


def held_out_perplexity(loaded: LoadedModel, tokens: int, cache_dir: Path) -> float:
    """Perplexity on the first ``tokens`` tokens of the eval corpus (calibration reads its end)."""
    from tokenmill.eval.corpus import fetch_corpus, read_tokens
    from tokenmill.eval.perplexity import perplexity

    ids = read_tokens(loaded.tokenizer, fetch_corpus(cache_dir), tokens)
    context = min(QUALITY_CONTEXT, len(ids))
    return perplexity(loaded.model, ids, context, min(QUALITY_STRIDE, context), progress=False).perplexity


def measure(space: SearchSpace, workload: OfflineConfig, ceilings: HardwareCeilings, *, device: str = "auto",
            cache_dir: str | None = None, engine_options: dict[str, Any] | None = None,
            progress: bool = True) -> list[Measurement]:
    """Run ``workload`` on every candidate of ``space``; measurements in the candidates' order."""
    check_workload(workload)
    candidates = space.candidates()
    configs = engine_configs(candidates, engine_options or {})
    resolved, cache = resolve_device(device), Path(cache_dir) if cache_dir else default_cache_dir()
    out: list[Measurement] = []
    with tqdm(total=len(candidates), desc="cost plan", unit="config", disable=not progress) as bar:
        for (model, weights), group in itertools.groupby(candidates, key=lambda c: (c.model, c.weights)):
            bar.set_postfix_str(f"loading {Path(model).name} {weights}")
            group = list(group)
            loaded = load_weights(model, weights, resolved, cache)
            draft = _draft(loaded, [configs[c] for c in group], resolved, cache)
            ppl = held_out_perplexity(loaded, space.quality_tokens, cache) if space.quality_tokens else None
            for candidate in group:
                bar.set_postfix_str(candidate.label)
                run = _run(EngineUnderTest.build(loaded, resolved, configs[candidate], draft), workload, ceilings)
                out.append(Measurement(candidate, run, ppl))
                bar.update(1)
            del loaded, draft
            gc.collect()
    return out


def _draft(loaded: LoadedModel, configs: list[EngineConfig], device: torch.device,
           cache_dir: Path) -> LoadedModel | None:
    """The draft model of speculative_method draft, if one of ``configs`` uses it (they share draft_model)."""
    spec = next((c.speculative for c in configs if c.speculative.speculative_method == "draft"), None)
    if spec is None:
        return None
    return load_draft(spec.draft_model, "auto", device, cache_dir, loaded.model.embed.weight.dtype)


def _run(target: EngineUnderTest, workload: OfflineConfig, ceilings: HardwareCeilings) -> dict:
    """One offline run; the engine's KV pool is freed before the next one is allocated."""
    try:
        return run_offline(target, workload, ceilings, progress=False)
    finally:
        del target
        gc.collect()
