"""``tokenmill cost plan``: measure configurations on a workload, price them, find the cheapest within an SLO.

Every combination of ``--models``, ``--weights``, ``--max-num-seqs`` and ``--speculative`` runs the
offline benchmark's workload (tokenmill.costplan); the table, a JSON file and a plot of cost against
p90 TPOT come out, the cheapest configuration meeting the SLO marked.
"""

from __future__ import annotations

import argparse

from tokenmill.benchmark.offline import OfflineConfig
from tokenmill.config import LoadConfig
from tokenmill.engine.config import ENGINE_OPTIONS
from tokenmill.options import add_option_group, from_namespace, option_fields

AXES = ("max_num_seqs", "speculative_method", "seed")
"""Engine options the plan sets per configuration (the workload has its own seed)."""
DEFAULT_OUT = "bench/results/cost_plan.json"


def add_cost_parser(sub) -> None:
    from tokenmill.costplan.config import Objectives, SearchSpace

    cost = sub.add_parser("cost", help="cost planning: plan")
    actions = cost.add_subparsers(dest="cost_command", required=True)
    plan = actions.add_parser("plan", help="measure configurations on a workload, price them, and find the "
                                           "cheapest that meets a latency SLO")
    add_option_group(plan, SearchSpace)
    add_option_group(plan, Objectives)
    add_option_group(plan, OfflineConfig)
    add_option_group(plan, LoadConfig, exclude=("model", "dtype"))
    for cls in ENGINE_OPTIONS:
        add_option_group(plan, cls, exclude=AXES)
    plan.add_argument("--out", default=DEFAULT_OUT, help=f"result JSON; the plot goes beside it as .png "
                                                         f"(default: {DEFAULT_OUT})")
    plan.add_argument("--no-progress", action="store_true")


def cmd_cost(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenmill.benchmark.hardware import load_or_measure
    from tokenmill.benchmark.report import write_json
    from tokenmill.costplan.config import Objectives, SearchSpace, check_workload
    from tokenmill.costplan.measure import engine_configs, measure
    from tokenmill.costplan.plan import make_plan
    from tokenmill.costplan.report import format_plan, plot_plan
    from tokenmill.device import resolve_device

    space, objectives = from_namespace(SearchSpace, args), from_namespace(Objectives, args)
    workload = from_namespace(OfflineConfig, args)
    check_workload(workload)
    engine_options = {f.name: getattr(args, f.name) for cls in ENGINE_OPTIONS
                      for f in option_fields(cls, exclude=AXES) if hasattr(args, f.name)}
    engine_configs(space.candidates(), engine_options)  # refuse a bad option before minutes of measuring
    device = resolve_device(args.device)
    print(f"hardware ceilings of {device} (measured once, cached)...", flush=True)
    ceilings = load_or_measure(device)
    print(f"measuring {len(space.candidates())} configurations on {workload.num_requests} requests", flush=True)
    measurements = measure(space, workload, ceilings, device=args.device, cache_dir=args.cache_dir,
                           engine_options=engine_options, progress=not args.no_progress)
    plan = make_plan(measurements, objectives, space, workload, ceilings)
    print(format_plan(plan))
    path = write_json(plan.to_dict(), args.out)
    print(f"results: {path}\nplot: {plot_plan(plan, Path(path).with_suffix('.png'))}")
    return 0
