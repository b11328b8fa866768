"""Sensitivity analysis and mixed-precision plans: keep_layers in configs, models and checkpoints,
per-layer measurements against a full forward, budgets, the CLI, and one plan on real SmolLM2."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from tests.model_utils import prompt_logits
from tests.quantization.helpers import tiny_loaded, write_tiny_checkpoint
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.errors import InvalidParameterError
from tokenmill.loader import load_model
from tokenmill.paths import default_cache_dir
from tokenmill.quantization import (
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    W8A8Config,
    config_from_dict,
    quantize,
    quantize_model,
    save_quantized,
)
from tokenmill.quantization.linear import Int4Linear, Int8Linear, W8A8Linear, sqnr
from tokenmill.quantization.sensitivity import (
    LayerSensitivity,
    SensitivityReport,
    analyze_sensitivity,
    model_bytes,
    plan_keep_layers,
    planned_config,
    read_plan,
    write_plan,
)
from tokenmill.quantization.targets import quantization_targets, set_module

IDS = list(range(3, 40, 2)) * 2
KEEP = ("layers.0.attn.qkv", "layers.1.mlp.down", "lm_head")
CONFIGS = {"int4": Int4WeightOnlyConfig(group_size=32, keep_layers=KEEP), "int8": Int8WeightOnlyConfig(keep_layers=KEEP),
           "w8a8": W8A8Config(smoothing_alpha=None, keep_layers=KEEP)}
QUANTIZED_AS = {"int4": Int4Linear, "int8": Int8Linear, "w8a8": W8A8Linear}


def eval_ids(n: int = 3, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


# --------------------------------------------------------------------------- keep_layers

def test_keep_layers_serialize_as_a_list_and_read_back_as_a_tuple():
    config = Int4WeightOnlyConfig(group_size=64, keep_layers=["layers.3.mlp.down", "lm_head"])
    assert config.keep_layers == ("layers.3.mlp.down", "lm_head")
    saved = json.loads(json.dumps(config.to_dict()))
    assert saved["keep_layers"] == ["layers.3.mlp.down", "lm_head"]
    assert config_from_dict(saved) == config
    assert config_from_dict({"method": "int8"}).keep_layers == ()


@pytest.mark.parametrize("bad, match", [("lm_head", "list of module paths"), ([3], "list of module paths"),
                                        (["lm_head", "lm_head"], "lm_head more than once")])
def test_bad_keep_layers_are_refused(bad, match):
    with pytest.raises(InvalidParameterError, match=match):
        W8A8Config(smoothing_alpha=None, keep_layers=bad)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kept_layers_get_the_higher_precision_module(name, tie, tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path, tie=tie))
    reference = prompt_logits(loaded.model, IDS)
    others = [t.name for t in quantization_targets(loaded.model, CONFIGS[name]) if t.name not in KEEP]
    model = quantize_model(loaded.model, CONFIGS[name], torch.float32, progress=False)
    assert len(others) == 6 and all(isinstance(model.get_submodule(n), QUANTIZED_AS[name]) for n in others)
    for kept in ("layers.0.attn.qkv", "layers.1.mlp.down"):
        module = model.get_submodule(kept)
        if name == "int4":
            assert isinstance(module, Int8Linear)
        else:  # the float layer, in the model dtype
            assert type(module) is nn.Linear and module.weight.dtype == torch.float32
    if name == "int4":
        assert isinstance(model.lm_head, Int8Linear)
    else:  # a tied head stays the embedding matrix; an untied one its float nn.Linear
        assert model.lm_head is None if tie else type(model.lm_head) is nn.Linear
    assert sqnr(reference, prompt_logits(model, IDS)) >= 12.0


def test_unknown_keep_layers_are_named(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    config = Int4WeightOnlyConfig(keep_layers=("layers.0.mlp.up", "layers.1.attn.o", "layers.7.mlp.down"))
    with pytest.raises(InvalidParameterError, match=r"unknown layer\(s\) layers.0.mlp.up, layers.7.mlp.down; .*"
                                                    r"layers.0.attn.qkv, .*blocks 0 to 1\), lm_head"):
        quantize_model(loaded.model, config, progress=False)
    with pytest.raises(InvalidParameterError, match="lm_head; .*the LM head is not quantized"):
        quantize_model(loaded.model, Int8WeightOnlyConfig(quantize_lm_head=False, keep_layers=["lm_head"]),
                       progress=False)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mixed_checkpoint_loads_with_identical_outputs(name, dtype, tie, tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", tie=tie, bias=name == "int8")
    loaded = quantize(str(src), CONFIGS[name], dtype=dtype, progress=False)
    before = prompt_logits(loaded.model, IDS)
    out = save_quantized(loaded, tmp_path / "q")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["keep_layers"] == list(KEEP)
    reloaded = load_model(out, dtype, "cpu").model
    assert reloaded.quantization_config == CONFIGS[name].resolved(has_calibration=True)
    assert [type(m) for m in reloaded.modules()] == [type(m) for m in loaded.model.modules()]
    assert torch.equal(prompt_logits(reloaded, IDS), before)


# --------------------------------------------------------------------------- the analysis

@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    config = Int4WeightOnlyConfig(group_size=32)
    return loaded.model, config, analyze_sensitivity(loaded.model, config, eval_ids(), torch.float32, progress=False)


def full_forward_nll(model, ids: list[list[int]]) -> float:
    runner = ModelRunner.for_sequences(model, max(len(s) for s in ids))
    total = sum(torch.nn.functional.cross_entropy(model.compute_logits(runner.hidden(s)[:-1]), torch.tensor(s[1:]),
                                                  reduction="sum").item() for s in ids)
    return total / sum(len(s) - 1 for s in ids)


def test_analysis_measures_each_layer_alone(tiny_report):
    model, config, report = tiny_report
    assert [layer.name for layer in report.layers] == [t.name for t in quantization_targets(model, config)]
    assert report.tokens == 3 * 47 and report.config == config.resolved(has_calibration=False)  # a bare model
    assert getattr(model, "quantization_config", None) is None  # the analysed model is left as it was
    assert report.reference_nll == pytest.approx(full_forward_nll(model, eval_ids()), abs=1e-6)
    quantized = quantize_model(copy.deepcopy(model), config, torch.float32, progress=False)
    assert report.quantized_nll == pytest.approx(full_forward_nll(quantized, eval_ids()), abs=1e-6)
    by_name = {layer.name: layer for layer in report.layers}
    for name in ("layers.0.mlp.down", "layers.1.attn.qkv", "lm_head"):  # delta NLL against a whole forward
        alone = copy.deepcopy(model)
        set_module(alone, name, quantized.lm_head if name == "lm_head" else quantized.get_submodule(name))
        expected = full_forward_nll(alone, eval_ids()) - report.reference_nll
        assert by_name[name].delta_nll == pytest.approx(expected, abs=1e-5), name
    down = by_name["layers.0.mlp.down"]
    w = model.get_submodule("layers.0.mlp.down").weight
    assert down.weight_sqnr == pytest.approx(sqnr(w, quantized.get_submodule("layers.0.mlp.down").dequantize()))
    assert 15 < down.output_sqnr < 40 and down.quantized_as == "Int4Linear" and down.kept_as == "Int8Linear"
    assert by_name["lm_head"].quantized_as == by_name["lm_head"].kept_as == "Int8Linear"  # lm_head_int8
    assert report.quantized_model_bytes == model_bytes(quantized) < report.reference_model_bytes


def test_smoothed_w8a8_is_refused(tiny_report):
    model = tiny_report[0]
    with pytest.raises(InvalidParameterError, match="smoothing_alpha"):
        analyze_sensitivity(model, W8A8Config(smoothing_alpha=0.5), eval_ids(), torch.float32, progress=False,
                            calibration=eval_ids())


# --------------------------------------------------------------------------- plans

def layer(name: str, delta: float, extra: int, kept_as: str = "Int8Linear") -> LayerSensitivity:
    return LayerSensitivity(name, 20.0, 20.0, delta, "Int4Linear", kept_as, 100, 100 + extra)


SYNTHETIC = SensitivityReport(Int4WeightOnlyConfig(), "bfloat16", 1000, 3.0, 3.181, 10_000, 40_000, (
    layer("a", 0.05, 100), layer("b", 0.04, 10), layer("c", 0.001, 10), layer("d", -0.01, 10),
    layer("head", 0.1, 0, kept_as="Int4Linear")))  # total delta 0.181 nats: +19.8%


@pytest.mark.parametrize("budget, keep", [
    ({"max_ppl_increase": 0.12}, ("b", "a")),  # b (0.004 nats/byte) then a; c not needed
    ({"max_ppl_increase": 0.0}, ("b", "a", "c")),  # everything that helps; d (harmless) and head (cannot) stay
    ({"max_bytes": 10_015}, ("b",)),  # a does not fit; c would overflow after b
    ({"max_bytes": 10_120}, ("b", "a", "c")),
    ({"max_bytes": 10_110}, ("b", "a")),  # c would overflow after a
    ({"max_bytes": 10_105}, ("b", "c"))])  # a does not fit after b; c still does
def test_plan_keeps_the_most_harmful_layers_per_byte(budget, keep):
    plan = plan_keep_layers(SYNTHETIC, **budget)
    assert plan.keep_layers == keep
    assert plan.estimated_bytes == 10_000 + sum({"a": 100, "b": 10, "c": 10}[n] for n in keep)
    remaining = 0.181 - sum({"a": 0.05, "b": 0.04, "c": 0.001}[n] for n in keep)
    assert plan.estimated_ppl_change == pytest.approx(torch.tensor(remaining).double().exp().item() - 1)
    assert plan.meets_budget == (budget.get("max_ppl_increase", 1.0) >= plan.estimated_ppl_change)


def test_perplexity_budget_is_judged_against_the_measured_whole():
    compounding = dataclasses.replace(SYNTHETIC, quantized_nll=3.0 + 2 * 0.181)  # together: twice the sum
    assert compounding.interaction == pytest.approx(2.0)
    plan = plan_keep_layers(compounding, max_ppl_increase=0.12)
    assert plan.keep_layers == ("b", "a", "c") and not plan.meets_budget  # 2 x 0.09 nats of d and head remain
    assert plan.estimated_ppl_change == pytest.approx(math.expm1(2 * 0.09))


@pytest.mark.parametrize("budget, match", [({}, "exactly one budget"),
                                           ({"max_ppl_increase": 0.1, "max_bytes": 20_000}, "exactly one budget"),
                                           ({"max_bytes": 9_999}, "below the fully quantized model's 10000 bytes"),
                                           ({"max_ppl_increase": -0.1}, ">= 0")])
def test_bad_budgets_are_refused(budget, match):
    with pytest.raises(InvalidParameterError, match=match):
        plan_keep_layers(SYNTHETIC, **budget)


def test_planned_model_fits_its_size_budget(tiny_report, tmp_path):
    model, _, report = tiny_report
    extras = sorted(layer.extra_bytes for layer in report.layers if layer.can_keep and layer.delta_nll > 0)
    budget = report.quantized_model_bytes + sum(extras) // 2
    plan = plan_keep_layers(report, max_bytes=budget)
    assert plan.keep_layers and plan.estimated_bytes <= budget
    planned = quantize_model(copy.deepcopy(model), planned_config(report, plan), torch.float32, progress=False)
    assert model_bytes(planned) == plan.estimated_bytes
    path = write_plan(tmp_path / "plan.json", report, plan)
    assert read_plan(path) == planned_config(report, plan)
    assert SensitivityReport.from_dict(json.loads(path.read_text())["analysis"]) == report


def test_perplexity_plan_meets_its_estimate(tiny_report):
    model, _, report = tiny_report
    full = plan_keep_layers(report, max_ppl_increase=1e9)
    assert full.keep_layers == () and full.estimated_bytes == report.quantized_model_bytes
    target = full.estimated_ppl_change / 2
    plan = plan_keep_layers(report, max_ppl_increase=target)
    assert plan.keep_layers and plan.meets_budget and plan.estimated_ppl_change <= target
    worst = max((layer for layer in report.layers if layer.can_keep), key=lambda x: x.delta_nll / x.extra_bytes)
    assert plan.keep_layers[0] == worst.name


# --------------------------------------------------------------------------- the command line

def test_cli_plans_then_applies_the_plan(tmp_path, capsys):
    from tokenmill.cli import main

    src = write_tiny_checkpoint(tmp_path / "src")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    common = ["--method", "int4", "--group-size", "32", "--dtype", "float32"]
    assert main(["quantize", str(src), *common, "--sensitivity", "--size-budget-mb", "0.16", "--eval-tokens", "128",
                 "--eval-data", str(text), "--out", str(tmp_path / "q")]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((tmp_path / "q" / "quantization_plan.json").read_text())
    keep = plan["quantization_config"]["keep_layers"]
    assert keep and plan["estimated_bytes"] <= 160_000 and "layers.1.mlp.down" in printed and "plan: keep" in printed
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved == plan["quantization_config"]
    assert main(["quantize", str(src), *common, "--plan", str(tmp_path / "q" / "quantization_plan.json"),
                 "--out", str(tmp_path / "q2")]) == 0
    assert json.loads((tmp_path / "q2" / "config.json").read_text())["quantization_config"]["keep_layers"] == keep
    assert main(["quantize", str(src), *common, "--keep-layers", "layers.0.attn.o, lm_head", "--out",
                 str(tmp_path / "q3")]) == 0
    assert json.loads((tmp_path / "q3" / "config.json").read_text())["quantization_config"]["keep_layers"] == [
        "layers.0.attn.o", "lm_head"]
    capsys.readouterr()
    assert main(["quantize", str(src), "--method", "int4", "--group-size", "64", "--plan",
                 str(tmp_path / "q" / "quantization_plan.json"), "--out", str(tmp_path / "q4")]) == 2
    assert "planned for other options (group_size: 32); this command has group_size: 64" in capsys.readouterr().err
    assert main(["quantize", str(src), *common, "--keep-layers", "layers.9.attn.o", "--out", str(tmp_path / "q5")]) == 2
    assert main(["quantize", str(src), *common, "--sensitivity", "--out", str(tmp_path / "q6")]) == 2
    assert "needs a budget" in capsys.readouterr().err


# --------------------------------------------------------------------------- real SmolLM2

SMOLLM2_GGUF = default_cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.real_model
@pytest.mark.skipif(not SMOLLM2_GGUF.exists(), reason="SmolLM2 GGUF not in the cache")
def test_smollm2_plan_beats_plain_int4_g64():
    from tokenmill.eval.corpus import read_tokens
    from tokenmill.eval.corpus import fetch_corpus
    from tokenmill.eval.perplexity import perplexity
    from tokenmill.quantization.sensitivity import sensitivity_ids

    loaded = load_model("smollm2-135m-instruct", torch.float32, "cpu")
    config = Int4WeightOnlyConfig(group_size=64, range_search=False)  # min-max rounding: quantizes in seconds
    report = analyze_sensitivity(loaded.model, config, sensitivity_ids(loaded.tokenizer, 256), torch.bfloat16,
                                 progress=False, tokenizer=loaded.tokenizer)
    plan = plan_keep_layers(report, max_bytes=report.quantized_model_bytes + 2_000_000)
    assert 2 <= len(plan.keep_layers) < 20
    ids = read_tokens(loaded.tokenizer, fetch_corpus(), 2048)  # the start of the corpus: not the analysed slice

    def ppl(cfg) -> float:
        model = quantize_model(copy.deepcopy(loaded.model), cfg, torch.bfloat16, progress=False)
        return perplexity(model, ids, context=512, stride=256, progress=False).perplexity

    planned, plain = ppl(planned_config(report, plan)), ppl(config)
    print(f"\nperplexity: {len(plan.keep_layers)} layers kept {planned:.2f}, plain int4 g64 {plain:.2f}")
    assert planned < plain
