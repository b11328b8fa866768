"""Chat templates: built-in Gemma / ChatML, HF-compatible Jinja environment, errors, SmolLM2 vs HF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.loading.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate, builtin_template
from tokenmill.loading.tokenizer import Tokenizer

SPECIALS = {"bos_token": "<bos>", "eos_token": "<eos>"}

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And 3+3?  \n"},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "中文 😀 <b>tags</b>"},
        {"role": "assistant", "content": "好的"},
        {"role": "user", "content": "more"},
    ],
]

# Templates exercising what HF's environment provides: trim/lstrip blocks, tojson without HTML
# escaping, loop controls, namespaces, the {% generation %} tag, the tools/documents variables.
ENVIRONMENT_TEMPLATES = [
    "{% for m in messages %}\n  {{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
    "{% if tools %}tools{% else %}none{% endif %}{% if documents is none %}-nodocs{% endif %}",
    "{{ bos_token }}{{ messages[-1]['content'] | trim }}{% if add_generation_prompt %}>>{% endif %}",
]


def hf_render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("template", ENVIRONMENT_TEMPLATES + [GEMMA_TEMPLATE, CHATML_TEMPLATE])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_matches_transformers_renderer(template: str, messages: list[dict[str, Any]]) -> None:
    ours = ChatTemplate(template, SPECIALS)
    for add in (True, False):
        assert ours.render(messages, add_generation_prompt=add) == hf_render(template, messages, add, **SPECIALS)


def test_gemma_builtin() -> None:
    rendered = ChatTemplate(GEMMA_TEMPLATE, SPECIALS).render(CONVERSATIONS[3])
    assert rendered == (
        "<bos><start_of_turn>user\nBe kind.\n\n中文 😀 <b>tags</b><end_of_turn>\n"
        "<start_of_turn>model\n好的<end_of_turn>\n"
        "<start_of_turn>user\nmore<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert builtin_template("gemma3") == builtin_template("gemma") == GEMMA_TEMPLATE
    assert builtin_template("llama") is None and builtin_template(None) is None


def test_chatml_fallback() -> None:
    rendered = ChatTemplate(CHATML_TEMPLATE, {}).render(CONVERSATIONS[1], add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("template,messages,needle", [
    (GEMMA_TEMPLATE, [{"role": "assistant", "content": "hi"}], "must alternate"),
    (GEMMA_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "must alternate"),
    (GEMMA_TEMPLATE, [{"role": "user", "content": [{"type": "image"}]}], "Unsupported content type 'image'"),
    (CHATML_TEMPLATE, [{"role": "wizard", "content": "hi"}], "Unknown role 'wizard'"),
    (CHATML_TEMPLATE, [{"role": "user", "content": None}], "chat template"),
    ("{{ raise_exception('no tools allowed') }}", [], "no tools allowed"),
    (CHATML_TEMPLATE, [{"content": "no role"}], "messages\\[0\\]"),
    (CHATML_TEMPLATE, "not a list", "list of dicts"),
])
def test_rejected_conversation(template: str, messages: Any, needle: str) -> None:
    with pytest.raises(InvalidParameterError, match=needle):
        ChatTemplate(template, SPECIALS).render(messages)


def test_invalid_template_source() -> None:
    with pytest.raises(InvalidParameterError, match="invalid chat template"):
        ChatTemplate("{% for m in messages %}unclosed", SPECIALS)


def test_sandbox_blocks_attribute_escape() -> None:
    with pytest.raises(InvalidParameterError):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", {}).render([])


def test_strftime_now_and_kwargs() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') }}|{{ custom }}|{{ tools | length }}", {})
    year, custom, n_tools = template.render([], custom="x", tools=[{"name": "f"}]).split("|")
    assert len(year) == 4 and year.isdigit() and custom == "x" and n_tools == "1"


# --------------------------------------------------------------------------- real models

@pytest.mark.real_model
def test_smollm2_template_matches_hf(smollm2_gguf: Path) -> None:
    from transformers import AutoTokenizer

    from tokenmill.loading.gguf_file import GGUFFile

    with GGUFFile(smollm2_gguf) as gguf:
        ours = Tokenizer.from_gguf_metadata(gguf.metadata)
    hf = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    assert ours.chat_template is not None and ours.chat_template == hf.chat_template
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


@pytest.mark.real_model
def test_gemma3_uses_builtin_template(gemma3_gguf: Path) -> None:
    from tokenmill.loading.gguf_file import GGUFFile

    with GGUFFile(gemma3_gguf) as gguf:
        assert "tokenizer.chat_template" not in gguf.metadata
        ours = Tokenizer.from_gguf_metadata(gguf.metadata)
    assert ours.chat_template == GEMMA_TEMPLATE
    prompt = ours.apply_chat_template(CONVERSATIONS[1])
    ids = ours.encode(prompt, add_special_tokens=False)
    assert ids[:3] == [2, 105, ours.encode("user", add_special_tokens=False)[0]]  # <bos><start_of_turn>user
    assert ids.count(106) == 1 and ids.count(105) == 2
