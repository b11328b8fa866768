"""LLMEngine: add requests, step, abort. Every step is one forward pass over a token budget.

    step():
      draft               with speculative decoding: a draft for each eligible decoding sequence (spec/)
      schedule            which sequences run, how many tokens each (scheduler.py)
      copy-on-write       block copies the KV manager owes (forked n > 1 samples)
      run the model       one ragged forward pass over all scheduled tokens (model_runner.py)
      sample              one batched sampler call for every sequence that completed its tokens;
                          a drafting sequence's rows verify its draft (the kept tokens and one more)
      bookkeeping         cache full blocks, fork n > 1 samples, detokenize, check stops, free
      report              one RequestDelta per changed request (what is new: outputs.py), step statistics
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
import torch

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.kv_quant import storage_dtype
from tokenmill.config import layer_groups
from tokenmill.allocator import keep_large_buffers
from tokenmill.engine.config import CacheConfig, EngineConfig
from tokenmill.engine.block_pool import PROCESS_HASHER, BlockHasher
from tokenmill.engine.kv_cache_manager import KVCacheCoordinator, KVCacheManager
from tokenmill.engine.model_runner import ModelRunner, SequenceInput
from tokenmill.engine.limits import PromptLimits
from tokenmill.engine.outputs import RequestDelta, SampleDelta, TokenLogprobs
from tokenmill.engine.request import Request, Sequence, SequenceStatus
from tokenmill.engine.sampler import Sampler, SamplingState, compute_prompt_logprobs, take_rows
from tokenmill.engine.scheduler import ScheduledSequence, Scheduler
from tokenmill.engine.spec.build import build_drafter
from tokenmill.engine.spec.verify import verify
from tokenmill.engine.stats import EngineSnapshot, StepStats
from tokenmill.engine.stop_checker import check_stop, stream_safe_length
from tokenmill.engine.work import SequenceWork, WorkModel
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.detokenizer import IncrementalDetokenizer
from tokenmill.lora.adapter import LoRAAdapter
from tokenmill.lora.manager import LoRAManager
from tokenmill.models.builder import LoadedModel
from tokenmill.models.moe_stats import MoEStepStats
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.engine")


def adapter_salt(cache_salt: str | None, content_hash: str) -> str:
    """The prefix-cache salt of a request run with a LoRA adapter (its KV differs from the base model's)."""
    return f"{cache_salt}\0lora:{content_hash}"

class LLMEngine:
    def __init__(self, loaded: LoadedModel, device: torch.device, config: EngineConfig = EngineConfig(),
                 draft: LoadedModel | None = None) -> None:
        """``draft``: the draft model of ``speculative_method`` draft, loaded by the caller."""
        self.model_config, self.tokenizer, self.config, self.device = loaded.config, loaded.tokenizer, config, device
        if config.keep_large_buffers and device.type == "cpu":
            keep_large_buffers()
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.kv, cache = self._init_kv_cache(loaded, config.cache, device)
        self.limits = PromptLimits(loaded.config.vocab_size, self.max_model_len, self.kv_capacity_tokens)
        self.lora = LoRAManager(config.lora, loaded.config, loaded.model.embed.weight.dtype, device) \
            if config.lora.enable_lora else None
        """The LoRA adapters (``enable_lora``), else None."""
        self.scheduler = Scheduler(config.scheduler, self.kv, config.lora.max_loras if self.lora else 0)
        self.runner = ModelRunner(loaded.model, cache, device, self.lora.slots if self.lora else None)
        if config.moe_capacity_factor is not None and loaded.config.moe is None:
            raise InvalidParameterError("moe_capacity_factor is for mixture-of-experts models; this one has no experts")
        loaded.model.set_moe_capacity(config.moe_capacity_factor)
        loaded.model.prepare_moe()
        self._expert_stats = loaded.model.expert_stats
        self.moe_totals: MoEStepStats | None = None
        """An MoE model's routing since start (tokenmill.models.moe_stats), None before the first routed step."""
        self.sampler = Sampler(loaded.config.vocab_size, seed=config.seed)
        self.work_model = WorkModel.of(loaded.config)
        self.drafter = build_drafter(config.speculative, loaded, draft, self.sampler,
                                     self.kv_capacity_tokens + config.scheduler.max_num_seqs
                                     * config.speculative.num_speculative_tokens, config.cache.block_size,
                                     self.kv, cache)
        self.eos_token_ids = frozenset(self.tokenizer.stop_token_ids)
        self.requests: dict[str, Request] = {}
        self._parked: dict[str, list[Sequence]] = {}  # n > 1 samples waiting for their prompt's KV
        self._ids = itertools.count()
        self.stats: deque[StepStats] = deque(maxlen=10_000)

    def _init_kv_cache(self, loaded: LoadedModel, cfg: CacheConfig, device: torch.device):
        """Size the block pool from the memory budget, one pool per KV group (see cache_config)."""
        mc = loaded.config
        groups, windows = layer_groups(mc)
        dtype = loaded.model.embed.weight.dtype
        kv_dtype = storage_dtype(cfg.kv_cache_dtype, dtype)
        budget = cfg.budget_bytes(device)
        # never more than max_num_seqs full-length sequences need
        budget = min(budget, PagedKVCache.bytes_per_block(cfg.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype,
                                                          mc.num_layers)
                     * (self.config.scheduler.max_num_seqs * -(-self.max_model_len // cfg.block_size) + 1))
        per_group = [groups.count(g) for g in range(len(windows))]
        num_blocks = [PagedKVCache.num_blocks_for_budget(budget * n // mc.num_layers, cfg.block_size,
                                                         mc.num_kv_heads, mc.head_dim, kv_dtype, n) for n in per_group]
        if min(num_blocks) < 2:
            raise InvalidParameterError(f"kv_cache_memory of {budget} bytes holds no KV block; raise it")
        self.block_hasher = PROCESS_HASHER if cfg.prefix_hash_key is None else BlockHasher(cfg.prefix_hash_key)
        managers = [KVCacheManager(n, cfg.block_size, cfg.enable_prefix_caching, w, self.block_hasher)
                    for n, w in zip(num_blocks, windows)]
        cache = PagedKVCache(num_blocks, cfg.block_size, groups, mc.num_kv_heads, mc.head_dim, dtype, device,
                             cfg.kv_cache_dtype)
        self.kv_capacity_tokens = (num_blocks[0] - 1) * cfg.block_size
        logger.info("KV cache: %d blocks of %d tokens per group (%s), %s, %.1f MiB: %d tokens",
                    num_blocks[0], cfg.block_size, len(num_blocks), str(kv_dtype).removeprefix("torch."),
                    budget / 2**20, self.kv_capacity_tokens)
        return KVCacheCoordinator(managers), cache

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    lora: str | LoRAAdapter | None = None) -> Request:
        """``lora``: the adapter it runs with, by name (loaded with ``self.lora.load``) or as the
        object; None runs the base model."""
        params = params or SamplingParams()
        adapter = self._adapter(lora)
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        self.limits.check(ids)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidParameterError(f"request id {request_id!r} is already in use")
        now = time.monotonic()
        if adapter is not None:  # a different adapter's KV differs: never shared through the prefix cache
            cache_salt = adapter_salt(cache_salt, adapter.content_hash)
        sequences = [self._new_sequence(request_id, i, ids, params, priority, cache_salt, now)
                     for i in range(params.n)]
        for seq in sequences:
            seq.lora = adapter
            if adapter is not None:
                self.lora.acquire(adapter, seq.seq_id)
        request = Request(request_id, text, ids, params, sequences, arrival_time=now)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.requests[request_id] = request
        self.scheduler.add(sequences[0])
        if len(sequences) > 1:
            self._parked[request_id] = sequences[1:]
        return request

    def _adapter(self, lora: str | LoRAAdapter | None) -> LoRAAdapter | None:
        if lora is None:
            return None
        if self.lora is None:
            raise InvalidParameterError(f"LoRA adapter {getattr(lora, 'name', lora)!r} asked for, but this engine "
                                        "serves no adapters (enable_lora)", param="model")
        return lora if isinstance(lora, LoRAAdapter) else self.lora.get(lora)

    def _new_sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams, priority: int,
                      cache_salt: str | None, now: float) -> Sequence:
        if params.n > 1 and params.seed is not None:  # each sample draws its own stream
            params = params.clone(seed=params.seed * 1_000_003 + index, n=1)
        state = SamplingState.create(params, ids, eos_token_ids=self.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        # prompt logprobs need every prompt position computed: no prefix-cache hit for such requests
        salt = cache_salt if params.prompt_logprobs is None else f"{cache_salt}:prompt-logprobs:{request_id}"
        return Sequence(request_id, index, ids, state, detok, priority=priority, arrival_time=now, cache_salt=salt,
                        logprobs=[] if params.logprobs is not None else None)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences:
            if not seq.status.finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
            self._finish(seq)
        self._parked.pop(request_id, None)

    def _finish(self, seq: Sequence) -> None:
        """Give back everything a finished (or aborted) sequence holds: its KV and its draft state."""
        self.scheduler.finish(seq)
        if self.drafter is not None:
            self.drafter.finish(seq)
        self._release_lora(seq)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.lora.release(seq.lora, seq.seq_id)

    WARM_UP_REQUEST_ID = "__warm_up__"

    def warm_up(self) -> list[StepStats]:
        """Run one tiny generation through the whole step (a 2-token prompt, 2 greedy tokens: a
        prefill step, then a decode step), so that what is built or loaded on first use (the CPU
        kernels, the decode stack, allocator pools, CUDA's kernels) is ready before the first real
        request. Returns its steps' statistics.

        Call it on an idle engine (RuntimeError otherwise: the other requests' deltas would be
        lost). It leaves nothing behind: its steps are kept out of :attr:`stats`, its request is
        gone and its KV blocks are free when it returns, even when a step raises (the error
        propagates). It does count in the prefix cache's lookup counter (2 prompt tokens, no hit:
        its cache salt is its own)."""
        if self.has_unfinished_requests() or self.WARM_UP_REQUEST_ID in self.requests:
            raise RuntimeError("warm_up() needs an idle engine: requests are unfinished")
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        prompt = [i % self.limits.vocab_size for i in range(2)]
        saved, self.stats = self.stats, deque(maxlen=self.stats.maxlen)
        try:
            self.add_request(prompt, params, request_id=self.WARM_UP_REQUEST_ID, cache_salt=self.WARM_UP_REQUEST_ID)
            for _ in range(64):  # a prefill step and a decode step; never loop forever
                if not self.has_unfinished_requests():
                    return list(self.stats)
                self.step()
            raise RuntimeError("warm_up(): the 2-token request did not finish in 64 steps")
        finally:
            self.abort(self.WARM_UP_REQUEST_ID)
            self.stats = saved

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool (every block of every group)."""
        return self.runner.cache.nbytes

    def cached_block_hashes(self) -> list[int]:
        """The hashes of the full blocks the prefix cache holds (held or free, not yet evicted), of
        the first KV group: what a scale-out router matches requests against (``block_hasher``
        computes a request's)."""
        return list(self.kv.groups[0].pool.cached)

    def prompt_tokens_left(self) -> int:
        """Prompt tokens of the running and waiting sequences not computed yet: the prefill work
        queued (a scale-out router weighs it; computed on demand, not in every snapshot)."""
        return self.scheduler.prompt_tokens_left

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_used_blocks(self) -> int:
        """KV blocks held by sequences, all groups together, a draft model's too (0 once every
        request has ended)."""
        drafts = self.drafter.proposer.num_used_blocks if self.drafter is not None else 0
        return sum(g.pool.num_blocks - 1 - g.num_free_blocks for g in self.kv.groups) + drafts

    def snapshot(self) -> EngineSnapshot:
        """The engine's state now: running and waiting sequences, KV use, prefix-cache and preemption counters."""
        prefix = self.kv.prefix_cache_stats
        c = self.drafter.counters if self.drafter else None
        return EngineSnapshot(len(self.scheduler.running), self.scheduler.num_waiting, self.num_used_blocks,
                              self.kv.usage, prefix.queries, prefix.hits, self.scheduler.num_preemptions,
                              *self._spec_totals(), c.num_drafts if c else 0,
                              tuple(c.accepted_per_position) if c else (),
                              len({id(s.lora) for s in self.scheduler.running if s.lora is not None}),
                              self.lora.num_registered if self.lora else 0, self.moe_totals)

    def _drain_moe(self) -> MoEStepStats | None:
        """The step's MoE routing (None for a dense model, or a step that routed nothing), added to the totals."""
        step = self._expert_stats.drain() if self._expert_stats is not None else None
        if step is not None:
            self.moe_totals = step if self.moe_totals is None else self.moe_totals.plus(step)
        return step

    def _spec_totals(self) -> tuple[int, int]:
        """(drafted, kept) tokens so far; (0, 0) without speculative decoding."""
        c = self.drafter.counters if self.drafter else None
        return (c.num_draft_tokens, c.num_accepted_tokens) if c else (0, 0)

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One forward pass; what each request that changed gained in it."""
        start = time.perf_counter()
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running, self.max_model_len,
                                 self.config.scheduler.max_num_batched_tokens)
        run_start = time.perf_counter()
        plan = self.scheduler.schedule()
        changed: dict[str, Request] = {}
        for seq in plan.failed:
            self._fail(seq, changed)
        num_sampled = sum(s.completes for s in plan.scheduled)
        work = self._work(plan.scheduled)
        spec_before = self._spec_totals()
        if plan.scheduled:
            self._run(plan.scheduled, changed)
        if self.drafter is not None and plan.scheduled and all(
                s.num_new_tokens == 1 + s.num_draft for s in plan.scheduled):
            # decode-only steps (each row sampled, so each costs logits too: a 262k vocabulary makes
            # a row as dear as the rest of the model); a prompt chunk's tokens need none and would
            # make draft tokens look cheap
            num_decoding = len(plan.scheduled)
            produced = num_decoding + self._spec_totals()[1] - spec_before[1]
            self.drafter.observe_step(plan.num_batched_tokens, time.perf_counter() - run_start
                                      + self.drafter.last_draft_seconds, num_decoding, produced)
        running = self.scheduler.running
        drafted, kept = (now - before for now, before in zip(self._spec_totals(), spec_before))
        self.stats.append(StepStats(
            len(running), self.scheduler.num_waiting, len(plan.scheduled), plan.num_batched_tokens,
            num_sampled, self.num_used_blocks,
            sum(s.num_computed_tokens for s in running), self.kv.usage, plan.prefix_hit_tokens,
            len(plan.preempted), time.perf_counter() - start, drafted, kept, self._drain_moe(), work))
        return [self._delta(request) for request in changed.values()]

    def _work(self, scheduled: list[ScheduledSequence]) -> tuple[SequenceWork, ...]:
        """The FLOPs each request's scheduled samples cause in this step (engine/work.py), read
        before the step moves ``num_computed_tokens``."""
        by_request: dict[str, SequenceWork] = {}
        for item in scheduled:
            seq = item.seq
            work = by_request.get(seq.request_id)
            if work is None:
                work = by_request[seq.request_id] = SequenceWork(seq.request_id)
            self.work_model.sequence(work, seq.num_computed_tokens, item.num_new_tokens, len(seq.prompt_token_ids),
                                     seq.num_cached_tokens, (1 + item.num_draft) if item.completes else 0)
        return tuple(by_request.values())

    def _run(self, scheduled: list[ScheduledSequence], changed: dict[str, Request]) -> None:
        for group, pairs in enumerate(self.kv.take_pending_copies()):
            self.runner.cache.copy_blocks(group, pairs)
        slots = self.lora.activate([s.seq.lora for s in scheduled if s.seq.lora is not None]) if self.lora else {}
        inputs = []
        for item in scheduled:
            seq, start, j = item.seq, item.seq.num_computed_tokens, item.num_draft
            if j and seq.draft_hidden is not None and seq.lora is None:
                # the draft was the model itself: its last token and guesses but the last are computed
                inputs.append(SequenceInput([seq.draft_token_ids[j - 1]], start + j, self.kv.block_table(seq.seq_id),
                                            True, num_sample_rows=1 + j, hidden_before=seq.draft_hidden[:j]))
                continue
            inputs.append(SequenceInput(seq.tokens_with_draft()[start:start + item.num_new_tokens], start,
                                        self.kv.block_table(seq.seq_id), item.completes,
                                        self._wants_prompt_logprobs(item), 1 + item.num_draft,
                                        slots[id(seq.lora)] if seq.lora is not None else -1))
        wants_hidden = self.drafter is not None and self.drafter.wants_hidden
        result = self.runner.execute(inputs, with_hidden=wants_hidden)
        if wants_hidden:
            self.drafter.observe_hidden(scheduled, result.hidden)
        for i in result.all_logits:
            self._add_prompt_logprobs(scheduled[i], result.all_logits[i])
        plain_rows, completing, verifying, verify_rows, row = [], [], [], [], 0
        for i in result.sample_rows:
            item = scheduled[i]
            if item.num_draft:
                verifying.append(item)
                verify_rows.extend(range(row, row + 1 + item.num_draft))
            else:
                plain_rows.append(row)
                completing.append(item)
            row += 1 + item.num_draft
        for item in scheduled:
            if not item.num_draft:  # a drafting sequence counts what verification keeps (_verify)
                item.seq.num_computed_tokens += item.num_new_tokens
                self.kv.cache_blocks(item.seq.seq_id, item.seq.all_token_ids, item.seq.num_computed_tokens)
        logits = take_rows(result.sample_logits, plain_rows)
        rows, seqs = self._with_forked_samples(completing, logits)
        samples = self.sampler(rows, [s.sampling for s in seqs])
        now = time.monotonic()
        for seq, sample in zip(seqs, samples):
            request = self.requests[seq.request_id]
            request.first_token_time = request.first_token_time or now
            self._append(seq, sample)
            changed[request.request_id] = request
        if verifying:
            self._verify(verifying, take_rows(result.sample_logits, verify_rows), changed)

    def _verify(self, verifying: list[ScheduledSequence], logits: torch.Tensor, changed: dict[str, Request]) -> None:
        """The drafting sequences' rows (``logits``, theirs in order), verified together
        (spec/verify.py): each keeps its draft up to the first token the target refuses, then one
        more. The KV of the refused tokens is dropped (truncate) before any block of the kept ones is
        offered to the prefix cache."""
        drafts = [(item.seq.sampling, item.seq.draft_token_ids, item.seq.draft_probs) for item in verifying]
        now = time.monotonic()
        for item, (_, draft, _), outcome in zip(verifying, drafts, verify(self.sampler, logits, drafts)):
            seq, kept = item.seq, outcome.num_accepted
            seq.draft_token_ids, seq.draft_probs = [], None
            self.drafter.accepted(item, len(draft), kept)
            seq.num_computed_tokens += 1 + kept  # its last token and the kept draft; the next token is new
            self.kv.truncate(seq.seq_id, seq.num_computed_tokens)
            self.kv.cache_blocks(seq.seq_id, seq.all_token_ids + draft[:kept], seq.num_computed_tokens)
            request = self.requests[seq.request_id]
            request.first_token_time = request.first_token_time or now
            changed[request.request_id] = request
            for sample in outcome.samples:
                self._append(seq, sample)
                if seq.status.finished:
                    break

    def _with_forked_samples(self, completing: list[ScheduledSequence], logits: torch.Tensor):
        """Sequences to sample and their logits rows: a request's first sample that just finished its
        prompt brings its n - 1 siblings, forked onto its KV blocks, sampling from the same row."""
        rows, seqs = [], []
        for row, item in enumerate(completing):
            seq = item.seq
            rows.append(row)
            seqs.append(seq)
            for child in self._parked.pop(seq.request_id, []) if not seq.output_token_ids else []:
                self.kv.fork(seq.seq_id, child.seq_id)
                child.num_computed_tokens = seq.num_computed_tokens
                self.scheduler.add_running(child)
                rows.append(row)
                seqs.append(child)
        # no fork (every step but a parallel sample's first): the logits as they are, not a copy
        return (logits if rows == list(range(logits.shape[0])) else logits[rows]), seqs

    def _wants_prompt_logprobs(self, item: ScheduledSequence) -> bool:
        """Only the first sample, and only while the prompt logprobs are still being filled in order."""
        seq, request = item.seq, self.requests[item.seq.request_id]
        return (request.prompt_logprobs is not None and seq.index == 0
                and seq.num_computed_tokens + 1 == len(request.prompt_logprobs)
                and len(request.prompt_logprobs) < len(request.prompt_token_ids))

    def _add_prompt_logprobs(self, item: ScheduledSequence, logits: torch.Tensor) -> None:
        """Chunk rows at positions a..b-1 predict prompt tokens a+1..b (those inside the prompt)."""
        request, a = self.requests[item.seq.request_id], item.seq.num_computed_tokens
        prompt = request.prompt_token_ids
        targets = prompt[a + 1:min(a + item.num_new_tokens + 1, len(prompt))]
        if not targets:
            return
        entries = compute_prompt_logprobs(logits[:len(targets)], [prompt[a]] + targets,
                                          item.seq.sampling.params.prompt_logprobs)[1:]
        request.prompt_logprobs.extend(TokenLogprobs(t, e["logprob"], e["top"]) for t, e in zip(targets, entries))

    def _append(self, seq: Sequence, sample) -> None:
        seq.append_token(sample.token_id)
        if seq.logprobs is not None:
            seq.logprobs.append(TokenLogprobs(sample.token_id, sample.logprob, list(sample.top_logprobs or [])))
        check_stop(seq, seq.detokenizer.add(sample.token_id), self.eos_token_ids, self.max_model_len)
        if seq.status.finished:
            if not isinstance(seq.stop_reason, str):  # text cut at a stop string stays cut
                seq.text += seq.detokenizer.finish()
            self._finish(seq)

    def _fail(self, seq: Sequence, changed: dict[str, Request]) -> None:
        """A sequence the KV pool cannot hold even alone: it and its parked siblings end with 'error'."""
        request = self.requests[seq.request_id]
        for sibling in self._parked.pop(seq.request_id, []):
            sibling.status = SequenceStatus.FINISHED_ERROR
            self._release_lora(sibling)
        self._finish(seq)
        changed[request.request_id] = request

    # ---- outputs --------------------------------------------------------------------------------
    def _delta(self, request: Request) -> RequestDelta:
        """What ``request`` gained since its previous delta; a finished request leaves the engine."""
        samples = [d for d in map(_sample_delta, request.sequences) if d is not None]
        finished = request.finished
        if finished:
            request.finish_time = time.monotonic()
            self.requests.pop(request.request_id, None)
        prompt_logprobs = None
        if request.prompt_logprobs is not None and len(request.prompt_logprobs) > request.num_sent_prompt_logprobs:
            prompt_logprobs = request.prompt_logprobs[request.num_sent_prompt_logprobs:]
            request.num_sent_prompt_logprobs = len(request.prompt_logprobs)
        first = request.sequences[0]
        return RequestDelta(request.request_id, samples, finished, prompt_logprobs, max(first.num_cached_tokens, 0),
                            request.arrival_time, first.scheduled_time, request.first_token_time,
                            request.finish_time)


def _sample_delta(seq: Sequence) -> SampleDelta | None:
    """The tokens, text and logprobs ``seq`` gained since it last reported; None when nothing changed.

    Text that may still be the start of a stop string stays back while the sample runs
    (stream_safe_length); a cut at a stop string only ever removes such held-back text."""
    finished = seq.status.finished
    num_tokens, num_chars = len(seq.output_token_ids), stream_safe_length(seq)
    if num_tokens == seq.num_sent_tokens and num_chars == seq.num_sent_chars and (seq.finish_sent or not finished):
        return None
    start = seq.num_sent_tokens
    delta = SampleDelta(seq.index, seq.output_token_ids[start:], seq.text[seq.num_sent_chars:num_chars],
                        seq.logprobs[start:] if seq.logprobs is not None else None, seq.status.finish_reason,
                        seq.stop_reason)
    seq.num_sent_tokens, seq.num_sent_chars, seq.finish_sent = num_tokens, num_chars, finished
    return delta

