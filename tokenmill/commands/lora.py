"""``tokenmill lora train BASE --data FILE.jsonl --rank R --out DIR``: a LoRA adapter from records.

The base loads in float32 by default; ``--dtype auto`` on a GGUF file keeps its quantized weights
(QLoRA: the adapter trains over the frozen 4-bit base), as does a ``tokenmill quantize`` directory.
DIR receives the adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``),
``train_log.json``, ``loss.png`` and ``run/`` (checkpoints: the same command again resumes). Serve
it with ``tokenmill serve BASE --enable-lora --lora-modules NAME=DIR``.
"""

from __future__ import annotations

import argparse

from tokenmill.config import LoadConfig
from tokenmill.options import option_fields

TRAIN_FLAGS = {  # TrainConfig field -> (type, help)
    "steps": (int, "optimizer steps"),
    "lr": (float, "peak AdamW learning rate"),
    "grad_accum": (int, "micro-batches per optimizer step"),
    "checkpoint_every": (int, "steps between checkpoints (0: at the end)"),
}
FLAGS = {  # LoRATrainConfig field -> (type, help)
    "alpha": (float, "lora_alpha: the update is scaled by alpha / rank"),
    "batch_size": (int, "records per micro-batch"),
    "max_len": (int, "tokens per record at most"),
    "eval_fraction": (float, "fraction of the records held out for the evaluation loss"),
    "eval_every": (int, "steps between evaluations"),
    "seed": (int, "seed of the split, the order and the initial weights"),
}


def add_lora_parser(sub) -> None:
    from tokenmill.finetune import LoRATrainConfig
    from tokenmill.lora.adapter import PROJECTIONS

    lora = sub.add_parser("lora", help="LoRA adapters: train one")
    verbs = lora.add_subparsers(dest="lora_command", required=True)
    t = verbs.add_parser("train", help="train a LoRA adapter on JSON-lines records (chat, prompt/completion, text)")
    t.add_argument("base", metavar="BASE", help="the base model: a name, GGUF file, HF or tokenmill-quantized directory")
    t.add_argument("--data", required=True, metavar="FILE.jsonl", help='records: {"messages": [...]}, '
                   '{"prompt": ..., "completion": ...} or {"text": ...}, one per line')
    t.add_argument("--out", required=True, metavar="DIR", help="where the adapter, its log and checkpoints go")
    defaults = LoRATrainConfig()
    t.add_argument("--rank", type=int, default=defaults.rank, help=f"adapter rank (default: {defaults.rank})")
    t.add_argument("--targets", nargs="+", default=None, choices=PROJECTIONS, metavar="PROJ",
                   help=f"projections to adapt, of {' '.join(PROJECTIONS)} (default: all seven)")
    t.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(rank) (rsLoRA)")
    for flags, owner in ((TRAIN_FLAGS, defaults.train), (FLAGS, defaults)):
        for name, (kind, text) in flags.items():
            t.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                           help=f"{text} (default: {getattr(owner, name)})")
    t.add_argument("--float32-matmuls", action="store_true", help="train with float32 matmuls (default: bfloat16)")
    t.add_argument("--dtype", default="float32", help="how the base loads: float32 (default), bfloat16, or auto "
                   "(a GGUF file's quantized weights as stored: QLoRA)")
    t.add_argument("--device", default="cpu", help="auto, cpu or cuda")
    t.add_argument("--cache-dir", default=None, help=option_fields(LoadConfig, only=("cache_dir",))[0].metadata["help"])


def lora_train_config(args: argparse.Namespace):
    """The LoRATrainConfig of the flags given (the others: its defaults)."""
    from dataclasses import replace

    from tokenmill.finetune import LoRATrainConfig

    defaults = LoRATrainConfig()
    train = {name: getattr(args, name) for name in TRAIN_FLAGS if getattr(args, name) is not None}
    if args.float32_matmuls:
        train["mixed_precision"] = False
    options = {name: getattr(args, name) for name in FLAGS if getattr(args, name) is not None}
    if args.targets:
        options["targets"] = tuple(dict.fromkeys(args.targets))
    return LoRATrainConfig(rank=args.rank, use_rslora=args.rslora, train=replace(defaults.train, **train), **options)


def cmd_lora(args: argparse.Namespace) -> int:
    from tokenmill.finetune.lora import plot_losses, train_lora
    from tokenmill.loader import load_model

    config = lora_train_config(args)
    loaded = load_model(args.base, args.dtype, args.device, args.cache_dir)
    result = train_lora(loaded, args.data, args.out, config)
    if result.eval_loss_after is not None:
        before = f"{result.eval_loss_before:.4f} -> " if result.eval_loss_before is not None else ""
        print(f"held-out loss ({result.num_eval} records): {before}{result.eval_loss_after:.4f}")
    resumed = f", resumed at step {result.log.resumed_at}" if result.log.resumed_at else ""
    print(f"{config.train.steps} steps on {result.num_train} records{resumed}")
    plot = plot_losses(result.log.values, result.adapter_dir / "loss.png")
    print(f"wrote {result.adapter_dir} (PEFT adapter: adapter_config.json, adapter_model.safetensors), "
          f"train_log.json" + (f", {plot.name}" if plot is not None else ""))
    return 0
