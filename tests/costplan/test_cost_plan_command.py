"""``tokenmill cost plan`` end to end on a tiny random Llama: four configurations (float32 and
in-process int8 weights, speculation off and ngram), the JSON and the plot written, and every
figure in the JSON consistent with the JSON's own measurements."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tokenmill.benchmark.hardware import HardwareCeilings
from tokenmill.cli import main
from tokenmill.costplan.pareto import cheapest_meeting, pareto_frontier

CEILINGS = HardwareCeilings("cpu:test", 1e10, 1e10, 5e9, {"float32": 5e10, "bfloat16": 2e10}, "now")
PRICE, SLO_TTFT, SLO_TPOT = 2.5, 0.05, 0.002


@pytest.fixture(scope="module")
def plan_run(tiny_llama_dir, tmp_path_factory):
    """(exit status, printed text, JSON path, the JSON) of one run; the hardware ceilings are fixed, not measured."""
    out = tmp_path_factory.mktemp("cost-plan") / "plan.json"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr("tokenmill.benchmark.hardware.load_or_measure", lambda device: CEILINGS)
        status = main(["cost", "plan", "--models", str(tiny_llama_dir), "--weights", "float32,int8",
                       "--max-num-seqs", "4", "--speculative", "off,ngram", "--slo-ttft", str(SLO_TTFT),
                       "--slo-tpot", str(SLO_TPOT), "--price-per-hour", str(PRICE), "--currency", "EUR ",
                       "--num-requests", "6", "--input-len", "20:40", "--output-len", "4:8", "--device", "cpu",
                       "--kv-cache-memory", str(4 << 20), "--quality-tokens", "200", "--out", str(out),
                       "--no-progress"])
    return status, printed.getvalue(), out, json.loads(out.read_text())


def test_writes_the_table_the_json_and_the_plot(plan_run, tiny_llama_dir) -> None:
    status, printed, out, data = plan_run
    assert status == 0 and data["kind"] == "cost_plan"
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    name = tiny_llama_dir.name
    labels = [f"{name} float32 seqs=4", f"{name} float32 seqs=4 ngram", f"{name} int8 seqs=4",
              f"{name} int8 seqs=4 ngram"]
    assert [p["label"] for p in data["points"]] == labels
    assert all(label in printed for label in labels) and "EUR /1M tok" in printed
    pick = data["cheapest_meeting_slo"]
    assert (f"cheapest meeting the SLO: {pick} (EUR " in printed) if pick else ("no configuration meets" in printed)


def test_costs_follow_from_the_measured_time_and_tokens(plan_run) -> None:
    data = plan_run[-1]
    for p in data["points"]:
        hours = p["duration_s"] / 3600
        assert p["cost_per_1m_tokens"] == pytest.approx(PRICE * hours / p["output_tokens"] * 1e6)
        assert p["cost_per_1k_requests"] == pytest.approx(PRICE * hours / p["requests"] * 1e3)
        assert p["output_tok_s"] == pytest.approx(p["output_tokens"] / p["duration_s"])
        s = p["summary"]
        assert (p["output_tokens"], p["duration_s"]) == (s["total_output_tokens"], s["duration_s"])
        assert p["ttft_p90_s"] == pytest.approx(s["ttft"]["percentiles"]["p90"] / 1000)
        assert p["tpot_p90_s"] == pytest.approx(s["tpot"]["percentiles"]["p90"] / 1000)
        assert p["meets_slo"] == (p["ttft_p90_s"] <= SLO_TTFT and p["tpot_p90_s"] <= SLO_TPOT)
    # one workload: every configuration generated the same tokens for the same requests
    assert len({(p["requests"], p["output_tokens"]) for p in data["points"]}) == 1
    assert data["points"][0]["requests"] == 6 and 6 * 4 <= data["points"][0]["output_tokens"] <= 6 * 8


def test_frontier_and_pick_follow_from_the_points(plan_run) -> None:
    data = plan_run[-1]
    points = data["points"]
    tradeoffs = [(p["cost_per_1m_tokens"], p["tpot_p90_s"]) for p in points]
    assert [p["on_frontier"] for p in points] == pareto_frontier(tradeoffs)
    pick = cheapest_meeting(tradeoffs, [p["meets_slo"] for p in points])
    assert data["cheapest_meeting_slo"] == (None if pick is None else points[pick]["label"])
    assert sorted(data["frontier"]) == sorted(p["label"] for p in points if p["on_frontier"])


def test_weights_and_their_quality(plan_run) -> None:
    data = plan_run[-1]
    by_weights = {p["weights"]: p for p in data["points"]}
    assert by_weights["float32"]["loaded"]["dtype"] == "float32" and by_weights["int8"]["loaded"]["dtype"] == "bfloat16"
    assert by_weights["int8"]["loaded"]["weight_bytes"] < by_weights["float32"]["loaded"]["weight_bytes"]
    ppl = {w: {p["perplexity"] for p in data["points"] if p["weights"] == w} for w in by_weights}
    assert all(len(v) == 1 for v in ppl.values())  # one figure per weights setting, whatever the engine
    assert ppl["float32"] != ppl["int8"] and all(v > 1 for (v,) in ppl.values())
