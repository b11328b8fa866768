"""``tokenmill cost plan``: which configuration serves a workload within an SLO at the lowest cost.

    config.py   what to measure (SearchSpace: models x weights x max_num_seqs x speculation) and
                what to ask of it (Objectives: p90 TTFT and TPOT objectives, the machine's price)
    measure.py  every configuration through the offline benchmark, each weights setting loaded once
    pareto.py   dominance, the cost-latency frontier, the cheapest point meeting the SLO
    plan.py     measurements priced (per 1M output tokens, per 1k requests) into a CostPlan
    report.py   the table, the verdict and the plot
"""
