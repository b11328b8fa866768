"""EAGLE-style self-speculation: a small head that reads the target's hidden state and drafts.

The head (Li et al. 2024, EAGLE) predicts the target's next final hidden state from the current one
and the next token's embedding::

    g_p = block(fc([f_{p-1} ; embed(t_p)]))        f: the target's hidden state (before its final norm)
    logits_p = head(norm(g_p))                      over a reduced draft vocabulary (EAGLE-3's idea)

``block`` is one decoder block of the target's own family (with its own KV cache), initialised from
the target's last block; ``fc`` starts as "take the feature"; ``norm`` and ``head`` start as the
target's final norm and the rows of its LM head for the ``draft_vocab`` most frequent tokens of the
training text. Drafting runs the head autoregressively on its own predictions (g in place of f);
its KV is rebuilt from the target's true hidden states for every token the target keeps.

Files: ``DIR/eagle.json`` (what it was trained for and how) and ``DIR/eagle.safetensors``.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.engine.model_runner import SequenceInput
from tokenmill.engine.request import Sequence
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.spec.draft_model import DraftModelProposer
from tokenmill.engine.spec.proposer import Draft
from tokenmill.errors import InvalidParameterError, ModelFormatError
from tokenmill.models.base import CausalLM
from tokenmill.models.fused_decode import FusedDecoder
from tokenmill.models.layers import linear

CONFIG_FILE, WEIGHTS_FILE = "eagle.json", "eagle.safetensors"


class EagleHead(nn.Module):
    def __init__(self, target: CausalLM, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        cfg = target.config
        self.config = replace(cfg, num_layers=1, layer_types=cfg.layer_types[-1:])
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.block = target.make_block(self.config, 0, PagedAttentionBackend())
        self.norm = copy.deepcopy(target.norm)
        self.head = nn.Linear(h, len(draft_vocab), bias=False)
        self.register_buffer("vocab", draft_vocab.to(torch.long), persistent=True)

    @classmethod
    def initialised_from(cls, target: CausalLM, draft_vocab: torch.Tensor) -> EagleHead:
        """The warm start: fc takes the feature, the block is the target's last, norm and head are the target's."""
        head = cls(target, draft_vocab).to(target.embed.weight.device)
        h = target.config.hidden_size
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, :h] = torch.eye(h)
            head.block.load_state_dict(target.layers[-1].state_dict())
            weight = target.lm_head.weight if target.lm_head is not None else target.embed.weight
            head.head.weight.copy_(weight[head.vocab].float())
        return head.float()

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: Any, meta: Any) -> torch.Tensor:
        """features [T, H] (f_{p-1}), embeddings [T, H] (of t_p) -> predicted features g_p [T, H]."""
        return self.block(self.join(features, embeddings), rope, cache, meta)

    def join(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """The block's input: fc([f_{p-1} ; embed(t_p)])."""
        return linear(self.fc, torch.cat([features, embeddings], dim=-1).to(self.fc.weight.dtype))

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, len(vocab)] logits over the draft vocabulary (float32 where the packed
        bfloat16 kernel computes them: the same bfloat16-rounded values)."""
        return linear(self.head, self.norm(g), out_float32=True)

    # ---- files ----------------------------------------------------------------------------------
    def save(self, path: str | Path, meta: dict[str, Any]) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, path / WEIGHTS_FILE,
                  metadata={"format": "pt"})
        (path / CONFIG_FILE).write_text(json.dumps({"kind": "eagle", "hidden_size": self.config.hidden_size,
                                                    "vocab_size": self.config.vocab_size,
                                                    "draft_vocab": len(self.vocab), **meta}, indent=2))

    @classmethod
    def load(cls, path: str | Path, target: CausalLM) -> EagleHead:
        """A head saved by :meth:`save`, checked against ``target``, in the target's dtype and device."""
        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise ModelFormatError(f"{path} is not an EAGLE head directory (no {CONFIG_FILE} / {WEIGHTS_FILE}); "
                                   "make one with `tokenmill spec train-heads MODEL --out DIR`")
        meta = json.loads((path / CONFIG_FILE).read_text())
        cfg = target.config
        if (meta.get("hidden_size"), meta.get("vocab_size")) != (cfg.hidden_size, cfg.vocab_size):
            raise InvalidParameterError(
                f"EAGLE head {path} was trained for a model of hidden size {meta.get('hidden_size')} and vocabulary "
                f"{meta.get('vocab_size')}, this one has {cfg.hidden_size} and {cfg.vocab_size}")
        state = load_file(path / WEIGHTS_FILE)
        head = cls(target, state["vocab"])
        head.load_state_dict(state)
        weight = target.embed.weight
        return head.to(device=weight.device, dtype=weight.dtype if weight.dtype.is_floating_point else torch.float32)


class EagleDraft(nn.Module):
    """The head as the draft runner's model: ``forward(ids, positions, cache, meta)`` over the features
    the proposer set (``features``, one row per token), logits over the whole vocabulary (the tokens
    outside the draft vocabulary impossible)."""

    def __init__(self, head: EagleHead, target: CausalLM) -> None:
        super().__init__()
        self.head, self.config = head, head.config
        self._target = [target]  # not a submodule: the target's weights are not the head's
        self.embed = target.embed
        self.layers = nn.ModuleList([head.block])  # what FusedDecoder runs: the head's one block
        self.norm_cast_before_scale = target.norm_cast_before_scale
        self.features: torch.Tensor | None = None
        self._fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: Any,
                lora: Any = None) -> torch.Tensor:
        """The draft runner's call (``lora`` always None: the head drafts without adapters; the
        target verifies with them)."""
        if lora is not None:
            raise ValueError("an EAGLE head runs without LoRA adapters")
        target = self._target[0]
        embeddings = target.embed_tokens(input_ids)
        local = self.config.layer_type(0) == "sliding" and target.config.rope_local_theta
        rope = (target.rotary_local if local else target.rotary_global)(positions, embeddings.dtype)
        decode_only = meta is not None and meta.query_start_loc[-1] == meta.num_seqs
        fused = FusedDecoder.cached(self, kv_cache, self._fused) if decode_only and not torch.is_grad_enabled() \
            else None
        if fused is not None:  # a pass of one guess per sequence: the block in one call, bit-identical
            return fused.run(self.head.join(self.features, embeddings), [rope, rope], meta)
        return self.head(self.features, embeddings, rope, kv_cache.layer(0), meta)

    def compute_logits(self, hidden: torch.Tensor, kernel_rows: int | None = None) -> torch.Tensor:
        small = self.head.draft_logits(hidden).float()
        full = torch.full((hidden.shape[0], self.config.vocab_size), -torch.inf, device=hidden.device)
        full[:, self.head.vocab] = small
        return full


class EagleProposer(DraftModelProposer):
    """DraftModelProposer over an EAGLE head: pass 0 feeds the tokens the head lacks with the target's
    hidden states before them; later passes feed each guess with the head's own prediction."""

    wants_hidden = True

    def __init__(self, head: EagleHead, target: CausalLM, num_blocks: int, block_size: int, sampler: Sampler,
                 observe=None, name: str = "eagle") -> None:
        self.draft = EagleDraft(head, target)
        super().__init__(self.draft, num_blocks, block_size, sampler, observe, name)
        self.hidden_size = target.config.hidden_size
        self._target_hidden: dict[str, list[tuple[int, torch.Tensor]]] = {}
        """seq_id -> chunks (first position, the target's hidden states from it on), in order."""
        self._last_g: dict[str, torch.Tensor] = {}

    def observe_hidden(self, seq_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states of positions ``start ..`` of a sequence, as computed and kept
        (held as chunks: joined only when the head catches up)."""
        chunks = self._target_hidden.setdefault(seq_id, [])
        if chunks and chunks[-1][0] + len(chunks[-1][1]) != start:  # not contiguous (recomputed): start over
            chunks.clear()
        chunks.append((start, hidden))

    def release(self, seq_id: str) -> None:
        super().release(seq_id)
        self._target_hidden.pop(seq_id, None)

    def _features(self, seq_id: str, first: int, last: int) -> torch.Tensor:
        """f_{first - 1} .. f_{last - 1}: the target's hidden states before positions first..last
        (zeros where the target never computed one: position 0, prompt tokens served from the prefix cache).
        Only what a later catch-up can need is kept: from position ``last`` on."""
        out = torch.zeros(last - first + 1, self.hidden_size, dtype=self.draft.embed.weight.dtype)
        kept = []
        for start, rows in self._target_hidden.pop(seq_id, []):
            lo, hi = max(first - 1, start), min(last, start + len(rows))
            if lo < hi:
                out[lo - first + 1:hi - first + 1] = rows[lo - start:hi - start]
            if start + len(rows) > last:
                kept.append((max(start, last), rows[max(0, last - start):]))
        if kept:
            self._target_hidden[seq_id] = kept
        return out

    def _kept_prefix(self, seq: Sequence, fed) -> int:
        return fed.num_tokens  # guesses were fed with predicted features: rebuild them from the target's

    def _first_input(self, seq: Sequence, keep: int) -> SequenceInput:
        ids = seq.all_token_ids
        self._pending[seq.seq_id] = self._features(seq.seq_id, keep, len(ids) - 1)
        return super()._first_input(seq, keep)

    def _feed(self, seq: Sequence, guess: int) -> SequenceInput | None:
        item = super()._feed(seq, guess)
        if item is not None:
            self._pending[seq.seq_id] = self._last_g[seq.seq_id]
        return item

    def _run(self, seqs: list[Sequence], inputs: list[SequenceInput]) -> torch.Tensor:
        self.draft.features = torch.cat([self._pending.pop(seq.seq_id) for seq in seqs])
        out = self.runner.execute(inputs, with_hidden=True)
        ends = 0
        for seq, item in zip(seqs, inputs):
            ends += len(item.token_ids)
            self._last_g[seq.seq_id] = out.hidden[ends - 1:ends]
        return out.sample_logits

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        self._pending: dict[str, torch.Tensor] = {}
        try:
            return super().propose(seqs, num_tokens)
        finally:
            self._last_g.clear()
            self._pending = {}
