"""Benchmark workloads: what to send, turn by turn, with token counts from the model's tokenizer.

A workload is a list of :class:`Conversation`. A single-turn request is a conversation of one
turn; a multi-turn conversation's later turns are sent after the previous reply arrives, with the
history in front. Four generators:

* :func:`random_workload`   random prompts whose text encodes to exactly the drawn number of tokens
* :func:`prefix_workload`   N shared system prompts x M questions (exercises prefix caching)
* :func:`multi_turn_workload` conversations of several random user turns
* :func:`jsonl_workload`    one JSON object per line: ``{"prompt": ..., "output_len": ..., "system": ...,
                            "turns": [...]}``

Lengths are ``N`` (fixed) or ``LO:HI`` (uniform integers, inclusive), see :class:`LengthDist`.
Everything is drawn from one seeded ``numpy`` generator: the same seed, the same workload.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tokenmill.errors import InvalidParameterError
from tokenmill.loading.tokenizer import Tokenizer


@dataclass(frozen=True)
class Turn:
    prompt: str
    """The user's text of this turn (completions: appended to the history)."""
    prompt_len: int
    """Tokens of ``prompt`` alone, by the model's tokenizer (no special tokens)."""
    output_len: int
    """max_tokens of the reply."""


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    system: str | None = None
    """A system prompt (chat: a system message; completions: text in front of the first turn)."""
    system_len: int = 0


@dataclass(frozen=True)
class LengthDist:
    """``N`` or ``LO:HI`` tokens, uniform over the inclusive range."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int) -> LengthDist:
        lo, _, hi = str(text).partition(":")
        try:
            low, high = int(lo), int(hi or lo)
        except ValueError:
            raise InvalidParameterError(f"bad length {text!r}: use N or LO:HI (tokens)") from None
        if not 1 <= low <= high:
            raise InvalidParameterError(f"bad length {text!r}: need 1 <= LO <= HI")
        return cls(low, high)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass
class WorkloadSpec:
    """What the CLI asks for; :func:`build_workload` turns it into conversations."""

    kind: str = "random"
    """random, prefix, multi-turn or jsonl."""
    num_requests: int = 200
    """Requests (random, jsonl), questions in all (prefix) or conversations (multi-turn)."""
    input_len: str = "256"
    output_len: str = "128"
    num_prefixes: int = 4
    prefix_len: int = 512
    num_turns: int = 3
    path: str | None = None
    seed: int = 0

    def describe(self) -> dict:
        """The fields that shape this kind of workload."""
        keep = {"kind", "num_requests", "output_len", "seed"} | {
            "random": {"input_len"}, "prefix": {"input_len", "num_prefixes", "prefix_len"},
            "multi-turn": {"input_len", "num_turns"}, "jsonl": {"path"}}.get(self.kind, set())
        return {k: v for k, v in asdict(self).items() if k in keep}


def load_tokenizer(model: str | os.PathLike | None, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of ``model`` (anything tokenmill's resolver accepts, or a directory with a
    tokenizer.json) without loading weights."""
    from tokenmill.loading.gguf_file import GGUFFile
    from tokenmill.loading.sources import resolve_model
    from tokenmill.paths import default_cache_dir

    path = Path(str(model)).expanduser() if model is not None else None
    if path is not None and path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(path)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    source = resolve_model(model, cache)
    if source.format == "hf":
        return Tokenizer.from_hf_dir(source.path)
    return Tokenizer.from_gguf_metadata(GGUFFile(source.path).metadata, cache_dir=cache / "tokenizers")


class PromptSampler:
    """Random text that encodes to an exact number of tokens.

    Random ids are drawn from the tokens that decode alone to clean text (no special tokens, no
    partial UTF-8). Re-encoding the decoded text may merge or split tokens at the seams, so the
    text is cut (decode of the first n re-encoded ids) or extended (more random tokens) until it
    re-encodes to exactly n tokens; a draw that does not settle is replaced by a fresh one.
    """

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator, rounds: int = 16, draws: int = 8) -> None:
        self.tokenizer, self.rng, self.rounds, self.draws = tokenizer, rng, rounds, draws
        self.candidates = np.array([i for i in range(tokenizer.vocab_size) if not tokenizer.is_special(i)
                                    and (t := tokenizer.decode([i])) and "\ufffd" not in t])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, n: int) -> str:
        for _ in range(self.draws):
            text = self._settle(self._random_text(n), n)
            if text is not None:
                return text
        raise InvalidParameterError(f"could not draw a text of exactly {n} tokens")

    def _random_text(self, n: int) -> str:
        return self.tokenizer.decode(self.rng.choice(self.candidates, size=n).tolist())

    def _settle(self, text: str, n: int) -> str | None:
        for _ in range(self.rounds):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == n:
                return text
            text = self.tokenizer.decode(ids[:n]) if len(ids) > n else text + self._random_text(n - len(ids))
        return None


def random_workload(tokenizer: Tokenizer, num_requests: int, input_len: LengthDist, output_len: LengthDist,
                    seed: int = 0) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    sampler = PromptSampler(tokenizer, rng)
    ins, outs = input_len.sample(rng, num_requests), output_len.sample(rng, num_requests)
    return [Conversation((Turn(sampler.text(i), i, o),)) for i, o in zip(ins, outs)]


def prefix_workload(tokenizer: Tokenizer, num_prefixes: int, num_questions: int, prefix_len: int,
                    input_len: LengthDist, output_len: LengthDist, seed: int = 0) -> list[Conversation]:
    """``num_questions`` questions spread round-robin over ``num_prefixes`` shared system prompts,
    in a seeded random order (so requests sharing a prefix interleave)."""
    if num_prefixes < 1:
        raise InvalidParameterError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    sampler = PromptSampler(tokenizer, rng)
    prefixes = [sampler.text(prefix_len) for _ in range(num_prefixes)]
    ins, outs = input_len.sample(rng, num_questions), output_len.sample(rng, num_questions)
    conversations = [Conversation((Turn(sampler.text(i), i, o),), prefixes[k % num_prefixes], prefix_len)
                     for k, (i, o) in enumerate(zip(ins, outs))]
    return [conversations[k] for k in rng.permutation(len(conversations))]


def multi_turn_workload(tokenizer: Tokenizer, num_conversations: int, num_turns: int, input_len: LengthDist,
                        output_len: LengthDist, seed: int = 0) -> list[Conversation]:
    if num_turns < 1:
        raise InvalidParameterError(f"num_turns must be >= 1, got {num_turns}")
    rng = np.random.default_rng(seed)
    sampler = PromptSampler(tokenizer, rng)
    conversations = []
    for _ in range(num_conversations):
        ins, outs = input_len.sample(rng, num_turns), output_len.sample(rng, num_turns)
        conversations.append(Conversation(tuple(Turn(sampler.text(i), i, o) for i, o in zip(ins, outs))))
    return conversations


def jsonl_workload(path: str | os.PathLike, tokenizer: Tokenizer, output_len: LengthDist,
                   num_requests: int | None = None, seed: int = 0) -> list[Conversation]:
    """Lines ``{"prompt": str}`` or ``{"turns": [str, ...]}``, optionally with ``"system"`` and
    ``"output_len"`` (else drawn from ``output_len``). ``num_requests`` takes the first lines."""
    rng = np.random.default_rng(seed)
    count = PromptSampler(tokenizer, rng).count
    conversations = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if num_requests is not None and len(conversations) >= num_requests:
            break
        try:
            item = json.loads(line)
            texts = item["turns"] if "turns" in item else [item["prompt"]]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InvalidParameterError(f"{path}:{lineno}: need a JSON object with 'prompt' or 'turns'") from None
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise InvalidParameterError(f"{path}:{lineno}: prompts must be non-empty strings")
        outs = [int(item["output_len"])] * len(texts) if "output_len" in item else output_len.sample(rng, len(texts))
        system = item.get("system")
        conversations.append(Conversation(tuple(Turn(t, count(t), o) for t, o in zip(texts, outs)), system,
                                          count(system) if system else 0))
    if not conversations:
        raise InvalidParameterError(f"{path}: no prompts")
    return conversations


def build_workload(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[Conversation]:
    ins, outs = LengthDist.parse(spec.input_len), LengthDist.parse(spec.output_len)
    if spec.num_requests < 1:
        raise InvalidParameterError(f"num_requests must be >= 1, got {spec.num_requests}")
    if spec.kind == "random":
        return random_workload(tokenizer, spec.num_requests, ins, outs, spec.seed)
    if spec.kind == "prefix":
        return prefix_workload(tokenizer, spec.num_prefixes, spec.num_requests, spec.prefix_len, ins, outs, spec.seed)
    if spec.kind == "multi-turn":
        return multi_turn_workload(tokenizer, spec.num_requests, spec.num_turns, ins, outs, spec.seed)
    if spec.kind == "jsonl":
        if not spec.path:
            raise InvalidParameterError("the jsonl workload needs a file (--dataset-path)")
        return jsonl_workload(spec.path, tokenizer, outs, spec.num_requests, spec.seed)
    raise InvalidParameterError(f"unknown workload {spec.kind!r}; use random, prefix, multi-turn or jsonl")
