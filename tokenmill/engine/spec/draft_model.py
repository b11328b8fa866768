"""Drafting with a smaller model that shares the target's tokenizer, over a paged KV cache of its own.

Each step the draft model runs, batched over every sequence that drafts:

    pass 0       each sequence's tokens the draft's KV does not hold yet (the tokens kept and the
                 one sampled in the last step; the whole prompt the first time): its first guess
    pass 1..k-1  one token per sequence still drafting: the next guess

A guess is made from the draft's logits processed exactly like the request's own sampling
(penalties counting the guesses before it, min_tokens, temperature, top-k, top-p, min-p;
``Sampler.scores``):

    greedy request     the argmax                                  (a point mass)
    seeded request     the draw with the request's own uniform for that position: the target draws
                       with the same one, so a guess is kept exactly when both agree and the output
                       is the one decoding without speculation gives (a point mass)
    other requests     a draw from the processed distribution q, returned with q for rejection
                       sampling (spec/verify.py)

The draft's KV holds what it was fed; the next step keeps the part the target kept (the fed
guesses up to the first refused one) and drops the rest (``truncate``), so a draft never recomputes
an accepted token. :func:`layer_skip_model` makes the zero-setup draft: the target's first layers
with its own final norm and head, sharing the target's weights (:func:`model_view`; spec/shortlist.py
keeps every layer and cuts the head instead).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable
import weakref

import torch
from torch import nn

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.config import layer_groups
from tokenmill.engine.kv_cache_manager import KVCacheCoordinator, KVCacheManager
from tokenmill.engine.logits_processors import sample
from tokenmill.engine.model_runner import ModelRunner, SequenceInput
from tokenmill.engine.request import Sequence
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.spec.proposer import NO_DRAFT, Draft
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.models.base import CausalLM


@dataclass
class Fed:
    """What the draft's KV holds for one sequence: ``all_token_ids[:num_tokens]`` then ``guesses``."""

    num_tokens: int
    guesses: list[int]


class DraftModelProposer:
    cheap = False
    vocab: torch.Tensor | None = None
    """The token ids of the draft head's logits columns, where its head covers only some tokens
    (spec/shortlist.py); None: the whole vocabulary, in id order."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, sampler: Sampler,
                 observe: Callable[[int, float], None] | None = None, name: str = "draft") -> None:
        """``num_blocks`` per KV group of the draft; ``sampler``: the engine's (its processing and
        seeded uniforms); ``observe(batch, seconds)`` is told the time of each forward pass."""
        cfg = model.config
        groups, windows = layer_groups(cfg)
        weight = model.embed.weight
        cache = PagedKVCache([num_blocks] * len(windows), block_size, groups, cfg.num_kv_heads, cfg.head_dim,
                             weight.dtype, weight.device)
        # prefix caching as the target's: a prompt the target serves from its cache is in the draft's too
        kv = KVCacheCoordinator([KVCacheManager(num_blocks, block_size, True, w) for w in windows])
        self._attach(model, kv, cache, sampler, observe, name)

    def _attach(self, model: CausalLM, kv: KVCacheCoordinator, cache: PagedKVCache, sampler: Sampler,
                observe: Callable[[int, float], None] | None, name: str) -> None:
        """Run ``model`` over ``cache``, with ``kv``'s block tables."""
        self.name, self.model, self.sampler, self.observe = name, model, sampler, observe
        self.vocab = getattr(getattr(model, "lm_head", None), "vocab", None)
        self.kv, self.cache = kv, cache
        self.runner = ModelRunner(model, cache, model.embed.weight.device)
        self.generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=sampler.generator)))
        self._fed: dict[str, Fed] = {}

    @property
    def num_used_blocks(self) -> int:
        return sum(g.pool.num_blocks - 1 - g.num_free_blocks for g in self.kv.groups)

    def release(self, seq_id: str) -> None:
        self._fed.pop(seq_id, None)
        self.kv.free(seq_id)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        drafts: list[Draft] = [NO_DRAFT] * len(seqs)
        active: list[int] = []
        inputs: list[SequenceInput] = []
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            first = self._catch_up(seq) if k > 0 else None
            if first is not None:
                active.append(i)
                inputs.append(first)
        guesses: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        while active:
            start = time.perf_counter()
            first_pass = not any(guesses[i] for i in active)
            logits = self._run([seqs[i] for i in active], inputs)
            if first_pass:
                for i in active:
                    self._cache_fed(seqs[i])
            self._guess([seqs[i] for i in active], [guesses[i] for i in active], [probs[i] for i in active], logits)
            if self.observe is not None:
                self.observe(len(active), time.perf_counter() - start)
            still, inputs = [], []
            for i in active:
                if len(guesses[i]) < num_tokens[i]:
                    item = self._feed(seqs[i], guesses[i][-1])
                    if item is not None:
                        still.append(i)
                        inputs.append(item)
            active = still
        for i, tokens in guesses.items():
            rows = probs[i]
            drafts[i] = Draft(tokens, torch.stack(rows) if rows and len(rows) == len(tokens) else None)
        return drafts

    def _run(self, seqs: list[Sequence], inputs: list[SequenceInput]) -> torch.Tensor:
        """One forward pass of the draft -> the logits of each input's last token."""
        return self.runner.execute(inputs).sample_logits

    def _kept_prefix(self, seq: Sequence, fed: Fed) -> int:
        """How much of what the draft holds is still right: its tokens, then its fed guesses up to
        the first one the sequence did not keep."""
        ids, keep = seq.all_token_ids, fed.num_tokens
        for g in fed.guesses:
            if keep < len(ids) and ids[keep] == g:
                keep += 1
            else:
                break
        return keep

    def _first_input(self, seq: Sequence, keep: int) -> SequenceInput:
        """Pass 0's input: the sequence's tokens from ``keep`` on (its KV slots allocated)."""
        return SequenceInput(seq.all_token_ids[keep:], keep, self.kv.block_table(seq.seq_id), True)

    def _catch_up(self, seq: Sequence) -> SequenceInput | None:
        """Drop what the draft holds past the sequence's tokens and allocate the tokens it lacks ->
        the first pass's input; None (and nothing held) when the draft's pool is full."""
        ids = seq.all_token_ids
        fed = self._fed.get(seq.seq_id)
        if fed is not None:
            keep = min(self._kept_prefix(seq, fed), len(ids) - 1)  # at least one token to feed
            self.kv.truncate(seq.seq_id, keep)
        else:  # first time: start on the draft's own cached prefix
            keep = self.kv.get_computed_blocks(seq.seq_id, ids, seq.cache_salt)
        if not self.kv.allocate_slots(seq.seq_id, ids, len(ids) - keep):
            self.release(seq.seq_id)
            return None
        self._fed[seq.seq_id] = Fed(len(ids), [])
        return self._first_input(seq, keep)

    def _cache_fed(self, seq: Sequence) -> None:
        """After pass 0: the full blocks of the sequence's own tokens but its last go into the draft's
        prefix cache (never a guess: those sit past them; never the last token, which a catch-up may
        feed again)."""
        self.kv.cache_blocks(seq.seq_id, seq.all_token_ids, self._fed[seq.seq_id].num_tokens - 1)

    def _feed(self, seq: Sequence, guess: int) -> SequenceInput | None:
        """The next pass's input of a sequence still drafting: its newest guess; None when the
        draft's pool cannot hold it (the draft ends there)."""
        fed = self._fed[seq.seq_id]
        if not self.kv.allocate_slots(seq.seq_id, seq.all_token_ids + fed.guesses + [guess], 1):
            return None
        fed.guesses.append(guess)
        return SequenceInput([guess], fed.num_tokens + len(fed.guesses) - 1, self.kv.block_table(seq.seq_id), True)

    def _guess(self, seqs: list[Sequence], guesses: list[list[int]], probs: list[list[torch.Tensor]],
               logits: torch.Tensor) -> None:
        """Append each sequence's next guess (and, for rejection sampling, its distribution)."""
        states = [seq.sampling.after(g) for seq, g in zip(seqs, guesses)]
        vocab = self.vocab
        if vocab is not None:
            if all(s.greedy and not s.has_penalties and not s.blocks_stop for s in states):
                for g, t in zip(guesses, vocab[logits.argmax(-1)].tolist()):  # the argmax of the listed tokens
                    g.append(t)
                return
            full = torch.full((logits.shape[0], self.sampler.vocab_size), -torch.inf, device=logits.device)
            full[:, vocab] = logits
            logits = full
        short = self.sampler.vocab_size - logits.shape[1]
        if short > 0:  # a draft head narrower than the target's vocabulary: the rest impossible
            logits = torch.nn.functional.pad(logits, (0, short), value=-torch.inf)
        _, scores = self.sampler.scores(logits, states)
        tokens = scores.argmax(-1)
        random = [i for i, s in enumerate(states) if not s.greedy]
        if random:
            index = torch.tensor(random)
            seeded = [states[i].params.seed is not None for i in random]
            # seeded rows: their (seed, position) uniforms; the others: one draw of this proposer's generator
            coupled = iter(self.sampler.uniforms([states[i] for i, s in zip(random, seeded) if s]))
            fresh = iter(torch.rand(seeded.count(False), generator=self.generator).tolist())
            u = torch.tensor([next(coupled) if s else next(fresh) for s in seeded], dtype=torch.float32)
            picked = scores.index_select(0, index)
            tokens[index] = sample(picked, u)
            dist = picked.softmax(-1)
            for row, (i, s) in enumerate(zip(random, seeded)):
                if not s:
                    probs[i].append(dist[row])
        for g, t in zip(guesses, tokens.tolist()):
            g.append(t)


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """A draft model must speak the target's token ids: same vocabulary, same ids for a probe text,
    same stop tokens. InvalidParameterError naming what differs otherwise."""
    probe = "Speculative decoding: the draft's guess, verified. 12345 ÄÖÜ 東京 🙂\n\tdef f(x): return x"
    problems = []
    if target.vocab_size != draft.vocab_size:
        problems.append(f"vocabulary of {draft.vocab_size} tokens, the target's has {target.vocab_size}")
    elif target.encode(probe) != draft.encode(probe):
        problems.append("it tokenizes text differently")
    if set(target.stop_token_ids) != set(draft.stop_token_ids):
        problems.append(f"stop tokens {sorted(draft.stop_token_ids)}, the target's are {sorted(target.stop_token_ids)}")
    if problems:
        raise InvalidParameterError(f"draft model {draft_name} does not share the target's tokenizer: "
                                    + "; ".join(problems))


def layer_skip_model(model: CausalLM, layers: list[int]) -> CausalLM:
    """The target with only ``layers`` of its blocks (in order), then its final norm and LM head: a
    draft that shares every weight with the target (no copy) and needs no training."""
    total = model.config.num_layers
    layers = sorted(set(layers))
    if not layers or layers[0] < 0 or layers[-1] >= total or len(layers) == total:
        raise InvalidParameterError(f"layer-skip draft: a proper subset of the layers 0..{total - 1} of a {total}-layer "
                                    f"model, got {layers}")
    return model_view(model, layers, model.lm_head)


def model_view(model: CausalLM, layers: list[int], lm_head: nn.Module | None) -> CausalLM:
    """The target running ``layers`` of its blocks (sorted, distinct), then its final norm and
    ``lm_head`` (None: the tied embedding, as the target's): every weight shared, nothing copied."""
    layers = sorted(set(layers))
    view = type(model).__new__(type(model))
    nn.Module.__init__(view)
    view.__dict__.update({k: v for k, v in model.__dict__.items() if not k.startswith("_")})
    cfg = model.config
    types = tuple(cfg.layer_type(i) for i in layers) if cfg.layer_types else ()
    view.config = replace(cfg, num_layers=len(layers), layer_types=types)
    for name, child in model.named_children():
        setattr(view, name, nn.ModuleList([child[i] for i in layers]) if name == "layers" else child)
    view.lm_head = lm_head
    view._fused = weakref.WeakKeyDictionary()
    return view
