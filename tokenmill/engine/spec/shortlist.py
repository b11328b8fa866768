"""Self-speculation over a shortlist: the model drafts for itself, its LM head cut to the tokens it writes.

With a large vocabulary the LM head is a large share of a decode step: Gemma 3's 262,144 x 640 head
is two thirds of the bytes a token reads. The draft here is the target's own layers (the same
weights, no copy) followed by a head holding only the rows of the ``draft_vocab_size`` tokens the
model writes most (FR-Spec's frequency-ranked draft vocabulary, Zhao et al. 2025, applied to the model
itself). A guess is therefore the target's own greedy token whenever that token is on the list, and
the target's verification keeps every such guess; a draft costs the layers plus a small head.

The draft computes what the target computes, so it needs no KV cache of its own and never catches
up: it reads the target's cache, where the target holds every token it computed, and writes the
keys and values of the sequence's last token and of its guesses into the sequence's own slots just
past them. Verification reuses that work: the step runs the model's layers only over the last
guess and its full head over the hidden states the draft computed (``Draft.hidden``), so a step
drafting k tokens runs the layers k + 1 times, one row each, as k + 1 plain steps would, and the
full head once over k + 1 rows instead of k + 1 times.

The list: the model's stop tokens, then every token by its expected count in the model's own greedy
answers to ``SHORTLIST_PROMPTS`` generic chat requests (``tokenmill.chat_requests``, training topics):
the sum over answer positions of its next-token probability, which ranks the tokens the model
considers as well as those it picks. It is computed once per model and kept in the cache directory
(``shortlists/``, keyed by the model's weights and tokenizer), so later starts read it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

import torch
from torch import nn

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.chat_requests import generic_request, user_turns
from tokenmill.config import layer_groups
from tokenmill.engine.kv_cache_manager import KVCacheCoordinator
from tokenmill.engine.model_runner import ModelRunner, SequenceInput
from tokenmill.engine.request import Sequence
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.spec.draft_model import DraftModelProposer, Fed, model_view
from tokenmill.engine.spec.proposer import Draft
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.models.base import CausalLM
from tokenmill.models.layers import linear
from tokenmill.paths import default_cache_dir

logger = logging.getLogger("tokenmill.engine")

SHORTLIST_PROMPTS = 64
"""Chat prompts the model answers to rank its tokens."""
SHORTLIST_ANSWER_TOKENS = 128
SHORTLIST_BATCH = 16
"""Prompts answered together (the throwaway KV cache holds this many answers at a time)."""
RANKING = "expected-counts-1"
"""Names how the ranking is made: part of the cached file's key."""


class ShortlistHead(nn.Module):
    """The LM head's rows of ``vocab``: float32 logits of the listed tokens only, in ``vocab``'s
    order (the draft's proposer maps them back to token ids: draft_model.DraftModelProposer._guess)."""

    def __init__(self, rows: torch.Tensor, vocab: torch.Tensor) -> None:
        super().__init__()
        self.head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        with torch.no_grad():
            self.head.weight.copy_(rows)
        self.register_buffer("vocab", vocab.to(device=rows.device, dtype=torch.long))

    def forward_float32(self, h: torch.Tensor, kernel_rows: int | None = None) -> torch.Tensor:
        return linear(self.head, h.to(self.head.weight.dtype), out_float32=True).float()

    forward = forward_float32


class ShortlistProposer(DraftModelProposer):
    """DraftModelProposer over the target's own KV cache (see the module docstring)."""

    def __init__(self, model: CausalLM, kv: KVCacheCoordinator, cache: PagedKVCache, sampler: Sampler,
                 observe=None, name: str = "shortlist") -> None:
        """``kv``, ``cache``: the target's block tables and KV cache; ``model``: shortlist_model's view."""
        self._attach(model, kv, cache, sampler, observe, name)
        self._start: dict[str, int] = {}
        """seq_id -> the target's computed tokens when its draft began (given back to that afterwards)."""
        self._room: dict[str, int] = {}
        """seq_id -> the tokens it drafts this step."""
        self._hidden: dict[str, list[torch.Tensor]] = {}
        """seq_id -> the final hidden state of each of this step's passes over it."""

    num_used_blocks = 0
    """It holds no block between steps."""

    def release(self, seq_id: str) -> None:
        self._fed.pop(seq_id, None)  # the blocks are the target's

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        self._room = {seq.seq_id: k for seq, k in zip(seqs, num_tokens)}
        try:
            drafts = super().propose(seqs, num_tokens)
            for seq, draft in zip(seqs, drafts):
                rows = self._hidden.get(seq.seq_id)
                if draft.token_ids and rows and len(rows) >= len(draft.token_ids):
                    draft.hidden = torch.cat(rows[:len(draft.token_ids)])
            return drafts
        finally:  # counted back, the blocks kept: the step's verification reuses what was written
            for seq_id, start in self._start.items():
                self.kv.uncount(seq_id, start)
            self._start.clear()
            self._fed.clear()
            self._hidden.clear()

    def _run(self, seqs: list[Sequence], inputs: list[SequenceInput]) -> torch.Tensor:
        """One pass -> the logits of each input's last token, keeping its final hidden state (the
        model's own: verification reuses it)."""
        out = self.runner.execute(inputs, with_hidden=True)
        end = 0
        for seq, item in zip(seqs, inputs):
            end += len(item.token_ids)
            self._hidden.setdefault(seq.seq_id, []).append(out.hidden[end - 1:end])
        return out.sample_logits

    def _catch_up(self, seq: Sequence) -> SequenceInput | None:
        """Slots in the target's table for the tokens it has not computed (the last sampled one) and
        for the guesses but the last -> pass 0's input; None when the pool cannot give them."""
        ids, start = seq.all_token_ids, self.kv.num_computed_tokens(seq.seq_id)
        new = len(ids) - start
        if new < 1 or not self.kv.allocate_slots(seq.seq_id, ids + [0] * (self._room[seq.seq_id] - 1),
                                                 new + self._room[seq.seq_id] - 1):
            return None
        self._start[seq.seq_id] = start
        for group, pairs in enumerate(self.kv.take_pending_copies()):  # a shared block written: copied first
            self.cache.copy_blocks(group, pairs)
        self._fed[seq.seq_id] = Fed(len(ids), [])
        return SequenceInput(ids[start:], start, self.kv.block_table(seq.seq_id), True)

    def _cache_fed(self, seq: Sequence) -> None:
        pass  # the target offers its blocks to the prefix cache, after verification

    def _feed(self, seq: Sequence, guess: int) -> SequenceInput | None:
        fed = self._fed[seq.seq_id]
        fed.guesses.append(guess)
        return SequenceInput([guess], fed.num_tokens + len(fed.guesses) - 1, self.kv.block_table(seq.seq_id), True)


def head_rows(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The LM head's weight rows of ``ids`` (the embedding's for a tied head), dequantized if stored quantized."""
    head = model.lm_head
    if head is None or model.config.tie_word_embeddings:  # a quantized tied head: the lookup table's rows
        return model.embed.weight[ids]
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point:
        return weight[ids]
    return head.dequantize()[ids]


def shortlist_model(model: CausalLM, vocab: torch.Tensor) -> CausalLM:
    """The target with every layer and a head of ``vocab``'s rows only: the draft (shares the layers)."""
    weight = model.embed.weight
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    rows = head_rows(model, vocab.to(weight.device)).to(dtype)
    return model_view(model, list(range(model.config.num_layers)),
                      ShortlistHead(rows, vocab))


def rank_tokens(scores: torch.Tensor, always: list[int]) -> torch.Tensor:
    """Token ids, most useful first: ``always``, then by ``scores`` [vocab] (higher first), ties by id."""
    scores = scores.double().clone()
    if always:
        scores[torch.tensor(sorted(set(always)), dtype=torch.long)] = float("inf")
    return torch.sort(scores, descending=True, stable=True).indices


def shortlist(ranking: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` ranked tokens (all of them if fewer), in id order."""
    if size < 1:
        raise InvalidParameterError(f"draft_vocab_size must be >= 1, got {size}")
    return ranking[:size].sort().values


@torch.inference_mode()
def greedy_answers(model: CausalLM, prompts: list[list[int]], max_tokens: int, stop: frozenset[int],
                   block_size: int = 16, expected: torch.Tensor | None = None) -> list[list[int]]:
    """The model's greedy answers to ``prompts``, all decoded together over a throwaway paged KV cache.
    ``expected`` [vocab]: adds each answer position's next-token probabilities (expected counts)."""
    cfg, weight = model.config, model.embed.weight
    groups, windows = layer_groups(cfg)
    per_seq = -(-(max(len(p) for p in prompts) + max_tokens) // block_size)
    cache = PagedKVCache([per_seq * len(prompts) + 1] * len(windows), block_size, groups, cfg.num_kv_heads,
                         cfg.head_dim, weight.dtype, weight.device)
    runner = ModelRunner(model, cache, weight.device)
    tables = [[list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))] * len(windows) for i in range(len(prompts))]
    answers: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    inputs = [SequenceInput(list(p), 0, tables[i], True) for i, p in enumerate(prompts)]
    while live:
        logits = runner.execute(inputs).sample_logits
        if expected is not None:
            expected += logits.softmax(-1).sum(0).to(expected.dtype)
        tokens = logits.argmax(-1).tolist()
        still, inputs = [], []
        for i, t in zip(live, tokens):
            answers[i].append(t)
            if t not in stop and len(answers[i]) < max_tokens:
                still.append(i)
                inputs.append(SequenceInput([t], len(prompts[i]) + len(answers[i]) - 1, tables[i], True))
        live = still
    return answers


def model_ranking(model: CausalLM, tokenizer: Tokenizer, cache_dir: Path | None = None) -> torch.Tensor:
    """The model's tokens ranked by its own greedy answers to ``SHORTLIST_PROMPTS`` chat prompts (the
    stop tokens first), from the cache directory when an earlier start ranked them."""
    vocab_size = model.config.vocab_size
    stop = frozenset(tokenizer.stop_token_ids)

    def compute() -> torch.Tensor:
        rng = random.Random(0)
        prompts = user_turns(tokenizer, [generic_request(rng, "train") for _ in range(SHORTLIST_PROMPTS)])
        logger.info("shortlist: ranking the vocabulary by the model's answers to %d chat prompts (once; kept in "
                    "the cache directory)", len(prompts))
        expected = torch.zeros(vocab_size, dtype=torch.float64)
        for at in range(0, len(prompts), SHORTLIST_BATCH):
            greedy_answers(model, prompts[at:at + SHORTLIST_BATCH], SHORTLIST_ANSWER_TOKENS, stop, expected=expected)
        return rank_tokens(expected, [t for t in stop if t < vocab_size])

    probe = tokenizer.encode("Shortlist: the tokens a model writes. 12345 ÄÖÜ 東京 🙂", add_special_tokens=False)
    h = hashlib.blake2b(digest_size=12)
    w = model.embed.weight
    h.update(repr((tuple(w.shape), probe, sorted(stop), SHORTLIST_PROMPTS, SHORTLIST_ANSWER_TOKENS, RANKING)).encode())
    h.update(w[:: max(1, w.shape[0] // 64)].float().flatten()[::7].contiguous().cpu().numpy().tobytes())
    path = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "shortlists" / f"{h.hexdigest()}.json"
    return load_or_rank(path, vocab_size, compute)


def load_or_rank(path: Path, vocab_size: int, compute) -> torch.Tensor:
    """The ranking saved at ``path``, else ``compute()``'s (saved there)."""
    if path.is_file():
        try:
            ids = json.loads(path.read_text())
            if sorted(ids) == list(range(vocab_size)):
                return torch.tensor(ids, dtype=torch.long)
        except (OSError, ValueError):
            pass
        logger.warning("shortlist: %s is damaged; ranking the tokens again", path)
    ranking = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(ranking.tolist()))
    partial.rename(path)
    return ranking
