"""Offline throughput: tokenmill's continuous batching vs HF transformers ``generate`` with
static batches of the same maximum batch size and dtype, on the same requests, in one run.

    python bench/offline_throughput.py [--num-requests 256] [--max-batch 32] [--dtype float32] [--hf-dtype D]
        [--device cpu|cuda] [--model NAME|GGUF|HF_DIR] [--out FILE.json]

Requests: random token prompts of 32-1024 tokens and outputs of 16-512 tokens (uniform, seeded),
EOS ignored so both engines produce exactly the requested tokens. HF runs the requests in
arrival order in batches of --max-batch, left-padded, each batch generating up to its longest
output; only requested tokens count. Output tok/s = requested output tokens / wall time.
Also reports the prompt-chunk steps' GFLOP/s (linear layers: 2 x decoder-layer linear parameters
per prompt token) against this machine's measured bfloat16 GEMM peak (on CPU tokenmill's own kernel
at 2048^3, as ``bench/peers/decode_prefill_peers.py`` measures it; on CUDA PyTorch's at 8192^3).
Prints the table, writes JSON and a PNG (default under bench/results/).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.loading.sources import resolve_model

RESULTS = Path(__file__).parent / "results"


def make_requests(n: int, vocab: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]):
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt_len, output_len = rng.randint(*prompt_range), rng.randint(*output_range)
        requests.append(([rng.randrange(100, vocab) for _ in range(prompt_len)], output_len))
    return requests


def run_tokenmill(llm: LLM, requests) -> float:
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in requests]
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == out for o, (_, out) in zip(outputs, requests))
    return elapsed


def step_breakdown(stats) -> dict:
    """Where the engine's time went: steps that only decoded vs steps that also ran prompt chunks."""
    decode = [s for s in stats if s.num_batched_tokens == s.num_scheduled]
    mixed = [s for s in stats if s.num_batched_tokens > s.num_scheduled]
    return {"steps": len(stats),
            "decode_steps": len(decode), "decode_seconds": sum(s.seconds for s in decode),
            "decode_mean_batch": sum(s.num_scheduled for s in decode) / max(1, len(decode)),
            "decode_ms_per_step": 1000 * sum(s.seconds for s in decode) / max(1, len(decode)),
            "prefill_steps": len(mixed), "prefill_seconds": sum(s.seconds for s in mixed),
            "prefill_tokens": sum(s.num_batched_tokens for s in mixed)}


def layer_linear_params(llm: LLM) -> int:
    """Weights the decoder layers' linears multiply per token (the LM head runs only for sampled tokens)."""
    from tokenmill.quantization.linear import QuantizedLinear

    model = llm.engine.runner.model
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, (nn.Linear, QuantizedLinear)) and m is not model.lm_head)


def prefill_gflops(llm: LLM, steps: dict, peak: dict) -> dict:
    """GFLOP/s of the steps that ran prompt chunks (their decodes counted as time, not work: a floor)."""
    flops = 2 * layer_linear_params(llm) * steps["prefill_tokens"]
    gflops = flops / steps["prefill_seconds"] / 1e9 if steps["prefill_seconds"] else None
    peak_gflops = peak.get("gflops")
    return {"gflops": gflops, "bf16_peak": peak, "of_peak": gflops / peak_gflops if gflops and peak_gflops else None}


def run_hf(model, requests, max_batch: int, pad_id: int, device: str = "cpu") -> float:
    start = time.perf_counter()
    for i in tqdm(range(0, len(requests), max_batch), desc="hf static batches"):
        batch = requests[i:i + max_batch]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
        longest = max(out for _, out in batch)
        with torch.no_grad():
            model.generate(input_ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad_id)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bf16_peak_of(device: str) -> dict:
    if device == "cuda":
        from tokenmill.benchmark.hardware import measure_matmul

        n = 8192
        return {"m": n, "k": n, "n": n, "gflops": measure_matmul(torch.device("cuda"), torch.bfloat16, n) / 1e9}
    sys.path.insert(0, str(Path(__file__).parent / "peers"))
    from decode_prefill_peers import bf16_peak

    return bf16_peak(torch.get_num_threads(), calls=5)


def load_hf(model: str, dtype: torch.dtype, device: str):
    import transformers

    source = resolve_model(model)
    if source.format == "gguf":  # HF dequantizes the file's weights
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    return hf.to(device).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--dtype", default="float32",
                        help="tokenmill's dtype: float32, bfloat16, or auto (a GGUF's quantized weights as stored)")
    parser.add_argument("--hf-dtype", default=None,
                        help="HF transformers' dtype (default: --dtype; bfloat16 where --dtype is auto, since HF "
                             "dequantizes GGUF weights)")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(32, 1024))
    parser.add_argument("--output-range", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=RESULTS / "offline_throughput.json",
                        help="the JSON; the PNG goes beside it")
    args = parser.parse_args()
    hf_dtype = args.hf_dtype or ("bfloat16" if args.dtype == "auto" else args.dtype)

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_batch)
    requests = make_requests(args.num_requests, llm.model_config.vocab_size, args.seed,
                             tuple(args.prompt_range), tuple(args.output_range))
    output_tokens = sum(out for _, out in requests)
    rows = []
    elapsed = run_tokenmill(llm, requests)
    rows.append({"engine": "tokenmill", "dtype": args.dtype, "seconds": elapsed, "output_tok_s": output_tokens / elapsed,
                 "steps": step_breakdown(llm.engine.stats)})
    b = rows[0]["steps"]
    rows[0]["prefill"] = prefill = prefill_gflops(llm, b, bf16_peak_of(args.device))
    peak_text = (f"{prefill['bf16_peak']['gflops']:.0f} GFLOP/s, {100 * prefill['of_peak']:.0f}% of it"
                 if prefill["of_peak"] else prefill["bf16_peak"].get("skipped", "not measured"))
    print(f"tokenmill steps: {b['decode_steps']} decode-only ({b['decode_seconds']:.1f} s, mean batch "
          f"{b['decode_mean_batch']:.1f}, {b['decode_ms_per_step']:.1f} ms/step), {b['prefill_steps']} with "
          f"prompt chunks ({b['prefill_seconds']:.1f} s, {b['prefill_tokens']} tokens)", flush=True)
    if prefill["gflops"]:
        print(f"prompt-chunk steps: {b['prefill_tokens'] / b['prefill_seconds']:.0f} tok/s, "
              f"{prefill['gflops']:.0f} GFLOP/s in the linears (bf16 peak {peak_text})", flush=True)
    print(f"tokenmill        {output_tokens / elapsed:8.1f} output tok/s  ({elapsed:.1f} s)", flush=True)
    if not args.no_hf:
        del llm  # its KV cache, before HF's
        hf = load_hf(args.model, getattr(torch, hf_dtype), args.device)
        elapsed = run_hf(hf, requests, args.max_batch, pad_id=0, device=args.device)
        rows.append({"engine": "hf-transformers (static batches)", "dtype": hf_dtype, "seconds": elapsed,
                     "output_tok_s": output_tokens / elapsed})
        print(f"hf-transformers  {output_tokens / elapsed:8.1f} output tok/s  ({elapsed:.1f} s)", flush=True)
        print(f"ratio tokenmill / hf: x{rows[0]['output_tok_s'] / rows[1]['output_tok_s']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": {**vars(args), "out": str(args.out)}, "cpu": _cpu_name(), "threads": torch.get_num_threads(),
              "output_tokens": output_tokens, "runs": rows}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    args.out.write_text(json.dumps(result, indent=2))
    _plot(rows, args.out)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plot(rows, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh([r["engine"] for r in rows], [r["output_tok_s"] for r in rows], color=["C0", "C1"][:len(rows)])
    ax.set_xlabel("output tok/s")
    ax.set_title("offline throughput")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(f"wrote {out} and .png")


if __name__ == "__main__":
    main()
