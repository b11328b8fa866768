"""Sparse upcycling: a dense model -> a mixture-of-experts model, trained, judged, saved.

    upcycle(dense, UpcycleConfig(experts=8, top_k=2), out_dir)
      grow        every MLP becomes ``experts`` experts (copies with noise, or its channels
                  partitioned) behind a new router: :func:`upcycled_model`
      train       the distillation loop (tokenmill.distillation): the dense model teaches the MoE
                  model, plus the load-balancing loss of its routers (:class:`BalanceLoss`)
      baseline    a copy of the dense model trained on the same tokens with the same loss, so the
                  upcycled model is judged against what the same training does without experts
      report      held-out perplexity of dense, baseline and upcycled; per layer and expert the
                  share of routed tokens; router entropy; how far apart the experts' weights
                  moved (copies that stayed copies are not a mixture); ``upcycle.json`` and the
                  expert-load plot ``expert_load.png``
      save        ``out_dir/student``: a Mixtral-layout HF checkpoint (transformers loads it;
                  tokenmill serves, quantizes and benchmarks it)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.config import ModelConfig, MoESpec
from tokenmill.device import resolve_device
from tokenmill.distillation.distill import LOG_FILE, distill
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.corpus import fetch_corpus, read_tokens
from tokenmill.eval.perplexity import perplexity
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel, build_model
from tokenmill.models.export import canonical_tensors
from tokenmill.models.moe import SparseMoE
from tokenmill.models.moe_stats import plot_expert_load
from tokenmill.paths import default_cache_dir
from tokenmill.quantization.api import load_float32
from tokenmill.upcycling.config import UpcycleConfig

REPORT_FILE = "upcycle.json"
PLOT_FILE = "expert_load.png"
_MLP = re.compile(r"^layers\.(\d+)\.mlp\.(gate|up|down)\.weight$")


def upcycled_config(cfg: ModelConfig, config: UpcycleConfig) -> ModelConfig:
    """The MoE architecture grown from ``cfg``: every layer MoE, Mixtral's routing (softmax, top-k
    renormalised), experts of the MLP's width (copy) or of width / experts (partition)."""
    if cfg.moe is not None:
        raise InvalidParameterError("upcycle: the model already has experts")
    if cfg.architecture != "llama":
        raise InvalidParameterError(f"upcycle: the Llama family only (Mixtral's layout), not {cfg.architecture}")
    width = cfg.intermediate_size
    if config.init == "partition":
        if width % config.experts:
            raise InvalidParameterError(f"upcycle: init partition needs the MLP width ({width}) to divide into "
                                        f"{config.experts} experts")
        width //= config.experts
    spec = MoESpec(num_experts=config.experts, top_k=config.top_k, expert_intermediate_size=width,
                   norm_topk_prob=True)
    return dataclasses.replace(cfg, intermediate_size=width, moe=spec)


def upcycled_model(dense: LoadedModel, config: UpcycleConfig) -> LoadedModel:
    """The untrained MoE model grown from ``dense`` (a float model), float32, on its device."""
    cfg = upcycled_config(dense.config, config)
    device = dense.model.embed.weight.device
    gen = torch.Generator().manual_seed(config.seed)
    tensors = canonical_tensors(dense.model)
    e, k, width = config.experts, config.top_k, cfg.intermediate_size

    def expert_weight(t: torch.Tensor, projection: str, expert: int) -> torch.Tensor:
        t = t.float().cpu()
        if config.init == "copy":
            return t + torch.randn(t.shape, generator=gen) * (config.noise * t.std())
        if projection == "down":  # the chosen k of 1/e parts each, weighted 1/k: scaled to add up as the MLP's sum
            return t[:, expert * width:(expert + 1) * width] * k
        return t[expert * width:(expert + 1) * width]

    def items():
        for name, t in tensors.items():
            m = _MLP.match(name)
            if m is None:
                yield name, t
                continue
            layer, projection = m.groups()
            if projection == "gate":
                yield f"layers.{layer}.mlp.router.weight", torch.randn(
                    e, cfg.hidden_size, generator=gen) * config.router_std
            for expert in range(e):
                yield f"layers.{layer}.mlp.experts.{expert}.{projection}.weight", expert_weight(t, projection, expert)

    model = build_model(Checkpoint(cfg, items()), torch.float32, device)
    return LoadedModel(model, cfg, dense.tokenizer, dense.source)


class BalanceLoss:
    """The load-balancing loss of the Switch Transformer (Fedus et al. 2022), as Mixtral trains
    with it: per MoE layer ``experts * sum_e f_e * P_e``, f_e the fraction of the step's top-k
    assignments that went to expert e and P_e its mean router probability, divided by top_k so
    that 1.0 means perfectly even; the mean over layers. Collects each training forward's router
    logits through hooks (forward passes without autograd, like evaluation, are not collected)."""

    def __init__(self, model: CausalLM, weight: float) -> None:
        self.weight = weight
        self.logits: list[tuple[torch.Tensor, MoESpec]] = []
        self.handles = [moe.router.register_forward_hook(
            lambda module, args, out, spec=moe.spec: self.logits.append((out, spec)) if torch.is_grad_enabled()
            else None) for moe in model.modules() if isinstance(moe, SparseMoE)]

    def __call__(self) -> tuple[torch.Tensor, dict[str, float]]:
        losses = []
        for logits, spec in self.logits:
            probs = F.softmax(logits.float(), dim=-1)
            chosen = F.one_hot(torch.topk(probs, spec.top_k, dim=-1).indices, spec.num_experts).float()
            share = chosen.sum(1).mean(0) / spec.top_k  # [experts]: fraction of assignments
            losses.append(spec.num_experts * (share * probs.mean(0)).sum())
        self.logits.clear()
        loss = torch.stack(losses).mean()
        return self.weight * loss, {"balance": loss.item()}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass
class UpcycleResult:
    student: LoadedModel
    saved: Path
    report: dict
    plot: Path | None


def upcycle(dense: LoadedModel, config: UpcycleConfig, out_dir: str | os.PathLike, progress: bool = True,
            cache_dir: str | os.PathLike | None = None) -> UpcycleResult:
    """Grow, train and judge an MoE model from ``dense`` (float32); everything goes to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else None

    def train_moe() -> _Run:
        moe = upcycled_model(dense, config)
        balance = BalanceLoss(moe.model, config.balance_weight)
        try:
            return _Run.of(distill(dense, moe, config.distill, out, progress, cache_dir=cache_dir, extra_loss=balance,
                                   extra_record={"upcycle": config.to_dict()}))
        finally:
            balance.remove()

    run = _finished(out, dense, cache) or train_moe()
    report: dict = {"config": config.to_dict(), "dense": dense.source.name,
                    "perplexity": {"dense": run.perplexity["teacher"], "upcycled_before": run.perplexity["student_before"],
                                   "upcycled": run.perplexity["student_after"]},
                    "parameters": {"dense": _count(dense.model), "upcycled": _count(run.student.model),
                                   "upcycled_active": _active(run.student.model)},
                    "tokens_seen": run.tokens_seen, "wall_seconds": {"upcycled": run.wall_seconds}}
    if config.baseline:
        baseline = _finished(out / "dense-baseline", dense, cache) or _Run.of(distill(
            dense, LoadedModel(copy.deepcopy(dense.model), dense.config, dense.tokenizer, dense.source),
            config.distill, out / "dense-baseline", progress, cache_dir=cache_dir))
        report["perplexity"]["dense_trained"] = baseline.perplexity["student_after"]
        report["wall_seconds"]["dense_trained"] = baseline.wall_seconds
    held_out = read_tokens(dense.tokenizer, fetch_corpus(Path(cache_dir) if cache_dir else None),
                           max(config.distill.eval_tokens, 512))
    report["routing"] = routing_report(run.student.model, held_out)
    report["expert_similarity"] = expert_similarity(run.student.model)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    plot = plot_expert_load(report["routing"]["load"], out / PLOT_FILE,
                            f"upcycled {dense.source.name}: share of routed tokens (even: {1 / config.experts:.3f})")
    return UpcycleResult(run.student, run.saved, report, plot)


@dataclass
class _Run:
    """What upcycle needs of a distillation run: one just trained, or one a previous call finished."""

    student: LoadedModel
    saved: Path
    perplexity: dict
    tokens_seen: int
    wall_seconds: float

    @classmethod
    def of(cls, result) -> _Run:
        return cls(result.student, result.saved, result.perplexity, result.tokens_seen, result.wall_seconds)


def _finished(out: Path, dense: LoadedModel, cache: Path | None) -> _Run | None:
    """The run a previous call completed in ``out`` (its student saved and its log.json written):
    an interrupted upcycle resumes after the phases it finished, reading the saved student rather
    than training again or loading the optimizer's checkpoint."""
    log, saved = out / LOG_FILE, out / "student"
    if not (log.is_file() and (saved / "config.json").is_file()):
        return None
    record = json.loads(log.read_text())
    student = load_float32(saved, dense.model.embed.weight.device, cache or default_cache_dir())
    return _Run(student, saved, record["perplexity"], record["tokens_seen"], record["wall_seconds"])


def upcycle_model_arg(model: str | os.PathLike, config: UpcycleConfig, out_dir: str | os.PathLike,
                      device: str = "cpu", progress: bool = True,
                      cache_dir: str | os.PathLike | None = None) -> UpcycleResult:
    """:func:`upcycle` of a model argument (name, GGUF file, HF directory), loaded in float32."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return upcycle(load_float32(model, resolve_device(device), cache), config, out_dir, progress, cache)


@torch.no_grad()
def routing_report(model: CausalLM, ids: list[int]) -> dict:
    """How ``model``'s routers spread ``ids`` (held-out text): per layer and expert the share of
    assignments, the mean router entropy (nats, and as a fraction of log(experts)), and the
    largest share any expert takes (even: 1 / experts)."""
    stats = model.expert_stats
    stats.drain()
    context = min(512, len(ids))
    perplexity(model, ids, context=context, stride=context, progress=False)
    step = stats.drain()
    experts = model.config.moe.num_experts
    load = [[n / sum(row) for n in row] for row in step.tokens_per_expert if sum(row)]
    return {"load": load, "mean_entropy": step.mean_entropy,
            "entropy_fraction": step.mean_entropy / math.log(experts),
            "max_share": max(max(row) for row in load), "min_share": min(min(row) for row in load),
            "tokens": step.routed_tokens // max(1, len(load))}


@torch.no_grad()
def expert_similarity(model: CausalLM) -> dict:
    """Mean cosine similarity of the experts' flattened weights, pairwise within each layer: 1.0 for
    identical copies; how far training (and the noise) moved them apart."""
    sims = []
    for block in model.layers:
        if not isinstance(block.mlp, SparseMoE):
            continue
        flat = torch.stack([torch.cat([p.detach().float().flatten() for p in e.parameters()])
                            for e in block.mlp.experts])
        flat = F.normalize(flat, dim=1)
        cos = flat @ flat.T
        n = cos.shape[0]
        sims.append(((cos.sum() - n) / (n * (n - 1))).item())
    return {"mean_pairwise_cosine": sum(sims) / len(sims), "per_layer": sims}


def _count(model: CausalLM) -> int:
    return sum(p.numel() for p in model.parameters())


def _active(model: CausalLM) -> int:
    """Parameters one token runs through: all but the experts it is not routed to."""
    total = _count(model)
    for block in model.layers:
        if isinstance(block.mlp, SparseMoE):
            per_expert = sum(p.numel() for p in block.mlp.experts[0].parameters())
            total -= (block.mlp.spec.num_experts - block.mlp.spec.top_k) * per_expert
    return total
