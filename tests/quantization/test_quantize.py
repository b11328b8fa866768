"""quantize() on tiny random models: which layers are swapped, output SQNR against the float
model, and save -> load (LLM(dir) included) giving identical outputs."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model_utils import prompt_logits
from tests.quantization.helpers import small_config, tiny_loaded, write_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.hf_config import hf_model_config
from tokenmill.loader import load_model
from tokenmill.quantization import (
    Int4GPTQConfig,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    quantize,
    quantize_model,
    save_quantized,
)
from tokenmill.quantization.checkpoint import hf_config_dict
from tokenmill.quantization.linear import Int4Linear, Int8Linear, sqnr

IDS = list(range(3, 40, 2)) * 2
CONFIGS = {"int8": Int8WeightOnlyConfig(), "int4-g32": Int4WeightOnlyConfig(group_size=32),
           "int4-g64-int4head": Int4WeightOnlyConfig(group_size=64, lm_head_int8=False)}
# logits SQNR (dB) of the quantized tiny model against its float self
LOGIT_SQNR = {"int8": 30.0, "int4-g32": 12.0, "int4-g64-int4head": 10.0}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quantized_logits_stay_close(name, tie, tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path, tie=tie))
    reference = prompt_logits(loaded.model, IDS)
    quantize_model(loaded.model, CONFIGS[name], torch.float32, progress=False)
    model = loaded.model
    assert isinstance(model.layers[0].attn.qkv, (Int8Linear, Int4Linear))
    assert isinstance(model.layers[1].mlp.gate_up, (Int8Linear, Int4Linear))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    head_int8 = name == "int8" or CONFIGS[name].lm_head_int8
    assert isinstance(model.lm_head, Int8Linear if head_int8 else Int4Linear)
    assert sqnr(reference, prompt_logits(model, IDS)) >= LOGIT_SQNR[name]


def test_lm_head_can_stay_float(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path, tie=True))
    quantize_model(loaded.model, Int8WeightOnlyConfig(quantize_lm_head=False), progress=False)
    assert loaded.model.lm_head is None


def test_qkv_bias_is_kept(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path, bias=True))
    reference = prompt_logits(loaded.model, IDS)
    quantize_model(loaded.model, Int8WeightOnlyConfig(), progress=False)
    assert loaded.model.layers[0].attn.qkv.bias is not None
    assert sqnr(reference, prompt_logits(loaded.model, IDS)) >= LOGIT_SQNR["int8"]


def test_quantizing_twice_is_refused(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    quantize_model(loaded.model, Int8WeightOnlyConfig(), progress=False)
    with pytest.raises(InvalidParameterError, match="already quantized"):
        quantize_model(loaded.model, Int8WeightOnlyConfig(), progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_then_load_gives_identical_outputs(name, dtype, tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", bias=name == "int8")
    loaded = quantize(str(src), CONFIGS[name], dtype=dtype, progress=False)
    before = prompt_logits(loaded.model, IDS)
    out = save_quantized(loaded, tmp_path / "q")
    saved = json.loads((out / "config.json").read_text())
    done = CONFIGS[name].resolved(has_calibration=True)  # a named model brings its tokenizer
    assert saved["quantization_config"] == done.to_dict()
    reloaded = load_model(out, dtype, "cpu")
    assert reloaded.model.quantization_config == done
    assert reloaded.model.embed.weight.dtype == dtype
    assert torch.equal(prompt_logits(reloaded.model, IDS), before)
    assert reloaded.tokenizer.encode("hello world") == loaded.tokenizer.encode("hello world")
    assert reloaded.tokenizer.stop_token_ids == loaded.tokenizer.stop_token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_dtype_computes_in_the_dtype_it_was_quantized_for(dtype, tmp_path):
    """``tokenmill serve DIR`` (dtype auto) on CPU runs a directory quantized for bfloat16 with
    bfloat16 activations, as ``quantize`` made it, not in float32 (twice the bytes per token)."""
    src = write_tiny_checkpoint(tmp_path / "src")
    out = save_quantized(quantize(str(src), Int4WeightOnlyConfig(group_size=32), dtype=dtype, progress=False),
                         tmp_path / "q")
    assert load_model(out, "auto", "cpu").model.embed.weight.dtype == dtype
    assert load_model(out, torch.float32, "cpu").model.embed.weight.dtype == torch.float32  # explicit wins


def test_a_loaded_quantized_model_saves_again(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src")
    save_quantized(quantize(str(src), Int4WeightOnlyConfig(group_size=32), dtype="float32", progress=False),
                   tmp_path / "q1")
    first = load_model(tmp_path / "q1", torch.float32, "cpu")
    save_quantized(first, tmp_path / "q2")
    second = load_model(tmp_path / "q2", torch.float32, "cpu")
    assert torch.equal(prompt_logits(second.model, IDS), prompt_logits(first.model, IDS))


def test_llm_generates_from_a_quantized_directory(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src")
    loaded = quantize(str(src), Int4WeightOnlyConfig(group_size=32), dtype="float32", progress=False)
    out = save_quantized(loaded, tmp_path / "q")
    ids = IDS[:8]
    expected = []
    for _ in range(6):  # greedy continuation by hand, through the in-memory quantized model
        expected.append(int(prompt_logits(loaded.model, ids + expected)[-1].argmax()))
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory=2**22)
    result = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert result[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("overrides", [
    {}, {"tie_word_embeddings": False}, {"attention_bias": True}, {"qk_norm": True},
    {"sliding_window": 32, "layer_types": ("sliding", "sliding")},
    {"architecture": "gemma3", "qk_norm": True, "hidden_act": "gelu_tanh", "sliding_window": 16,
     "layer_types": ("sliding", "full"), "rope_local_theta": 10000.0, "rope_theta": 1e6,
     "query_pre_attn_scalar": 16.0}])
def test_hf_config_dict_reads_back(overrides):
    cfg = small_config(**overrides)
    assert hf_model_config(hf_config_dict(cfg)) == cfg


def test_cli_quantize_then_eval(tmp_path, capsys):
    from tokenmill.cli import main

    src = write_tiny_checkpoint(tmp_path / "src")
    assert main(["quantize", str(src), "--method", "int4", "--group-size", "32", "--out", str(tmp_path / "q"),
                 "--dtype", "float32"]) == 0
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    assert main(["eval", "perplexity", str(tmp_path / "q"), "--data", str(text), "--max-tokens", "300",
                 "--context", "128", "--stride", "64", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("perplexity: ") and float(lines[-2].split()[1]) > 1.0
    assert lines[-1] == "tokens: 299"


@pytest.mark.parametrize("args,expected", [
    (["--method", "int4", "--no-range-search"], {"range_search": False, "activation_weighted": False}),
    (["--method", "int4", "--calibration-samples", "2"], {"range_search": True, "activation_weighted": True}),
    (["--method", "int4", "--no-activation-weighted"], {"activation_weighted": False}),
    (["--method", "int4-gptq", "--no-act-order", "--calibration-samples", "2"], {"act_order": False}),
    (["--method", "w8a8", "--smoothing-alpha", "none"], {"smoothing_alpha": None}),
    (["--method", "w8a8", "--activation", "static", "--calibration-samples", "2"], {"smoothing_alpha": 0.85}),
])
def test_cli_method_options_reach_the_saved_config(tmp_path, args, expected):
    import json

    from tokenmill.cli import main

    src = write_tiny_checkpoint(tmp_path / "src")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    from tokenmill.eval import corpus

    with pytest.MonkeyPatch.context() as mp:  # calibration text: a local file instead of the corpus
        mp.setattr(corpus, "fetch_corpus", lambda cache_dir=None: text)
        assert main(["quantize", str(src), *args, "--out", str(tmp_path / "q"), "--dtype", "float32"]) == 0
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert {k: saved[k] for k in expected} == expected


def test_cli_rejects_a_bad_smoothing_alpha(tmp_path, capsys):
    from tokenmill.cli import main

    src = write_tiny_checkpoint(tmp_path / "src")
    assert main(["quantize", str(src), "--method", "w8a8", "--smoothing-alpha", "lots", "--out", str(tmp_path / "q")]) == 2
    assert "--smoothing-alpha" in capsys.readouterr().err


def test_cli_quantize_ends_with_the_quality_line(tmp_path, capsys):
    """Every quantize run ends with perplexity before and after on held-out text (the start of
    --eval-data here, of the corpus by default); no warning within the budget."""
    from tokenmill.cli import main

    src = write_tiny_checkpoint(tmp_path / "src")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["quantize", str(src), "--method", "int8", "--out", str(tmp_path / "q"), "--dtype", "float32",
                 "--eval-data", str(text), "--quality-tokens", "200", "--quality-budget", "5"]) == 0
    out, err = capsys.readouterr()
    line = out.strip().splitlines()[-1]
    assert line.startswith("quality: perplexity on 200 held-out tokens ") and "(int8, float32)" in line, line
    before, after = float(line.split(" tokens ")[1].split()[0]), float(line.split("-> ")[1].split()[0])
    assert before > 1 and after > 1 and "budget +500%" in line
    assert "warning" not in err


@pytest.mark.parametrize("after,warns", [(10.5, False), (11.0, True)])
def test_quality_check_warns_above_its_budget(monkeypatch, capsys, after, warns):
    import argparse

    from tokenmill.commands.quantize import QualityCheck
    from tokenmill.quantization.config import Int4WeightOnlyConfig

    figures = iter([10.0, after])
    monkeypatch.setattr(QualityCheck, "_perplexity", lambda self, model: next(figures))
    check = QualityCheck.__new__(QualityCheck)
    check.budget, check.ids, check.before = 0.08, list(range(64)), check._perplexity(None)
    loaded = argparse.Namespace(model=torch.nn.Module())
    loaded.model.embed = torch.nn.Embedding(2, 2).to(torch.bfloat16)
    change = check.report(loaded, Int4WeightOnlyConfig())
    out, err = capsys.readouterr()
    assert change == pytest.approx(after / 10.0 - 1)
    assert f"10.000 (float32 source) -> {after:.3f} (int4, bfloat16): {change:+.2%} (budget +8%)" in out
    assert ("warning: quantizing raised perplexity by" in err) == warns


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(activation_weighted=True, num_samples=2, seq_len=32),
                                    Int4GPTQConfig(num_samples=2, seq_len=32)], ids=["int4 weighted", "int4-gptq"])
def test_calibrating_in_bfloat16_quantizes_the_float32_weights(config, tmp_path, monkeypatch):
    """The calibrating methods run the model in the compute dtype, but quantize the source's float32
    weights, not their bfloat16 cast (which would round them twice)."""
    from tokenmill.quantization import gptq, handlers

    seen = []
    for module, name in ((handlers.Int4Linear, "from_float"), (gptq, "gptq_quantize")):
        original = getattr(module, name)

        def record(weight, *args, _original=original, **kwargs):
            seen.append(weight.dtype)
            return _original(weight, *args, **kwargs)
        monkeypatch.setattr(module, name, record)
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    assert loaded.model.embed.weight.dtype == torch.float32
    calibration = [list(range(5, 37)), list(range(40, 72))]
    quantize_model(loaded.model, config, torch.bfloat16, progress=False, calibration=calibration)
    assert seen and set(seen) == {torch.float32}
    assert loaded.model.embed.weight.dtype == torch.bfloat16
