"""CUDA check of the shared code path on a SmolLM2-sized random checkpoint (no weights travel):
load through LLM(device='cuda'), greedy decode batch 1, and report tok/s per dtype.

    python bench/cuda_smoke.py [--out results.json]
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
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp())
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                      tie_word_embeddings=True, eos_token_id=256, rope_theta=100000.0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    save_byte_tokenizer(path)
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "runs": []}
    for dtype in ("float32", "bfloat16", "float16"):
        if args.device == "cpu" and dtype == "float16":
            continue
        llm = LLM(str(path), device=args.device, dtype=dtype)
        ids = llm.tokenizer.encode("Once upon a time")
        for n in (1, 65):  # warm-up
            llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        times = {}
        for n in (1, 129):
            start = time.perf_counter()
            llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            times[n] = time.perf_counter() - start
        row = {"dtype": dtype, "decode_tok_s": 128 / (times[129] - times[1])}
        results["runs"].append(row)
        print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
