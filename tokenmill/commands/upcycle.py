"""``tokenmill upcycle MODEL --experts 8 --top-k 2 --out DIR``: sparse upcycling from the command line.

The dense model loads in float32; its MLPs become experts behind new routers; the dense model
distils into the MoE model with a load-balancing loss (tokenmill.upcycling), and, unless
--no-baseline, a copy of the dense model trains on the same tokens for comparison. DIR gets
``student/`` (a Mixtral-layout HF checkpoint: LLM(dir), tokenmill serve, transformers load it),
``upcycle.json`` (perplexities, routing load and entropy, expert similarity), ``expert_load.png``
and the training run's ``log.json``, ``loss.png`` and checkpoints (a run resumes; the baseline's in ``dense-baseline/``).
"""

from __future__ import annotations

import argparse

from tokenmill.commands.distill import add_training_flags, training_options
from tokenmill.config import LoadConfig
from tokenmill.options import option_fields


def add_upcycle_parser(sub) -> None:
    from tokenmill.upcycling.config import INITS, UpcycleConfig

    defaults = UpcycleConfig()
    u = sub.add_parser("upcycle", help="sparse upcycling: a mixture-of-experts model grown from a dense one")
    u.add_argument("model", help="the dense model: a name, GGUF file or HF directory (loaded in float32)")
    u.add_argument("--out", required=True, metavar="DIR", help="output directory (the MoE model, report, plot)")
    u.add_argument("--experts", type=int, default=defaults.experts, help=f"experts per layer (default: {defaults.experts})")
    u.add_argument("--top-k", type=int, default=defaults.top_k, help=f"experts per token (default: {defaults.top_k})")
    u.add_argument("--init", choices=INITS, default=defaults.init,
                   help="copy: each expert the MLP plus noise; partition: the MLP's channels split among the experts "
                        f"(default: {defaults.init})")
    u.add_argument("--noise", type=float, default=defaults.noise,
                   help=f"copy: noise std relative to each weight's (default: {defaults.noise})")
    u.add_argument("--balance-weight", type=float, default=defaults.balance_weight,
                   help=f"weight of the load-balancing loss (default: {defaults.balance_weight})")
    u.add_argument("--no-baseline", action="store_true",
                   help="skip training the dense model on the same tokens for comparison")
    add_training_flags(u, defaults.distill)
    u.add_argument("--device", default="cpu", help="auto, cpu or cuda")
    u.add_argument("--cache-dir", default=None, help=option_fields(LoadConfig, only=("cache_dir",))[0].metadata["help"])


def cmd_upcycle(args: argparse.Namespace) -> int:
    from tokenmill.upcycling.config import UpcycleConfig
    from tokenmill.upcycling.upcycle import upcycle_model_arg

    distill, flags = UpcycleConfig().distill.to_dict(), training_options(args)
    distill.update({k: v for k, v in flags.items() if k != "train"})
    distill["train"] = {**distill["train"], **flags.get("train", {})}
    config = UpcycleConfig(experts=args.experts, top_k=args.top_k, init=args.init, noise=args.noise,
                           balance_weight=args.balance_weight, baseline=not args.no_baseline, distill=distill)
    result = upcycle_model_arg(args.model, config, args.out, device=args.device, cache_dir=args.cache_dir)
    r = result.report
    ppl = r["perplexity"]
    print(f"perplexity ({config.distill.eval_tokens} held-out tokens): dense {ppl['dense']:.3f}; upcycled "
          f"{ppl['upcycled_before']:.3f} -> {ppl['upcycled']:.3f}"
          + (f"; dense trained on the same tokens {ppl['dense_trained']:.3f}" if "dense_trained" in ppl else ""))
    routing = r["routing"]
    print(f"routing: router entropy {routing['mean_entropy']:.3f} nats ({100 * routing['entropy_fraction']:.0f}% of "
          f"log {config.experts}); expert shares {routing['min_share']:.3f}..{routing['max_share']:.3f} "
          f"(even {1 / config.experts:.3f}); experts' mean pairwise cosine "
          f"{r['expert_similarity']['mean_pairwise_cosine']:.4f}")
    p = r["parameters"]
    print(f"parameters: dense {p['dense'] / 1e6:.1f}M, upcycled {p['upcycled'] / 1e6:.1f}M "
          f"({p['upcycled_active'] / 1e6:.1f}M active per token)")
    print(f"wrote {result.saved} (the MoE model), {args.out}/upcycle.json"
          + (f", {result.plot}" if result.plot else ""))
    return 0
