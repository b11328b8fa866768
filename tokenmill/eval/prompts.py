"""Chat prompts for training and measuring on a model's own answers (speculative heads, draft models).

    chat_prompts(tokenizer, n, seed)                 training prompts: half tasks on a passage of the
                                                     corpus' training half (summarise, continue,
                                                     explain, rewrite, question), half generic
                                                     requests (task x topic)
    chat_prompts(tokenizer, n, seed, split="eval")   held out: generic requests on topics the
                                                     training prompts never name (EVAL_TOPICS)

Each prompt is one user turn rendered by the model's chat template, ready for the assistant to answer.
"""

from __future__ import annotations

import random
from typing import Any

from tokenmill.chat_requests import EVAL_TOPICS, SPLITS, TASKS, TOPICS, generic_request, user_turns
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.corpus import fetch_corpus

__all__ = ["EVAL_TOPICS", "TASKS", "TOPICS", "chat_prompts", "chat_texts"]

TRAIN_SPLIT = (0.25, 0.75)
"""The corpus characters training prompts cut passages from (the middle half: perplexity reads
the start, calibration the end)."""

INSTRUCTIONS = [
    "Summarise the following passage in a few sentences.\n\n{passage}",
    "Continue this passage in the same style.\n\n{passage}",
    "Explain in plain modern English what happens in this passage.\n\n{passage}",
    "Rewrite the following passage as a short modern story.\n\n{passage}",
    "Who speaks in this passage, and what do they want?\n\n{passage}",
    "{passage}",
]
"""Tasks on a corpus passage."""


def chat_texts(n: int, seed: int, split: str = "train", passage_chars: int = 1200) -> list[str]:
    """The user's text of each of :func:`chat_prompts`' ``n`` prompts (the same ones for the same
    ``seed``, ``split`` and ``passage_chars``), before the chat template."""
    if split not in SPLITS:
        raise InvalidParameterError(f"chat prompts: split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(seed)
    text = None
    contents = []
    for i in range(n):
        if split == "eval" or i % 2:
            content = generic_request(rng, split)
        else:
            if text is None:
                text = fetch_corpus().read_text(encoding="utf-8")
                begin, end = (int(f * len(text)) for f in TRAIN_SPLIT)
            at = rng.randrange(begin, end - passage_chars)
            passage = text[at:at + rng.randrange(max(1, passage_chars // 4), passage_chars + 1)]
            content = INSTRUCTIONS[(i // 2) % len(INSTRUCTIONS)].format(passage=passage)
        contents.append(content)
    return contents


def chat_prompts(tokenizer: Any, n: int, seed: int, split: str = "train", passage_chars: int = 1200) -> list[list[int]]:
    """``n`` prompts (token ids, seeded) of ``split``; see the module docstring. ``tokenizer``:
    one with ``apply_chat_template`` and ``encode`` (tokenmill's Tokenizer)."""
    return user_turns(tokenizer, chat_texts(n, seed, split, passage_chars))
