"""A small learned router: does the cheaper model's answer suffice for this prompt?

Features are the prompt's token ids (the route's first model's tokenizer), hashed::

    unigrams and bigrams of ids   -> one of ``dim`` buckets each (a fixed multiplicative hash),
                                     counts scaled to unit length
    + log(1 + prompt length) and a constant

and the classifier is logistic regression on them, fitted by full-batch gradient descent with
an L2 penalty (a few thousand examples train in well under a second). ``predict`` gives the
probability that the cheap model suffices; the route sends a prompt to the cheap model when it
is at least the route's threshold.

Training data (``tokenmill route train``) are JSON lines, one per logged request, each with
``prompt_token_ids`` and a label: ``label`` (1: the cheap model's answer was good: a checked
answer, a user's rating) when present, else ``not escalated`` from a cascade's log (the cheap
model was confident enough), so a cascade's own traffic teaches the router to skip the cheap
attempt where it would have escalated anyway.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.errors import InvalidParameterError

DIM = 4096
_MULT = 0x9E3779B1


def _bucket(a: int, b: int, dim: int) -> int:
    return ((a * _MULT) ^ (b + 0x7F4A7C15) * 0x85EBCA6B) % (2**32) % dim


def features(token_ids: list[int], dim: int = DIM) -> torch.Tensor:
    """``[dim + 2]``: hashed unigram and bigram counts at unit length, log(1 + length), 1."""
    x = torch.zeros(dim + 2)
    for i, t in enumerate(token_ids):
        x[_bucket(t, -1, dim)] += 1
        if i:
            x[_bucket(token_ids[i - 1], t, dim)] += 1
    norm = x[:dim].norm()
    if norm > 0:
        x[:dim] /= norm
    x[dim] = math.log1p(len(token_ids)) / 5
    x[dim + 1] = 1.0
    return x


@dataclass
class LearnedRouter:
    weights: torch.Tensor
    """``[dim + 2]``: one per feature, the last the bias."""
    dim: int = DIM
    trained_on: int = 0
    train_accuracy: float = 0.0

    def predict(self, token_ids: list[int]) -> float:
        """Probability that the cheap model's answer suffices for this prompt."""
        return float(torch.sigmoid(features(token_ids, self.dim) @ self.weights))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"kind": "tokenmill-learned-router", "dim": self.dim,
                                    "trained_on": self.trained_on, "train_accuracy": self.train_accuracy,
                                    "weights": [round(float(w), 6) for w in self.weights]}))
        return path

    @classmethod
    def load(cls, path: str | Path) -> LearnedRouter:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidParameterError(f"cannot read the router {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("kind") != "tokenmill-learned-router":
            raise InvalidParameterError(f"{path} is not a router written by `tokenmill route train`")
        weights = torch.tensor(data["weights"], dtype=torch.float32)
        if weights.shape != (data["dim"] + 2,):
            raise InvalidParameterError(f"{path}: {len(weights)} weights for dim {data['dim']}")
        return cls(weights, data["dim"], data.get("trained_on", 0), data.get("train_accuracy", 0.0))


def read_examples(path: str | Path) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, label) of every usable line of a route log (see the module docstring)."""
    prompts, labels = [], []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidParameterError(f"cannot read the route log {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise InvalidParameterError(f"{path}:{number}: not JSON: {exc}") from None
        ids = entry.get("prompt_token_ids")
        label = entry.get("label")
        if label is None and "escalated" in entry:
            label = not entry["escalated"]
        if not isinstance(ids, list) or label is None:
            continue
        prompts.append([int(t) for t in ids])
        labels.append(int(bool(label)))
    return prompts, labels


def train(prompts: list[list[int]], labels: list[int], dim: int = DIM, l2: float = 1e-3,
          steps: int = 500, lr: float = 0.5) -> LearnedRouter:
    """Logistic regression on the prompts' features (both labels must occur)."""
    if len(prompts) != len(labels) or not prompts:
        raise InvalidParameterError("training a router needs at least one labelled prompt")
    if len(set(labels)) < 2:
        raise InvalidParameterError(f"every one of the {len(labels)} examples has label {labels[0]}: a router "
                                    "needs both outcomes to learn from")
    x = torch.stack([features(p, dim) for p in prompts])
    y = torch.tensor(labels, dtype=torch.float32)
    w = torch.zeros(dim + 2, requires_grad=True)
    optimizer = torch.optim.Adam([w], lr=lr / 10)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y) + l2 * (w[:-1] ** 2).sum()
        loss.backward()
        optimizer.step()
    weights = w.detach()
    accuracy = float(((x @ weights > 0).float() == y).float().mean())
    return LearnedRouter(weights, dim, len(labels), accuracy)
