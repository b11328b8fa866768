"""Offline peers side by side: tokenmill's LLM, HF transformers (the floor), CTranslate2 (int8)
and onnxruntime-genai (int4) on the same prompts, in one run.

    python bench/peers/offline_peers.py [--num-prompts 64] [--batch 32] [--input-len 256] [--output-len 128]
                                        [--dtype bfloat16] [--engines tokenmill,hf,ct2,ort] [--no-install]

Weights: one GGUF (SmolLM2-135M-Instruct Q4_1 by default). tokenmill and HF transformers load it
dequantized to --dtype; the peers are converted from an HF-format export of the same weights
(transformers loads the GGUF, its ``quantization_config`` is cleared, and it is saved once to
~/.cache/tokenmill/peers/<name>-hf), then requantized by their own tools: CTranslate2's converter
to int8, onnxruntime-genai's model builder to int4 (MatMulNBits, CPU). Conversions are cached.
A peer whose package cannot be installed (pip, unless --no-install) or converted is skipped.

Workload: --num-prompts random token prompts of --input-len tokens (seeded, the same ids for every
engine), --output-len tokens each with EOS ignored, greedy. Two numbers per engine:

    decode tok/s      batch 1: (output-len - 1) / (time for output-len tokens - time for 1 token)
    batched tok/s     every prompt, in batches of --batch (the prompts have one length: no padding);
                      output tokens / wall time

Every engine runs with the torch / intra-op thread count of this machine (--threads).
Prints the table and writes JSON, markdown and a PNG under bench/results/peers/.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import numpy as np

from tokenmill.benchmark.report import fmt, markdown_table, write_json
from tokenmill.benchmark.workloads import load_tokenizer

CACHE = Path.home() / ".cache" / "tokenmill" / "peers"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "peers"
PIP_PACKAGES = {"ctranslate2": ["ctranslate2"], "onnxruntime_genai": ["onnxruntime-genai", "onnxruntime"],
                "onnx_ir": ["onnx", "onnx_ir"]}   # onnx_ir: what onnxruntime-genai's model builder needs
ENGINES = ("tokenmill", "hf", "ct2", "ort")

Generate = Callable[[list[list[int]], int], None]
"""generate(prompts, max_new_tokens): exactly max_new_tokens per prompt, EOS ignored, greedy."""


class Skip(Exception):
    """This peer cannot run here; the message says why."""


# ---------------------------------------------------------------- weights: one GGUF, exported once


def gguf_path(model: str) -> Path:
    from tokenmill.loading.sources import resolve_model

    source = resolve_model(model)
    if source.format != "gguf":
        raise SystemExit(f"{model} is not a GGUF model; the peers are converted from a GGUF's weights")
    return source.path


def export_hf(gguf: Path) -> Path:
    """The GGUF dequantized to an HF float32 checkpoint (config, safetensors, tokenizer), once."""
    out = CACHE / f"{gguf.stem}-hf"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    import transformers

    print(f"exporting {gguf.name} to HF format in {out} (once)", flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    del model.config.quantization_config       # saved as a plain float checkpoint, not "gguf-quantized"
    model.hf_quantizer = None
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def require(module: str, install: bool):
    """Import ``module``, pip-installing its packages first when allowed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if not install:
            raise Skip(f"{module} is not installed (and --no-install)") from None
    print(f"pip install {' '.join(PIP_PACKAGES[module])}", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", *PIP_PACKAGES[module]])
    if done.returncode != 0:
        raise Skip(f"pip could not install {' '.join(PIP_PACKAGES[module])}")
    importlib.invalidate_caches()
    return importlib.import_module(module)


# ---------------------------------------------------------------- engines: each returns its generate


def tokenmill_engine(args, gguf: Path, hf_dir: Path | None) -> Generate:
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(gguf), dtype=args.dtype, device="cpu", max_num_seqs=args.batch)

    def generate(prompts: list[list[int]], n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return generate


def hf_engine(args, gguf: Path, hf_dir: Path | None) -> Generate:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, args.dtype)).eval()

    def generate(prompts: list[list[int]], n: int) -> None:
        with torch.no_grad():
            out = model.generate(torch.tensor(prompts), attention_mask=torch.ones(len(prompts), len(prompts[0]),
                                 dtype=torch.long), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
        assert out.shape[1] == len(prompts[0]) + n
    return generate


def ct2_engine(args, gguf: Path, hf_dir: Path | None) -> Generate:
    ctranslate2 = require("ctranslate2", args.install)
    import transformers

    out = CACHE / f"{hf_dir.name.removesuffix('-hf')}-ct2-int8"
    if not (out / "model.bin").is_file():
        print(f"converting to CTranslate2 int8 in {out} (once)", flush=True)
        try:
            ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out), quantization="int8",
                                                                             force=True)
        except Exception as exc:  # noqa: BLE001 (any converter failure means: skip this peer)
            raise Skip(f"CTranslate2 conversion failed: {type(exc).__name__}: {exc}") from None
    generator = ctranslate2.Generator(str(out), device="cpu", compute_type="int8", intra_threads=args.threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))

    def generate(prompts: list[list[int]], n: int) -> None:
        tokens = [tokenizer.convert_ids_to_tokens(p) for p in prompts]
        results = generator.generate_batch(tokens, max_length=n, min_length=n, sampling_topk=1,
                                           include_prompt_in_result=False, max_batch_size=len(prompts))
        assert all(len(r.sequences_ids[0]) == n for r in results), [len(r.sequences_ids[0]) for r in results]
    return generate


def ort_engine(args, gguf: Path, hf_dir: Path | None) -> Generate:
    og = require("onnxruntime_genai", args.install)
    require("onnx_ir", args.install)

    out = CACHE / f"{hf_dir.name.removesuffix('-hf')}-ort-int4"
    if not (out / "genai_config.json").is_file():
        print(f"building the onnxruntime-genai int4 model in {out} (once)", flush=True)
        build = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                 "-p", "int4", "-e", "cpu", "-c", str(CACHE / "ort-build-cache")]
        if subprocess.run(build).returncode != 0:
            raise Skip("the onnxruntime-genai model builder failed (see above)")
    _set_ort_threads(out / "genai_config.json", args.threads)
    model = og.Model(str(out))

    def generate(prompts: list[list[int]], n: int) -> None:
        params = og.GeneratorParams(model)
        total = len(prompts[0]) + n
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(prompts, dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        assert all(len(generator.get_sequence(i)) == total for i in range(len(prompts)))
    return generate


def _set_ort_threads(config_path: Path, threads: int) -> None:
    config = json.loads(config_path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    if options.get("intra_op_num_threads") != threads:
        options["intra_op_num_threads"] = threads
        config_path.write_text(json.dumps(config, indent=4))


ENGINE_SETUP = {"tokenmill": (tokenmill_engine, "tokenmill LLM", "GGUF dequantized to {dtype}"),
                "hf": (hf_engine, "HF transformers", "GGUF dequantized to {dtype}"),
                "ct2": (ct2_engine, "CTranslate2", "int8, from the HF export"),
                "ort": (ort_engine, "onnxruntime-genai", "int4 MatMulNBits, from the HF export")}


# ---------------------------------------------------------------- measurement


def measure(generate: Generate, prompts: list[list[int]], args) -> dict:
    generate(prompts[:1], 2)                                   # warm-up: first-call allocations, kernels
    t1 = _timed(generate, prompts[:1], 1)
    tn = _timed(generate, prompts[:1], args.output_len)
    decode = (args.output_len - 1) / (tn - t1)
    print(f"  batch-1 decode {decode:,.1f} tok/s", flush=True)
    start = time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        generate(prompts[i:i + args.batch], args.output_len)
        print(f"  {min(i + args.batch, len(prompts))}/{len(prompts)} prompts", flush=True)
    batched_s = time.perf_counter() - start
    return {"decode_tok_s": decode, "batched_s": batched_s,
            "batched_tok_s": len(prompts) * args.output_len / batched_s}


def _timed(generate: Generate, prompts: list[list[int]], n: int) -> float:
    start = time.perf_counter()
    generate(prompts, n)
    return time.perf_counter() - start


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab, size=(n, length)).tolist()


# ---------------------------------------------------------------- report


def rows_of(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    base = next((r for r in runs if r["engine"] == "tokenmill" and "decode_tok_s" in r), None)
    header = ["engine", "weights", "batch-1 decode tok/s", "batched output tok/s", "tokenmill / engine (decode)",
              "tokenmill / engine (batched)"]
    rows = []
    for r in runs:
        if "skipped" in r:
            rows.append([r["label"], r["weights"], "skipped", r["skipped"], "-", "-"])
            continue
        ratios = [f"x{base[k] / r[k]:.2f}" if base else "-" for k in ("decode_tok_s", "batched_tok_s")]
        rows.append([r["label"], r["weights"], fmt(r["decode_tok_s"], 1), fmt(r["batched_tok_s"], 1), *ratios])
    return header, rows


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if "skipped" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    for ax, key, title in ((axes[0], "decode_tok_s", "batch-1 decode"), (axes[1], "batched_tok_s", "batched")):
        ax.barh([r["label"] for r in done], [r[key] for r in done], color=[f"C{i}" for i in range(len(done))])
        ax.set(xlabel="output tok/s", title=title)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF model name or file")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", help="tokenmill's and HF transformers' dtype")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-install", dest="install", action="store_false",
                        help="skip a peer whose package is missing instead of pip-installing it")
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}; use {','.join(ENGINES)}")

    import torch

    torch.set_num_threads(args.threads)
    gguf = gguf_path(args.model)
    hf_dir, no_export = None, ""
    if set(engines) - {"tokenmill"}:
        try:
            hf_dir = export_hf(gguf)
        except Exception as exc:  # noqa: BLE001 (then only tokenmill runs)
            no_export = f"no HF export of {gguf.name}: {type(exc).__name__}: {exc}"
            print(no_export, flush=True)
    prompts = make_prompts(args.num_prompts, args.input_len, load_tokenizer(str(gguf)).vocab_size, args.seed)
    runs = []
    for name in engines:
        setup, label, weights = ENGINE_SETUP[name]
        run = {"engine": name, "label": label, "weights": weights.format(dtype=args.dtype)}
        print(f"== {label}: {run['weights']}", flush=True)
        try:
            if name != "tokenmill" and hf_dir is None:
                raise Skip(no_export)
            run.update(measure(setup(args, gguf, hf_dir), prompts, args))
        except Skip as exc:
            print(f"  skipped: {exc}", flush=True)
            run["skipped"] = str(exc)
        except Exception as exc:  # noqa: BLE001 (one engine failing must not lose the others' numbers)
            print(f"  failed: {type(exc).__name__}: {exc}", flush=True)
            run["skipped"] = f"failed: {type(exc).__name__}: {exc}"
        runs.append(run)

    header, rows = rows_of(runs)
    table = markdown_table(header, rows)
    print(table)
    stem = RESULTS / f"offline-{datetime.now():%Y%m%d-%H%M%S}"
    write_json({"kind": "offline_peers", "args": vars(args), "gguf": str(gguf), "runs": runs}, stem.with_suffix(".json"))
    intro = (f"Offline, {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out (EOS ignored), "
             f"batch {args.batch}, {args.threads} threads, weights from `{gguf.name}`. Ratios > 1: tokenmill faster.")
    stem.with_suffix(".md").write_text(f"# Offline peers\n\n{intro}\n\n{table}\n\n![offline]({stem.name}.png)\n")
    plot(runs, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md and .png")


if __name__ == "__main__":
    main()
