"""``tokenmill quantize MODEL --method M --out DIR``: the command line of tokenmill.quantization."""

from __future__ import annotations

import argparse

METHODS = ("int8", "int4", "int4-gptq", "w8a8")


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a model and save it as a directory LLM() loads")
    q.add_argument("model", metavar="MODEL", help="model name, GGUF file or HF directory")
    q.add_argument("--method", required=True, choices=METHODS)
    q.add_argument("--group-size", type=int, default=64,
                   help="int4, int4-gptq: input columns per scale/zero (32, 64, 128, 256)")
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
    q.add_argument("--out", required=True, metavar="DIR", help="output directory")
    q.add_argument("--dtype", default="bfloat16", help="dtype the quantized model computes in")
    q.add_argument("--device", default="cpu", help="cpu or cuda")
    q.add_argument("--no-lm-head", action="store_true", help="leave the LM head unquantized")


def cmd_quantize(args: argparse.Namespace) -> int:
    from tokenmill.quantization import config_from_dict, quantize, save_quantized

    options: dict = {"method": args.method, "quantize_lm_head": not args.no_lm_head}
    if args.method.startswith("int4"):
        options["group_size"] = args.group_size
    if args.method == "w8a8":
        options.update(activation=args.activation, observer=args.observer, symmetric=not args.asymmetric)
        if args.percentile is not None:
            options["percentile"] = args.percentile
    if args.calibration_samples is not None:
        options["calibration_samples" if args.method == "w8a8" else "num_samples"] = args.calibration_samples
    config = config_from_dict(options)
    loaded = quantize(args.model, config, dtype=args.dtype, device=args.device)
    out = save_quantized(loaded, args.out)
    print(f"wrote {out} ({config.method})")
    return 0
