"""``tokenmill distill --teacher T --student S --out DIR``: knowledge distillation from the command line.

Both models load in float32 (a name, GGUF file or HF directory; the student typically one that
``tokenmill prune`` wrote, the Minitron recipe). The run (tokenmill.distillation) writes into DIR
its checkpoints (an interrupted run resumes from them), ``log.json``, ``loss.png`` and the student
in ``DIR/student``, which ``LLM(dir)``, ``tokenmill serve``, ``tokenmill eval`` and HF transformers
load. Flags left out keep DistillConfig's defaults, shown in ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses

from tokenmill.config import LoadConfig
from tokenmill.options import option_fields

TRAIN_FLAGS = {  # TrainConfig field (DistillConfig.train) -> (type, help)
    "steps": (int, "optimizer steps"),
    "lr": (float, "peak AdamW learning rate"),
    "grad_accum": (int, "micro-batches per optimizer step"),
    "checkpoint_every": (int, "steps between checkpoints"),
}
FLAGS = {  # DistillConfig field -> (type, help)
    "batch_size": (int, "sequences per micro-batch"),
    "seq_len": (int, "tokens per training sequence"),
    "temperature": (float, "kd: softmax temperature of both models"),
    "kd_weight": (float, "weight of the KL (kd) or total-variation (acceptance) term"),
    "ce_weight": (float, "weight of the hard-label cross entropy (acceptance: on the teacher's argmax)"),
    "feature_weight": (float, "weight of hidden-state transfer through a learned projection (0: off)"),
    "objective": (str, "kd, or acceptance: a draft model maximising speculative decoding's acceptance"),
    "data": (str, "corpus (its training split), teacher (data-free: text the teacher writes), chat (its answers "
                 "to chat prompts: a draft's data) or a text file"),
    "eval_tokens": (int, "held-out corpus tokens for perplexity before and after (0: skip)"),
    "eval_every": (int, "also measure the student's perplexity and agreement every this many steps (the curves "
                        "in the plot)"),
    "agreement_prompts": (int, "held-out chat prompts whose greedy teacher answers measure the student's "
                               "agreement, a draft's acceptance (0: skip; unset: 8 for --objective acceptance, else 0)"),
    "agreement_tokens": (int, "longest teacher answer per agreement prompt"),
    "save_dtype": (str, "dtype of the saved student: bfloat16, float32 or float16"),
    "seed": (int, "seed of the window order, the teacher's text and the projections"),
}


def add_distill_parser(sub) -> None:
    from tokenmill.distillation.config import DistillConfig

    d = sub.add_parser("distill", help="knowledge distillation: train a student on a teacher's distributions")
    d.add_argument("--teacher", required=True, metavar="T", help="the teacher: a model name, GGUF file or HF "
                   "directory (loaded in float32)")
    d.add_argument("--student", required=True, metavar="S", help="the student, same vocabulary (e.g. a directory "
                   "made by tokenmill prune)")
    d.add_argument("--out", required=True, metavar="DIR", help="output directory (checkpoints, log, plot, student)")
    defaults = DistillConfig()
    add_training_flags(d, defaults)
    d.add_argument("--qat-group-size", type=int, default=None, metavar="G",
                   help="quantization-aware distillation: train through INT4 weights of group size G, save INT4")
    d.add_argument("--teacher-sequences", type=int, default=None,
                   help=f"--data teacher/chat: sequences it writes (default: {defaults.teacher_text.sequences})")
    d.add_argument("--teacher-max-tokens", type=int, default=None,
                   help=f"--data teacher/chat: longest text it writes per sequence "
                   f"(default: {defaults.teacher_text.max_tokens})")
    d.add_argument("--teacher-temperature", type=float, default=None,
                   help=f"--data teacher/chat: its sampling temperature, 0 greedy "
                   f"(default: {defaults.teacher_text.temperature})")
    d.add_argument("--completion-only", action=argparse.BooleanOptionalAction, default=None,
                   help="--data chat: train only on the positions whose next token the teacher wrote (its "
                   "answers), not on the prompts it answered (default: on for chat)")
    d.add_argument("--freeze-embedding", action="store_true",
                   help="keep the student's embedding (and a tied LM head) as it is: a pruned student's is the "
                   "teacher's")
    d.add_argument("--device", default="cpu", help="auto, cpu or cuda")
    d.add_argument("--cache-dir", default=None, help=option_fields(LoadConfig, only=("cache_dir",))[0].metadata["help"])


def add_training_flags(parser, defaults) -> None:
    """The training loop's and the losses' flags (FLAGS, TRAIN_FLAGS), their defaults from
    ``defaults`` (a DistillConfig), and --float32-matmuls."""
    unset = {f.name for f in dataclasses.fields(defaults) if f.default is None}  # resolved from other fields
    for flags, owner in ((TRAIN_FLAGS, defaults.train), (FLAGS, defaults)):
        for name, (kind, text) in flags.items():
            shown = "" if owner is defaults and name in unset else f" (default: {getattr(owner, name)})"
            parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text + shown)
    parser.add_argument("--float32-matmuls", action="store_true", help="train with float32 matmuls (default: bfloat16)")


def training_options(args: argparse.Namespace) -> dict:
    """The DistillConfig options the flags of :func:`add_training_flags` give (others left out)."""
    options = {name: getattr(args, name) for name in FLAGS if getattr(args, name) is not None}
    train = {name: getattr(args, name) for name in TRAIN_FLAGS if getattr(args, name) is not None}
    if args.float32_matmuls:
        train["mixed_precision"] = False
    if train:
        options["train"] = train
    return options


def distill_config(args: argparse.Namespace):
    """The DistillConfig of the flags given (the others: its defaults)."""
    from tokenmill.distillation.config import DistillConfig

    options = training_options(args)
    if args.qat_group_size is not None:
        options["qat"] = args.qat_group_size
    text = {"sequences": args.teacher_sequences, "max_tokens": args.teacher_max_tokens,
            "temperature": args.teacher_temperature}
    if any(v is not None for v in text.values()):
        options["teacher_text"] = {k: v for k, v in text.items() if v is not None}
    if args.freeze_embedding:
        options["train_embedding"] = False
    if args.completion_only is not None:
        options["completion_only"] = args.completion_only
    return DistillConfig.from_dict(options)


def cmd_distill(args: argparse.Namespace) -> int:
    from tokenmill.distillation.distill import distill_models

    config = distill_config(args)
    result = distill_models(args.teacher, args.student, config, args.out, device=args.device,
                            cache_dir=args.cache_dir)
    print_summary(result, config, args.out)
    return 0


def print_summary(result, config, out) -> None:
    """The run's perplexities (before, while and after), final losses, tokens and files."""
    ppl = result.perplexity
    if ppl["teacher"] is not None:
        print(f"perplexity on {config.eval_tokens} held-out tokens: teacher {ppl['teacher']:.3f}, student "
              f"{ppl['student_before']:.3f} -> {ppl['student_after']:.3f}")
    agreed = result.agreement
    if agreed["teacher"] is not None:
        print(f"greedy agreement with the teacher's answers to {config.agreement_prompts} held-out chat prompts: "
              f"teacher {agreed['teacher']:.3f}, student {agreed['student_before']:.3f} -> "
              f"{agreed['student_after']:.3f}")
    tail = {k: sum(v[-10:]) / len(v[-10:]) for k, v in result.log.items() if not k.startswith("eval_")}
    for key, what, form in (("eval_perplexity", "perplexity", ".2f"), ("eval_agreement", "agreement", ".3f")):
        if key in result.log:
            print(f"{what} while training: " + ", ".join(
                f"step {int(s)} {v:{form}}" for s, v in zip(result.log["eval_step"], result.log[key])))
    print("final (mean of the last 10 steps): " + ", ".join(f"{k} {v:.4f}" for k, v in tail.items()))
    resumed = f", resumed at step {result.resumed_at}" if result.resumed_at else ""
    print(f"{config.train.steps} steps, {result.tokens_seen:,} tokens seen, {result.wall_seconds:.1f} s{resumed}")
    print(f"wrote {result.saved} (the student), {out}/log.json"
          + (f", {result.plot}" if result.plot is not None else " (no loss.png: matplotlib is not installed)"))
