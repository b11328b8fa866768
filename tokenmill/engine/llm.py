"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.chat(messages)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tqdm import tqdm

from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.device import resolve_device, resolve_dtype
from tokenmill.engine.cache_config import CacheConfig
from tokenmill.engine.llm_engine import EngineConfig, LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loading.model_loader import load_model
from tokenmill.loading.sources import resolve_model
from tokenmill.paths import default_cache_dir
from tokenmill.engine.scheduler import SchedulerConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    """A model loaded for offline generation.

    ``model``: a known name (default ``smollm2-135m-instruct``), a GGUF file, an HF checkpoint
    directory or an HF hub repo id. ``dtype``: auto (float32 on CPU, bfloat16 on CUDA), float32,
    bfloat16 or float16 (CUDA). ``device``: auto, cpu or cuda.

    Engine: ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens per step (see
    SchedulerConfig), a paged KV pool of ``block_size``-token blocks sized by ``kv_cache_memory``
    (bytes, or a fraction of free memory; see CacheConfig), prefix caching on by default;
    ``kv_cache_dtype`` ``int8`` or ``fp8`` stores keys and values quantized (about 1.9x the tokens).
    """

    def __init__(self, model: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
                 device: str = "auto", max_model_len: int | None = None, seed: int | None = None,
                 cache_dir: str | os.PathLike | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_prefill_chunk: int = 0, policy: str = "fcfs",
                 block_size: int = 16, kv_cache_memory: float | int = 0.1,
                 enable_prefix_caching: bool = True, kv_cache_dtype: str = "auto") -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        config = EngineConfig(max_model_len, seed,
                              SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_prefill_chunk, True, policy),
                              CacheConfig(block_size, kv_cache_memory, enable_prefix_caching, kv_cache_dtype))
        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        source = resolve_model(model, cache)
        loaded = load_model(source, PagedAttentionBackend(), self.dtype, self.device, cache_dir=cache)
        self.model_name = source.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.engine = LLMEngine(loaded, self.device, config)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        ``priority``: one per prompt, lower first (used with ``policy="priority"``)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidParameterError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, sp, rank in zip(prompts, params, priorities):
                ids.append(self.engine.add_request(prompt, sp, priority=rank).request_id)
        except Exception:
            for request_id in ids:  # a bad prompt rejects the whole call; nothing stays queued
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the assistant turn."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(m) for m in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def render_chat(self, messages: Messages) -> list[int]:
        """Token ids of a conversation rendered by the chat template, ready for the assistant to answer."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt's first sample as they are generated."""
        request = self.engine.add_request(prompt, sampling_params)
        shown = 0
        try:
            while not request.finished:
                for out in self.engine.step():
                    if out.request_id != request.request_id:
                        continue
                    text = LLMEngine.make_output(request, streaming=True).outputs[0].text
                    if len(text) > shown:
                        yield text[shown:]
                        shown = len(text)
        finally:
            if not request.finished:
                self.engine.abort(request.request_id)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise InvalidParameterError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
