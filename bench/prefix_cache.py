"""Prefix caching: time to first token of a request whose 1,024-token system prompt is cached
vs one whose prompt is not; and throughput at a 0% hit rate with prefix caching on vs off.

    python bench/prefix_cache.py [--system-tokens 1024] [--repeats 7]

TTFT here is engine time from add_request to the first sampled token (one request at a time).
Each cached request shares the system prompt with the one before it and has its own question;
each uncached request gets a fresh system prompt. The 0%-hit throughput runs the same unique
prompts through an engine with caching on and one with it off, alternating who goes first, after
one unmeasured run each; the figure is the median over pairs of on/off.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"


def ttft(llm: LLM, prompt: list[int]) -> float:
    engine = llm.engine
    start = time.perf_counter()
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while not request.finished:
        engine.step()
    return time.perf_counter() - start


def throughput(llm: LLM, prompts: list[list[int]], out_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return len(prompts) * out_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--throughput-requests", type=int, default=32)
    parser.add_argument("--throughput-output", type=int, default=32)
    args = parser.parse_args()

    rng = random.Random(0)
    cached_llm = LLM(args.model, dtype=args.dtype, device="cpu")
    vocab = cached_llm.model_config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    ttft(cached_llm, tokens(64))  # warm-up
    uncached, cached = [], []
    for _ in range(args.repeats):
        system = tokens(args.system_tokens)
        uncached.append(ttft(cached_llm, system + tokens(args.question_tokens)))  # fresh prefix: a miss
        cached.append(ttft(cached_llm, system + tokens(args.question_tokens)))  # same prefix: a hit
    ratio = statistics.median(cached) / statistics.median(uncached)
    print(f"TTFT uncached {1000 * statistics.median(uncached):.1f} ms, cached {1000 * statistics.median(cached):.1f} ms"
          f" (median of {args.repeats}): cached/uncached = {ratio:.3f} (1/{1 / ratio:.1f})", flush=True)

    # two fresh engines fed the same workloads, so their block pools age alike
    del cached_llm
    on_llm = LLM(args.model, dtype=args.dtype, device="cpu")
    off_llm = LLM(args.model, dtype=args.dtype, device="cpu", enable_prefix_caching=False)
    warm = [tokens(rng.randint(64, 512)) for _ in range(args.throughput_requests)]
    for llm in (on_llm, off_llm):  # first runs pay one-time costs (allocator, caches): not measured
        throughput(llm, warm, args.throughput_output)
    on_runs, off_runs = [], []
    for i in range(args.repeats):
        prompts = [tokens(rng.randint(64, 512)) for _ in range(args.throughput_requests)]  # unique: 0% hits
        pair = [(on_llm, on_runs), (off_llm, off_runs)]
        for llm, runs in pair if i % 2 == 0 else pair[::-1]:  # alternate who goes first
            runs.append(throughput(llm, prompts, args.throughput_output))
    assert sum(s.prefix_hit_tokens for s in on_llm.engine.stats) == 0, "the 0% workload hit the cache"
    on, off = statistics.median(on_runs), statistics.median(off_runs)
    # each pair ran back to back on the same prompts: the median of their ratios cancels the drift
    # of a shared machine between pairs, which the ratio of the two medians does not
    pair_ratio = statistics.median(a / b for a, b in zip(on_runs, off_runs))
    print(f"0% hit rate: caching on {on:.1f} output tok/s, off {off:.1f} (median of {args.repeats}); "
          f"on/off per pair, median = {pair_ratio:.3f} (ratio of medians {on / off:.3f})")
    result = {"model": on_llm.model_name, "dtype": args.dtype, "system_tokens": args.system_tokens,
              "ttft_uncached_s": uncached, "ttft_cached_s": cached, "ttft_ratio": ratio,
              "throughput_on": on_runs, "throughput_off": off_runs, "throughput_ratio": pair_ratio,
              "throughput_ratio_of_medians": on / off}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_cache.json").write_text(json.dumps(result, indent=2))
    _plot(result, RESULTS / "prefix_cache.png")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(["uncached", "cached"], [1000 * statistics.median(result["ttft_uncached_s"]),
                                   1000 * statistics.median(result["ttft_cached_s"])], color=["C1", "C0"])
    a.set_ylabel("TTFT ms")
    a.set_title(f"{result['system_tokens']}-token shared system prompt")
    b.bar(["caching on", "caching off"], [statistics.median(result["throughput_on"]),
                                          statistics.median(result["throughput_off"])], color=["C0", "C1"])
    b.set_ylabel("output tok/s")
    b.set_title("0% prefix-cache hit rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
