"""The plan's configs: axes parsed and checked, unknown keys and bad values refused with messages
that name them, on construction and through the command line (``error: ...``, exit status 2)."""

from __future__ import annotations

import pytest

from tokenmill.benchmark.offline import OfflineConfig
from tokenmill.cli import main
from tokenmill.costplan.config import Candidate, Objectives, PlanError, SearchSpace, check_workload
from tokenmill.costplan.measure import engine_configs
from tokenmill.errors import InvalidParameterError


def test_axes_parse_into_every_combination_grouped_by_weights() -> None:
    space = SearchSpace(models="a, b.gguf", weights="native,int8", max_num_seqs="1,8", speculative="off,ngram")
    assert space.models == ("a", "b.gguf") and space.max_num_seqs == (1, 8)
    candidates = space.candidates()
    assert len(candidates) == 16 and len({c.label for c in candidates}) == 16
    assert candidates[:4] == [Candidate("a", "native", 1, "off"), Candidate("a", "native", 1, "ngram"),
                              Candidate("a", "native", 8, "off"), Candidate("a", "native", 8, "ngram")]
    assert SearchSpace(max_num_seqs=(2, 4), weights=["int4"]) == SearchSpace(max_num_seqs="2,4", weights="int4")
    assert Candidate("dir/x.gguf", "int8", 8, "ngram").label == "x.gguf int8 seqs=8 ngram"


@pytest.mark.parametrize("kwargs, message", [
    ({"weights": "native,int3"}, "weights: unknown value(s) 'int3'; use native, float32"),
    ({"speculative": "medusa"}, "speculative: unknown value(s) 'medusa'; use off, ngram"),
    ({"max_num_seqs": "1,x"}, "max_num_seqs: '1,x' is not a list of int values"),
    ({"max_num_seqs": "0,4"}, "max_num_seqs values must be >= 1"),
    ({"max_num_seqs": "4,4"}, "max_num_seqs: 4 given more than once"),
    ({"models": ""}, "models: give one or more comma-separated values"),
    ({"quality_tokens": -1}, "quality_tokens must be 0 (off) or at least 2"),
])
def test_bad_axes_are_refused(kwargs, message) -> None:
    with pytest.raises(PlanError) as exc:
        SearchSpace(**kwargs)
    assert message in str(exc.value)


def test_unknown_keys_are_named() -> None:
    with pytest.raises(InvalidParameterError, match="SearchSpace: unknown key.*'max_seqs'"):
        SearchSpace.from_dict({"models": "a", "max_seqs": "1"})
    with pytest.raises(InvalidParameterError, match="Objectives: unknown key.*'slo_e2e'"):
        Objectives.from_dict({"slo_ttft": 1, "slo_tpot": 0.1, "price_per_hour": 1, "slo_e2e": 3})


@pytest.mark.parametrize("kwargs, message", [
    ({"slo_tpot": 0.1, "price_per_hour": 1}, "slo_ttft is required (--slo-ttft)"),
    ({"slo_ttft": 0, "slo_tpot": 0.1, "price_per_hour": 1}, "slo_ttft must be a positive number, got 0"),
    ({"slo_ttft": 1, "slo_tpot": -0.1, "price_per_hour": 1}, "slo_tpot must be a positive number"),
    ({"slo_ttft": 1, "slo_tpot": 0.1, "price_per_hour": 0}, "price_per_hour must be a positive number"),
    ({"slo_ttft": 1, "slo_tpot": 0.1, "price_per_hour": float("inf")}, "price_per_hour must be a positive number"),
])
def test_bad_objectives_are_refused(kwargs, message) -> None:
    with pytest.raises(PlanError) as exc:
        Objectives(**kwargs)
    assert message in str(exc.value)


def test_objectives_verdict_and_price() -> None:
    o = Objectives(slo_ttft=0.5, slo_tpot=0.05, price_per_hour=7.2)
    assert o.meets(0.5, 0.05) and not o.meets(0.51, 0.01) and not o.meets(0.1, 0.051)
    assert o.cost(seconds=10, count=4, per=1000) == pytest.approx(7.2 * 10 / 3600 / 4 * 1000)


def test_workload_needs_two_output_tokens_and_a_valid_arrival_process() -> None:
    with pytest.raises(PlanError, match="at least 2 tokens"):
        check_workload(OfflineConfig(output_len="1:8"))
    check_workload(OfflineConfig(output_len="2:8"))
    with pytest.raises(InvalidParameterError, match="request_rate must be > 0"):
        OfflineConfig(request_rate=0)
    with pytest.raises(InvalidParameterError, match="max_concurrency must be >= 0"):
        OfflineConfig(max_concurrency=-1)


def test_engine_configs_give_the_draft_model_only_to_the_methods_that_read_it() -> None:
    space = SearchSpace(max_num_seqs="2", speculative="off,draft")
    configs = engine_configs(space.candidates(), {"draft_model": "small.gguf"})
    off, draft = space.candidates()
    assert configs[off].speculative.draft_model is None and configs[off].scheduler.max_num_seqs == 2
    assert configs[draft].speculative.speculative_method == "draft"
    assert configs[draft].speculative.draft_model == "small.gguf"
    with pytest.raises(InvalidParameterError, match="needs draft_model"):
        engine_configs(space.candidates(), {})


@pytest.mark.parametrize("flags, message", [
    (["--slo-ttft", "0", "--slo-tpot", "0.1", "--price-per-hour", "1"], "error: slo_ttft must be a positive number"),
    (["--slo-ttft", "1", "--slo-tpot", "0.1"], "error: price_per_hour is required (--price-per-hour)"),
    (["--slo-ttft", "1", "--slo-tpot", "0.1", "--price-per-hour", "-2"], "price_per_hour must be a positive"),
    (["--slo-ttft", "1", "--slo-tpot", "0.1", "--price-per-hour", "1", "--weights", "fp4"], "unknown value(s) 'fp4'"),
    (["--slo-ttft", "1", "--slo-tpot", "0.1", "--price-per-hour", "1", "--output-len", "1"], "at least 2 tokens"),
])
def test_the_command_line_reports_bad_input_in_one_line(flags, message, capsys) -> None:
    assert main(["cost", "plan", *flags]) == 2  # refused before any model is loaded
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and "Traceback" not in err
