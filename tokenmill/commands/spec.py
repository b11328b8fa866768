"""``tokenmill spec train-heads MODEL --out DIR``: train an EAGLE head for speculative decoding.

The head drafts for ``--speculative-method eagle --draft-model DIR`` (tokenmill.spec_heads). Interrupted runs
resume from the checkpoint in DIR; the generated training data is kept there too.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from tokenmill.config import LoadConfig
from tokenmill.options import add_option_group, option_fields


HELP = {
    "prompts": "training sequences the model generates (one answer per prompt)",
    "max_tokens": "longest answer per prompt", "temperature": "sampling temperature of the answers",
    "passage_chars": "longest corpus passage in a prompt, in characters",
    "draft_vocab": "output rows of the head: the most frequent tokens of the training text",
    "steps": "optimizer steps", "batch_size": "windows per micro-batch", "seq_len": "tokens per window",
    "grad_accum": "micro-batches per optimizer step", "lr": "peak AdamW learning rate",
    "warmup_steps": "steps of linear warm-up", "cls_weight": "weight of the distribution loss beside the "
    "hidden-state regression", "unroll": "drafting steps trained (step j reads the head's own step j-1 features)",
    "checkpoint_every": "write a checkpoint every this many steps", "mixed_precision": "bfloat16 autocast",
    "seed": "seed of the prompts, answers and window order",
    "texts": "train on these teacher_text.json files of `tokenmill distill --data chat` runs of this model "
    "instead of generating answers"}


def add_spec_parser(sub) -> None:
    from tokenmill.spec_heads import HeadTrainingConfig

    spec = sub.add_parser("spec", help="speculative decoding tools: train-heads")
    actions = spec.add_subparsers(dest="spec_command", required=True)
    train = actions.add_parser("train-heads", help="train an EAGLE head on text the model generates itself")
    train.add_argument("model", metavar="MODEL", help=option_fields(LoadConfig, only=("model",))[0].metadata["help"])
    train.add_argument("--out", required=True, metavar="DIR", help="output directory (checkpoints and data too)")
    defaults = HeadTrainingConfig()
    for f in fields(HeadTrainingConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        text = f"{HELP.get(f.name, '')} (default: {value})".strip()
        if isinstance(value, tuple):
            train.add_argument(flag, nargs="+", default=value, metavar="FILE", help=text)
        elif isinstance(value, bool):
            train.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=text)
        else:
            train.add_argument(flag, type=type(value), default=value, help=text)
    add_option_group(train, LoadConfig, exclude=("model",))


def cmd_spec(args: argparse.Namespace) -> int:
    from tokenmill.spec_heads import HeadTrainingConfig, train_eagle_head

    config = HeadTrainingConfig(**{f.name: getattr(args, f.name) for f in fields(HeadTrainingConfig)})
    load = {f.name: getattr(args, f.name) for f in option_fields(LoadConfig) if f.name != "model"}
    report = train_eagle_head(args.model, args.out, config, **load)
    print(json.dumps({k: v for k, v in report.items() if k != "training"}, indent=2))
    print(f"wrote {args.out}: serve it with --speculative-method eagle --draft-model {args.out}")
    return 0
