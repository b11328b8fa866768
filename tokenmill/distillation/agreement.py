"""Held-out greedy agreement: how often a student (a draft) picks the teacher's greedy token.

    answers = held_out_answers(teacher, prompts=8, max_tokens=64, seed=0)
    agreement(student.model, answers)   -> the fraction of answer positions where they agree

The teacher answers held-out chat prompts (tokenmill.eval.prompts, split "eval": topics no
training prompt names) greedily, through the serving engine. A model then reads prompt + answer in
one teacher-forced pass and its argmax at every answer position is compared with the answer's
token. That is the per-token acceptance of greedy speculative decoding with this model as the
draft, one token at a time: with k draft tokens and agreement a, independent per position, the
acceptance rate (accepted / drafted) is about (a + a^2 + ... + a^k) / k.

A distillation run for a draft (``objective="acceptance"``) measures it before, while and after
training (DistillConfig.agreement_prompts); bench/agreement.py measures saved models with it.
"""

from __future__ import annotations

import torch

from tokenmill.distillation.config import TeacherTextConfig
from tokenmill.distillation.data import generate
from tokenmill.eval.prompts import chat_prompts
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel
from tokenmill.quantization.qat import training_logits

Answers = list[tuple[list[int], list[int]]]
"""(prompt ids, the teacher's greedy answer ids) per held-out prompt."""


def held_out_answers(teacher: LoadedModel, prompts: int, max_tokens: int, seed: int) -> Answers:
    """The teacher's greedy answers (at most ``max_tokens``, its own EOS included when it stopped)
    to ``prompts`` held-out chat prompts (seeded)."""
    asked = chat_prompts(teacher.tokenizer, prompts, seed, split="eval")
    written = generate(teacher, asked, TeacherTextConfig(sequences=prompts, max_tokens=max_tokens, temperature=0.0),
                       seed, progress=False, end_with_eos=False)
    return [(p, s[len(p):]) for p, s in zip(asked, written)]


@torch.no_grad()
def agreement(model: CausalLM, answers: Answers) -> float:
    """The fraction of answer positions where ``model``'s argmax, reading prompt + answer, is the
    answer's token (answers without tokens count for nothing)."""
    device = model.embed.weight.device
    same = total = 0
    for prompt, answer in answers:
        if not answer:
            continue
        ids = torch.tensor([prompt + answer], device=device)
        picks = training_logits(model, ids)[0, len(prompt) - 1:-1].argmax(-1)
        same += int((picks == torch.tensor(answer, device=device)).sum())
        total += len(answer)
    return same / total if total else float("nan")
