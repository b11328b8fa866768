"""Tokenizers built from GGUF metadata or an HF checkpoint directory, on HF's Rust ``tokenizers``.

A GGUF carries no ``tokenizer.json``, only llama.cpp's vocabulary keys. We rebuild the pipeline the
model was trained with:

* ``tokenizer.ggml.model = gpt2``: byte-level BPE from ``tokens`` + ``merges``. Text is split by the
  regex ``tokenizer.ggml.pre`` names (:data:`BYTE_LEVEL_PRE`); ``smollm`` (like ``starcoder``) first
  splits every digit apart, as the original SmolLM2 tokenizer.json does.
* ``tokenizer.ggml.model = llama``: SentencePiece-style BPE with byte fallback. When the file has no
  merges they are derived from the vocabulary (:func:`derive_merges`): ranked by token position for
  Gemma (its scores do not follow its merge order), by score otherwise. Gemma replaces every space
  with ``▁`` and adds no prefix space; plain Llama uses ``Metaspace`` with ``add_space_prefix``.

Token types: CONTROL (3) and UNKNOWN (2) become special added tokens, USER_DEFINED (4) plain added
tokens; both are matched whole in the raw text. Special tokens are what ``decode`` skips and what
:meth:`Tokenizer.is_special` reports.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from tokenmill.errors import InvalidParameterError, ModelFormatError, UnsupportedModelError
from tokenmill.loading.chat_template import CHATML_TEMPLATE, ChatTemplate, builtin_template

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""llama.cpp's ``tokenizer.ggml.token_type`` values."""

END_OF_TURN_TOKENS = (
    "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<|eom_id|>",
    "<|end_of_text|>", "<|return|>", "<|call|>",
)
"""Special tokens that end a turn; each one a vocabulary has (as a special token) is a stop token."""

_BUILD_VERSION = "1"
"""Part of the cache key: bump when the built pipeline changes for the same metadata."""


# --------------------------------------------------------------------------- byte-level pre-tokenizers

@dataclass(frozen=True)
class PreTokenizerSpec:
    """How a byte-level vocabulary splits text before BPE."""

    regex: str | None
    """Split pattern (isolated); None means GPT-2's, built into ``ByteLevel(use_regex=True)``."""
    split_digits: bool = False
    """Split every digit into its own piece first (``Digits(individual_digits=True)``)."""
    nfc: bool = False
    """NFC-normalize the text first (Qwen2's tokenizer.json does)."""


_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _specs(spec: PreTokenizerSpec, *names: str) -> dict[str, PreTokenizerSpec]:
    return {name: spec for name in names}


BYTE_LEVEL_PRE: dict[str, PreTokenizerSpec] = {
    **_specs(PreTokenizerSpec(None), "default", "gpt2", "gpt-2", "mpt", "olmo", "jais"),
    **_specs(PreTokenizerSpec(None, split_digits=True),
             "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
    **_specs(PreTokenizerSpec(_LLAMA3), "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
             "pixtral", "dbrx", "smaug-bpe"),
    **_specs(PreTokenizerSpec(_QWEN2, nfc=True), "qwen2", "deepseek-r1-qwen", "megrez"),
    **_specs(PreTokenizerSpec(_GPT4O), "gpt-4o", "llama4"),
    **_specs(PreTokenizerSpec(_TEKKEN), "tekken"),
}
"""``tokenizer.ggml.pre`` -> split rule, after llama.cpp's ``llama-vocab.cpp`` and the models' tokenizer.json."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _byte_level_pre_tokenizer(pre: str) -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer]:
    spec = BYTE_LEVEL_PRE.get(pre)
    if spec is None:
        supported = ", ".join(sorted(BYTE_LEVEL_PRE))
        raise UnsupportedModelError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {supported}")
    steps: list[pre_tokenizers.PreTokenizer] = []
    if spec.split_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.regex is not None:
        steps.append(pre_tokenizers.Split(Regex(spec.regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.regex is None))
    normalizer = normalizers.NFC() if spec.nfc else None
    return normalizer, pre_tokenizers.Sequence(steps)


# --------------------------------------------------------------------------- GGUF vocabulary

@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer keys of a GGUF file, validated."""

    model: str
    pre: str
    architecture: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    chat_template: str | None

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> GGUFVocab:
        model = _required(metadata, "tokenizer.ggml.model")
        tokens = _required(metadata, "tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens[:1]):
            raise ModelFormatError("GGUF metadata 'tokenizer.ggml.tokens' is not a list of strings")
        types = metadata.get("tokenizer.ggml.token_type")
        scores = metadata.get("tokenizer.ggml.scores")
        _check_length("tokenizer.ggml.token_type", types, len(tokens))
        _check_length("tokenizer.ggml.scores", scores, len(tokens))
        roles = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"))
        ids = {name: _token_id(metadata, key, len(tokens)) for name, key in roles}
        return cls(
            model=model, pre=metadata.get("tokenizer.ggml.pre", "default"),
            architecture=metadata.get("general.architecture"), tokens=list(tokens),
            token_types=list(types) if types is not None else [NORMAL] * len(tokens),
            scores=list(scores) if scores is not None else None,
            merges=list(metadata["tokenizer.ggml.merges"]) if "tokenizer.ggml.merges" in metadata else None,
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
            bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unk"], pad_id=ids["pad"],
            chat_template=metadata.get("tokenizer.chat_template"))

    @property
    def is_gemma(self) -> bool:
        return self.architecture is not None and self.architecture.startswith("gemma")

    def special_ids(self) -> set[int]:
        """CONTROL and UNKNOWN tokens, plus the declared bos/eos/unk/pad."""
        ids = {i for i, t in enumerate(self.token_types) if t in (CONTROL, UNKNOWN)}
        return ids | {i for i in (self.bos_id, self.eos_id, self.unk_id, self.pad_id) if i is not None}

    def cache_key(self) -> str:
        """A digest of everything the built pipeline depends on."""
        h = hashlib.sha256()
        header = [_BUILD_VERSION, self.model, self.pre, self.architecture, self.add_bos, self.add_eos,
                  self.add_space_prefix, self.bos_id, self.eos_id, self.unk_id, self.pad_id, len(self.tokens)]
        h.update(json.dumps(header).encode())
        h.update("\0".join(self.tokens).encode("utf-8", "surrogatepass"))
        h.update(struct.pack(f"<{len(self.token_types)}i", *self.token_types))
        if self.scores is not None:
            h.update(struct.pack(f"<{len(self.scores)}f", *self.scores))
        if self.merges is not None:
            h.update("\n".join(self.merges).encode("utf-8", "surrogatepass"))
        return h.hexdigest()[:32]


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ModelFormatError(f"GGUF metadata has no {key!r}, needed to build the tokenizer")
    return metadata[key]


def _check_length(key: str, values: Sequence[Any] | None, n_tokens: int) -> None:
    if values is not None and len(values) != n_tokens:
        raise ModelFormatError(f"GGUF metadata {key!r} has {len(values)} entries for {n_tokens} tokens")


def _token_id(metadata: dict[str, Any], key: str, n_tokens: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not 0 <= int(value) < n_tokens:
        raise ModelFormatError(
            f"GGUF metadata tokenizer.ggml.{key}={value} is outside the {n_tokens}-token vocabulary")
    return int(value)


# --------------------------------------------------------------------------- building from GGUF

def build_gguf_backend(vocab: GGUFVocab) -> Backend:
    """The full ``tokenizers`` pipeline the vocabulary describes."""
    if vocab.model == "gpt2":
        backend = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        backend = _sentencepiece_bpe(vocab)
    else:
        raise UnsupportedModelError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={vocab.model!r}; supported: gpt2, llama")
    _add_gguf_added_tokens(backend, vocab)
    backend.post_processor = _bos_eos_processor(
        _with_token(vocab.tokens, vocab.bos_id) if vocab.add_bos else None,
        _with_token(vocab.tokens, vocab.eos_id) if vocab.add_eos else None)
    return backend


def _byte_level_bpe(vocab: GGUFVocab) -> Backend:
    """Byte-level BPE. Tokens not spelled in the byte alphabet are respelled into it, except added
    (special and user-defined) tokens: they are matched in raw text and decode to their raw bytes."""
    if vocab.merges is None:
        raise ModelFormatError(
            "GGUF metadata has no 'tokenizer.ggml.merges', needed for a gpt2 (byte-level BPE) tokenizer")
    table = byte_alphabet()
    alphabet = set(table.values())
    raw = vocab.special_ids() | {i for i, ty in enumerate(vocab.token_types) if ty == USER_DEFINED}
    spelled = [t if i in raw or set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8"))
               for i, t in enumerate(vocab.tokens)]
    bpe = _bpe_model({t: i for i, t in enumerate(spelled)}, _split_merges(vocab.merges),
                     dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    backend = Backend(bpe)
    backend.normalizer, backend.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def respell_spaces(token: str) -> str:
    """A token made only of spaces (Gemma stores ``"  "``) as SentencePiece spells it (``"▁▁"``)."""
    return "\u2581" * len(token) if token and not token.strip(" ") else token


def _sentencepiece_bpe(vocab: GGUFVocab) -> Backend:
    tokens = [respell_spaces(t) for t in vocab.tokens] if vocab.is_gemma else vocab.tokens
    if vocab.merges is not None:
        merges = _split_merges(vocab.merges)
    elif vocab.is_gemma or vocab.scores is None:
        merges = derive_merges(tokens, None)
    else:
        merges = derive_merges(tokens, vocab.scores)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    bpe = _bpe_model({t: i for i, t in enumerate(tokens)}, merges,
                     unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    backend = Backend(bpe)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.is_gemma:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    else:
        scheme = "first" if vocab.add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
        if vocab.add_space_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _bpe_model(vocab: dict[str, int], merges: list[tuple[str, str]], **kwargs: Any) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, **kwargs)
    except Exception as e:  # the Rust side raises a bare Exception for e.g. a merge result outside the vocab
        raise ModelFormatError(f"GGUF tokenizer vocabulary and merges are inconsistent: {e}") from e


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ")) for m in merges]
    for m, pair in zip(merges, pairs):
        if len(pair) != 2:
            raise ModelFormatError(f"GGUF merge {m!r} is not two tokens separated by one space")
    return pairs  # type: ignore[return-value]


def derive_merges(tokens: Sequence[str], scores: Sequence[float] | None) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first.

    Every way of cutting a token into two vocabulary tokens is a merge. Merges are ranked by the
    merged token's score, higher first (``scores=None``: by position in the vocabulary, earlier
    first), then by longer left part; ties left after that keep vocabulary order. This is the order
    ``transformers``' ``generate_merges`` produces (duplicate tokens included), so the BPE is the same.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    if scores is None:
        return [pair for token in sorted(vocab, key=vocab.__getitem__) for pair in _cuts(token, vocab)]
    score_of = dict(zip(tokens, scores))
    merges: list[tuple[str, str]] = []
    for _, group in itertools.groupby(sorted(score_of, key=lambda t: -score_of[t]), key=score_of.__getitem__):
        pairs = [pair for token in group for pair in _cuts(token, vocab)]
        pairs.sort(key=lambda pair: (-len(pair[0]), -len(pair[1])))
        merges.extend(pairs)
    return merges


def _cuts(token: str, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The (left, right) splits of ``token`` into two vocabulary tokens, longest left part first."""
    return [(token[:k], token[k:]) for k in range(len(token) - 1, 0, -1)
            if token[:k] in vocab and token[k:] in vocab]


def _add_gguf_added_tokens(backend: Backend, vocab: GGUFVocab) -> None:
    special = vocab.special_ids()
    backend.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False) for i in sorted(special)])
    # Gemma's USER_DEFINED space runs ("  ") are respelled into the BPE vocabulary instead.
    user = [AddedToken(t, special=False, normalized=False) for i, (t, ty) in
            enumerate(zip(vocab.tokens, vocab.token_types)) if ty == USER_DEFINED and i not in special
            and not (vocab.is_gemma and respell_spaces(t) != t)]
    backend.add_tokens(user)


def _bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.PostProcessor | None:
    """``<bos> $A <eos>`` with whichever of the two (token, id) the model adds (None: add nothing)."""
    if bos is None and eos is None:
        return None
    specials = [t for t in (bos, eos) if t is not None]

    def template(seq: str, type_id: int) -> list[str]:
        pieces = [*([bos[0]] if bos else []), seq, *([eos[0]] if eos else [])]
        return [f"{piece}:{type_id}" for piece in pieces]

    return processors.TemplateProcessing(
        single=template("$A", 0), pair=template("$A", 0) + template("$B", 1), special_tokens=specials)


def _with_token(tokens: Sequence[str], token_id: int | None) -> tuple[str, int] | None:
    return (tokens[token_id], token_id) if token_id is not None else None


def load_or_build_gguf_backend(vocab: GGUFVocab, cache_dir: Path | None) -> Backend:
    """Build the pipeline, or load it from ``cache_dir/tokenizer-<digest>.json`` built earlier."""
    if cache_dir is None:
        return build_gguf_backend(vocab)
    path = Path(cache_dir) / f"tokenizer-{vocab.cache_key()}.json"
    if path.is_file():
        try:
            return Backend.from_file(str(path))
        except Exception:  # a corrupt or foreign file: rebuild and overwrite it
            pass
    backend = build_gguf_backend(vocab)
    try:
        _atomic_write(path, backend.to_str())
    except OSError:  # an unwritable cache only costs the next load a rebuild
        pass
    return backend


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- HF checkpoint directories

@dataclass(frozen=True)
class HFTokenizerFiles:
    """The tokenizer-related JSON files of an HF checkpoint directory (missing ones are empty)."""

    config: dict[str, Any]
    special_tokens_map: dict[str, Any]
    generation_config: dict[str, Any]
    model_config: dict[str, Any]
    chat_template: str | None

    @classmethod
    def read(cls, path: Path) -> HFTokenizerFiles:
        config = _read_json(path / "tokenizer_config.json")
        return cls(config=config, special_tokens_map=_read_json(path / "special_tokens_map.json"),
                   generation_config=_read_json(path / "generation_config.json"),
                   model_config=_read_json(path / "config.json"), chat_template=_find_template(path, config))

    def token(self, name: str) -> str | None:
        """The string of special token ``name`` (``"bos_token"``...), from tokenizer_config or the map."""
        value = self.config.get(name, self.special_tokens_map.get(name))
        return value.get("content") if isinstance(value, dict) else value

    def generation_eos_ids(self) -> tuple[int, ...]:
        eos = self.generation_config.get("eos_token_id")
        return tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON: {e}") from e


def _find_template(path: Path, config: dict[str, Any]) -> str | None:
    """As transformers looks: chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template_json = _read_json(path / "chat_template.json")
    return _pick_template(template_json.get("chat_template", config.get("chat_template")))


def _pick_template(template: Any) -> str | None:
    """tokenizer_config's chat_template is a string or a list of ``{name, template}``; take "default"."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _load_hf_backend(path: Path, files: HFTokenizerFiles) -> Backend:
    tokenizer_json = path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ModelFormatError(f"{path}: no tokenizer.json (tokenmill needs the fast-tokenizer file)")
    try:
        backend = Backend.from_file(str(tokenizer_json))
    except Exception as e:
        raise ModelFormatError(f"{tokenizer_json}: cannot be loaded: {e}") from e
    # Like transformers: an explicit add_bos_token/add_eos_token (or no post-processor) rebuilds it.
    if "add_bos_token" in files.config or "add_eos_token" in files.config or backend.post_processor is None:
        bos = _lookup_pair(backend, files.token("bos_token")) if files.config.get("add_bos_token") else None
        eos = _lookup_pair(backend, files.token("eos_token")) if files.config.get("add_eos_token") else None
        backend.post_processor = _bos_eos_processor(bos, eos)
    return backend


def _lookup(backend: Backend, token: str | None) -> int | None:
    return backend.token_to_id(token) if token is not None else None


def _lookup_pair(backend: Backend, token: str | None) -> tuple[str, int] | None:
    token_id = _lookup(backend, token)
    return (token, token_id) if token is not None and token_id is not None else None


# --------------------------------------------------------------------------- the tokenizer

@dataclass(frozen=True)
class SpecialTokenIds:
    """The ids a model gives its special roles (None: the model has none)."""

    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    unk: int | None = None
    extra_stops: tuple[int, ...] = ()
    """Further end-of-generation ids, e.g. generation_config.json's eos_token_id list."""


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens.

    ``encode`` adds BOS/EOS iff the model's config says so (the backend's post-processor) and maps
    special-token strings in the text (``"<|im_start|>"``) to their ids. ``decode`` skips special
    tokens by default. Build with :meth:`from_gguf_metadata` or :meth:`from_hf_dir`.
    """

    def __init__(self, backend: Backend, ids: SpecialTokenIds, chat_template: str | None = None,
                 architecture: str | None = None) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = ids.bos, ids.eos, ids.pad
        self._unk_token_id = ids.unk
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.stop_token_ids: frozenset[int] = self._find_stop_ids(ids)
        self.byte_token_ids: frozenset[int] = self._find_byte_tokens()
        """Byte-fallback tokens (``<0xE4>``): the decoder joins runs of them before UTF-8 decoding."""
        self.chat_template: str | None = chat_template or builtin_template(architecture)
        """The model's template (or the built-in one for its architecture); None: ChatML is used."""
        self._compiled: ChatTemplate | None = None

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], cache_dir: Path | None = None) -> Tokenizer:
        """From a GGUF's metadata dict; with ``cache_dir`` the built pipeline is cached there by vocab digest."""
        vocab = GGUFVocab.from_metadata(metadata)
        backend = load_or_build_gguf_backend(vocab, cache_dir)
        ids = SpecialTokenIds(bos=vocab.bos_id, eos=vocab.eos_id, pad=vocab.pad_id, unk=vocab.unk_id)
        return cls(backend, ids, vocab.chat_template, vocab.architecture)

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """From an HF checkpoint directory: tokenizer.json, tokenizer_config.json and the optional
        special_tokens_map.json, generation_config.json, chat_template.jinja, config.json."""
        path = Path(path)
        files = HFTokenizerFiles.read(path)
        backend = _load_hf_backend(path, files)
        gen_eos = files.generation_eos_ids()
        eos = _lookup(backend, files.token("eos_token"))
        bos = _lookup(backend, files.token("bos_token"))
        ids = SpecialTokenIds(
            bos=bos if bos is not None else files.generation_config.get("bos_token_id"),
            eos=eos if eos is not None else (gen_eos[0] if gen_eos else None),
            pad=_lookup(backend, files.token("pad_token")), unk=_lookup(backend, files.token("unk_token")),
            extra_stops=gen_eos)
        return cls(backend, ids, files.chat_template, files.model_config.get("model_type"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As :meth:`encode`, but other Python threads run while the backend works (its
        ``encode_batch`` releases the GIL, ``encode`` holds it): for long texts, from a worker thread."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's spelling in characters (added tokens included), computed once. A token
        covers at most that many characters of text (a byte-level token's spelling has one character
        per byte), so a text of n characters has at least n / max_token_chars tokens."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """Whether ``decode(skip_special_tokens=True)`` drops this id."""
        return token_id in self._special_ids

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary spelling of ``token_id`` (``"Ġworld"``, ``"▁world"``, ``"<0x0A>"``)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise InvalidParameterError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` into prompt text (not ids: encode it with ``add_special_tokens=False``
        when the template writes BOS itself, as most do)."""
        if self._compiled is None:
            self._compiled = ChatTemplate(self.chat_template or CHATML_TEMPLATE, self._special_strings())
        return self._compiled.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def _special_strings(self) -> dict[str, str | None]:
        roles = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id,
                 "pad_token": self.pad_token_id, "unk_token": self._unk_token_id}
        return {name: self._backend.id_to_token(i) for name, i in roles.items() if i is not None}

    def _find_stop_ids(self, ids: SpecialTokenIds) -> frozenset[int]:
        named = (self._backend.token_to_id(t) for t in END_OF_TURN_TOKENS)
        stops = {i for i in named if i is not None and i in self._special_ids}
        return frozenset(stops | {i for i in (ids.eos, *ids.extra_stops) if i is not None})

    def _find_byte_tokens(self) -> frozenset[int]:
        if "ByteFallback" not in repr(self._backend.decoder):
            return frozenset()
        ids = (self._backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)
