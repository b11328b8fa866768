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
        if isinstance(value, bool):
            train.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            train.add_argument(flag, type=type(value), default=value, help=f"(default: {value})")
    add_option_group(train, LoadConfig, exclude=("model",))


def cmd_spec(args: argparse.Namespace) -> int:
    from tokenmill.spec_heads import HeadTrainingConfig, train_eagle_head

    config = HeadTrainingConfig(**{f.name: getattr(args, f.name) for f in fields(HeadTrainingConfig)})
    load = {f.name: getattr(args, f.name) for f in option_fields(LoadConfig) if f.name != "model"}
    report = train_eagle_head(args.model, args.out, config, **load)
    print(json.dumps({k: v for k, v in report.items() if k != "training"}, indent=2))
    print(f"wrote {args.out}: serve it with --speculative-method eagle --draft-model {args.out}")
    return 0
