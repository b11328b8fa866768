"""LLMEngine: add requests, step, abort; every step is one forward pass over all running sequences.

This is the simple engine of the model-runtime milestone: a contiguous KV cache row per
sequence, FCFS admission up to ``max_num_seqs``, whole-prompt prefill. Each step::

    admit waiting sequences -> run the model on every running sequence's new tokens
    -> sample one token per sequence (one batched sampler call) -> detokenize, check stops
    -> free finished sequences -> report outputs of requests that changed
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import torch

from tokenmill.engine.model_runner import ModelRunner, ScheduledSequence
from tokenmill.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from tokenmill.engine.request import Request, Sequence, SequenceStatus
from tokenmill.engine.sampler import Sampler, SamplingState, compute_prompt_logprobs
from tokenmill.engine.stop_checker import check_stop, stream_safe_length
from tokenmill.errors import ContextLengthError, InvalidParameterError
from tokenmill.loading.detokenizer import IncrementalDetokenizer
from tokenmill.loading.model_loader import LoadedModel
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32
    """Sequences decoded together in one step."""
    max_model_len: int | None = None
    """Context window in tokens; None means the model's own."""
    seed: int | None = None
    """Seed of the RNG used by requests without their own seed."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidParameterError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidParameterError(f"max_model_len must be >= 2, got {self.max_model_len}")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, device: torch.device, config: EngineConfig = EngineConfig()) -> None:
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.config = config
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded.model, device)
        self.sampler = Sampler(loaded.config.vocab_size, seed=config.seed)
        self.device = device
        self.eos_token_ids = frozenset(self.tokenizer.stop_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        params = params or SamplingParams()
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        self._validate_prompt(ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidParameterError(f"request id {request_id!r} is already in use")
        sequences = [self._new_sequence(request_id, i, ids, params) for i in range(params.n)]
        request = Request(request_id, text, ids, params, sequences)
        self.requests[request_id] = request
        self.waiting.extend(sequences)
        return request

    def _new_sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams) -> Sequence:
        if params.n > 1 and params.seed is not None:  # each sample draws its own stream
            params = params.clone(seed=params.seed * 1_000_003 + index, n=1)
        # seeded generators live on the CPU: the same tokens on CPU and CUDA, no device round-trip
        state = SamplingState.create(params, ids, "cpu", eos_token_ids=self.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        return Sequence(request_id, index, ids, state, detok, logprobs=[] if params.logprobs is not None else None)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidParameterError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the context window is {self.max_model_len} tokens; "
                f"shorten the prompt by at least {len(ids) - self.max_model_len + 1} tokens")

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences:
            if not seq.status.finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
            self._release(seq)
        self.waiting = deque(s for s in self.waiting if not s.status.finished)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._admit()
        if not self.running:
            return []
        scheduled = [ScheduledSequence(s, s.num_tokens - s.num_computed_tokens,
                                       all_logits=self._wants_prompt_logprobs(s)) for s in self.running]
        result = self.runner.execute(scheduled)
        samples = self.sampler(result.last_logits, [s.sampling for s in self.running])
        changed: dict[str, Request] = {}
        for i, (item, sample) in enumerate(zip(scheduled, samples)):
            seq, request = item.seq, self.requests[item.seq.request_id]
            if i in result.all_logits:
                request.prompt_logprobs = _prompt_logprobs(
                    result.all_logits[i], seq.prompt_token_ids, seq.sampling.params.prompt_logprobs)
            seq.num_computed_tokens += item.num_new_tokens
            self._append(seq, sample)
            request.first_token_time = request.first_token_time or time.monotonic()
            changed[request.request_id] = request
        outputs = []
        for request in changed.values():
            if request.finished:
                request.finish_time = time.monotonic()
                self.requests.pop(request.request_id, None)
            outputs.append(self.make_output(request))
        return outputs

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.status.finished:  # aborted while waiting
                continue
            # without max_tokens, start at the prompt's size: the slot grows as the sequence does
            budget = seq.num_tokens + (seq.sampling.params.max_tokens or 0)
            self.runner.allocate(seq, min(budget, self.max_model_len))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _wants_prompt_logprobs(self, seq: Sequence) -> bool:
        return (seq.index == 0 and seq.num_computed_tokens == 0
                and seq.sampling.params.prompt_logprobs is not None)

    def _append(self, seq: Sequence, sample) -> None:
        seq.sampling.output_token_ids.append(sample.token_id)
        if seq.logprobs is not None:
            seq.logprobs.append(TokenLogprobs(sample.token_id, sample.logprob, list(sample.top_logprobs or [])))
        check_stop(seq, seq.detokenizer.add(sample.token_id), self.eos_token_ids, self.max_model_len)
        if seq.status.finished:
            if not isinstance(seq.stop_reason, str):  # text cut at a stop string stays cut
                seq.text += seq.detokenizer.finish()
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.runner.free(seq)
        if seq in self.running:
            self.running.remove(seq)

    # ---- outputs --------------------------------------------------------------------------------
    @staticmethod
    def make_output(request: Request, streaming: bool = False) -> RequestOutput:
        outputs = []
        for seq in request.sequences:
            text = seq.text[:stream_safe_length(seq)] if streaming else seq.text
            outputs.append(CompletionOutput(seq.index, text, list(seq.output_token_ids), seq.status.finish_reason,
                                            seq.stop_reason, seq.logprobs))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.prompt_logprobs)


def _prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], top_n: int) -> list[TokenLogprobs | None]:
    """Logits rows i predict token i+1: shift by one; the first prompt token has no logprob."""
    entries = compute_prompt_logprobs(logits, prompt_ids, top_n)
    out: list[TokenLogprobs | None] = []
    for token, entry in zip(prompt_ids, entries):
        out.append(None if entry is None else TokenLogprobs(token, entry["logprob"], entry["top"]))
    return out
