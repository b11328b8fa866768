"""The distillation losses, over logits [B, S, V] of one batch of token ids [B, S].

    soft_kl            T^2 * KL(p_teacher^T || p_student^T), every position
    total_variation    1 - sum_v min(p_teacher, p_student) at T = 1: the probability that
                       speculative sampling rejects a token the student drafted (the accept
                       test keeps x with probability min(1, p_t(x) / p_s(x)); summed over
                       x ~ p_s that is sum_v min(p_t, p_s))
    argmax_agreement   how often the student's top token is the teacher's: greedy acceptance
    FeatureTransfer    MSE between layer-normalized hidden states of paired blocks, the
                       student's through a learned projection when the widths differ

:func:`distill_loss` combines them as :class:`~tokenmill.distillation.config.DistillConfig`
says and returns every term as a float for the log, whichever are optimized.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distillation.config import DistillConfig
from tokenmill.models.base import CausalLM


def soft_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """student, teacher [N, V] logits -> T^2 * mean over rows of KL(softmax(teacher / T) || softmax(student / T))
    (``weights`` [N]: the rows' weighted mean)."""
    logp = F.log_softmax(student / temperature, dim=-1)
    target = F.log_softmax(teacher / temperature, dim=-1)
    rows = F.kl_div(logp, target, log_target=True, reduction="none").sum(-1)
    return weighted_mean(rows, weights) * temperature ** 2


def total_variation(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """student, teacher [N, V] logits -> mean over rows of 1 - sum_v min(p_teacher, p_student)."""
    overlap = torch.minimum(F.softmax(student, dim=-1), F.softmax(teacher, dim=-1)).sum(-1)
    return weighted_mean(1 - overlap, weights)


def argmax_agreement(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Fraction of rows whose argmax is the same in both [N, V] logits."""
    return weighted_mean((student.argmax(-1) == teacher.argmax(-1)).float(), weights).item()


def weighted_mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """values [N] -> their mean, or with ``weights`` [N] their weighted mean (0 where every weight is 0)."""
    if weights is None:
        return values.mean()
    weights = weights.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1)


@contextmanager
def block_outputs(model: CausalLM, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block, each forward of ``model`` fills the dict with the output ([tokens, hidden],
    the residual stream) of each block in ``layers``; the hooks are gone after."""
    out: dict[int, torch.Tensor] = {}
    handles = [model.layers[i].register_forward_hook(lambda m, args, h, i=i: out.__setitem__(i, h))
               for i in layers]
    try:
        yield out
    finally:
        for handle in handles:
            handle.remove()


def evenly_spaced_pairs(student_layers: int, teacher_layers: int) -> tuple[tuple[int, int], ...]:
    """Student block i <- teacher block round((i + 1) * teacher / student) - 1: the last to the last,
    the others at the same relative depth."""
    return tuple((i, round((i + 1) * teacher_layers / student_layers) - 1) for i in range(student_layers))


class FeatureTransfer(nn.Module):
    """Hidden-state transfer: for each pair (i, j), MSE between the layer-normalized output of
    teacher block j and that of student block i mapped by its own linear projection (identity when
    both widths are equal). Normalizing both sides matches directions and relative sizes, not the
    scale of the residual stream, which grows with depth differently in the two models."""

    def __init__(self, pairs: tuple[tuple[int, int], ...], student_hidden: int, teacher_hidden: int) -> None:
        super().__init__()
        self.pairs, self.teacher_hidden = pairs, teacher_hidden
        self.proj = nn.ModuleList(nn.Linear(student_hidden, teacher_hidden, bias=False) for _ in pairs) \
            if student_hidden != teacher_hidden else None

    @property
    def student_layers(self) -> list[int]:
        return [i for i, _ in self.pairs]

    @property
    def teacher_layers(self) -> list[int]:
        return [j for _, j in self.pairs]

    def forward(self, student: dict[int, torch.Tensor], teacher: dict[int, torch.Tensor]) -> torch.Tensor:
        """Block outputs by layer index (as :func:`block_outputs` fills them) -> the mean MSE over the pairs."""
        total = 0.0
        for k, (i, j) in enumerate(self.pairs):
            h = student[i] if self.proj is None else self.proj[k](student[i])
            norm = (self.teacher_hidden,)
            total = total + F.mse_loss(F.layer_norm(h.float(), norm), F.layer_norm(teacher[j].float(), norm))
        return total / len(self.pairs)


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor, config: DistillConfig,
                 feature: torch.Tensor | None = None,
                 trained: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Logits [B, S, V] of both models on ids [B, S] (and the feature loss, when transferring)
    -> (the loss ``config`` optimizes, {kd, tvd, ce, acceptance[, feature]} for the log).

    The distribution terms cover every position; the text's next-token cross entropy the first
    S - 1. ``trained`` [B, S] (bool): only the positions it marks count (completion-only
    training: those whose next token the teacher wrote). Terms the objective does not optimize
    are computed on detached logits (logged, no graph)."""
    v = student.shape[-1]
    s_rows, t_rows = student.reshape(-1, v), teacher.reshape(-1, v)
    rows = None if trained is None else trained.reshape(-1)
    kd_objective = config.objective == "kd"
    kd = soft_kl(s_rows if kd_objective else s_rows.detach(), t_rows, config.temperature, rows)
    tvd = total_variation(s_rows.detach() if kd_objective else s_rows, t_rows, rows)
    text_logits = (student if kd_objective else student.detach())[:, :-1].reshape(-1, v)
    ce = weighted_mean(F.cross_entropy(text_logits, ids[:, 1:].reshape(-1), reduction="none"),
                       None if trained is None else trained[:, :-1].reshape(-1))
    values = {"kd": kd.item(), "tvd": tvd.item(), "ce": ce.item(),
              "acceptance": argmax_agreement(s_rows, t_rows, rows)}
    if kd_objective:
        loss = config.kd_weight * kd + config.ce_weight * ce
    else:
        ce_argmax = weighted_mean(F.cross_entropy(s_rows, t_rows.argmax(-1), reduction="none"), rows)
        loss = config.kd_weight * tvd + config.ce_weight * ce_argmax
        values["ce_argmax"] = ce_argmax.item()
    if feature is not None:
        loss = loss + config.feature_weight * feature
        values["feature"] = feature.item()
    return loss, values
