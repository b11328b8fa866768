"""The ``tokenmill`` command line: thin wrappers over the library.

Errors the user can fix print one line (``error: ...``) and exit with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from tokenmill.attention.kv_quant import KV_CACHE_DTYPES
from tokenmill.benchmark.commands import add_bench_parser, cmd_bench
from tokenmill.errors import TokenmillError
from tokenmill.eval.commands import add_eval_parser, cmd_eval
from tokenmill.quantization.commands import add_quantize_parser, cmd_quantize
from tokenmill.quantization.qat_commands import add_qat_parser, cmd_qat


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default=None,
                        help="model name, GGUF file, HF directory or hub repo id (default: smollm2-135m-instruct)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (CUDA)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context window in tokens (default: the model's own)")


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
    add_eval_parser(sub)
    return parser


def _serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    serve.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                       help="model to serve (same as --model; default: smollm2-135m-instruct)")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="name clients pass as 'model'")
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help="JSON file of tenants with sha256-hashed keys and limits (enables auth)")
    serve.add_argument("--isolate-tenant-cache", action="store_true",
                       help="tenants never share prefix-cache blocks")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="sequences the engine runs at once")
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    serve.add_argument("--kv-cache-memory", type=float, default=0.1,
                       help="KV cache size: bytes, or a fraction of free memory when < 1")
    serve.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV cache storage: auto (the model dtype), int8 or fp8 (e4m3): ~1.9x the tokens")
    serve.add_argument("--max-queued-requests", type=int, default=256, help="queue bound before 429")
    serve.add_argument("--max-queued-tokens", type=int, default=262_144, help="queued prompt tokens before 429")
    serve.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline, seconds")
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    serve.add_argument("--seed", type=int, default=None, help="seed of requests without their own")


def _sampling_params(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop)


def _load(args: argparse.Namespace):
    from tokenmill.engine.llm import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    prompt = llm.render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
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

    from tokenmill.engine.llm import LLM
    from tokenmill.server.config import ServerConfig
    from tokenmill.server.serve import serve

    if args.model_pos and args.model and args.model_pos != args.model:
        raise TokenmillError(f"two models given: {args.model_pos!r} and --model {args.model!r}")
    config = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                          api_keys_file=args.api_keys, max_queued_requests=args.max_queued_requests,
                          max_queued_tokens=args.max_queued_tokens, request_timeout=args.request_timeout,
                          isolate_tenant_prefix_cache=args.isolate_tenant_cache, drain_timeout=args.drain_timeout)
    kv = int(args.kv_cache_memory) if args.kv_cache_memory >= 1 else args.kv_cache_memory
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(args.model_pos or args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              seed=args.seed, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=kv, kv_cache_dtype=args.kv_cache_dtype, policy="priority")
    serve(llm, config)
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "serve": cmd_serve,
            "quantize": cmd_quantize, "eval": cmd_eval, "qat": cmd_qat}


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
