"""Request and response schemas of the OpenAI-compatible API (pydantic), apart from the handlers.

Requests reject unknown fields (400 naming the field) but accept every field the official
OpenAI SDK sends; OpenAI features tokenmill does not implement (tools, logit_bias, suffix, ...)
are accepted only at their no-op values. vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, priority, ...) are accepted too, e.g. through ``extra_body``.
Ranges the engine checks itself (SamplingParams) are left to it, so its error names the field.

Text fields are :data:`Text`: JSON lets a lone UTF-16 surrogate through (``"\\ud800"``), but no
tokenizer or UTF-8 encoder takes one, so it is refused here (error type ``invalid_unicode``).
Errors raised as :class:`PydanticCustomError` carry their type as the error's ``code``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

INT64 = 2**63


def valid_unicode(text: str) -> str:
    """``text`` if it encodes to UTF-8, else an ``invalid_unicode`` error (a lone surrogate)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(
                "invalid_unicode", "the text has a lone UTF-16 surrogate ({char}) at character {position}; "
                "send valid Unicode (surrogates only as pairs)",
                {"char": f"\\u{ord(text[exc.start]):04x}", "position": exc.start}) from None
    return text


def only_with_tools(value: Any) -> Any:
    """Refuse any value but null (``unsupported_parameter``): for options that only make sense with tools."""
    if value is not None:
        raise PydanticCustomError("unsupported_parameter", "only allowed with tools, which tokenmill does not "
                                  "support")
    return value


Text = Annotated[str, AfterValidator(valid_unicode)]
StopList = Annotated[list[Text], Field(max_length=64)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(Strict):
    """Fields completions and chat share."""

    model: Text | None = None
    n: int = Field(1, ge=1, le=256)
    temperature: float | None = Field(None, ge=0, le=1e4)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, lt=INT64)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Text | StopList | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=64)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=INT64)
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    speculative: bool = True
    """False: no speculative drafts for this request (the output is distributed the same either way)."""
    """Lower is served first (vLLM's convention)."""
    cache_salt: Text | None = Field(None, max_length=256)
    """Requests with different salts never share prefix-cache blocks."""
    user: Text | None = None
    logit_bias: dict[str, float] | None = None
    """Only accepted empty."""


class CompletionRequest(SamplingFields):
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0, lt=INT64)
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    """Only accepted equal to n."""
    suffix: str | None = None
    """Not supported; only accepted empty."""


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None


class ResponseFormat(Strict):
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=0, lt=INT64)
    """Deprecated by OpenAI in favour of max_completion_tokens; either works."""
    max_completion_tokens: int | None = Field(None, ge=0, lt=INT64)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: Annotated[bool | None, AfterValidator(only_with_tools)] = None
    """Refused unless null, as tools are (OpenAI allows it only with tools)."""
    store: bool | None = None
    metadata: dict[Text, Text] | None = None
    service_tier: Text | None = None
    add_generation_prompt: bool = True


# ---- responses ------------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI's usage; with a price configured (--price-per-hour) it also carries ``cost``: the
    request's measured cost in that currency (an extra field, as OpenRouter's)."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    max_model_len: int
    root: str | None = None
    """The served model's name; for a LoRA adapter, the path it was loaded from (as vLLM)."""
    parent: str | None = None
    """For a LoRA adapter: the model it runs on; None for a served model."""
    route: list[str] | None = None
    """For a routed name: the served models it answers with."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizePromptRequest(Strict):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True


class TokenizeChatRequest(Strict):
    model: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class LoadLoRAAdapterRequest(Strict):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_inplace: bool = False
    """Replace the weights of a name already loaded (running requests finish on the old ones)."""
    base_model_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """The served model it runs on (default: the first served model)."""


class UnloadLoRAAdapterRequest(Strict):
    """POST /v1/unload_lora_adapter (vLLM's body; ``lora_int_id`` is accepted and ignored)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None
    base_model_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None


class LoadModelRequest(Strict):
    """POST /admin/models: serve another model, loaded now."""

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    source: Annotated[str, Field(min_length=1, max_length=4096)]
    """A known name, a GGUF file, an HF or tokenmill-quantized directory (as ``tokenmill serve``'s model)."""
    kv_cache_memory: int | None = Field(None, gt=0)
    """Bytes of KV pool (default: all of the server's KV budget no served model holds)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Load and engine options for this model only (``tokenmill serve``'s flags, by field name)."""


class ServedModelInfo(BaseModel):
    name: str
    source: str
    created: int
    max_model_len: int
    kv_cache_memory: int
    """Bytes of its KV pool."""
    cold_start_seconds: float | None
    warming: bool
    running: int
    waiting: int


class ServedModelList(BaseModel):
    data: list[ServedModelInfo]
    kv_cache_budget: int | None
    """The server's total KV budget (None when models cannot be loaded at runtime)."""
    kv_cache_available: int | None


class LoRAAdapterResponse(BaseModel):
    object: Literal["lora_adapter"] = "lora_adapter"
    lora_name: str
    status: Literal["loaded", "unloaded"]
    in_use: int = 0
    """Unfinished requests still running on its weights (they finish on them)."""
    message: str


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
