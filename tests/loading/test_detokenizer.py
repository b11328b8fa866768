"""IncrementalDetokenizer: deltas concatenate to decode(ids), never half a character, small windows."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

import pytest

from tokenmill.loading.detokenizer import IncrementalDetokenizer
from tokenmill.loading.tokenizer import Tokenizer, byte_alphabet

REAL_TEXT = (
    "Streaming text: the quick brown fox 🦊 jumps over 13 lazy dogs.\n\n"
    "中文：你好，世界！日本語もあります。 Ελληνικά, русский, العربية.\n"
    "def f(x):\n\treturn x ** 2  # squares\n"
    "Family: 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷, tones 👍🏿 — done…   ☃ ∑ ≠ é\n"
)


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens, a few merged multi-byte characters and words, and two control tokens."""
    table = byte_alphabet()
    words = ["中", "文", "😀", "é", " world", " hello", "ab"]
    merges: list[str] = []
    merged: list[str] = []
    for word in words:
        spelled = [table[b] for b in word.encode()]
        for i in range(1, len(spelled)):
            left = "".join(spelled[:i])
            merges.append(f"{left} {spelled[i]}")
            merged.append(left + spelled[i])
    tokens = ["<|endoftext|>", "<|im_end|>"] + [table[b] for b in range(256)]
    tokens += [t for t in dict.fromkeys(merged)]
    return Tokenizer.from_gguf_metadata({
        "general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": list(dict.fromkeys(merges)), "tokenizer.ggml.eos_token_id": 1})


def sentencepiece_tokenizer(architecture: str) -> Tokenizer:
    """Byte tokens, whole-character pieces and ▁-words; Gemma-style or Llama-style (prefix space)."""
    specials = ["<unk>", "<s>", "</s>", "<end_of_turn>"]
    pieces = ["▁", "a", "b", "c", "ab", "▁a", "▁ab", "▁▁", "中", "😀", "é", "▁c", "\n"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    return Tokenizer.from_gguf_metadata({
        "general.architecture": architecture, "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 260 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [3] * 4 + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": architecture == "llama"})


SYNTHETIC = {
    "byte_level": byte_level_tokenizer,
    "gemma": lambda: sentencepiece_tokenizer("gemma3"),
    "llama": lambda: sentencepiece_tokenizer("llama"),
}


def stream(tok: Tokenizer, ids: Sequence[int], prompt: Sequence[int] = (), skip: bool = True) -> IncrementalDetokenizer:
    """Feed ``ids`` one at a time, checking after each that the text so far is final: a prefix of
    what everything seen so far decodes to after the prompt (so later tokens cannot change it)."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    prompt_text = tok.decode(prompt, skip_special_tokens=skip)
    deltas = []
    for n, token_id in enumerate(ids, 1):
        deltas.append(detok.add(token_id))
        assert "".join(deltas) == detok.text
        so_far = tok.decode([*prompt, *ids[:n]], skip_special_tokens=skip)
        assert so_far.startswith(prompt_text + detok.text), (ids[:n], detok.text)
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return detok


def random_ids(tok: Tokenizer, rng: random.Random, byte_heavy: bool) -> list[int]:
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
    pool = sorted(tok.byte_token_ids) or list(range(2, 258))
    return [rng.choice(pool) if byte_heavy and rng.random() < 0.7 else i for i in ids]


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_random_ids_concatenate_to_decode(name: str) -> None:
    tok = SYNTHETIC[name]()
    rng = random.Random(0)
    for trial in range(300):
        ids = random_ids(tok, rng, byte_heavy=trial % 2 == 1)
        for skip in (True, False):
            assert stream(tok, ids, skip=skip).text == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_valid_text_never_emits_partial_characters(name: str) -> None:
    tok = SYNTHETIC[name]()
    text = "ab 中文 😀é abc\n a b 😀😀 中"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == tok.decode(ids)
    assert detok.finish() == ""


def test_byte_fallback_characters_emitted_whole() -> None:
    tok = sentencepiece_tokenizer("gemma3")
    ids = tok.encode("a☃b", add_special_tokens=False)  # ☃ is three byte tokens
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add(i) for i in ids] == ["a", "", "", "", "☃b"]


def test_prompt_context_keeps_leading_space() -> None:
    tok = sentencepiece_tokenizer("llama")  # its decoder strips the first space of a whole text
    prompt = tok.encode("ab")
    out = tok.encode("ab c", add_special_tokens=False)[1:]  # "▁c"
    assert tok.decode(out) == "c"
    detok = stream(tok, out, prompt=prompt)
    assert detok.text == " c"
    assert stream(tok, out).text == "c"  # no prompt: like decode


def test_special_tokens_skipped_or_kept() -> None:
    tok = byte_level_tokenizer()
    ids = tok.encode("ab<|im_end|> world", add_special_tokens=False)
    assert 1 in ids
    assert stream(tok, ids).text == "ab world"
    assert stream(tok, ids, skip=False).text == "ab<|im_end|> world"


def test_decodes_only_a_short_window(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = sentencepiece_tokenizer("gemma3")
    ids = tok.encode(REAL_TEXT * 20, add_special_tokens=False)
    longest = 0
    decode = tok.decode

    def counting(token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        nonlocal longest
        longest = max(longest, len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting)
    detok = IncrementalDetokenizer(tok, ids[:50])
    for token_id in ids:
        detok.add(token_id)
    byte_runs = "".join("b" if i in tok.byte_token_ids else " " for i in ids).split()
    # window = the last emitted chunk (a byte run + 1) + the held byte run + the new token
    assert len(ids) > 1000 and longest <= 2 * max(map(len, byte_runs)) + 2


# --------------------------------------------------------------------------- real models

def load(path: Path) -> Tokenizer:
    from tokenmill.loading.gguf_file import GGUFFile

    with GGUFFile(path) as gguf:
        return Tokenizer.from_gguf_metadata(gguf.metadata)


@pytest.fixture(scope="module")
def real_tokenizers(smollm2_gguf: Path, gemma3_gguf: Path) -> dict[str, Tokenizer]:
    return {"smollm2": load(smollm2_gguf), "gemma3": load(gemma3_gguf)}


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_real_tokenizers(real_tokenizers: dict[str, Tokenizer], name: str) -> None:
    tok = real_tokenizers[name]
    rng = random.Random(2)
    for trial in range(200):
        ids = random_ids(tok, rng, byte_heavy=trial % 2 == 1)
        assert stream(tok, ids).text == tok.decode(ids), ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write something."}])
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(REAL_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == tok.decode(ids) == REAL_TEXT
    with_stop = ids + sorted(tok.stop_token_ids)
    assert stream(tok, with_stop, prompt=prompt_ids).text == REAL_TEXT
