"""Fine-tuning records (JSON lines) -> token ids with a loss mask, and the batches a step takes.

Each line of the file is one record, in one of three forms::

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}
        chat: rendered by the model's chat template; the loss covers the last assistant turn
        (what the template adds after the generation prompt: its text and end-of-turn)
    {"prompt": "...", "completion": "..."}
        completion: the loss covers the completion and the end-of-sequence token after it
    {"text": "..."}
        plain text: the loss covers every token

A record longer than ``max_len`` tokens keeps its prompt's tail and its completion's head. A
batch pads its rows on the right to its longest; padded positions carry no loss and, attention
being causal, change nothing for the real ones.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import InvalidParameterError

IGNORE = -100
"""The label of a position without loss."""


@dataclass(frozen=True)
class Example:
    prompt: list[int]
    """Tokens the model reads without loss."""
    completion: list[int]
    """Tokens it learns to produce."""

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.completion


def read_examples(path: str | Path, tokenizer: Any, max_len: int) -> list[Example]:
    """Every record of the JSON-lines file ``path``, tokenized. InvalidParameterError names the line
    of a record that is not JSON, of no known form, or without anything to learn."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidParameterError(f"cannot read the training data {path}: {exc}", param="data") from None
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidParameterError(f"{where}: not JSON ({exc.msg})", param="data") from None
        example = _example(record, tokenizer, where)
        if not example.completion:
            raise InvalidParameterError(f"{where}: nothing to learn (empty completion)", param="data")
        examples.append(_truncate(example, max_len))
    if not examples:
        raise InvalidParameterError(f"{path} has no records", param="data")
    return examples


def _example(record: Any, tokenizer: Any, where: str) -> Example:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if isinstance(record, dict) and set(record) == {"messages"} and isinstance(record["messages"], list):
        messages = record["messages"]
        if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
            raise InvalidParameterError(f"{where}: a chat record ends with the assistant's message", param="data")
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        if not full.startswith(prompt):
            raise InvalidParameterError(f"{where}: the chat template does not render the conversation as its "
                                        "prompt followed by the answer", param="data")
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        return Example(prompt_ids, tokenizer.encode(full[len(prompt):], add_special_tokens=False))
    if isinstance(record, dict) and set(record) == {"prompt", "completion"} and all(
            isinstance(record[k], str) for k in record):
        prompt_ids = tokenizer.encode(record["prompt"])
        return Example(prompt_ids, tokenizer.encode(record["completion"], add_special_tokens=False) + eos)
    if isinstance(record, dict) and set(record) == {"text"} and isinstance(record["text"], str):
        return Example([], tokenizer.encode(record["text"]))
    raise InvalidParameterError(f"{where}: expected {{\"messages\": [...]}}, {{\"prompt\": ..., \"completion\": ...}} "
                                "or {\"text\": ...} (strings)", param="data")


def _truncate(example: Example, max_len: int) -> Example:
    if len(example.ids) <= max_len:
        return example
    completion = example.completion[:max_len]
    keep = max_len - len(completion)
    return Example(example.prompt[len(example.prompt) - keep:] if keep else [], completion)


def split(examples: list[Example], eval_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held out): a seeded shuffle, the last ``eval_fraction`` held out (at least one record
    when the fraction is above 0 and there are two or more)."""
    order = list(examples)
    random.Random(seed).shuffle(order)
    held = min(len(order) - 1, max(1, round(eval_fraction * len(order)))) if eval_fraction > 0 else 0
    return order[:len(order) - held], order[len(order) - held:]


def collate(examples: list[Example], pad_id: int, device: torch.device | str = "cpu",
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, S], labels [B, S]): rows padded on the right; ``labels[b, t]`` is the token at
    ``t + 1`` where it is a completion token, else IGNORE."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, example in enumerate(examples):
        seq = example.ids
        ids[row, :len(seq)] = torch.tensor(seq)
        start = max(len(example.prompt) - 1, 0)
        labels[row, start:len(seq) - 1] = torch.tensor(seq[start + 1:])
    return ids.to(device), labels.to(device)


def sample_batches(examples: list[Example], count: int, batch_size: int, seed: int, pad_id: int,
                   device: torch.device | str = "cpu") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of ``batch_size`` records, in seeded epochs (each a fresh shuffle)."""
    rng = random.Random(seed)
    order: list[Example] = []
    for _ in range(count):
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(examples)
                rng.shuffle(order)
            batch.append(order.pop())
        yield collate(batch, pad_id, device)
