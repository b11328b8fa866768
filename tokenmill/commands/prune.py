"""``tokenmill prune MODEL --method M --sparsity S --out DIR``: the command line of tokenmill.pruning.

Unstructured methods (magnitude, wanda, sparsegpt) take ``--sparsity`` (0.5, or 2:4); structured
pruning takes ``--target`` (a fraction of the non-embedding parameters, or a count such as 60M)
or explicit shapes. The result is an HF checkpoint directory: ``LLM(DIR)``, ``tokenmill serve
DIR``, ``tokenmill quantize DIR``, ``tokenmill distill --student DIR`` and HF transformers load it.
"""

from __future__ import annotations

import argparse
import json

from tokenmill.config import LoadConfig
from tokenmill.options import option_fields
from tokenmill.pruning.config import PruneConfig, StructuredConfig

METHODS = ("magnitude", "wanda", "sparsegpt", "structured")


def add_prune_parser(sub) -> None:
    p = sub.add_parser("prune", help="prune a model (sparse or smaller shapes) and save it as an HF directory")
    p.add_argument("model", metavar="MODEL", help=option_fields(LoadConfig, only=("model",))[0].metadata["help"])
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--sparsity", default=None, metavar="S",
                   help="magnitude, wanda, sparsegpt: fraction of each layer's weights zeroed (0.5) or an N:M "
                        "pattern (2:4)")
    p.add_argument("--scope", choices=("layer", "global"), default=None,
                   help="magnitude: one fraction per layer (default) or one threshold over all layers")
    p.add_argument("--schedule-steps", type=int, default=None, metavar="K",
                   help="reach the sparsity in K rounds on a cubic schedule, re-scoring between rounds")
    p.add_argument("--target", default=None, metavar="T",
                   help="structured: non-embedding parameters to keep, a fraction (0.5) or a count (60M, 6e7); "
                        "the shapes are planned by calibration loss")
    p.add_argument("--dims", default=None, metavar="D,D",
                   help="structured --target: which of heads,channels,layers the plan may shrink (default: all)")
    p.add_argument("--num-layers", type=int, default=None, help="structured: layers kept (by block influence)")
    p.add_argument("--num-kv-heads", type=int, default=None, help="structured: KV groups kept per layer")
    p.add_argument("--heads-per-group", type=int, default=None, help="structured: q heads kept per KV group")
    p.add_argument("--intermediate-size", type=int, default=None, help="structured: FFN channels kept per layer")
    p.add_argument("--no-refit", action="store_true",
                   help="structured: keep the o and down projections' kept columns as they are (default: refit "
                   "by least squares on the calibration inputs to what the removed heads and channels wrote)")
    p.add_argument("--calibration-samples", type=int, default=None, metavar="N",
                   help=f"calibration sequences of {PruneConfig.seq_len} tokens from the end of the corpus "
                   f"(default {PruneConfig.num_samples}; structured {StructuredConfig.num_samples})")
    p.add_argument("--save-dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help="dtype of the saved weights (default bfloat16)")
    p.add_argument("--quality-tokens", type=int, default=2048, metavar="N",
                   help="end with the perplexity before and after on the first N tokens of the corpus (held out: "
                        "calibration reads its end); 0 skips it")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--cache-dir", default=None, help=option_fields(LoadConfig, only=("cache_dir",))[0].metadata["help"])


def parse_count(text: str) -> float:
    """"0.5" -> 0.5, "60M" -> 6e7, "1.2B" -> 1.2e9, "6e7" -> 6e7."""
    from tokenmill.errors import InvalidParameterError

    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise InvalidParameterError(f"--target must be a fraction such as 0.5 or a count such as 60M, "
                                    f"got {text!r}") from None
    return value


def build_config(args: argparse.Namespace):
    from tokenmill.errors import InvalidParameterError
    from tokenmill.pruning.config import config_from_dict

    options: dict = {"method": args.method}
    if args.calibration_samples is not None:
        options["num_samples"] = args.calibration_samples
    structured = {"target": args.target, "dims": args.dims, "num_layers": args.num_layers,
                  "num_kv_heads": args.num_kv_heads, "heads_per_group": args.heads_per_group,
                  "intermediate_size": args.intermediate_size, "refit": False if args.no_refit else None}
    unstructured = {"sparsity": args.sparsity, "scope": args.scope, "schedule_steps": args.schedule_steps}
    own, other = (structured, unstructured) if args.method == "structured" else (unstructured, structured)
    wrong = [f"--{k.replace('_', '-')}" for k, v in other.items() if v is not None]
    if args.method != "magnitude" and args.scope is not None:
        wrong.append("--scope")
    if wrong:
        raise InvalidParameterError(f"{', '.join(sorted(set(wrong)))} do(es) not apply to --method {args.method}")
    if args.method == "structured":
        if args.target is not None:
            options["target_params"] = parse_count(args.target)
        options.update({k: v for k, v in own.items() if v is not None and k != "target"})
    else:
        if args.sparsity is None:
            raise InvalidParameterError(f"--method {args.method} needs --sparsity (0.5, or 2:4)")
        options.update({k: v for k, v in own.items() if v is not None})
    return config_from_dict(options)


def cmd_prune(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.commands.quantize import QualityCheck, _load_float
    from tokenmill.pruning.api import prune, save_pruned

    config = build_config(args)
    loaded = _load_float(args)
    quality = None
    if args.quality_tokens:
        args.eval_data, args.quality_budget = None, 1.0
        quality = QualityCheck(args, loaded)
    loaded, report = prune(loaded, config, cache_dir=args.cache_dir)
    dtype = getattr(torch, args.save_dtype)
    out = save_pruned(loaded, report, args.out, dtype)
    before, after = report.params_before, report.params_after
    print(json.dumps({"method": report.method, "shape": f"{report.shape_before} -> {report.shape_after}",
                      "non_embedding_params": f"{before['non_embedding']:,} -> {after['non_embedding']:,} "
                                              f"({after['non_embedding'] / before['non_embedding']:.1%})",
                      "embedding_params": f"{after['embedding']:,}", "sparsity": round(report.sparsity, 4),
                      "calibration_nll": [report.calibration_nll_before, report.calibration_nll_after],
                      "seconds": round(report.seconds, 1)}, indent=2))
    if quality is not None:
        saved = loaded.model.to(dtype)  # as it was written
        ppl = quality.measure(saved)
        print(f"quality: perplexity on {len(quality.ids)} held-out tokens {quality.before:.3f} (float32 source) -> "
              f"{ppl:.3f} ({report.method}, {args.save_dtype}): {ppl / quality.before - 1:+.2%}")
    print(f"wrote {out} (pruning_report.json: sensitivity, plan and per-projection sparsity)")
    return 0
