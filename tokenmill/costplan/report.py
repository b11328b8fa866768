"""A cost plan as a table, a verdict line and a plot of cost against p90 TPOT."""

from __future__ import annotations

from pathlib import Path

from tokenmill.benchmark.report import fmt, grid, save_figure
from tokenmill.costplan.plan import CostPlan, PlanPoint
from tokenmill.errors import InvalidParameterError


def format_plan(plan: CostPlan) -> str:
    """One row per configuration, cheapest first, then the pick (or why there is none)."""
    cur = plan.objectives.currency
    quality = any(p.perplexity is not None for p in plan.points)
    header = ["config", "tok/s", "p90 TTFT ms", "p90 TPOT ms", f"{cur}/1M tok", f"{cur}/1k req",
              *(["perplexity"] if quality else []), "SLO", "frontier"]
    order = sorted(range(len(plan.points)), key=lambda i: plan.points[i].tradeoff)
    rows = [_row(plan.points[i], quality, i == plan.cheapest) for i in order]
    o = plan.objectives
    title = (f" Cost plan: p90 TTFT <= {fmt(o.slo_ttft * 1000, 0)} ms, p90 TPOT <= {fmt(o.slo_tpot * 1000, 1)} ms, "
             f"{cur}{o.price_per_hour:g}/h ")
    return grid(header, rows, title) + "\n" + verdict(plan)


def _row(p: PlanPoint, quality: bool, pick: bool) -> list[str]:
    ppl = [fmt(p.perplexity, 3)] if quality else []
    return [("> " if pick else "  ") + p.candidate.label, fmt(p.output_tok_s, 1), fmt(p.ttft_p90_s * 1000, 1),
            fmt(p.tpot_p90_s * 1000, 1), fmt(p.cost_per_1m_tokens, 4), fmt(p.cost_per_1k_requests, 4), *ppl,
            "yes" if p.meets_slo else "no", "*" if p.on_frontier else ""]


def verdict(plan: CostPlan) -> str:
    """The cheapest configuration that meets the SLO, or the fact that none does."""
    if plan.cheapest is None:
        return "no configuration meets the SLO: relax it, or add weights, max_num_seqs or models to the plan"
    p, cur = plan.points[plan.cheapest], plan.objectives.currency
    return (f"cheapest meeting the SLO: {p.candidate.label} ({cur}{fmt(p.cost_per_1m_tokens, 4)} per 1M output tokens, "
            f"{cur}{fmt(p.cost_per_1k_requests, 4)} per 1k requests)")


def plot_plan(plan: CostPlan, path: str | Path) -> Path:
    """Cost per 1M output tokens against p90 TPOT: every configuration (filled if it meets the SLO),
    the frontier as a staircase, the TPOT objective as a vertical line, the pick starred."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    _draw_points(ax, plan)
    _draw_frontier_and_pick(ax, plan)
    o = plan.objectives
    ax.set(xlabel="p90 time per output token (ms)", ylabel=f"{o.currency} per 1M output tokens", title=_title(plan))
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def _draw_points(ax, plan: CostPlan) -> None:
    """Each configuration, named by its setting alone when the plan has one model."""
    one_model = len(plan.space.models) == 1
    for p in plan.points:
        x, y = p.tpot_p90_s * 1000, p.cost_per_1m_tokens
        ax.scatter([x], [y], s=40, zorder=3, color="tab:green" if p.meets_slo else "white",
                   edgecolors="tab:green" if p.meets_slo else "tab:red")
        ax.annotate(p.candidate.setting if one_model else p.candidate.label, (x, y), textcoords="offset points",
                    xytext=(5, 4), fontsize=7)
    ax.scatter([], [], color="tab:green", label="meets the SLO")
    ax.scatter([], [], color="white", edgecolors="tab:red", label="misses it")
    costs = [p.cost_per_1m_tokens for p in plan.points]
    if max(costs) > 10 * min(costs):
        ax.set_yscale("log")


def _draw_frontier_and_pick(ax, plan: CostPlan) -> None:
    frontier = sorted(plan.frontier, key=lambda p: p.tpot_p90_s)
    ax.step([p.tpot_p90_s * 1000 for p in frontier], [p.cost_per_1m_tokens for p in frontier], where="post",
            color="tab:blue", label="Pareto frontier")
    ax.axvline(plan.objectives.slo_tpot * 1000, color="tab:gray", linestyle="--", label="p90 TPOT objective")
    if plan.cheapest is not None:
        pick = plan.points[plan.cheapest]
        ax.scatter([pick.tpot_p90_s * 1000], [pick.cost_per_1m_tokens], marker="*", s=260, color="gold",
                   edgecolors="black", zorder=4, label="cheapest meeting the SLO")


def _title(plan: CostPlan) -> str:
    o, models = plan.objectives, plan.space.models
    return (f"{Path(models[0]).name + ': ' if len(models) == 1 else ''}cost vs latency, SLO p90 TTFT <= "
            f"{fmt(o.slo_ttft * 1000, 0)} ms and p90 TPOT <= {fmt(o.slo_tpot * 1000, 1)} ms, machine at "
            f"{o.currency}{o.price_per_hour:g}/h")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InvalidParameterError("the cost plan's plot needs matplotlib: pip install 'tokenmill[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
