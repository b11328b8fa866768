"""Knowledge distillation: train a student to match a frozen teacher's next-token distributions.

    distill(teacher, student, DistillConfig(...), out_dir)         two models in memory
    distill_models("smollm2-135m-instruct", "pruned/", config, out) model arguments, loaded in float32

One run:
  check        the student shares the teacher's vocabulary and tokenizer (the losses compare
               distributions row by row, so a different vocabulary has nothing to compare)
  measure      held-out perplexity of the teacher and the student (the corpus start, as eval does)
               and, with ``agreement_prompts`` (a draft's run by default), their greedy agreement
               on the teacher's answers to held-out chat prompts (agreement.py)
  data         the token stream ``config.data`` names (data.py); seeded windows of it
  prepare      with ``qat``: the student's linear layers become fake-quantized (qat.py); with
               ``keep_sparsity``: masks of the student's zeros; with ``feature_weight``: the
               projections of :class:`~tokenmill.distillation.losses.FeatureTransfer`
  train        the shared trainer (AdamW, accumulation, autocast, progress, checkpoints every
               ``checkpoint_every`` steps in ``out_dir``, resume; with each checkpoint a float
               student's weights so far in ``out_dir/student-latest``, which loads and serves like
               the final one while the run goes on): per micro-batch the teacher's logits (and
               hidden states) are computed on the fly without autograd, nothing is cached,
               and the student's forward runs over training_attention (plain causal SDPA)
  finish       convert a QAT student to INT4/INT8, measure again, save the student (HF directory,
               or a quantized one), ``log.json`` and ``loss.png``

A student made by ``tokenmill prune`` (an HF directory: smaller widths or fewer layers, or
zeros) is the Minitron recipe: prune the teacher, then distill the teacher back into it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tokenmill.device import resolve_device
from tokenmill.distillation.agreement import Answers, agreement, held_out_answers
from tokenmill.distillation.config import DistillConfig
from tokenmill.distillation.data import training_data
from tokenmill.distillation.losses import FeatureTransfer, block_outputs, distill_loss, evenly_spaced_pairs
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.corpus import fetch_corpus, read_tokens
from tokenmill.eval.perplexity import perplexity
from tokenmill.loading.sources import ModelSource
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel
from tokenmill.models.export import save_hf
from tokenmill.paths import default_cache_dir
from tokenmill.quantization.api import load_float32
from tokenmill.quantization.checkpoint import save_quantized
from tokenmill.quantization.qat import convert_qat, prepare_qat, sample_batches, training_logits
from tokenmill.training.trainer import Trainer, TrainLog

ExtraLoss = Callable[[], tuple[torch.Tensor, dict[str, float]]]
"""A term added to each micro-batch's loss, read from what its forward passes left (hooks)."""
LATEST = "student-latest"
"""The student as of the last periodic checkpoint (float students), beside ``checkpoint.pt``."""
LOG_FILE = "log.json"
PLOT_FILE = "loss.png"
SPARSE_LAYER_FRACTION = 0.1
"""A linear weight with at least this fraction of exact zeros is taken to be pruned (keep_sparsity)."""


@dataclass
class DistillResult:
    """What a run produced; ``log.json`` in ``out_dir`` holds the same."""

    student: LoadedModel
    """The trained student as saved (quantized with ``qat``), ready to run."""
    saved: Path
    """The student's directory (``out_dir/student``)."""
    log: dict[str, list[float]]
    """Per optimizer step: loss, kd, tvd, ce, acceptance (argmax agreement)[, ce_argmax, feature]."""
    perplexity: dict[str, float | None]
    """Held-out perplexity: teacher, student_before, student_after (None with eval_tokens 0)."""
    agreement: dict[str, float | None]
    """Held-out greedy agreement with the teacher's answers (agreement.py): teacher (itself, about
    1), student_before, student_after (None with agreement_prompts 0)."""
    tokens_seen: int
    """Training tokens the student read (all steps, the resumed part included)."""
    wall_seconds: float
    """This call's wall time."""
    resumed_at: int
    """The step training resumed from (0: from the start)."""
    plot: Path | None
    """``loss.png`` (None without matplotlib)."""


def distill(teacher: CausalLM | LoadedModel, student: CausalLM | LoadedModel, config: DistillConfig,
            out_dir: str | os.PathLike, progress: bool = True, tokenizer: Tokenizer | None = None,
            cache_dir: str | os.PathLike | None = None, extra_loss: ExtraLoss | None = None,
            extra_record: dict | None = None) -> DistillResult:
    """Train ``student`` (float32, in place) on ``teacher`` (frozen) as ``config`` says; checkpoints,
    the log, the plot and the student go to ``out_dir``; a checkpoint there is resumed from.
    ``tokenizer``: the shared tokenizer, needed when both models are bare CausalLMs.
    ``extra_loss``: called after each micro-batch's forward passes, its loss added to the
    objective and its values to the log (an MoE student's load-balancing loss); ``extra_record``:
    further entries of the ``distillation`` record in the student's config.json and log.json."""
    start = time.monotonic()
    teacher, student = _loaded(teacher, tokenizer, "teacher"), _loaded(student, tokenizer, "student")
    check_same_vocabulary(teacher, student)
    _check_float32(student.model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else None
    held_out = read_tokens(teacher.tokenizer, fetch_corpus(cache), config.eval_tokens) if config.eval_tokens else None
    scores = {"teacher": _perplexity(teacher.model, held_out), "student_before": _perplexity(student.model, held_out)}
    answers = (held_out_answers(teacher, config.agreement_prompts, config.agreement_tokens, config.seed)
               if config.agreement_prompts else None)
    agreed = {"teacher": _agreement(teacher.model, answers), "student_before": _agreement(student.model, answers)}
    ids, trained = training_data(config, teacher, out, cache, progress)

    run = {"config": config.to_dict(), "teacher": teacher.source.name, "student": student.source.name}

    def save_latest(step: int) -> None:
        if config.qat is None:  # a fake-quantized student is written once, converted, at the end
            _save_latest(student, out, config, {**pruned_from(student, config), "distillation": {
                **run, "checkpoint_step": step, "tokens_seen": step * config.tokens_per_step}})

    log = _train(teacher.model, student.model, config, ids, out, progress, held_out, extra_loss, trained, answers,
                 save_latest)
    if config.qat is not None:
        convert_qat(student.model, config.qat, progress)
    else:
        student.model.to(getattr(torch, config.save_dtype))  # measured as it is written
    scores["student_after"] = _perplexity(student.model, held_out)
    agreed["student_after"] = _agreement(student.model, answers)
    tokens = config.train.steps * config.tokens_per_step
    record = {**run, "tokens_seen": tokens, "wall_seconds": round(time.monotonic() - start, 3),
              "resumed_at": log.resumed_at, "perplexity": scores, "agreement": agreed, **(extra_record or {})}
    saved = _save(student, out / "student", {**pruned_from(student, config), "distillation": record})
    (out / LOG_FILE).write_text(json.dumps({**record, "per_step": log.values}, indent=2))
    plot = plot_losses(log.values, out / PLOT_FILE)
    return DistillResult(student, saved, log.values, scores, agreed, tokens, record["wall_seconds"], log.resumed_at,
                         plot)


def distill_models(teacher: str | os.PathLike | LoadedModel, student: str | os.PathLike | LoadedModel,
                   config: DistillConfig, out_dir: str | os.PathLike, device: str = "cpu", progress: bool = True,
                   cache_dir: str | os.PathLike | None = None) -> DistillResult:
    """:func:`distill` the first model into the second (``tokenmill.distill``, the CLI's verb). Each
    is a model argument (name, GGUF file, HF directory: e.g. one ``tokenmill prune`` wrote), loaded
    in float32 on ``device``, or a ``LoadedModel`` already in memory (a student trained in place)."""
    resolved = resolve_device(device)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()

    def load(model: str | os.PathLike | LoadedModel) -> LoadedModel:
        return model if isinstance(model, LoadedModel) else load_float32(model, resolved, cache)

    return distill(load(teacher), load(student), config, out_dir, progress, cache_dir=cache)


# --------------------------------------------------------------------------- checks and parts

def _train(teacher: CausalLM, student: CausalLM, config: DistillConfig, ids: list[int], out: Path,
           progress: bool, held_out: list[int] | None = None, extra_loss: ExtraLoss | None = None,
           trained: list[bool] | None = None, answers: Answers | None = None,
           on_checkpoint: Callable[[int], None] | None = None) -> TrainLog:
    """Prepare the student (masks of its zeros, fake quantization, projections) and run the trainer;
    every ``config.eval_every`` steps the student's perplexity on ``held_out`` and its agreement
    on ``answers`` (each when given) join the log.
    ``trained``: per token of ``ids``, whether it is trained on (completion-only); None: all."""
    masks = sparsity_masks(student) if config.keep_sparsity else []
    if config.qat is not None:
        prepare_qat(student, config.qat, getattr(torch, config.save_dtype))
    features = _feature_transfer(teacher, student, config)
    teacher.requires_grad_(False)
    student.requires_grad_(True)
    student.embed.weight.requires_grad_(config.train_embedding)
    modules: dict[str, nn.Module] = {"student": student}
    if features is not None:
        modules["features"] = features
    trainer = Trainer(modules, config.train, out, desc="distill", progress=progress)
    batches = sample_batches(ids, config.train.steps * config.train.grad_accum, config.batch_size, config.seq_len,
                             config.seed, student.embed.weight.device, trained)

    def after_step(step: int) -> dict[str, float] | None:
        reapply(masks)
        if not config.eval_every or (step % config.eval_every and step != config.train.steps):
            return None
        measured: dict[str, float] = {"eval_step": step}
        if held_out is not None:
            measured["eval_perplexity"] = _perplexity(student, held_out)
        if answers is not None:
            measured["eval_agreement"] = agreement(student, answers)
        return measured

    def batch_loss(batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        windows, mask = batch if trained is not None else (batch, None)
        loss, values = step_loss(teacher, student, features, windows, config, mask)
        if extra_loss is not None:
            more, more_values = extra_loss()
            loss = loss + more
            values.update(more_values)
        return loss, values

    log = trainer.fit(batches, batch_loss, after_step=after_step, on_checkpoint=on_checkpoint)
    student.requires_grad_(False)
    return log


def check_same_vocabulary(teacher: LoadedModel, student: LoadedModel) -> None:
    """InvalidParameterError naming the first difference between the two vocabularies, if any."""
    t, s = teacher.config.vocab_size, student.config.vocab_size
    why = "distillation compares next-token distributions row by row, so both need one vocabulary"
    if t != s:
        raise InvalidParameterError(f"the student's vocabulary differs from the teacher's: vocab_size {s} "
                                    f"(student) vs {t} (teacher); {why}")
    tt, st = teacher.tokenizer, student.tokenizer
    if tt is st:
        return
    if tt.vocab_size != st.vocab_size:
        raise InvalidParameterError(f"the student's tokenizer differs from the teacher's: {st.vocab_size} tokens "
                                    f"(student) vs {tt.vocab_size} (teacher); {why}")
    for i in range(tt.vocab_size):
        a, b = _spelling(tt, i), _spelling(st, i)
        if a != b:
            raise InvalidParameterError(f"the student's tokenizer differs from the teacher's: token id {i} is {b!r} "
                                        f"for the student, {a!r} for the teacher; {why}")


def _spelling(tokenizer: Tokenizer, i: int) -> str | None:
    try:
        return tokenizer.id_to_token(i)
    except InvalidParameterError:  # an id with no token (a hole in the vocabulary)
        return None


def _check_float32(model: CausalLM) -> None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if getattr(model, "quantization_config", None) is not None or dtypes != {torch.float32}:
        raise InvalidParameterError("distill: the student must be a float32 model (AdamW keeps float32 weights); "
                                    f"this one has {sorted(map(str, dtypes))} parameters")


def _loaded(model: CausalLM | LoadedModel, tokenizer: Tokenizer | None, role: str) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    if tokenizer is None:
        raise InvalidParameterError(f"distill: the {role} is a bare CausalLM; pass tokenizer= (or a LoadedModel)")
    return LoadedModel(model, model.config, tokenizer, ModelSource(role, "hf", Path(role)))


def sparsity_masks(model: CausalLM) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(weight, nonzero mask) of each linear weight (2-D, the embedding aside) with at least
    SPARSE_LAYER_FRACTION exact zeros: the pattern a pruned model's zeros make."""
    out = []
    for p in model.parameters():
        if p.dim() == 2 and p is not model.embed.weight:
            keep = p.detach() != 0
            if 1 - keep.float().mean().item() >= SPARSE_LAYER_FRACTION:
                out.append((p, keep))
    return out


@torch.no_grad()
def reapply(masks: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Zero again what an optimizer step moved off zero."""
    for p, keep in masks:
        p.mul_(keep)


def _feature_transfer(teacher: CausalLM, student: CausalLM, config: DistillConfig) -> FeatureTransfer | None:
    if config.feature_weight == 0:
        return None
    n_s, n_t = len(student.layers), len(teacher.layers)
    pairs = config.feature_layers or evenly_spaced_pairs(n_s, n_t)
    bad = [(i, j) for i, j in pairs if i >= n_s or j >= n_t]
    if bad:
        raise InvalidParameterError(f"DistillConfig.feature_layers: {bad} out of range (the student has {n_s} "
                                    f"layers, the teacher {n_t})")
    torch.manual_seed(config.seed)  # the projections' initial weights (a resumed run loads them)
    device = student.embed.weight.device
    return FeatureTransfer(pairs, student.config.hidden_size, teacher.config.hidden_size).to(device)


def step_loss(teacher: CausalLM, student: CausalLM, features: FeatureTransfer | None, batch: torch.Tensor,
              config: DistillConfig, trained: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's loss and its parts: what each step of :func:`distill` computes (and what
    ``bench/distill_budget.py`` times); ``trained``: the positions that count (completion-only),
    None: all. The teacher runs under no_grad rather than inference_mode:
    the KL's backward saves the teacher's probabilities, and inference tensors cannot be saved for
    backward."""
    t_layers, s_layers = (features.teacher_layers, features.student_layers) if features is not None else ([], [])
    with torch.no_grad(), block_outputs(teacher, t_layers) as t_hidden:
        t_logits = training_logits(teacher, batch)
    with block_outputs(student, s_layers) as s_hidden:
        s_logits = training_logits(student, batch)
    feature = features(s_hidden, t_hidden) if features is not None else None
    return distill_loss(s_logits, t_logits, batch, config, feature, trained)


def _agreement(model: CausalLM, answers: Answers | None) -> float | None:
    return None if answers is None else agreement(model, answers)


def _perplexity(model: CausalLM, ids: list[int] | None) -> float | None:
    if ids is None:
        return None
    context = min(512, len(ids))
    return perplexity(model, ids, context=context, stride=max(1, context // 2), progress=False).perplexity


def pruned_from(student: LoadedModel, config: DistillConfig) -> dict:
    """The ``pruning_config`` and ``pruning`` entries of the student's own config.json, when it is
    a ``tokenmill prune`` directory whose shapes or zeros the distilled student keeps (structured:
    always; unstructured: with ``keep_sparsity``), so that the loader runs its zeros on the sparse
    kernel as it does the pruned model's; else none."""
    try:
        source = json.loads((student.source.path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return {}
    method = (source.get("pruning_config") or {}).get("method")
    if method is None or (method != "structured" and not config.keep_sparsity):
        return {}
    return {k: source[k] for k in ("pruning_config", "pruning") if k in source}


def _save(student: LoadedModel, out: Path, extra: dict) -> Path:
    """An HF directory (float student) or a tokenmill-quantized one (QAT), config.json recording
    ``extra`` (``distillation``, and what the student was pruned by)."""
    if getattr(student.model, "quantization_config", None) is None:
        return save_hf(student.model, student.config, student.tokenizer, out, extra=extra)
    saved = save_quantized(student, out)
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
    return saved


def _save_latest(student: LoadedModel, out: Path, config: DistillConfig, extra: dict) -> Path:
    """The float student's weights so far, in ``config.save_dtype`` (the training copy untouched),
    as ``out/student-latest``: written beside it, then swapped in, so that a reader never meets
    a half-written directory."""
    final = out / LATEST
    fresh, old = out / (LATEST + ".tmp"), out / (LATEST + ".old")
    for stale in (fresh, old):
        shutil.rmtree(stale, ignore_errors=True)
    save_hf(student.model, student.config, student.tokenizer, fresh, dtype=getattr(torch, config.save_dtype),
            extra=extra)
    if final.exists():
        final.replace(old)
    fresh.replace(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def plot_losses(values: dict[str, list[float]], path: Path) -> Path | None:
    """Loss curves per step, argmax agreement (and, when measured while training, held-out
    agreement) and held-out perplexity per step -> the PNG, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = "eval_perplexity" in values  # eval_agreement shares the agreement panel
    fig, axes = plt.subplots(1, 3 if curve else 2, figsize=(16 if curve else 11, 4))
    losses, agreement = axes[0], axes[1]
    for name in ("loss", "kd", "tvd", "ce", "ce_argmax", "feature"):
        if name in values:
            losses.plot(range(1, len(values[name]) + 1), values[name], label=name)
    losses.set(xlabel="step", ylabel="nats per token (tvd: probability)", yscale="log", title="distillation losses")
    losses.legend()
    agreement.plot(range(1, len(values["acceptance"]) + 1), values["acceptance"], color="tab:green",
                   label="training batches")
    if "eval_agreement" in values:
        agreement.plot(values["eval_step"], values["eval_agreement"], marker="o", color="tab:purple",
                       label="held-out chat answers")
        agreement.legend()
    agreement.set(xlabel="step", ylabel="fraction of positions", ylim=(0, 1),
                  title="student top-1 = teacher top-1 (greedy acceptance)")
    if curve:
        axes[2].plot(values["eval_step"], values["eval_perplexity"], marker="o", color="tab:red")
        axes[2].set(xlabel="step", ylabel="perplexity", yscale="log", title="student held-out perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
