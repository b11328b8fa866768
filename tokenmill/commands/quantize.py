"""``tokenmill quantize MODEL --method M --out DIR``: the command line of tokenmill.quantization."""

from __future__ import annotations

import argparse

from tokenmill.config import LoadConfig
from tokenmill.options import add_option_group, option_fields
from tokenmill.quantization.config import Int4WeightOnlyConfig

METHODS = ("int8", "int4", "int4-gptq", "w8a8")


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a model and save it as a directory LLM() loads")
    q.add_argument("model", metavar="MODEL", help=option_fields(LoadConfig, only=("model",))[0].metadata["help"])
    q.add_argument("--method", required=True, choices=METHODS)
    q.add_argument("--group-size", type=int, default=None,
                   help=f"int4, int4-gptq: input columns per scale/zero (32, 64, 128, 256; default "
                        f"{Int4WeightOnlyConfig.group_size})")
    q.add_argument("--calibration-samples", type=int, default=None,
                   help="int4-gptq, w8a8 static: calibration sequences of 512 tokens (default 32, 16)")
    q.add_argument("--activation", choices=("dynamic", "static"), default="dynamic",
                   help="w8a8: int8 activations per token at run time, or per tensor from calibration")
    q.add_argument("--observer", choices=("minmax", "percentile", "mse"), default="minmax",
                   help="w8a8 static: how the calibration inputs give each layer's activation range")
    q.add_argument("--percentile", type=float, default=None,
                   help="w8a8 static with --observer percentile: the percentile clipped at (default 99.99)")
    q.add_argument("--asymmetric", action="store_true",
                   help="w8a8: asymmetric activations (-128..127 with a zero point)")
    q.add_argument("--smoothing-alpha", default=None, metavar="A",
                   help="w8a8: SmoothQuant migration strength in [0, 1], 'auto' (0.5 dynamic, 0.85 static, the "
                        "default) or 'none'")
    q.add_argument("--no-range-search", action="store_true",
                   help="int4, int4-gptq: plain min-max (scale, zero) per group instead of the error-minimising "
                        "search; int8: plain absmax scales")
    q.add_argument("--activation-weighted", action=argparse.BooleanOptionalAction, default=None,
                   help="int4: weight the range search by each input's mean square on calibration text "
                        "(the default: it is what meets the +8%% budget on Gemma 3; always on for int4-gptq, "
                        "which has its Hessian)")
    q.add_argument("--no-act-order", action="store_true",
                   help="int4-gptq: quantize columns left to right instead of by decreasing Hessian diagonal")
    q.add_argument("--out", required=True, metavar="DIR", help="output directory")
    add_option_group(q, LoadConfig, exclude=("model",))  # --dtype: what the quantized model computes in
    q.add_argument("--no-lm-head", action="store_true", help="leave the LM head unquantized")
    _add_mixed_precision_args(q)


def _add_mixed_precision_args(q: argparse.ArgumentParser) -> None:
    """Layers kept in higher precision (INT8 under int4, the model dtype under int8 and w8a8):
    named, read from a plan file, or planned here by a sensitivity analysis under a budget."""
    how = q.add_mutually_exclusive_group()
    how.add_argument("--keep-layers", default=None, metavar="A,B",
                     help="comma-separated module paths kept in higher precision (layers.3.mlp.down,lm_head)")
    how.add_argument("--plan", default=None, metavar="FILE", help="apply a plan written by --sensitivity")
    how.add_argument("--sensitivity", action="store_true",
                     help="measure each layer's perplexity damage, print the table, write the plan and quantize by it")
    budget = q.add_mutually_exclusive_group()
    budget.add_argument("--ppl-budget", type=float, default=None, metavar="FRACTION",
                        help="--sensitivity: maximum estimated perplexity increase over the unquantized model (0.08)")
    budget.add_argument("--size-budget-mb", type=float, default=None, metavar="MB",
                        help="--sensitivity: maximum size of the model's tensors, in MB (10^6 bytes)")
    q.add_argument("--eval-tokens", type=int, default=2048,
                   help="--sensitivity: tokens of the evaluation slice (from the middle of the corpus)")
    q.add_argument("--eval-data", default=None, metavar="FILE",
                   help="--sensitivity: text whose middle is the evaluation slice, and whose start the quality "
                        "check reads (default: the corpus)")
    q.add_argument("--quality-tokens", type=int, default=2048, metavar="N",
                   help="end with the perplexity before and after quantizing on the first N tokens of the corpus "
                        "(held out: calibration reads its end, sensitivity its middle); 0 skips the check")
    q.add_argument("--quality-budget", type=float, default=0.08, metavar="FRACTION",
                   help="warn when quantizing raises that perplexity by more than this fraction")
    q.add_argument("--plan-out", default=None, metavar="FILE",
                   help="--sensitivity: where to write the plan (default DIR/quantization_plan.json)")


def cmd_quantize(args: argparse.Namespace) -> int:
    from tokenmill.errors import InvalidParameterError
    from tokenmill.quantization import config_from_dict, quantize, save_quantized

    options: dict = {"method": args.method, "quantize_lm_head": not args.no_lm_head}
    if args.method == "int8":
        options["scale_search"] = not args.no_range_search
    if args.method.startswith("int4"):
        options["range_search"] = not args.no_range_search
        if args.group_size is not None:
            options["group_size"] = args.group_size
        if args.activation_weighted is not None:
            options["activation_weighted"] = args.activation_weighted
    if args.method == "int4-gptq" and args.no_act_order:
        options["act_order"] = False
    if args.method == "w8a8":
        options.update(activation=args.activation, observer=args.observer, symmetric=not args.asymmetric)
        if args.percentile is not None:
            options["percentile"] = args.percentile
        if args.smoothing_alpha is not None:
            alpha = args.smoothing_alpha.lower()
            options["smoothing_alpha"] = None if alpha == "none" else alpha if alpha == "auto" else _fraction(alpha)
    if args.calibration_samples is not None:
        options["calibration_samples" if args.method == "w8a8" else "num_samples"] = args.calibration_samples
    config = config_from_dict(options)
    if args.quality_tokens < 0 or not args.quality_budget > 0:
        raise InvalidParameterError("--quality-tokens must be 0 or more and --quality-budget positive")
    if not args.sensitivity:
        config = _with_kept_layers(args, config)
    elif args.ppl_budget is None and args.size_budget_mb is None:
        raise InvalidParameterError("--sensitivity needs a budget: --ppl-budget FRACTION or --size-budget-mb MB")
    loaded = _load_float(args)
    quality = QualityCheck(args, loaded) if args.quality_tokens else None
    if args.sensitivity:
        config = _plan(args, config, loaded)
    quantize(loaded, config, dtype=compute_dtype(args), cache_dir=args.cache_dir)
    out = save_quantized(loaded, args.out)
    print(f"wrote {out} ({config.method})")
    if quality is not None:
        quality.report(loaded, config)
    return 0


def _load_float(args: argparse.Namespace):
    """The model to quantize, in float32 (a quantized directory refused)."""
    from pathlib import Path

    from tokenmill.device import resolve_device
    from tokenmill.paths import default_cache_dir
    from tokenmill.quantization.api import load_float32

    return load_float32(args.model, resolve_device(args.device), Path(args.cache_dir or default_cache_dir()))


class QualityCheck:
    """Perplexity on held-out text before quantizing (the float32 source) and after (the quantized
    model in its compute dtype), printed as one line, with a warning on stderr above the budget."""

    CONTEXT, STRIDE = 512, 256

    def __init__(self, args: argparse.Namespace, loaded) -> None:
        from tokenmill.eval.corpus import fetch_corpus, read_tokens

        self.budget = args.quality_budget
        text = args.eval_data or fetch_corpus(args.cache_dir)
        self.ids = read_tokens(loaded.tokenizer, text, args.quality_tokens)
        self.before = self._perplexity(loaded.model)

    def measure(self, model) -> float:
        """Perplexity of ``model`` on the held-out tokens (what ``before`` holds for the source)."""
        return self._perplexity(model)

    def _perplexity(self, model) -> float:
        from tokenmill.eval.perplexity import perplexity

        context = min(self.CONTEXT, len(self.ids))
        return perplexity(model, self.ids, context, min(self.STRIDE, context), progress=False).perplexity

    def report(self, loaded, config) -> float:
        """Print the quality line (and the warning): -> the relative change."""
        import sys

        after = self._perplexity(loaded.model)
        change = after / self.before - 1
        dtype = str(loaded.model.embed.weight.dtype).removeprefix("torch.")
        print(f"quality: perplexity on {len(self.ids)} held-out tokens {self.before:.3f} (float32 source) -> "
              f"{after:.3f} ({config.method}, {dtype}): {change:+.2%} (budget +{self.budget:.0%})")
        if change > self.budget:
            print(f"warning: quantizing raised perplexity by {change:+.2%}, above the +{self.budget:.0%} budget; "
                  f"try a smaller --group-size, --method int4-gptq, or keep the worst layers "
                  f"(--sensitivity --ppl-budget {self.budget})", file=sys.stderr)
        return change


def compute_dtype(args: argparse.Namespace) -> str:
    """The dtype the quantized model computes in: --dtype, where auto means bfloat16 (the quantized
    kernels' activations) on every device."""
    return "bfloat16" if args.dtype == "auto" else args.dtype


def _fraction(text: str) -> float:
    from tokenmill.errors import InvalidParameterError

    try:
        return float(text)
    except ValueError:
        raise InvalidParameterError(f"--smoothing-alpha must be a number in [0, 1], 'auto' or 'none', got {text!r}")


def _with_kept_layers(args: argparse.Namespace, config):
    """``config`` with the layers of ``--keep-layers`` or ``--plan``; a plan made for other options is refused."""
    import dataclasses

    from tokenmill.errors import InvalidParameterError
    from tokenmill.quantization.sensitivity import read_plan

    if args.ppl_budget is not None or args.size_budget_mb is not None:
        raise InvalidParameterError("--ppl-budget and --size-budget-mb apply with --sensitivity")
    if args.keep_layers is not None:
        return dataclasses.replace(config, keep_layers=tuple(n.strip() for n in args.keep_layers.split(",") if n.strip()))
    if args.plan is None:
        return config
    planned = read_plan(args.plan)
    config = config.resolved(has_calibration=True)  # the command's model brings its tokenizer, as the plan's did
    if dataclasses.replace(planned, keep_layers=()) != config:
        ours, theirs = config.to_dict(), planned.to_dict()
        differ = sorted(k for k in ours.keys() | theirs.keys() if k != "keep_layers" and ours.get(k) != theirs.get(k))
        raise InvalidParameterError(
            f"{args.plan} was planned for other options ({', '.join(f'{k}: {theirs.get(k)!r}' for k in differ)}); "
            f"this command has {', '.join(f'{k}: {ours.get(k)!r}' for k in differ)}")
    return planned


def _plan(args: argparse.Namespace, config, loaded):
    """Sensitivity analysis of the float model ``loaded``, a plan under the budget (table printed,
    plan file written): -> the planned config to quantize by."""
    from pathlib import Path

    from tokenmill.device import resolve_device, resolve_dtype
    from tokenmill.paths import default_cache_dir
    from tokenmill.quantization.sensitivity import (
        analyze_sensitivity, format_table, plan_keep_layers, planned_config, sensitivity_ids, write_plan)

    device = resolve_device(args.device)
    cache = args.cache_dir or default_cache_dir()
    ids = sensitivity_ids(loaded.tokenizer, args.eval_tokens, text_file=args.eval_data, cache_dir=cache)
    report = analyze_sensitivity(loaded.model, config, ids, resolve_dtype(compute_dtype(args), device),
                                 tokenizer=loaded.tokenizer, cache_dir=cache)
    max_bytes = None if args.size_budget_mb is None else int(args.size_budget_mb * 1e6)
    plan = plan_keep_layers(report, args.ppl_budget, max_bytes)
    print(format_table(report, plan))
    print(f"wrote {write_plan(args.plan_out or Path(args.out) / 'quantization_plan.json', report, plan)}")
    return planned_config(report, plan)
