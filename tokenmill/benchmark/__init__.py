"""``tokenmill bench``: serving and engine benchmarks.

    workloads.py  what to send (token-exact random prompts, shared prefixes, multi-turn, JSONL)
    arrivals.py   when (gamma/Poisson at a rate, seeded)
    client.py     how (streaming OpenAI-compatible client) -> one RequestRecord per request
    metrics.py    what it means (TTFT, TPOT, ITL, E2E, throughput, goodput: vLLM's definitions)
    runner.py     serve benchmark; sweep.py rising loads; compare.py ratios and regressions
    offline.py    the engine alone; hardware.py ceilings, MBU / MFU, roofline
    prometheus.py the server's own histograms beside the client's; report.py tables and JSON
    commands.py   the CLI subcommands
"""
