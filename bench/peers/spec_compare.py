"""Speculative decoding through the HTTP servers, side by side: tokenmill and llama.cpp's
``llama-server``, each without and with n-gram speculation, on bench/speculative.py's workloads.

    python bench/peers/spec_compare.py [--workloads copy code edit open] [--concurrencies 1,4]
                                       [--output-len 128] [--requests 8] [--llama-spec-type ngram-simple]
                                       [--draft-model DIR]

    tokenmill off       tokenmill serve GGUF
    tokenmill ngram     tokenmill serve GGUF --speculative-method ngram
    llama.cpp off       llama-server -m GGUF -np S --cont-batching
    llama.cpp ngram     llama-server ... --spec-type ngram-simple (llama.cpp's prompt lookup)
    with --draft-model DIR (an HF directory: a draft tokenmill pruned or distilled), also
    tokenmill draft     tokenmill serve GGUF --speculative-method draft --draft-model DIR
    llama.cpp draft     llama-server ... --spec-type draft-simple --spec-draft-model DIR.bf16.gguf (the same
                        draft in bfloat16, converted once by llama.cpp's convert_hf_to_gguf.py)

Each server runs alone (one at a time, never two sharing the cores) and is stopped after its
sweep. Requests: the workload's prompt as one user message to /v1/chat/completions (each server
applies the GGUF's chat template), greedy, ``--output-len`` tokens with EOS ignored, streamed.
Output tok/s and TPOT p50 per (workload, concurrency); the ratio of each server's speculation
to its own off, and tokenmill's to llama.cpp's (acceptance rates come from bench/speculative.py,
which reads the engine's counters). Writes JSON and markdown under bench/results/peers/.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from build_llama_cpp import gguf_of_hf_dir  # noqa: E402
from serve_compare import RESULTS, Server, free_port, llama_server, running, served_model  # noqa: E402
from speculative import WORKLOADS, prompt_texts  # noqa: E402

from tokenmill.benchmark.client import ClientConfig  # noqa: E402
from tokenmill.benchmark.report import markdown_table, write_json  # noqa: E402
from tokenmill.benchmark.runner import LoadConfig, run_serve  # noqa: E402
from tokenmill.benchmark.workloads import Conversation, Turn, load_tokenizer  # noqa: E402


def conversations(tokenizer, workload: str, n: int, output_len: int, seed: int) -> list[Conversation]:
    return [Conversation((Turn(t, len(tokenizer.encode(t, add_special_tokens=False)), output_len),))
            for t in prompt_texts(workload, n, seed)]


def methods(args) -> list[str]:
    return ["off", "ngram"] + (["draft"] if args.draft_model else [])


def servers(args, gguf: Path) -> list[Server]:
    out = []
    for spec in methods(args):
        port = free_port()
        cmd = [sys.executable, "-m", "tokenmill", "serve", str(gguf), "--port", str(port), "--device", "cpu",
               "--max-num-seqs", str(args.slots)]
        if spec != "off":
            cmd += ["--speculative-method", spec, "--num-speculative-tokens", str(args.k)]
        if spec == "draft":
            cmd += ["--draft-model", str(args.draft_model)]
        out.append(Server(f"tokenmill {spec}", cmd, port, "/ready"))
    for spec in methods(args):
        server = llama_server(argparse.Namespace(build=args.build, input_len=args.input_len,
                                                 output_len=args.output_len, slots=args.slots,
                                                 threads=args.threads), gguf)
        if spec == "ngram":
            server.command += ["--spec-type", args.llama_spec_type, "--spec-draft-n-max", str(args.k)]
        if spec == "draft":
            server.command += ["--spec-type", "draft-simple", "--spec-draft-model", str(gguf_of_hf_dir(args.draft_model)),
                               "--spec-draft-n-max", str(args.k)]
        out.append(Server(f"llama.cpp {spec}", server.command, server.port, server.ready))
    return out


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF model name or file")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--concurrencies", default="1,4")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=1024, help="llama-server context per slot, with output")
    parser.add_argument("--requests", type=int, default=8, help="requests per (workload, concurrency)")
    parser.add_argument("--k", type=int, default=4, help="most draft tokens per step, both servers")
    parser.add_argument("--llama-spec-type", default="ngram-simple")
    parser.add_argument("--draft-model", type=Path, default=None,
                        help="an HF directory (a draft tokenmill pruned or distilled): both servers also speculate "
                        "with it")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--no-build", dest="build", action="store_false")
    args = parser.parse_args()
    loads = [int(c) for c in args.concurrencies.split(",")]
    args.slots = max(loads)

    from tokenmill.loading.sources import resolve_model

    source = resolve_model(args.model)
    if source.format != "gguf":
        parser.error(f"{args.model} is not a GGUF model: both servers must load the same GGUF file")
    tokenizer = load_tokenizer(args.model)
    # prompts of their own for every point and for the warm-up: a server's n-gram memory of a tenant's
    # finished answers would otherwise draft a point's answers from an earlier point's identical ones
    pairs = [(w, c) for w in args.workloads for c in loads]
    work = {(w, c): conversations(tokenizer, w, max(args.requests, c), args.output_len, args.seed + 1 + i)
            for i, (w, c) in enumerate(pairs)}
    warm = conversations(tokenizer, args.workloads[0], 2, args.output_len, args.seed + 1 + len(pairs))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    stem = RESULTS / f"spec-{datetime.now():%Y%m%d-%H%M%S}"
    results: dict[str, dict] = {}
    for server in servers(args, source.path):
        print(f"== {server.name}", flush=True)
        try:
            with running(server, Path(f"{stem}-{server.name.replace(' ', '-')}.log"), args.startup_timeout) as root:
                client = ClientConfig(root, served_model(root), "chat", ignore_eos=True, temperature=0.0)
                run_serve(client, LoadConfig(max_concurrency=2), warm, count, progress=False)
                for (w, c), convs in work.items():
                    s = run_serve(client, LoadConfig(max_concurrency=c), convs, count, progress=False).summary
                    results.setdefault(server.name, {})[f"{w} c={c}"] = {
                        "tok_s": s.output_throughput, "tpot_p50_ms": s.tpot.median, "failed": s.failed}
                    print(f"  {w} c={c}: {s.output_throughput:.1f} tok/s, TPOT p50 {s.tpot.median or 0:.1f} ms"
                          f"{f', {s.failed} failed' if s.failed else ''}", flush=True)
        except RuntimeError as exc:
            print(f"  skipped: {exc}", flush=True)
    rows = []
    for key in (f"{w} c={c}" for w in args.workloads for c in loads):
        got = {name: r.get(key, {}).get("tok_s") for name, r in results.items()}
        ratio = lambda a, b: f"x{got[a] / got[b]:.2f}" if got.get(a) and got.get(b) else "-"  # noqa: E731
        specs = [m for m in methods(args) if m != "off"]
        rows.append([key, *(f"{got[n]:.1f}" if got.get(n) else "-" for n in results),
                     *(ratio(f"{e} {m}", f"{e} off") for m in specs for e in ("tokenmill", "llama.cpp")),
                     *(ratio(f"tokenmill {m}", f"llama.cpp {m}") for m in specs)])
    specs = [m for m in methods(args) if m != "off"]
    header = ["workload", *results, *(f"{e} {m}/off" for m in specs for e in ("tokenmill", "llama.cpp")),
              *(f"tokenmill/llama.cpp {m}" for m in specs)]
    table = markdown_table(header, rows)
    print(f"\noutput tok/s, {args.output_len} tokens per request (EOS ignored), greedy, chat\n\n{table}")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}  # --draft-model: a Path
    write_json({"kind": "spec_peers", "args": settings, "results": results}, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {stem.with_suffix('.json')}")


if __name__ == "__main__":
    main()
