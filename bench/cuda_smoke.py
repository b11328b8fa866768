"""CUDA check of the shared code path on a SmolLM2-sized random checkpoint (no weights travel):
load through LLM(device='cuda'), greedy decode batch 1, and report tok/s per dtype beside HF
transformers' ``generate`` on the same checkpoint, device and dtype.

    python bench/cuda_smoke.py [--out results.json] [--model-dir DIR]

--model-dir keeps the random checkpoint there (made once) for other benchmarks to load.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.model_utils import save_byte_tokenizer  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    path = args.model_dir or Path(tempfile.mkdtemp())
    if not (path / "config.json").is_file():
        save_random_smollm2(path)
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "runs": []}
    for dtype in ("float32", "bfloat16", "float16"):
        if args.device == "cpu" and dtype == "float16":
            continue
        llm = LLM(str(path), device=args.device, dtype=dtype)
        ids = llm.tokenizer.encode("Once upon a time")
        tokenmill_s = decode_seconds(lambda n: llm.generate(
            [ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        llm = None  # its KV cache, before HF loads
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(args.device)
        prompt = torch.tensor([ids], device=args.device)
        hf_s = decode_seconds(lambda n: hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                    pad_token_id=0))
        hf = None
        row = {"dtype": dtype, "decode_tok_s": 128 / tokenmill_s, "hf_decode_tok_s": 128 / hf_s,
               "ratio": hf_s / tokenmill_s}
        results["runs"].append(row)
        print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def decode_seconds(generate) -> float:
    """Seconds for 128 more tokens after the first: generate(129) - generate(1), after a warm-up."""
    for n in (1, 65):
        generate(n)
    times = {}
    for n in (1, 129):
        start = time.perf_counter()
        generate(n)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times[n] = time.perf_counter() - start
    return times[129] - times[1]


def save_random_smollm2(path: Path) -> None:
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                      tie_word_embeddings=True, eos_token_id=256, rope_theta=100000.0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    save_byte_tokenizer(path)


if __name__ == "__main__":
    main()
