"""Chat templates: a model's Jinja template (or a built-in one) rendered the way HF transformers does.

The environment matches ``transformers``' ``apply_chat_template``: an ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not escape HTML, and the globals ``raise_exception`` and ``strftime_now``. Templates see
``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the special token strings
(``bos_token``, ``eos_token``, ...) and any extra keyword arguments.

Models without a template get one by architecture: :data:`GEMMA_TEMPLATE` for ``gemma*``,
:data:`CHATML_TEMPLATE` otherwise.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.errors import InvalidParameterError

GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/... "
                           + "after an optional system message, got role '" + message['role'] + "'") }}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- else -%}
                {{ raise_exception("Unsupported content type '" + item['type'] + "'") }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
"""Gemma's chat format (as in Google's Gemma 3 tokenizer_config.json, text only): BOS first, the
system message prepended to the first user turn, ``assistant`` spelled ``model``."""

CHATML_TEMPLATE = """{%- for message in messages -%}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}
        {{ raise_exception("Unknown role '" + message['role'] + "': expected system, user, assistant or tool") }}
    {%- endif -%}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
{%- endif -%}
"""
"""The fallback for models that ship no template and are not Gemma."""


def builtin_template(architecture: str | None) -> str | None:
    """The template tokenmill supplies for an architecture whose files carry none (None: use ChatML)."""
    if architecture is not None and architecture.startswith("gemma"):
        return GEMMA_TEMPLATE
    return None


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with.

    Construction compiles the source, so a syntax error surfaces here as InvalidParameterError.
    """

    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise InvalidParameterError(f"invalid chat template: {e}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for ``messages``; a conversation the template rejects raises InvalidParameterError."""
        _check_messages(messages)
        context = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise InvalidParameterError(f"chat template rejected the conversation: {e}") from e
        except (TypeError, KeyError, IndexError) as e:
            raise InvalidParameterError(f"chat template failed on the conversation: {e!r}") from e


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list):
        raise InvalidParameterError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidParameterError(f"messages[{i}] must be a dict with a string 'role', got {message!r}")
