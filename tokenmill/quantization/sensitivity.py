"""Per-layer sensitivity to quantization, and a mixed-precision plan built from it.

:func:`analyze_sensitivity` quantizes a copy of the model with a config, then measures each
quantizable layer (:func:`~tokenmill.quantization.targets.quantization_targets`) on its own:

    weight SQNR   sqnr(W, dequantized W)                                  dB
    output SQNR   sqnr(x W^T, quantized layer(x)) on inputs x the layer
                  sees on the evaluation slice                              dB
    delta NLL     mean NLL per token with only this layer quantized (all
                  others as in the unquantized model) minus the unquantized
                  model's, on the same slice                                nats/token

The unquantized reference is the model in the compute dtype, as a bfloat16 model is the
baseline of a bfloat16 quantized one. Each layer's measurement starts from the hidden states the
reference feeds its block (cached once), so a layer in block i runs blocks i..L-1 only.

:func:`plan_keep_layers` turns the measurements into ``keep_layers`` for a budget: a maximum
perplexity increase or a maximum model size in bytes. The evaluation slice comes from the middle
of the corpus: perplexity (measured on its start) and calibration (drawn from its end) never
reach it, so the plan is not chosen on the text that judges it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.engine.model_runner import ModelRunner
from tokenmill.errors import InvalidParameterError
from tokenmill.models.base import CausalLM
from tokenmill.quantization.api import kept_module, quantize_model
from tokenmill.quantization.config import QuantConfig, config_from_dict
from tokenmill.quantization.linear import sqnr
from tokenmill.quantization.targets import Target, cast_float_parameters, quantization_targets, set_module


@dataclass(frozen=True)
class LayerSensitivity:
    """What quantizing one layer alone does, and what keeping it in higher precision costs."""

    name: str
    """Module path (``layers.3.mlp.down``, ``lm_head``)."""
    weight_sqnr: float
    """dB, the quantized weight against the float one."""
    output_sqnr: float
    """dB, the quantized layer's outputs against the float layer's, on evaluation-slice inputs."""
    delta_nll: float
    """Mean NLL per token (nats) with only this layer quantized, minus the reference's."""
    quantized_as: str
    """The layer's module under the config (``Int4Linear``, ``Int8Linear``, ``W8A8Linear``)."""
    kept_as: str
    """Its module when kept (``Int8Linear``, or ``float`` for the model dtype)."""
    quantized_bytes: int
    """Bytes of the layer's tensors when quantized."""
    kept_bytes: int
    """Bytes when kept (0 for a tied LM head kept in float: it is the embedding matrix)."""

    @property
    def ppl_change(self) -> float:
        """Relative perplexity change from quantizing this layer alone: exp(delta NLL) - 1."""
        return math.expm1(self.delta_nll)

    @property
    def extra_bytes(self) -> int:
        """What keeping the layer adds to the model size (negative: keeping it saves bytes)."""
        return self.kept_bytes - self.quantized_bytes

    @property
    def can_keep(self) -> bool:
        """Keeping changes the layer (under int4, an INT8 LM head is already what keeping gives)."""
        return self.kept_as != self.quantized_as


@dataclass(frozen=True)
class SensitivityReport:
    """:func:`analyze_sensitivity`'s result for one model and config."""

    config: QuantConfig
    """The config analysed (its keep_layers empty)."""
    dtype: str
    tokens: int
    """Tokens scored on the evaluation slice."""
    reference_nll: float
    """Mean NLL per token of the unquantized model in ``dtype``."""
    quantized_nll: float
    """Mean NLL per token of the fully quantized model."""
    quantized_model_bytes: int
    """Bytes of every tensor of the fully quantized model (what its checkpoint holds)."""
    reference_model_bytes: int
    """Bytes of every tensor of the unquantized model in ``dtype``."""
    layers: tuple[LayerSensitivity, ...]

    @property
    def reference_perplexity(self) -> float:
        return math.exp(self.reference_nll)

    @property
    def interaction(self) -> float:
        """The fully quantized model's delta NLL over the sum of the single-layer ones (1 when that
        sum is not positive). Errors compound through the blocks after them, so the sum of what
        each layer does alone underestimates what all do together (SmolLM2, int4 g64: about 1.7)."""
        total = sum(layer.delta_nll for layer in self.layers)
        return (self.quantized_nll - self.reference_nll) / total if total > 0 else 1.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SensitivityReport:
        """The inverse of :meth:`to_dict` (a plan file's ``analysis``), to plan again under another budget."""
        fields = {f.name for f in dataclasses.fields(LayerSensitivity)}
        layers = tuple(LayerSensitivity(**{k: v for k, v in layer.items() if k in fields}) for layer in data["layers"])
        return cls(**{**data, "config": config_from_dict(data["config"]), "layers": layers})

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = self.config.to_dict()
        out["layers"] = [{**dataclasses.asdict(layer), "ppl_change": layer.ppl_change} for layer in self.layers]
        return out


@dataclass(frozen=True)
class QuantPlan:
    """Which layers stay in higher precision, and what the measurements predict for the result."""

    keep_layers: tuple[str, ...]
    """In decreasing order of benefit per byte."""
    budget: dict[str, float]
    """``{"max_ppl_increase": 0.08}`` or ``{"max_bytes": 1.2e8}``."""
    estimated_ppl_change: float
    """Relative to the unquantized model: exp(interaction * sum of the delta NLL of the layers
    quantized) - 1 (see :func:`plan_keep_layers`)."""
    estimated_bytes: int
    """The planned model's tensors, in bytes."""
    meets_budget: bool
    """False when keeping every layer that helps still misses a perplexity budget."""


# --------------------------------------------------------------------------- evaluation slice

def sensitivity_ids(tokenizer: Any, num_tokens: int = 2048, seq_len: int = 512, text_file: str | Path | None = None,
                    cache_dir: Path | None = None) -> list[list[int]]:
    """``num_tokens`` tokens (rounded down to whole sequences, at least one) from the middle of
    ``text_file`` (default: the corpus, whose middle neither perplexity nor calibration reads), in
    sequences of ``seq_len``."""
    from tokenmill.eval.corpus import fetch_corpus

    if num_tokens < 2 or seq_len < 2:
        raise InvalidParameterError(f"sensitivity needs at least 2 tokens per sequence, got {num_tokens} tokens "
                                    f"in sequences of {seq_len}")
    seq_len = min(seq_len, num_tokens)
    need = num_tokens // seq_len * seq_len
    path = Path(text_file) if text_file is not None else fetch_corpus(cache_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"cannot read {path}: {exc}") from None
    middle = len(text) // 2
    ids = tokenizer.encode(text[middle:middle + 8 * need], add_special_tokens=False)[:need]
    if len(ids) < need:
        raise InvalidParameterError(f"the second half of {path} gave {len(ids)} tokens for the sensitivity slice, "
                                    f"{need} needed")
    return [ids[i:i + seq_len] for i in range(0, need, seq_len)]


# --------------------------------------------------------------------------- running part of the model

def run_block(model: CausalLM, runner: ModelRunner, index: int, h: torch.Tensor) -> torch.Tensor:
    """Block ``index`` over one sequence's hidden states [T, hidden], as CausalLM.forward runs it
    (``runner``: a :meth:`ModelRunner.for_sequences` runner, for its KV cache and metadata)."""
    meta = runner.sequence_metadata(h.shape[0])
    positions = meta.positions(h.device)
    sliding = model.config.layer_type(index) == "sliding" and model.config.rope_local_theta
    rotary = model.rotary_local if sliding else model.rotary_global
    return model.layers[index](h, rotary(positions, h.dtype), runner.cache.layer(index), meta)


def run_blocks(model: CausalLM, runner: ModelRunner, start: int, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """Blocks ``start``..L-1 over each sequence's hidden states entering block ``start``."""
    out = []
    for h in hidden:
        for index in range(start, len(model.layers)):
            h = run_block(model, runner, index, h)
        out.append(h)
    return out


def mean_nll(model: CausalLM, final: list[torch.Tensor], ids: list[list[int]]) -> float:
    """Mean NLL per scored token (every token but each sequence's first) from the final hidden states."""
    total, count = 0.0, 0
    for h, seq in zip(final, ids):
        logits = model.compute_logits(h[:-1])
        targets = torch.tensor(seq[1:], device=logits.device)
        total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").double().item()
        count += len(seq) - 1
    return total / count


def model_nll(model: CausalLM, ids: list[list[int]]) -> float:
    """Mean NLL per scored token of the whole model's own forward over each sequence."""
    runner = ModelRunner.for_sequences(model, max(len(s) for s in ids))
    return mean_nll(model, [runner.hidden(s) for s in ids], ids)


def block_of(name: str, num_layers: int) -> int:
    """``layers.3.mlp.down`` -> 3; ``lm_head`` -> num_layers (after every block)."""
    return int(name.split(".")[1]) if name.startswith("layers.") else num_layers


class InputSampler:
    """Forward hooks keeping about ``rows`` rows of the inputs of some layers, spread evenly over
    each sequence, for output SQNR. The LM head's input is the final norm's output."""

    def __init__(self, model: CausalLM, names: list[str], rows: int, num_sequences: int) -> None:
        self.per_sequence = max(1, rows // num_sequences)
        self.inputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        self.handles = []
        for name in names:
            if name == "lm_head":
                self.handles.append(model.norm.register_forward_hook(
                    lambda m, args, out, n=name: self._keep(n, out)))
            else:
                self.handles.append(model.get_submodule(name).register_forward_pre_hook(
                    lambda m, args, n=name: self._keep(n, args[0])))

    def _keep(self, name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        step = max(1, x.shape[0] // self.per_sequence)
        self.inputs[name].append(x[::step][:self.per_sequence].clone())

    def rows(self, name: str) -> torch.Tensor:
        return torch.cat(self.inputs[name])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's tensors (what a checkpoint holds; RoPE tables are not saved)."""
    return tensor_bytes(model)


# --------------------------------------------------------------------------- the analysis

@dataclass
class _Prepared:
    """The unquantized reference, the quantized copy and the reference's cached activations."""

    reference: CausalLM
    quantized: CausalLM
    runner: ModelRunner
    block_inputs: list[list[torch.Tensor]]
    """[block][sequence] hidden states entering each block; index L: the final hidden states."""
    inputs: InputSampler


def analyze_sensitivity(model: CausalLM, config: QuantConfig, ids: list[list[int]], dtype: torch.dtype | None = None,
                        progress: bool = True, tokenizer: Any = None, cache_dir: Path | None = None,
                        calibration: list[list[int]] | None = None, sqnr_rows: int = 256) -> SensitivityReport:
    """Measure every layer ``config`` quantizes, one at a time (see the module docstring).

    ``model`` (unquantized, left unchanged) is copied twice: a reference cast to ``dtype`` (default
    the model's) and a copy quantized with ``config`` (its ``keep_layers`` ignored), whose layers
    are swapped into the reference one by one. ``ids``: the evaluation sequences (see
    :func:`sensitivity_ids`); ``tokenizer`` and ``cache_dir``, or ``calibration`` (token ids), serve
    methods that calibrate, as in :func:`~tokenmill.quantization.api.quantize_model`."""
    if getattr(model, "quantization_config", None) is not None:
        raise InvalidParameterError("sensitivity analysis needs the unquantized model")
    if not ids or any(len(seq) < 2 for seq in ids):
        raise InvalidParameterError("sensitivity analysis needs sequences of at least 2 tokens")
    config = dataclasses.replace(config, keep_layers=())
    dtype = dtype or model.embed.weight.dtype
    quantized = quantize_model(copy.deepcopy(model), config, dtype, progress, tokenizer, cache_dir, calibration)
    config = quantized.quantization_config  # its automatic choices made (int4's activation weighting)
    prepared = _prepare(model, quantized, config, ids, dtype, sqnr_rows)
    reference, quantized = prepared.reference, prepared.quantized
    num_layers = len(reference.layers)
    layers = []
    with torch.inference_mode():
        reference_nll = mean_nll(reference, prepared.block_inputs[num_layers], ids)
        quantized_nll = model_nll(quantized, ids)
        for target in tqdm(quantization_targets(model, config), desc=f"sensitivity ({config.method})",
                           disable=not progress, unit="layer"):
            module = quantized.lm_head if target.name == "lm_head" else quantized.get_submodule(target.name)
            nll = _nll_with(prepared, target.name, module, ids)
            layers.append(_measure(target, module, config, dtype, prepared.inputs.rows(target.name),
                                   nll - reference_nll, reference.lm_head is None))
    return SensitivityReport(config, str(dtype).removeprefix("torch."), sum(len(s) - 1 for s in ids), reference_nll,
                             quantized_nll,
                             model_bytes(quantized), model_bytes(reference), tuple(layers))


def _prepare(model: CausalLM, quantized: CausalLM, config: QuantConfig, ids: list[list[int]], dtype: torch.dtype,
             sqnr_rows: int) -> _Prepared:
    reference = copy.deepcopy(model)
    cast_float_parameters(reference, dtype)
    _check_only_layers_changed(reference, quantized, config)
    names = [t.name for t in quantization_targets(reference, config)]
    inputs = InputSampler(reference, names, sqnr_rows, len(ids))
    runner = ModelRunner.for_sequences(reference, max(len(s) for s in ids))
    device = reference.embed.weight.device
    block_inputs: list[list[torch.Tensor]] = [[] for _ in range(len(reference.layers) + 1)]
    try:
        with torch.inference_mode():
            for seq in ids:
                h = reference.embed_tokens(torch.tensor(seq, device=device))
                for index in range(len(reference.layers)):
                    block_inputs[index].append(h)
                    h = run_block(reference, runner, index, h)
                block_inputs[-1].append(h)
                reference.norm(h)  # the LM head's input, for the sampler
    finally:
        inputs.remove()
    return _Prepared(reference, quantized, runner, block_inputs, inputs)


def _check_only_layers_changed(reference: CausalLM, quantized: CausalLM, config: QuantConfig) -> None:
    """Refuse configs whose handler also rewrites float parameters (SmoothQuant folds its scales
    into the norms): one of their layers does not compute the same function inside the reference."""
    layers = {t.name for t in quantization_targets(reference, config)}
    ref_state = reference.state_dict()
    changed = [name for name, t in quantized.state_dict().items()
               if name.rpartition(".")[0] not in layers and t.is_floating_point()
               and (name not in ref_state or not torch.equal(ref_state[name], t))]
    if changed:
        raise InvalidParameterError(
            f"sensitivity analysis swaps one quantized layer at a time into the unquantized model, but {config.method} "
            f"also changes float parameters ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); "
            "for w8a8 set smoothing_alpha to None")


def _nll_with(prepared: _Prepared, name: str, module: nn.Module, ids: list[list[int]]) -> float:
    """Mean NLL with ``module`` in place of the reference's layer ``name``, restored afterwards."""
    reference = prepared.reference
    num_layers = len(reference.layers)
    original = reference.lm_head if name == "lm_head" else reference.get_submodule(name)  # None: tied head
    set_module(reference, name, module)
    try:
        start = block_of(name, num_layers)
        final = prepared.block_inputs[num_layers] if start == num_layers else \
            run_blocks(reference, prepared.runner, start, prepared.block_inputs[start])
        return mean_nll(reference, final, ids)
    finally:
        set_module(reference, name, original)


def _measure(target: Target, module: nn.Module, config: QuantConfig, dtype: torch.dtype, x: torch.Tensor,
             delta_nll: float, tied_head: bool) -> LayerSensitivity:
    """One layer's row: SQNRs against the float weight (``target``), sizes quantized and kept."""
    weight = target.weight.float()
    reference_out = torch.nn.functional.linear(x.float(), weight, None if target.bias is None else target.bias.float())
    kept = kept_module(config, target, dtype)
    if kept is not None:
        kept_bytes, kept_as = tensor_bytes(kept), type(kept).__name__
    else:
        float_bytes = (weight.numel() + (0 if target.bias is None else target.bias.numel())) * dtype.itemsize
        kept_bytes, kept_as = (0 if target.name == "lm_head" and tied_head else float_bytes), "float"
    return LayerSensitivity(target.name, sqnr(weight, module.dequantize()), sqnr(reference_out, module(x)),
                            delta_nll, type(module).__name__, kept_as, tensor_bytes(module), kept_bytes)


# --------------------------------------------------------------------------- the plan

def plan_keep_layers(report: SensitivityReport, max_ppl_increase: float | None = None,
                     max_bytes: int | None = None) -> QuantPlan:
    """Choose the layers to keep in higher precision under one budget.

    ``max_ppl_increase``: the smallest model whose estimated perplexity is at most
    ``(1 + max_ppl_increase)`` times the reference's. ``max_bytes``: the lowest estimated perplexity
    whose model's tensors fit in ``max_bytes``. The estimate: the delta NLL of the layers left
    quantized, summed and scaled by :attr:`SensitivityReport.interaction`, so that with no layer
    kept it is the fully quantized model's measured perplexity.

    Layers are taken greedily by delta NLL per extra byte, the best first (layers whose keeping
    costs nothing or saves bytes, such as a tied LM head left in float, come first of all). The
    estimate treats each layer's damage as additive in NLL (log perplexity), and model size is
    additive in bytes, so choosing layers is a knapsack problem: value = the NLL a layer gives back,
    weight = the bytes it adds. Taking items in order of value per weight is the optimal solution
    of its fractional relaxation and, for layers that are each small against the budget, close to
    the integer optimum; ordering by damage alone would spend the budget on large layers (the LM
    head, a fused gate_up) that buy back less perplexity per byte than several small ones.
    """
    if (max_ppl_increase is None) == (max_bytes is None):
        raise InvalidParameterError("a plan needs exactly one budget: max_ppl_increase or max_bytes")
    if max_ppl_increase is not None and max_ppl_increase < 0:
        raise InvalidParameterError(f"max_ppl_increase must be >= 0, got {max_ppl_increase}")
    if max_bytes is not None and max_bytes < report.quantized_model_bytes:
        raise InvalidParameterError(f"max_bytes {max_bytes} is below the fully quantized model's "
                                    f"{report.quantized_model_bytes} bytes: no plan can fit")
    order = sorted((layer for layer in report.layers if layer.can_keep and layer.delta_nll > 0),
                   key=lambda layer: (layer.extra_bytes > 0, -layer.delta_nll / max(layer.extra_bytes, 1)))
    nll = sum(layer.delta_nll for layer in report.layers)
    scale = report.interaction
    size = report.quantized_model_bytes
    kept = []
    for layer in order:
        if max_ppl_increase is not None and math.expm1(scale * nll) <= max_ppl_increase:
            break
        if max_bytes is not None and size + layer.extra_bytes > max_bytes:
            continue  # a smaller layer later in the order may still fit
        kept.append(layer.name)
        nll -= layer.delta_nll
        size += layer.extra_bytes
    budget = {"max_ppl_increase": max_ppl_increase} if max_ppl_increase is not None else {"max_bytes": max_bytes}
    meets = max_ppl_increase is None or math.expm1(scale * nll) <= max_ppl_increase
    return QuantPlan(tuple(kept), budget, math.expm1(scale * nll), size, meets)


def planned_config(report: SensitivityReport, plan: QuantPlan) -> QuantConfig:
    return dataclasses.replace(report.config, keep_layers=plan.keep_layers)


# --------------------------------------------------------------------------- plan files and the table

def plan_dict(report: SensitivityReport, plan: QuantPlan) -> dict[str, Any]:
    """The plan file's content: the config to quantize with (``keep_layers`` filled), the budget,
    the estimates and the analysis they come from."""
    return {"quantization_config": planned_config(report, plan).to_dict(), "budget": plan.budget,
            "estimated_ppl_change": plan.estimated_ppl_change, "estimated_bytes": plan.estimated_bytes,
            "meets_budget": plan.meets_budget, "analysis": report.to_dict()}


def write_plan(path: str | Path, report: SensitivityReport, plan: QuantPlan) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan_dict(report, plan), indent=2))
    return path


def read_plan(path: str | Path) -> QuantConfig:
    """The config a plan file says to quantize with (:func:`write_plan`'s ``quantization_config``)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidParameterError(f"cannot read the plan {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("quantization_config"), dict):
        raise InvalidParameterError(f"{path} is not a quantization plan: no quantization_config object")
    return config_from_dict(data["quantization_config"])


def format_table(report: SensitivityReport, plan: QuantPlan | None = None, top: int | None = None) -> str:
    """Layers by decreasing perplexity damage: SQNRs, perplexity change, extra bytes when kept,
    and a mark on those the plan keeps; then the plan's estimates."""
    kept = set(plan.keep_layers) if plan else set()
    rows = sorted(report.layers, key=lambda layer: -layer.delta_nll)[:top]
    lines = [f"{report.config.method}: perplexity {report.reference_perplexity:.3f} unquantized, "
             f"{math.exp(report.quantized_nll):.3f} fully quantized, on {report.tokens} tokens ({report.dtype}); "
             f"all layers together do {report.interaction:.2f}x the sum of what each does alone",
             f"{'layer':24s} {'weight dB':>9s} {'output dB':>9s} {'ppl change':>10s} {'keep +KB':>9s}  kept"]
    for layer in rows:
        lines.append(f"{layer.name:24s} {layer.weight_sqnr:9.2f} {layer.output_sqnr:9.2f} "
                     f"{100 * layer.ppl_change:+9.3f}% {layer.extra_bytes / 1e3:9.1f}  "
                     f"{('yes (' + layer.kept_as + ')') if layer.name in kept else ''}")
    if plan is not None:
        lines.append(f"plan: keep {len(plan.keep_layers)} layer(s); estimated perplexity change "
                     f"{100 * plan.estimated_ppl_change:+.2f}%, size {plan.estimated_bytes / 1e6:.2f} MB "
                     f"(fully quantized {report.quantized_model_bytes / 1e6:.2f} MB, unquantized "
                     f"{report.reference_model_bytes / 1e6:.2f} MB)"
                     f"{'' if plan.meets_budget else '; the perplexity budget is not met even so'}")
    return "\n".join(lines)
