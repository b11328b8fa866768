"""``tokenmill route train --log FILE --out router.json``: a learned router from logged outcomes.

The log is JSON lines with ``prompt_token_ids`` and ``label`` (1: the cheap model's answer was
good enough) or ``escalated`` (a cascade's decision, from ``tokenmill serve --route-log``); see
tokenmill/routing/learned.py. The router file goes in a route of policy ``learned``.
"""

from __future__ import annotations

import argparse
import random

from tokenmill.errors import InvalidParameterError


def add_route_parser(sub) -> None:
    route = sub.add_parser("route", help="model routing tools: train a learned router")
    actions = route.add_subparsers(dest="route_command", required=True)
    train = actions.add_parser("train", help="train a learned router from logged outcomes")
    train.add_argument("--log", action="append", required=True, metavar="FILE",
                       help="JSON-lines log of outcomes (repeatable)")
    train.add_argument("--out", required=True, metavar="FILE", help="where to write the router (JSON)")
    train.add_argument("--holdout", type=float, default=0.2,
                       help="fraction of the examples kept out of training to report accuracy on (0: none)")
    train.add_argument("--steps", type=int, default=500, help="optimizer steps")
    train.add_argument("--l2", type=float, default=1e-3, help="L2 penalty on the weights")
    train.add_argument("--seed", type=int, default=0, help="seed of the hold-out split")


def cmd_route(args: argparse.Namespace) -> int:
    from tokenmill.routing.learned import read_examples, train

    if not 0 <= args.holdout < 1:
        raise InvalidParameterError(f"--holdout must be in [0, 1), got {args.holdout}")
    prompts, labels = [], []
    for path in args.log:
        p, lab = read_examples(path)
        prompts += p
        labels += lab
    order = list(range(len(prompts)))
    random.Random(args.seed).shuffle(order)
    held = set(order[:int(len(order) * args.holdout)])
    fit = [i for i in order if i not in held]
    router = train([prompts[i] for i in fit], [labels[i] for i in fit], l2=args.l2, steps=args.steps)
    router.save(args.out)
    print(f"{len(prompts)} examples ({sum(labels)} where the cheap model sufficed), trained on {len(fit)}: "
          f"accuracy {router.train_accuracy:.3f}")
    if held:
        right = sum((router.predict(prompts[i]) >= 0.5) == bool(labels[i]) for i in held)
        positive = sum(labels[i] for i in held)
        print(f"held out {len(held)}: accuracy {right / len(held):.3f} "
              f"(always the majority label: {max(positive, len(held) - positive) / len(held):.3f})")
    print(f"wrote {args.out}")
    return 0
