"""Structured pruning: a smaller dense model, with new shapes, from a larger one.

    Shape                        what a model keeps: layers, KV groups, q heads per group, FFN width
    parameter_count(cfg)         embedding and non-embedding parameters of a config (no model needed)
    shrink(model, shape, imp)    the smaller model: in every kept layer the best-scoring KV groups,
                                 heads and channels of that layer (:mod:`importance`), the layers
                                 with the highest block influence, in their original order; where
                                 ``imp`` holds the inputs' second moments, the o and down
                                 projections' kept columns refit to what the removed ones wrote
    refit_columns(w, G, keep)    that refit: least squares on the calibration inputs
    plan(model, target, ...)     candidate shapes near a parameter budget, each shrunk and scored
                                 by its loss on calibration text; the lowest wins

The result is an ordinary model of its family: ``save_hf`` writes a config.json with its shapes
(``num_hidden_layers``, ``num_key_value_heads``, ``num_attention_heads``, ``intermediate_size``,
``head_dim`` unchanged) that HF transformers and tokenmill load.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tokenmill.config import ModelConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.perplexity import perplexity
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import build_model
from tokenmill.models.export import canonical_tensors
from tokenmill.pruning.config import StructuredConfig
from tokenmill.pruning.importance import Importance
from tokenmill.quantization.gptq import dampen_


@dataclass(frozen=True)
class Shape:
    num_layers: int
    num_kv_heads: int
    heads_per_group: int
    intermediate_size: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shape:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.intermediate_size)

    def config(self, cfg: ModelConfig, layers: list[int]) -> ModelConfig:
        """``cfg`` with this shape; ``layers``: the original indices kept (their attention types follow)."""
        return dataclasses.replace(
            cfg, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
            num_heads=self.num_kv_heads * self.heads_per_group, intermediate_size=self.intermediate_size,
            layer_types=tuple(cfg.layer_type(i) for i in layers) if cfg.layer_types else ())

    def expressible(self, cfg: ModelConfig) -> bool:
        """Whether HF transformers accepts this shape for ``cfg``'s family: its Llama config insists
        that the head count divide the hidden size (even with an explicit head_dim)."""
        return cfg.architecture != "llama" or cfg.hidden_size % (self.num_kv_heads * self.heads_per_group) == 0

    def describe(self) -> str:
        return (f"{self.num_layers} layers, {self.num_kv_heads} KV x {self.heads_per_group} heads, "
                f"FFN {self.intermediate_size}")


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    """The token embedding, plus an untied LM head."""
    non_embedding: int

    @property
    def total(self) -> int:
        return self.embedding + self.non_embedding


def parameter_count(cfg: ModelConfig) -> ParamCount:
    """Parameters of a model of config ``cfg``, as tokenmill's modules hold them."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if cfg.attention_bias else 0) + (2 * d if cfg.qk_norm else 0)
    norms = (4 if cfg.architecture == "gemma3" else 2) * h
    per_layer = attn + 3 * h * cfg.intermediate_size + norms
    embedding = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return ParamCount(embedding, cfg.num_layers * per_layer + h)


def kept_layers(importance: Importance, n: int) -> list[int]:
    """The ``n`` layers of highest block influence, in order (ShortGPT)."""
    ranked = sorted(range(len(importance.block_influence)), key=lambda i: -importance.block_influence[i])
    return sorted(ranked[:n])


def _top(scores: torch.Tensor, n: int) -> list[int]:
    return sorted(torch.topk(scores, n).indices.tolist())


REFIT_DAMPING = 0.01
"""lambda of :func:`refit_columns` as a fraction of the kept inputs' mean second moment (GPTQ's
dampening): keeps the solve well posed where kept inputs are (nearly) collinear or silent."""


def refit_columns(weight: torch.Tensor, moment: torch.Tensor, keep: torch.Tensor,
                  damping: float = REFIT_DAMPING) -> torch.Tensor:
    """The columns ``keep`` of ``weight`` [out, K], refit so that on inputs x with second moment
    ``moment`` (sum x x^T, [K, K]) they predict the whole product W x best in least squares:

        W' = W_S + W_R G_RS (G_SS + lambda I)^-1,   lambda = damping * mean diag G_SS

    (S the kept columns, R the removed ones). The removed inputs' part of the output, the part
    correlated with the kept inputs, moves onto them; at damping 0 this is the least-squares
    solution exactly. Computed in float64, returned in ``weight``'s dtype."""
    K = weight.shape[1]
    keep = keep.to(torch.long).cpu()
    removed = torch.ones(K, dtype=torch.bool)
    removed[keep] = False
    if not removed.any():
        return weight[:, keep.to(weight.device)].clone()
    drop = removed.nonzero().squeeze(1)
    g = moment.to(torch.float64).cpu()
    g_ss, g_sr = dampen_(g[keep][:, keep], damping), g[keep][:, drop]
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    moved = torch.linalg.solve(g_ss, g_sr @ w[:, drop].T).T  # [out, |S|] = W_R G_RS (G_SS + lambda I)^-1
    return (w[:, keep] + moved).to(device=weight.device, dtype=weight.dtype)


@torch.no_grad()
def shrink(model: CausalLM, shape: Shape, importance: Importance) -> CausalLM:
    """The model with ``shape``: each kept layer keeps its own best KV groups (by the sum of their
    heads' scores), in each its best heads, and its best FFN channels; with ``importance``'s second
    moments, the o and down projections' kept columns are refit (:func:`refit_columns`). A new
    model; ``model`` is unchanged."""
    cfg = model.config
    full = Shape.of(cfg)
    if (shape.num_layers > full.num_layers or shape.num_kv_heads > full.num_kv_heads
            or shape.heads_per_group > full.heads_per_group or shape.intermediate_size > full.intermediate_size):
        raise InvalidParameterError(f"structured pruning cannot grow a model: {shape.describe()} from {full.describe()}")
    layers = kept_layers(importance, shape.num_layers)
    groups = importance.kv_groups(full.heads_per_group)
    tensors = canonical_tensors(model)
    d = cfg.head_dim
    out: dict[str, torch.Tensor] = {n: t for n, t in tensors.items() if not n.startswith("layers.")}
    for new, old in enumerate(layers):
        kept_groups = _top(groups[old], shape.num_kv_heads)
        q_heads = [g * full.heads_per_group + h for g in kept_groups
                   for h in _top(importance.heads[old].reshape(-1, full.heads_per_group)[g], shape.heads_per_group)]
        q_rows = torch.tensor([h * d + j for h in q_heads for j in range(d)])
        kv_rows = torch.tensor([g * d + j for g in kept_groups for j in range(d)])
        channels = torch.tensor(_top(importance.channels[old], shape.intermediate_size))
        for name, t in tensors.items():
            prefix = f"layers.{old}."
            if not name.startswith(prefix):
                continue
            part = name[len(prefix):]
            if part.startswith("attn.q.") and not part.startswith("attn.q_norm"):
                t = t[q_rows.to(t.device)]
            elif part.startswith(("attn.k.", "attn.v.")):
                t = t[kv_rows.to(t.device)]
            elif part == "attn.o.weight":
                t = (t[:, q_rows.to(t.device)] if importance.o_moments is None
                     else refit_columns(t, importance.o_moments[old], q_rows))
            elif part.startswith(("mlp.gate.", "mlp.up.")):
                t = t[channels.to(t.device)]
            elif part == "mlp.down.weight":
                t = (t[:, channels.to(t.device)] if importance.down_moments is None
                     else refit_columns(t, importance.down_moments[old], channels))
            out[f"layers.{new}.{part}"] = t.clone()
    new_cfg = shape.config(cfg, layers)
    dtype = model.embed.weight.dtype
    return build_model(Checkpoint(new_cfg, iter(out.items())), dtype, model.embed.weight.device)


def shape_for(config: StructuredConfig, cfg: ModelConfig) -> Shape:
    """The shape named by a config's explicit sizes (unset ones: the model's)."""
    full = Shape.of(cfg)
    shape = Shape(config.num_layers or full.num_layers, config.num_kv_heads or full.num_kv_heads,
                  config.heads_per_group or full.heads_per_group, config.intermediate_size or full.intermediate_size)
    if shape.num_kv_heads > full.num_kv_heads or shape.heads_per_group > full.heads_per_group \
            or shape.num_layers > full.num_layers or shape.intermediate_size > full.intermediate_size:
        raise InvalidParameterError(f"structured pruning keeps at most the model's shape ({full.describe()}), "
                                    f"asked for {shape.describe()}")
    if not shape.expressible(cfg):
        raise InvalidParameterError(f"{shape.num_kv_heads * shape.heads_per_group} attention heads do not divide the "
                                    f"hidden size {cfg.hidden_size}, which HF's Llama config requires")
    return shape


def budget(config: StructuredConfig, cfg: ModelConfig) -> int:
    """The non-embedding parameter budget of ``config.target_params``."""
    full = parameter_count(cfg).non_embedding
    t = config.target_params
    return int(t * full) if t < 1 else int(t)


def planned_shapes(config: StructuredConfig, cfg: ModelConfig) -> list[Shape]:
    """The plan's candidate shapes for ``config.target_params``; an error naming the problem where
    there are none to plan: a budget that keeps the whole model, or one below every reachable shape."""
    full = parameter_count(cfg).non_embedding
    target = budget(config, cfg)
    if target >= full:
        raise InvalidParameterError(f"a target of {target:,} non-embedding parameters keeps the whole model "
                                    f"({full:,}): ask for fewer (a fraction below 1, or a smaller count)")
    shapes = candidate_shapes(cfg, target, config.dims, config.channel_multiple)
    if not shapes:
        smallest = parameter_count(Shape(1, 1, 1, config.channel_multiple).config(cfg, [0])).non_embedding
        raise InvalidParameterError(
            f"no shape over {', '.join(config.dims)} fits {target:,} non-embedding parameters "
            f"(the model has {full:,}; the smallest reachable is {smallest:,} with heads, channels and layers)")
    return shapes


def check_shape(config: StructuredConfig, cfg: ModelConfig) -> None:
    """Raise now, before any calibration pass, where ``config`` asks for a shape ``cfg`` cannot take."""
    if config.target_params is not None:
        planned_shapes(config, cfg)
    else:
        shape_for(config, cfg)


def candidate_shapes(cfg: ModelConfig, target: int, dims: tuple[str, ...], multiple: int) -> list[Shape]:
    """Shapes with at most ``target`` non-embedding parameters, each as large as the budget lets the
    FFN (with ``channels``) or the depth (without) be: every KV-group count and heads-per-group of
    ``heads``, depths from the full one down in tenths with ``layers``."""
    full = Shape.of(cfg)
    group_options = range(1, full.num_kv_heads + 1) if "heads" in dims else [full.num_kv_heads]
    per_group_options = range(1, full.heads_per_group + 1) if "heads" in dims else [full.heads_per_group]
    if "layers" in dims:
        depths = sorted({max(1, round(full.num_layers * f / 10)) for f in range(10, 1, -1)}, reverse=True)
    else:
        depths = [full.num_layers]
    count = lambda s: parameter_count(s.config(cfg, list(range(s.num_layers)))).non_embedding  # noqa: E731
    out = []
    for groups, per_group in itertools.product(group_options, per_group_options):
        if not Shape(1, groups, per_group, 1).expressible(cfg):
            continue
        if "channels" in dims:
            for depth in depths:
                low, high = 0, full.intermediate_size // multiple  # the widest multiple within budget
                while low < high:
                    mid = (low + high + 1) // 2
                    if count(Shape(depth, groups, per_group, mid * multiple)) <= target:
                        low = mid
                    else:
                        high = mid - 1
                if low > 0:
                    out.append(Shape(depth, groups, per_group, min(low * multiple, full.intermediate_size)))
        else:
            depth_options = range(full.num_layers, 0, -1) if "layers" in dims else [full.num_layers]
            fitting = [n for n in depth_options if count(Shape(n, groups, per_group, full.intermediate_size)) <= target]
            if fitting:  # the deepest that fits
                out.append(Shape(fitting[0], groups, per_group, full.intermediate_size))
    # the budget binds: drop shapes far below it (another candidate uses it better)
    best = max((count(s) for s in out), default=0)
    return sorted({s for s in out if count(s) >= 0.9 * best}, key=lambda s: -count(s))


@dataclass
class PlanEntry:
    shape: Shape
    non_embedding: int
    calibration_nll: float


def plan(model: CausalLM, config: StructuredConfig, importance: Importance, samples: list[list[int]],
         progress: bool = True, max_candidates: int = 16) -> tuple[Shape, list[PlanEntry]]:
    """The shape within ``config.target_params`` whose shrunk model has the lowest loss on
    ``samples``, and every candidate's figures (lowest loss first)."""
    shapes = planned_shapes(config, model.config)
    if len(shapes) > max_candidates:  # evenly over the list, which runs from the largest
        shapes = [shapes[round(i * (len(shapes) - 1) / (max_candidates - 1))] for i in range(max_candidates)]
    ids = [t for s in samples for t in s]
    entries = []
    for shape in tqdm(shapes, desc="plan", disable=not progress, unit="shape"):
        small = shrink(model, shape, importance)
        nll = perplexity(small, ids, context=len(samples[0]), stride=len(samples[0]), progress=False).nll
        entries.append(PlanEntry(shape, parameter_count(small.config).non_embedding, nll))
        del small
    entries.sort(key=lambda e: e.calibration_nll)
    if not math.isfinite(entries[0].calibration_nll):
        raise InvalidParameterError("every candidate shape gave a non-finite calibration loss")
    return entries[0].shape, entries
