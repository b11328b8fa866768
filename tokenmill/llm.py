"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.chat(messages)``.

The engine hands out deltas (what each request gained in a step); ``generate`` and ``chat``
fold them into each request's cumulative :class:`RequestOutput`, ``stream`` yields the text
deltas of one prompt as they come.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Sequence

from tqdm import tqdm

from tokenmill.config import LoadConfig
from tokenmill.engine import (
    ENGINE_OPTIONS,
    EngineConfig,
    LLMEngine,
    OutputAccumulator,
    RequestOutput,
    SpeculativeConfig,
)
from tokenmill.errors import InvalidParameterError
from tokenmill.loader import load_draft, load_model
from tokenmill.options import option_fields, options_doc, split_options
from tokenmill.quantization.grouped import apply_copies
from tokenmill.sampling_params import SamplingParams


Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    """A model loaded for offline generation: ``LLM()``, ``LLM("gemma3-270m", max_num_seqs=8)``.

    ``model``: a known name (default ``smollm2-135m-instruct``), a GGUF file, an HF or
    tokenmill-quantized directory, or an HF hub repo id. Every other option is a keyword with the
    name, default and meaning of the command-line flag of the same name (``tokenmill serve
    --help``); an unknown name is an error that lists the known ones.
    """

    def __init__(self, model: str | None = None, speculative: dict[str, Any] | None = None, **options: Any) -> None:
        if speculative is not None:  # vLLM's form: speculative={"method": "ngram", "num_speculative_tokens": 4}
            flat = SpeculativeConfig.options_of(speculative)
            both = sorted(set(flat) & set(options))
            if both:
                raise InvalidParameterError(f"{', '.join(both)} given both in speculative and as an option")
            options = {**options, **flat}
        load, *engine_parts = split_options({"model": model, **options}, LoadConfig, *ENGINE_OPTIONS)
        load_config = LoadConfig(**load)
        engine_config = EngineConfig.from_parts(*engine_parts)
        loaded = load_model(load_config.model, load_config.dtype, load_config.device, load_config.cache_dir)
        apply_copies(loaded.model, load_config.bf16_copy_rows, load_config.int8_copies,
                     load_config.head_int8_activations, load_config.int8_activations)
        self.model_name = loaded.source.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = loaded.model.embed.weight.device
        self.dtype = loaded.model.embed.weight.dtype
        spec = engine_config.speculative
        draft = None if spec.speculative_method != "draft" else load_draft(
            spec.draft_model, load_config.dtype, load_config.device, load_config.cache_dir, self.dtype)
        self.engine = LLMEngine(loaded, self.device, engine_config, draft)

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Load the LoRA adapter at ``path`` (a PEFT directory or a GGUF LoRA file) as ``name``, for
        ``generate(..., lora=name)`` (needs ``enable_lora=True``). ``replace``: a name already loaded
        takes the new weights."""
        if self.engine.lora is None:
            raise InvalidParameterError("this LLM serves no adapters: create it with enable_lora=True")
        self.engine.lora.load(name, path, replace=replace)

    def unload_lora(self, name: str) -> None:
        if self.engine.lora is None:
            raise InvalidParameterError("this LLM serves no adapters: create it with enable_lora=True")
        self.engine.lora.unload(name)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
                 priority: Sequence[int] | None = None,
                 lora: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        ``priority``: one per prompt, lower first. ``lora``: the adapter (loaded by :meth:`load_lora`)
        every prompt runs with, or one per prompt (None: the base model)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidParameterError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise InvalidParameterError(f"got {len(adapters)} adapters for {len(prompts)} prompts")
        outputs: dict[str, OutputAccumulator] = {}
        try:
            for prompt, sp, rank, adapter in zip(prompts, params, priorities, adapters):
                request = self.engine.add_request(prompt, sp, priority=rank, lora=adapter)
                outputs[request.request_id] = OutputAccumulator(
                    request.request_id, request.prompt, request.prompt_token_ids, sp.n, sp.logprobs is not None,
                    sp.prompt_logprobs is not None)
        except Exception:
            for request_id in outputs:  # a bad prompt rejects the whole call; nothing stays queued
                self.engine.abort(request_id)
            raise
        with tqdm(total=len(outputs), disable=not use_tqdm, desc="generating") as bar:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    outputs[delta.request_id].add(delta)
                    bar.update(delta.finished)
        return [acc.output for acc in outputs.values()]

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
        try:
            while not request.finished:
                for delta in self.engine.step():
                    if delta.request_id != request.request_id:
                        continue
                    text = "".join(s.text for s in delta.samples if s.index == 0)
                    if text:
                        yield text
        finally:
            if not request.finished:
                self.engine.abort(request.request_id)


def _signature() -> inspect.Signature:
    """LLM(model=None, *, <every option>): the keyword options with their defaults, for help() and IDEs."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for cls in (LoadConfig, *ENGINE_OPTIONS):
        for f in option_fields(cls):
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
            params.append(inspect.Parameter(f.name, kind, default=f.default))
    params.append(inspect.Parameter("speculative", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()
LLM.__doc__ = f"{LLM.__doc__}\n    {options_doc(LoadConfig, *ENGINE_OPTIONS)}\n"


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
