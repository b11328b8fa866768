"""What a distillation run optimizes, on which text, and how long: :class:`DistillConfig`.

    DistillConfig()                                      KL at T = 2 on the corpus' training split
    DistillConfig(objective="acceptance")                a draft model for speculative decoding
    DistillConfig(data="teacher", feature_weight=1.0)    data-free, with hidden-state transfer
    DistillConfig(qat=64)                                quantization-aware: an INT4 g64 student

``DistillConfig.from_dict(data)`` rejects unknown keys, naming them; ``to_dict()`` is what the
saved student records in its config.json (under ``distillation``) and what ``log.json`` holds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import reject_unknown_keys
from tokenmill.errors import InvalidParameterError
from tokenmill.quantization.qat import QATConfig
from tokenmill.training.trainer import TrainConfig

OBJECTIVES = ("kd", "acceptance")
DATA_SOURCES = ("corpus", "teacher", "chat")
"""Named training texts; any other ``data`` value is the path of a UTF-8 text file."""
SAVE_DTYPES = ("bfloat16", "float32", "float16")
QAT_GRID_KEYS = ("weight", "group_size", "lm_head_int8", "quantize_lm_head")
"""The QATConfig fields that say what the student is quantized to; its training fields (steps,
lr, ...) are DistillConfig's own."""
AGREEMENT_PROMPTS = 8
"""Held-out chat prompts a draft's distillation measures its agreement on when none is asked."""
DISTILL_TRAINING = TrainConfig(steps=200, lr=1e-4, checkpoint_every=50)
"""The training loop of a run that sets none of it."""


@dataclass(frozen=True)
class TeacherTextConfig:
    """The text the teacher writes to be trained on (``data="teacher"`` or ``"chat"``).

    ``teacher`` (data-free): each sequence starts from BOS (when the tokenizer has one) and one
    token drawn uniformly from the vocabulary, and the teacher continues it by sampling, as
    LLM-QAT (Liu et al. 2023) generates its data: no corpus is read, and the text follows the
    teacher's own distribution, the one the student is asked to match.

    ``chat``: each sequence is a chat prompt (tokenmill.eval.prompts, the training split) and the
    teacher's answer: the text a draft model drafts on when it serves chat requests.
    """

    sequences: int = 256
    """Sequences the teacher writes (generated once, cached in the output directory)."""
    max_tokens: int = 256
    """Longest continuation per sequence."""
    passage_chars: int = 1200
    """``chat``: the longest corpus passage in a prompt, in characters (the shortest is a quarter of it)."""
    temperature: float = 1.0
    """Sampling temperature: 1 samples the teacher's distribution as it is; 0 is greedy (the
    answers greedy serving gives)."""

    def __post_init__(self) -> None:
        for name in ("sequences", "max_tokens", "passage_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise InvalidParameterError(f"TeacherTextConfig.{name} must be a positive integer, "
                                            f"got {getattr(self, name)!r}")
        if not self.temperature >= 0 or not math.isfinite(self.temperature):
            raise InvalidParameterError(f"TeacherTextConfig.temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class DistillConfig:
    """Teacher -> student training. Example: ``distill_models("smollm2-135m-instruct", "pruned/",
    DistillConfig(train={"steps": 500}), "out/")``.

    Loss per token (``objective="kd"``)::

        kd_weight * T^2 * KL(p_teacher^T || p_student^T)  +  ce_weight * CE(student, next token of the text)
          + feature_weight * MSE(norm(proj(h_student_i)), norm(h_teacher_j))   for each pair (i, j)

    ``objective="acceptance"`` trains a draft model: the first term becomes the total-variation
    distance ``1 - sum_v min(p_teacher, p_student)`` at T = 1, which is the probability that
    speculative sampling rejects the student's token (DistillSpec, Zhou et al. 2024), and the
    hard labels become the teacher's argmax, the token greedy verification accepts.
    """

    objective: str = "kd"
    """``kd`` (soft-label KL) or ``acceptance`` (draft model: total variation + CE on the teacher's argmax)."""
    temperature: float = 2.0
    """kd: both distributions softened by T before the KL; the KL is scaled by T^2 so that its
    gradients keep the size of T = 1's (Hinton et al. 2015)."""
    kd_weight: float = 1.0
    """Weight of the distribution term (the KL, or the total variation for ``acceptance``)."""
    ce_weight: float = 0.1
    """Weight of the hard-label cross entropy (the text's next tokens; the teacher's argmax for
    ``acceptance``): small, since the teacher's distribution carries more than one label."""
    feature_weight: float = 0.0
    """Weight of hidden-state transfer; 0 turns it off."""
    feature_layers: tuple[tuple[int, int], ...] | None = None
    """Pairs (student layer i, teacher layer j): the output of student block i learns to predict
    that of teacher block j through a learned linear projection (when the widths differ). None:
    every student layer, matched to evenly spaced teacher layers (the last to the last)."""
    data: str = "corpus"
    """``corpus`` (the training split QAT reads, never the perplexity text), ``teacher`` (data-free:
    text the teacher writes, :class:`TeacherTextConfig`), ``chat`` (the teacher's answers to chat
    prompts: a draft model's data) or the path of a UTF-8 text file."""
    teacher_text: TeacherTextConfig = field(default_factory=TeacherTextConfig)
    """What the teacher writes when ``data`` is ``teacher`` or ``chat``."""
    completion_only: bool | None = None
    """Train only on the positions whose next token the teacher wrote (its answers and their
    EOS), not on the chat prompts and passages it answered (TRL's completion-only loss): a draft
    is verified on the target's answers, and a prompt's passage is text the teacher did not
    choose. Only ``data="chat"`` has prompts; None: True there, False for every other text."""
    qat: QATConfig | None = None
    """Quantization-aware distillation: the student trains through fake-quantized weights (qat.py)
    and is converted at the end. Given as a QATConfig, an int (the INT4 group size) or a dict of
    ``weight``, ``group_size``, ``lm_head_int8``, ``quantize_lm_head``. None: a float student."""
    keep_sparsity: bool = True
    """Weights exactly zero at the start stay zero, in every linear layer at least 10% zeros (a
    sparse-pruned student keeps its pattern, and with it what the sparse kernels gain)."""
    train_embedding: bool = True
    """Train the embedding matrix (and a tied LM head) too; a pruned student's is the teacher's."""
    train: TrainConfig = DISTILL_TRAINING
    """The optimizer loop: steps, lr, warmup_steps, weight_decay, max_grad_norm, grad_accum,
    mixed_precision (bfloat16 autocast for both models' matmuls), checkpoint_every. A dict is laid
    over :data:`DISTILL_TRAINING`."""
    batch_size: int = 4
    """Sequences per micro-batch."""
    seq_len: int = 256
    """Tokens per training sequence."""
    eval_tokens: int = 2048
    """Held-out perplexity of teacher and student, before and after, on the first this many
    corpus tokens (text the training split never reaches); 0 skips it."""
    eval_every: int = 0
    """Measure the student's held-out perplexity (on the ``eval_tokens``) and agreement (on the
    ``agreement_prompts``) every this many steps while training, for the curves in the log and
    the plot; 0: before and after only."""
    agreement_prompts: int | None = None
    """Held-out chat prompts (tokenmill.eval.prompts, split "eval") that the teacher answers
    greedily, on whose answers the student's greedy agreement with the teacher is measured
    (distillation/agreement.py: a draft's per-token acceptance), before, after and with
    ``eval_every``; 0 skips it. None: 8 for ``objective="acceptance"`` (a draft), 0 otherwise."""
    agreement_tokens: int = 64
    """Longest teacher answer per agreement prompt."""
    save_dtype: str = "bfloat16"
    """dtype of the saved student (the compute dtype of a quantized one)."""
    seed: int = 0
    """Seed of the window order, the teacher's text and the projections' initial weights."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalize the forms from_dict and callers may give
        set_(self, "qat", _qat_config(self.qat))
        if isinstance(self.train, dict):
            reject_unknown_keys(TrainConfig, self.train)
            set_(self, "train", dataclasses.replace(DISTILL_TRAINING, **self.train))
        if isinstance(self.teacher_text, dict):
            reject_unknown_keys(TeacherTextConfig, self.teacher_text)
            set_(self, "teacher_text", TeacherTextConfig(**self.teacher_text))
        if self.feature_layers is not None:
            set_(self, "feature_layers", _layer_pairs(self.feature_layers))
        if self.objective not in OBJECTIVES:
            raise InvalidParameterError(f"DistillConfig.objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise InvalidParameterError(f"DistillConfig.save_dtype must be one of {SAVE_DTYPES}, "
                                        f"got {self.save_dtype!r}")
        if not isinstance(self.data, str) or not self.data:
            raise InvalidParameterError(f"DistillConfig.data must be {' or '.join(DATA_SOURCES)} or a text file's "
                                        f"path, got {self.data!r}")
        if self.completion_only is None:
            set_(self, "completion_only", self.data == "chat")
        if not isinstance(self.completion_only, bool):
            raise InvalidParameterError(f"DistillConfig.completion_only must be true, false or None, "
                                        f"got {self.completion_only!r}")
        if self.completion_only and self.data != "chat":
            raise InvalidParameterError(f"DistillConfig.completion_only needs data='chat' (the only text with "
                                        f"prompts apart from answers), got data={self.data!r}")
        for name in ("batch_size", "seq_len"):
            _check(name, isinstance(getattr(self, name), int) and getattr(self, name) > 0, "a positive integer")
        _check("seq_len", self.seq_len >= 2, "at least 2")
        _check("eval_tokens", isinstance(self.eval_tokens, int) and self.eval_tokens >= 0, "an integer >= 0")
        _check("eval_every", isinstance(self.eval_every, int) and self.eval_every >= 0, "an integer >= 0")
        if self.agreement_prompts is None:
            set_(self, "agreement_prompts", AGREEMENT_PROMPTS if self.objective == "acceptance" else 0)
        _check("agreement_prompts", isinstance(self.agreement_prompts, int) and self.agreement_prompts >= 0,
               "an integer >= 0 or None")
        _check("agreement_tokens", isinstance(self.agreement_tokens, int) and self.agreement_tokens > 0,
               "a positive integer")
        if self.eval_every and not (self.eval_tokens or self.agreement_prompts):
            raise InvalidParameterError("DistillConfig.eval_every needs eval_tokens > 0 or agreement_prompts > 0 "
                                        "(what it measures on)")
        _check("temperature", self.temperature > 0 and math.isfinite(self.temperature), "positive")
        for name in ("kd_weight", "ce_weight", "feature_weight"):
            _check(name, getattr(self, name) >= 0 and math.isfinite(getattr(self, name)), ">= 0")
        if self.kd_weight == self.ce_weight == self.feature_weight == 0:
            raise InvalidParameterError("DistillConfig: kd_weight, ce_weight and feature_weight are all 0: "
                                        "nothing to train on")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistillConfig:
        """From keyword data (JSON, the command line), unknown keys rejected with their names."""
        reject_unknown_keys(cls, data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``from_dict`` reads it back as an equal config."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["train"] = dataclasses.asdict(self.train)
        out["teacher_text"] = dataclasses.asdict(self.teacher_text)
        out["qat"] = None if self.qat is None else {k: getattr(self.qat, k) for k in QAT_GRID_KEYS}
        if self.feature_layers is not None:
            out["feature_layers"] = [list(pair) for pair in self.feature_layers]
        return out

    @property
    def tokens_per_step(self) -> int:
        return self.train.grad_accum * self.batch_size * self.seq_len


def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        raise InvalidParameterError(f"DistillConfig.{name} must be {what}")


def _qat_config(value: QATConfig | int | dict | None) -> QATConfig | None:
    """None, a QATConfig, an INT4 group size or a dict of the grid keys -> None or a QATConfig
    whose training fields are the defaults (a QATConfig with others is refused: they would be
    silently unused, DistillConfig's steps and lr being the ones that apply)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidParameterError(f"DistillConfig.qat must be None, a group size, a dict or a QATConfig, "
                                    f"got {value!r}")
    if isinstance(value, int):
        return QATConfig(group_size=value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(QAT_GRID_KEYS))
        if unknown:
            raise InvalidParameterError(f"DistillConfig.qat: unknown key(s) {', '.join(map(repr, unknown))}; known "
                                        f"keys are {', '.join(QAT_GRID_KEYS)} (training settings are DistillConfig's)")
        return QATConfig(**value)
    if isinstance(value, QATConfig):
        default = QATConfig()
        set_ = [f.name for f in dataclasses.fields(QATConfig)
                if f.name not in QAT_GRID_KEYS and getattr(value, f.name) != getattr(default, f.name)]
        if set_:
            raise InvalidParameterError(f"DistillConfig.qat: {', '.join(set_)} would be unused; set the training "
                                        "settings on DistillConfig")
        return value
    raise InvalidParameterError(f"DistillConfig.qat must be None, a group size, a dict or a QATConfig, got {value!r}")


def _layer_pairs(value: Any) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(i), int(j)) for i, j in value)
    except (TypeError, ValueError):
        raise InvalidParameterError(f"DistillConfig.feature_layers must be pairs (student layer, teacher layer), "
                                    f"got {value!r}") from None
    if not pairs or any(i < 0 or j < 0 for i, j in pairs) or len({i for i, _ in pairs}) != len(pairs):
        raise InvalidParameterError(f"DistillConfig.feature_layers must be non-empty pairs of layer indices >= 0, "
                                    f"each student layer once, got {value!r}")
    return pairs
