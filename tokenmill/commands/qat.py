"""``tokenmill qat MODEL --out DIR``: quantization-aware training from the command line.

Loads the model in float32, fine-tunes it through fake-quantized weights on the middle half of
the Shakespeare corpus (tokenmill.quantization.qat), converts it to INT4 (or INT8) and saves it
as a directory that ``LLM(dir)``, ``tokenmill serve`` and ``tokenmill eval`` load like any
quantized checkpoint.
"""

from __future__ import annotations

import argparse

from tokenmill.commands.quantize import compute_dtype
from tokenmill.config import LoadConfig
from tokenmill.options import add_option_group, option_fields


def add_qat_parser(sub) -> None:
    q = sub.add_parser("qat", help="quantization-aware training: fine-tune through INT4 weights, then quantize")
    q.add_argument("model", metavar="MODEL", help=option_fields(LoadConfig, only=("model",))[0].metadata["help"])
    q.add_argument("--out", required=True, metavar="DIR", help="output directory")
    q.add_argument("--weight", choices=("int4", "int8"), default="int4", help="what the weights are quantized to")
    q.add_argument("--group-size", type=int, default=64, help="int4: input columns per scale/zero (32, 64, 128, 256)")
    q.add_argument("--steps", type=int, default=100, help="optimizer steps")
    q.add_argument("--lr", type=float, default=5e-5, help="peak AdamW learning rate")
    q.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    q.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    q.add_argument("--distill-weight", type=float, default=1.0,
                   help="weight of KL distillation from the float model's logits (1 - it: text cross entropy)")
    q.add_argument("--int4-lm-head", action="store_true", help="int4: the LM head in INT4 too (default INT8)")
    q.add_argument("--no-lm-head", action="store_true", help="leave the LM head unquantized")
    q.add_argument("--float32-matmuls", action="store_true",
                   help="train with float32 matmuls (default: bfloat16 autocast)")
    q.add_argument("--seed", type=int, default=0, help="seed of the training-sequence order")
    add_option_group(q, LoadConfig, exclude=("model",))  # --dtype: what the quantized model computes in


def cmd_qat(args: argparse.Namespace) -> int:
    from tokenmill.quantization import save_quantized
    from tokenmill.quantization.qat import qat, qat_config_from_dict

    config = qat_config_from_dict({
        "weight": args.weight, "group_size": args.group_size, "steps": args.steps, "lr": args.lr,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "distill_weight": args.distill_weight,
        "lm_head_int8": not args.int4_lm_head, "quantize_lm_head": not args.no_lm_head,
        "mixed_precision": not args.float32_matmuls, "seed": args.seed})
    loaded, log = qat(args.model, config, dtype=compute_dtype(args), device=args.device, cache_dir=args.cache_dir)
    out = save_quantized(loaded, args.out)
    tail = log.loss[-10:]
    print(f"wrote {out} (qat {config.quant_config().method}, {config.steps} steps, "
          f"final loss {sum(tail) / len(tail):.4f})")
    return 0
