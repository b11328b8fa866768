"""One verb: ``prune(model, config)``, and ``save_pruned`` for a directory every loader reads.

    loaded, report = prune("smollm2-135m-instruct", WandaConfig(sparsity="2:4"))
    save_pruned(loaded, report, "smollm2-2of4/")      # an HF checkpoint (+ pruning_report.json)

:func:`prune_model` finds the config's handler in :data:`HANDLERS`, draws calibration text for
the methods that need it (the end of the corpus, as quantization does), runs it, and returns the
pruned model (the same module for unstructured methods, a new smaller one for structured) with a
:class:`PruneReport`: parameters before and after (embeddings apart), sparsity per projection,
calibration loss before and after, and for structured pruning the per-layer / per-head
sensitivity report and the plan's candidates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tokenmill.device import resolve_device
from tokenmill.eval.perplexity import perplexity
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel
from tokenmill.models.export import save_hf
from tokenmill.paths import default_cache_dir
from tokenmill.pruning.config import (
    MagnitudeConfig, PruneConfig, SparseGPTConfig, SparsityConfig, StructuredConfig, WandaConfig)
from tokenmill.pruning.importance import measure_importance
from tokenmill.pruning.masks import prunable_parts
from tokenmill.pruning.structured import Shape, check_shape, parameter_count, plan, shape_for, shrink
from tokenmill.pruning.unstructured import prune_magnitude, prune_sparsegpt, prune_wanda
from tokenmill.quantization.api import load_float32
from tokenmill.quantization.calibration import calibration_ids
from tokenmill.quantization.targets import QuantizeContext

REPORT_FILE = "pruning_report.json"
SCORED_SAMPLES = 4
"""Calibration sequences the report's before / after loss is measured on."""


@dataclass
class PruneReport:
    method: str
    config: dict[str, Any]
    params_before: dict[str, int]
    """{"embedding", "non_embedding", "total"}."""
    params_after: dict[str, int]
    shape_before: str
    shape_after: str
    sparsity: float
    """Zero fraction of all prunable projection weights (0 for structured: no zeros added)."""
    calibration_nll_before: float
    calibration_nll_after: float
    seconds: float
    sparsity_per_projection: dict[str, float] = field(default_factory=dict)
    sensitivity: list[dict] = field(default_factory=list)
    """Structured: per layer, block influence, head and KV-group importance, channel importance."""
    plan: list[dict] = field(default_factory=list)
    """Structured with ``target_params``: each candidate shape, its parameters and calibration loss."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: a loss not measured (NaN) as None."""
        out = dataclasses.asdict(self)
        for key in ("calibration_nll_before", "calibration_nll_after"):
            out[key] = None if math.isnan(out[key]) else out[key]
        return out

    def summary(self) -> dict[str, Any]:
        """The figures config.json records (the full report goes to pruning_report.json)."""
        keep = ("method", "params_before", "params_after", "shape_after", "sparsity", "calibration_nll_before",
                "calibration_nll_after")
        return {k: v for k, v in self.to_dict().items() if k in keep}


def _counts(cfg) -> dict[str, int]:
    c = parameter_count(cfg)
    return {"embedding": c.embedding, "non_embedding": c.non_embedding, "total": c.total}


def _unstructured(run: Callable[..., dict]) -> Callable[..., tuple[CausalLM, dict]]:
    def handler(model: CausalLM, config: SparsityConfig, samples, progress: bool):
        run(model, config, samples, progress)
        return model, {}
    return handler


def _structured(model: CausalLM, config: StructuredConfig, samples, progress: bool) -> tuple[CausalLM, dict]:
    importance = measure_importance(model, samples, progress, moments=config.refit)
    extra: dict[str, Any] = {"sensitivity": importance.report(model.config.num_heads // model.config.num_kv_heads)}
    if config.target_params is not None:
        shape, entries = plan(model, config, importance, samples[:config.plan_samples], progress)
        extra["plan"] = [{"shape": e.shape.describe(), **dataclasses.asdict(e.shape),
                          "non_embedding": e.non_embedding, "calibration_nll": round(e.calibration_nll, 5)}
                         for e in entries]
    else:
        shape = shape_for(config, model.config)
    return shrink(model, shape, importance), extra


HANDLERS: dict[type[PruneConfig], Callable[..., tuple[CausalLM, dict]]] = {
    MagnitudeConfig: _unstructured(lambda m, c, s, p: prune_magnitude(m, c, p)),
    WandaConfig: _unstructured(prune_wanda),
    SparseGPTConfig: _unstructured(prune_sparsegpt),
    StructuredConfig: _structured,
}
NEEDS_CALIBRATION = (WandaConfig, SparseGPTConfig, StructuredConfig)


def _nll(model: CausalLM, samples: list[list[int]]) -> float:
    ids = [t for s in samples for t in s]
    return perplexity(model, ids, context=len(samples[0]), stride=len(samples[0]), progress=False).nll


def prune_model(model: CausalLM, config: PruneConfig, tokenizer: object | None = None,
                cache_dir: Path | None = None, calibration: list[list[int]] | None = None,
                progress: bool = True) -> tuple[CausalLM, PruneReport]:
    """Prune ``model`` with the handler of ``type(config)`` -> (the pruned model, its report).

    Unstructured methods change ``model`` in place and return it; structured pruning returns a
    new, smaller model. Calibration: ``calibration`` (token ids) or the corpus, which needs
    ``tokenizer``; the magnitude method needs neither (the report's loss figures then stay NaN)."""
    handler = HANDLERS[type(config)]
    if isinstance(config, StructuredConfig):
        check_shape(config, model.config)  # minutes of calibration would come before the shape's error
    start = time.perf_counter()
    ctx = QuantizeContext(model.embed.weight.dtype, progress, tokenizer, cache_dir, calibration)
    has_text = tokenizer is not None or calibration is not None
    samples = calibration_ids(ctx, config.num_samples, config.seq_len, config.method) \
        if isinstance(config, NEEDS_CALIBRATION) or has_text else None
    scored = samples[:SCORED_SAMPLES] if samples else None
    cfg_before = model.config
    before = _nll(model, scored) if scored else float("nan")
    pruned, extra = handler(model, config, samples, progress)
    after = _nll(pruned, scored) if scored else float("nan")
    per_part = {p.name: float((p.weight == 0).float().mean()) for p in prunable_parts(pruned)}
    weights = sum(p.weight.numel() for p in prunable_parts(pruned))
    zeros = sum(int((p.weight == 0).sum()) for p in prunable_parts(pruned))
    report = PruneReport(
        method=config.method, config=config.to_dict(), params_before=_counts(cfg_before),
        params_after=_counts(pruned.config), shape_before=Shape.of(cfg_before).describe(),
        shape_after=Shape.of(pruned.config).describe(), sparsity=zeros / weights,
        calibration_nll_before=before, calibration_nll_after=after, seconds=time.perf_counter() - start,
        sparsity_per_projection=per_part if isinstance(config, SparsityConfig) else {}, **extra)
    return pruned, report


def prune(model: str | os.PathLike | CausalLM | LoadedModel, config: PruneConfig, device: str = "cpu",
          progress: bool = True, cache_dir: str | os.PathLike | None = None,
          ) -> tuple[CausalLM | LoadedModel, PruneReport]:
    """Prune a model: a :class:`CausalLM` (returned pruned; in place for unstructured methods), a
    ``LoadedModel`` (its model and config replaced), or a model argument (name, GGUF file, HF
    directory) loaded in float32 -> (a ``LoadedModel`` ready for :func:`save_pruned`, the report)."""
    if isinstance(model, CausalLM):
        return prune_model(model, config, progress=progress)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    loaded = model if isinstance(model, LoadedModel) else load_float32(model, resolve_device(device), cache)
    pruned, report = prune_model(loaded.model, config, loaded.tokenizer, cache, progress=progress)
    loaded.model, loaded.config = pruned, pruned.config
    return loaded, report


def save_pruned(loaded: LoadedModel, report: PruneReport, out_dir: str | os.PathLike,
                dtype: torch.dtype | None = None) -> Path:
    """Write the pruned model as an HF checkpoint directory (config.json records
    ``pruning_config`` and the report's summary) plus the full ``pruning_report.json``."""
    out = save_hf(loaded.model, loaded.config, loaded.tokenizer, out_dir, dtype,
                  extra={"pruning_config": report.config, "pruning": report.summary()})
    (out / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2))
    return out
