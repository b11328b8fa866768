"""The ``tokenmill`` command line: thin wrappers over the library.

Errors the user can fix print one line (``error: ...``) and exit with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from tokenmill.benchmark.commands import add_bench_parser, cmd_bench
from tokenmill.config import LoadConfig
from tokenmill.engine import ENGINE_OPTIONS, add_engine_options
from tokenmill.errors import TokenmillError
from tokenmill.options import add_option_group
from tokenmill.commands.cost import add_cost_parser, cmd_cost
from tokenmill.commands.distill import add_distill_parser, cmd_distill
from tokenmill.commands.upcycle import add_upcycle_parser, cmd_upcycle
from tokenmill.commands.eval import add_eval_parser, cmd_eval
from tokenmill.commands.lora import add_lora_parser, cmd_lora
from tokenmill.commands.prune import add_prune_parser, cmd_prune
from tokenmill.commands.qat import add_qat_parser, cmd_qat
from tokenmill.commands.route import add_route_parser, cmd_route
from tokenmill.commands.spec import add_spec_parser, cmd_spec
from tokenmill.commands.quantize import add_quantize_parser, cmd_quantize


def _model_args(parser: argparse.ArgumentParser) -> None:
    """The model and engine options of generate and chat (the request's --seed is the sampling one)."""
    add_option_group(parser, LoadConfig)
    for cls in ENGINE_OPTIONS:
        add_option_group(parser, cls, exclude=("seed",))


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", "-n", type=int, default=max_tokens, help="tokens to generate")
    parser.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="Serve and optimize language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt and stream the text to stdout")
    _model_args(gen)
    _sampling_args(gen, max_tokens=64)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("prompt", help="the prompt text")
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    _model_args(chat)
    _sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="system prompt")
    add_bench_parser(sub)
    _serve_parser(sub)
    add_quantize_parser(sub)
    add_qat_parser(sub)
    add_prune_parser(sub)
    add_distill_parser(sub)
    add_upcycle_parser(sub)
    add_lora_parser(sub)
    add_spec_parser(sub)
    add_route_parser(sub)
    add_eval_parser(sub)
    add_cost_parser(sub)
    return parser


def _serve_parser(sub) -> None:
    from tokenmill.scaleout.config import ScaleOutConfig
    from tokenmill.server.config import CostConfig, ServerConfig

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    serve.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                       help="model to serve (same as --model; default: smollm2-135m-instruct)")
    serve.add_argument("--model", "-m", action="append", default=[], metavar="[NAME=]SOURCE",
                       help="model to serve: a known name, GGUF file or directory; NAME=SOURCE serves it as NAME. "
                            "Repeat to serve several (one KV budget, --kv-cache-memory, split among them)")
    add_option_group(serve, LoadConfig, exclude=("model",))
    add_engine_options(serve)
    add_option_group(serve, ServerConfig)
    add_option_group(serve, CostConfig)
    add_option_group(serve, ScaleOutConfig)


def _sampling_params(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop)


def _llm_options(args: argparse.Namespace) -> dict:
    """The parsed load and engine options, as LLM keywords (``model`` aside)."""
    from tokenmill.options import option_fields

    names = [f.name for cls in (LoadConfig, *ENGINE_OPTIONS) for f in option_fields(cls) if hasattr(args, f.name)]
    return {name: getattr(args, name) for name in names if name != "model"}


def _llm(args: argparse.Namespace, **overrides):
    """LLM(...) from the parsed load and engine options."""
    from tokenmill.llm import LLM

    return LLM(args.model, **{**_llm_options(args), **overrides})


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _llm(args)
    prompt = llm.render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _llm(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"tokenmill chat with {llm.model_name} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for delta in llm.stream(llm.render_chat(messages), params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from tokenmill.options import from_namespace
    from tokenmill.scaleout.config import ScaleOutConfig
    from tokenmill.server.config import CostConfig, ServerConfig
    from tokenmill.server.model_pool import ModelLoader, ModelSpec
    from tokenmill.server.serve import serve

    specs = [ModelSpec.parse(text) for text in ([args.model_pos] if args.model_pos else []) + args.model]
    if not specs:
        specs = [ModelSpec(None, LoadConfig().model)]
    names = [spec.name for spec in specs if spec.name]
    if len(set(names)) != len(names):
        raise TokenmillError(f"two models share a name: {', '.join(names)}")
    config, cost = from_namespace(ServerConfig, args), from_namespace(CostConfig, args)
    if len(specs) > 1 and config.served_model_name:
        raise TokenmillError("--served-model-name names one model; with several, give each as --model NAME=SOURCE")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    scale = from_namespace(ScaleOutConfig, args)
    if scale.replicas or scale.attach:
        return _serve_replicas(specs, args, config, cost, scale)
    loader = ModelLoader(_llm_options(args), config.spare_kv_cache_memory)
    models, seconds = {}, {}
    for spec in specs:
        llm, took = loader.load(spec.source, loader.share(len(specs)))
        name = spec.name or (config.served_model_name if len(specs) == 1 else None) or llm.model_name
        if name in models:
            raise TokenmillError(f"two models are named {name!r}: name them with --model NAME=SOURCE")
        models[name], seconds[name] = llm, took
    serve(models, config, cost, loader, seconds)
    return 0


def _serve_replicas(specs, args: argparse.Namespace, config, cost, scale) -> int:
    """``tokenmill serve --replicas N``: the model on N Ray Serve replicas behind this process's endpoint."""
    from tokenmill.scaleout.deploy import launch
    from tokenmill.server.serve import run

    if len(specs) != 1:
        raise TokenmillError("--replicas serves one model; give one --model")
    if specs[0].name and not config.served_model_name:
        config = dataclasses.replace(config, served_model_name=specs[0].name)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise TokenmillError("--replicas runs on Ray Serve: pip install 'tokenmill[scaleout]'") from None
    front = launch(specs[0].source, _llm_options(args), config, cost, scale)
    try:
        run(front.state, front.app())
    finally:
        front.stop()  # the replicas this front started (a cluster of its own stops with the process anyway)
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "serve": cmd_serve,
            "quantize": cmd_quantize, "eval": cmd_eval, "qat": cmd_qat, "prune": cmd_prune, "distill": cmd_distill,
            "upcycle": cmd_upcycle, "spec": cmd_spec, "route": cmd_route, "lora": cmd_lora, "cost": cmd_cost}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except TokenmillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
