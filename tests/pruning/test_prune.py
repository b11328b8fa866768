"""Pruning: masks hold the requested pattern exactly, error compensation does what it claims,
structured pruning gives smaller models that tokenmill and HF transformers load with equal logits."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model_utils import prompt_logits
from tests.pruning.helpers import calibration, load_tiny, write_tiny
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.checkpoint import open_hf
from tokenmill.models.builder import build_model
from tokenmill.pruning.api import prune_model, save_pruned
from tokenmill.pruning.config import (
    MagnitudeConfig, SparseGPTConfig, StructuredConfig, WandaConfig, config_from_dict, parse_sparsity)
from tokenmill.pruning.masks import holds_pattern, prunable_parts
from tokenmill.pruning.structured import Shape, parameter_count
from tokenmill.pruning.unstructured import sparsegpt_prune

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("gemma"), "gemma3")


def test_sparsity_parsing_and_config_errors():
    assert parse_sparsity(0.5) == (0.5, None)
    assert parse_sparsity("50%") == (0.5, None)
    assert parse_sparsity("2:4") == (0.5, (2, 4))
    for bad in (0, 1.0, "4:2", "a:b", "x", 1.5):
        with pytest.raises(InvalidParameterError, match="sparsity"):
            parse_sparsity(bad)
    with pytest.raises(InvalidParameterError, match="unknown key"):
        config_from_dict({"method": "wanda", "sparsty": 0.5})
    with pytest.raises(InvalidParameterError, match="unknown pruning method"):
        config_from_dict({"method": "lottery"})
    with pytest.raises(InvalidParameterError, match="either target_params or shapes"):
        StructuredConfig()
    with pytest.raises(InvalidParameterError, match="one shot"):
        WandaConfig(sparsity="2:4", schedule_steps=3)
    assert config_from_dict(SparseGPTConfig(sparsity="2:4").to_dict()) == SparseGPTConfig(sparsity="2:4")


CONFIGS = [MagnitudeConfig(sparsity=0.5), MagnitudeConfig(sparsity=0.6, scope="global"), WandaConfig(sparsity=0.5),
           SparseGPTConfig(sparsity=0.5, block_size=48), WandaConfig(sparsity=0.3, schedule_steps=3),
           MagnitudeConfig(sparsity="2:4"), WandaConfig(sparsity="2:4"), SparseGPTConfig(sparsity="2:4")]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method}-{c.sparsity}-{getattr(c, 'scope', '')}"
                         f"{c.schedule_steps}")
def test_masks_hold_the_requested_sparsity_exactly(tiny_dir, config):
    loaded = load_tiny(tiny_dir)
    with torch.no_grad():
        loaded.model.layers[0].mlp.down.weight *= 3  # one layer of larger weights
    model, report = prune_model(loaded.model, config, calibration=calibration(), progress=False)
    parts = prunable_parts(model)
    if config.pattern is not None:
        for p in parts:  # exactly N nonzeros in every group of M (random weights have no zeros of their own)
            assert holds_pattern(p.weight, *config.pattern), p.name
            nonzero = (p.weight != 0).reshape(p.weight.shape[0], -1, config.pattern[1]).sum(-1)
            assert (nonzero == config.pattern[0]).all(), p.name
    elif getattr(config, "scope", "layer") == "global":
        total = sum(p.weight.numel() for p in parts)
        assert sum(int((p.weight == 0).sum()) for p in parts) == int(config.fraction * total)
        per_part = {p.name: float((p.weight == 0).float().mean()) for p in parts}
        assert per_part["layers.0.mlp.down"] < 0.5 * min(v for k, v in per_part.items() if k != "layers.0.mlp.down")
    elif config.method == "magnitude":
        for p in parts:
            assert int((p.weight == 0).sum()) == int(config.fraction * p.weight.numel()), p.name
    else:  # per output row
        for p in parts:
            zeros = (p.weight == 0).sum(dim=1)
            assert (zeros == int(config.fraction * p.weight.shape[1])).all(), p.name
    assert report.sparsity == pytest.approx(
        sum(int((p.weight == 0).sum()) for p in parts) / sum(p.weight.numel() for p in parts))
    assert report.params_after == report.params_before
    assert report.calibration_nll_after != report.calibration_nll_before  # measured on the pruned model


def test_schedule_keeps_earlier_zeros(tiny_dir):
    """Round by round the zero set only grows; the last round is at the requested sparsity."""
    loaded = load_tiny(tiny_dir)
    config = WandaConfig(sparsity=0.5, schedule_steps=3)
    assert [round(config.fraction_at(s), 4) for s in (1, 2, 3)] == [0.3519, 0.4815, 0.5]
    one_round = WandaConfig(sparsity=config.fraction_at(1))
    first, _ = prune_model(load_tiny(tiny_dir).model, one_round, calibration=calibration(), progress=False)
    zeros_first = {p.name: p.weight == 0 for p in prunable_parts(first)}
    model, _ = prune_model(loaded.model, config, calibration=calibration(), progress=False)
    for p in prunable_parts(model):
        assert bool((p.weight[zeros_first[p.name]] == 0).all()), p.name


def test_sparsegpt_compensates_the_error_it_makes():
    """On correlated inputs, SparseGPT's output error is well below pruning the same weights without
    the update, and below Wanda's mask: the OBS update is doing its job."""
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(48, 48, generator=g)
    x = torch.randn(2048, 48, generator=g) @ mix  # correlated inputs, as text's are
    w = torch.randn(32, 48, generator=g)
    h = x.T @ x
    for sparsity, pattern in ((0.5, None), (0.5, (2, 4))):
        pruned, keep = sparsegpt_prune(w, h, sparsity, pattern, block_size=16)
        assert bool((pruned[~keep] == 0).all())
        err_sparsegpt = (x @ (w - pruned).T).norm()
        err_mask_only = (x @ (w - w * keep).T).norm()
        norms = x.norm(dim=0)
        from tokenmill.pruning.masks import pattern_mask
        wanda_keep = pattern_mask(w.abs() * norms, sparsity, pattern)
        err_wanda = (x @ (w - w * wanda_keep).T).norm()
        assert err_sparsegpt < 0.8 * err_mask_only
        assert err_sparsegpt < 0.9 * err_wanda


def _hf_logits(path, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_structured_shapes_load_in_tokenmill_and_hf_with_equal_logits(family, tiny_dir, gemma_dir, tmp_path):
    src = tiny_dir if family == "llama" else gemma_dir
    loaded = load_tiny(src)
    cfg = loaded.config
    config = StructuredConfig(num_layers=3, num_kv_heads=cfg.num_kv_heads - 1,
                              heads_per_group=1 if family == "llama" else None, intermediate_size=96)
    model, report = prune_model(loaded.model, config, calibration=calibration(), progress=False)
    loaded.model, loaded.config = model, model.config
    out = save_pruned(loaded, report, tmp_path / "pruned")
    saved = json.loads((out / "config.json").read_text())
    assert saved["num_hidden_layers"] == 3 and saved["intermediate_size"] == 96
    assert saved["num_key_value_heads"] == cfg.num_kv_heads - 1
    assert saved["pruning_config"]["method"] == "structured"
    ids = calibration(1, 40, seed=5)[0]
    ours = build_model(open_hf(out), torch.float32, "cpu")
    expected = _hf_logits(out, ids)
    got = prompt_logits(ours, ids)
    assert (got - expected).abs().max().item() <= 1e-3
    # and the pruned model in memory is the saved one
    assert (prompt_logits(model, ids) - got).abs().max().item() <= 1e-5
    assert report.params_after["non_embedding"] == parameter_count(model.config).non_embedding
    assert sum(p.numel() for p in model.parameters()) == report.params_after["total"]
    if family == "gemma3":  # the kept layers' attention types travel with them
        assert len(saved["layer_types"]) == 3


def test_unstructured_pruned_checkpoint_keeps_its_zeros(tiny_dir, tmp_path):
    loaded = load_tiny(tiny_dir)
    model, report = prune_model(loaded.model, WandaConfig(sparsity="2:4"), calibration=calibration(), progress=False)
    out = save_pruned(loaded, report, tmp_path / "sparse")
    again = build_model(open_hf(out), torch.float32, "cpu")
    for p in prunable_parts(again):
        assert holds_pattern(p.weight, 2, 4)
    ids = calibration(1, 40, seed=5)[0]
    assert (prompt_logits(again, ids) - _hf_logits(out, ids)).abs().max().item() <= 1e-3
    assert json.loads((out / "pruning_report.json").read_text())["sparsity"] == pytest.approx(0.5)


def test_importance_keeps_what_matters(tiny_dir):
    """Keeping each layer's most important channels and heads changes the outputs less than keeping its least."""
    from tokenmill.pruning.importance import measure_importance
    from tokenmill.pruning.structured import shrink

    model = load_tiny(tiny_dir).model
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # some channels and heads that matter more than others, as trained ones do
        for block in model.layers:
            block.mlp.down.weight[:, torch.randperm(128, generator=g)[:40]] *= 6
            block.attn.o.weight[:, :32] *= 6  # the two heads of KV group 0
    samples = calibration(8, 64)
    imp = measure_importance(model, samples, progress=False)
    assert bool((imp.kv_groups(2).argmax(dim=1) == 0).all())
    assert imp.channels.shape == (4, 128) and imp.heads.shape == (4, 6) and len(imp.block_influence) == 4
    ids = calibration(1, 64, seed=9)[0]
    full = prompt_logits(model, ids)
    shape = Shape(4, 2, 2, 48)
    best = (prompt_logits(shrink(model, shape, imp), ids) - full).norm()
    flipped = type(imp)(imp.block_influence, -imp.heads, -imp.channels)
    worst = (prompt_logits(shrink(model, shape, flipped), ids) - full).norm()
    assert best < 0.8 * worst


def test_refit_columns_is_the_least_squares_fit():
    """Undamped, the refit kept columns are what least squares gives for predicting X W^T from the
    kept inputs; damped (the default) they still predict it better than the kept columns as they were."""
    from tokenmill.pruning.structured import refit_columns

    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 12, generator=g, dtype=torch.float64)
    w = torch.randn(8, 12, generator=g, dtype=torch.float64)
    keep = torch.tensor([0, 2, 3, 5, 8, 9, 11])
    exact = refit_columns(w, x.T @ x, keep, damping=0.0)
    expected = torch.linalg.lstsq(x[:, keep], x @ w.T).solution.T
    assert torch.allclose(exact, expected, atol=1e-8)

    def residual(cols):
        return (x @ w.T - x[:, keep] @ cols.T).norm().item()

    damped = refit_columns(w.float(), (x.T @ x).float(), keep)
    assert damped.dtype == torch.float32 and damped.shape == (8, 7)
    assert residual(damped.double()) < 0.7 * residual(w[:, keep])
    assert torch.equal(refit_columns(w, x.T @ x, torch.arange(12)), w)  # nothing removed: nothing moves


def test_refit_brings_the_pruned_model_closer_to_the_original(tiny_dir):
    """Channels and heads removed, the refit o and down projections leave the outputs on held-out
    text closer to the full model's than the kept columns as they were; the other tensors are the same."""
    from tokenmill.models.export import canonical_tensors
    from tokenmill.pruning.importance import measure_importance
    from tokenmill.pruning.structured import shrink

    model = load_tiny(tiny_dir).model
    text = calibration(18, 64)  # the held-out sequences: the same kind of text as the calibration's
    imp = measure_importance(model, text[:16], progress=False, moments=True)
    assert len(imp.down_moments) == 4 and imp.down_moments[0].shape == (128, 128)
    assert imp.o_moments[0].shape == (96, 96)
    plain_imp = type(imp)(imp.block_influence, imp.heads, imp.channels)
    shape = Shape(4, 2, 2, 64)
    refit, plain = shrink(model, shape, imp), shrink(model, shape, plain_imp)
    ids = text[16:]
    full = torch.cat([prompt_logits(model, s) for s in ids])
    err = [(torch.cat([prompt_logits(m, s) for s in ids]) - full).norm().item() for m in (refit, plain)]
    assert err[0] < 0.9 * err[1], err
    a, b = canonical_tensors(refit), canonical_tensors(plain)
    assert a.keys() == b.keys()
    changed = sorted({n.split(".", 2)[2] for n in a if not torch.equal(a[n], b[n])})
    assert changed == ["attn.o.weight", "mlp.down.weight"]


def test_plan_meets_the_budget_and_picks_the_lowest_loss(tiny_dir):
    model = load_tiny(tiny_dir).model
    full = parameter_count(model.config).non_embedding
    config = StructuredConfig(target_params=0.5, plan_samples=2)
    small, report = prune_model(model, config, calibration=calibration(), progress=False)
    kept = parameter_count(small.config).non_embedding
    assert 0.4 * full <= kept <= 0.5 * full
    losses = [c["calibration_nll"] for c in report.plan]
    assert len(losses) >= 2 and losses == sorted(losses)
    assert report.shape_after == report.plan[0]["shape"]
    assert len(report.sensitivity) == 4 and "block_influence" in report.sensitivity[0]
    with pytest.raises(InvalidParameterError, match="no shape over heads fits"):
        prune_model(load_tiny(tiny_dir).model, StructuredConfig(target_params=0.3, dims=("heads",)),
                    calibration=calibration(), progress=False)


def test_quantized_or_fused_modules_are_refused(tiny_dir):
    from tokenmill.quantization.api import quantize_model
    from tokenmill.quantization.config import Int8WeightOnlyConfig

    model = quantize_model(load_tiny(tiny_dir).model, Int8WeightOnlyConfig(), progress=False)
    with pytest.raises(InvalidParameterError, match="prune the float model, then quantize"):
        prune_model(model, MagnitudeConfig(), progress=False)


def test_cli_prunes_a_directory_and_the_result_serves(tiny_dir, tmp_path, capsys):
    """``tokenmill prune DIR --method structured ...`` calibrates on the corpus with the model's own
    tokenizer, writes a directory LLM() loads and generates from."""
    from tokenmill.cli import main
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    out = tmp_path / "small"
    assert main([
        "prune", str(tiny_dir), "--method", "structured", "--num-layers", "2", "--intermediate-size", "64",
        "--calibration-samples", "2", "--quality-tokens", "256", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "quality: perplexity on 256 held-out tokens" in printed and "FFN 64" in printed
    llm = LLM(str(out), dtype="float32")
    text = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(text.outputs[0].token_ids) == 4
    assert json.loads((out / "config.json").read_text())["pruning_config"]["refit"] is True
    assert main(["prune", str(tiny_dir), "--method", "structured", "--intermediate-size", "64", "--no-refit",
                 "--calibration-samples", "2", "--quality-tokens", "0", "--out", str(tmp_path / "plain")]) == 0
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["pruning_config"]["refit"] is False
    assert main(["prune", str(tiny_dir), "--method", "wanda", "--sparsity", "0.5", "--no-refit",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--refit do(es) not apply to --method wanda" in capsys.readouterr().err
    assert main(["prune", str(tiny_dir), "--method", "wanda", "--out", str(tmp_path / "x")]) == 2
    assert "needs --sparsity" in capsys.readouterr().err
    assert main(["prune", str(tiny_dir), "--method", "wanda", "--sparsity", "0.5", "--num-layers", "2",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--num-layers do(es) not apply to --method wanda" in capsys.readouterr().err


def test_the_library_verb_prunes_a_model_argument_and_saves_what_loads(tiny_dir, tmp_path):
    """``tokenmill.prune(model, config)``: a model argument (a directory here) loaded in float32,
    pruned as the config says, and ``tokenmill.pruning.save_pruned`` writes what LLM loads."""
    import tokenmill
    from tokenmill import pruning
    from tokenmill.llm import LLM

    assert tokenmill.prune is pruning.prune and pruning.WandaConfig is WandaConfig
    loaded, report = tokenmill.prune(str(tiny_dir), pruning.MagnitudeConfig(sparsity="2:4"), progress=False)
    assert report.method == "magnitude" and report.sparsity == pytest.approx(0.5)
    assert all(holds_pattern(p.weight, 2, 4) for p in prunable_parts(loaded.model))
    out = pruning.save_pruned(loaded, report, tmp_path / "sparse")
    assert json.loads((out / "config.json").read_text())["pruning"]["method"] == "magnitude"
    assert len(LLM(str(out), dtype="float32").generate([[5, 6, 7]])[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize("config, match", [
    (StructuredConfig(target_params=2), "no shape over heads, channels, layers fits 2 non-embedding parameters"),
    (StructuredConfig(target_params=1e12), "keeps the whole model"),
    (StructuredConfig(num_layers=99), "at most the model's shape"),
])
def test_a_shape_the_model_cannot_take_fails_before_calibration(tiny_dir, monkeypatch, config, match):
    """The error comes first, not after minutes of calibration (no text is needed to get it)."""
    from tokenmill.pruning import api

    monkeypatch.setattr(api, "calibration_ids", lambda *a, **k: pytest.fail("calibration ran"))
    with pytest.raises(InvalidParameterError, match=match):
        prune_model(load_tiny(tiny_dir).model, config, progress=False)


def test_a_structured_prune_quantizes_and_serves(tiny_dir, tmp_path):
    """The smaller dense directory goes on through ``quantize`` and ``serve`` as any checkpoint does:
    the int8 directory generates what the quantized model in memory picks, and the server answers
    with the same text."""
    import openai

    from tests.server.conftest import MODEL, live_server
    from tokenmill.llm import LLM
    from tokenmill.quantization import Int8WeightOnlyConfig, quantize, save_quantized
    from tokenmill.sampling_params import SamplingParams

    loaded = load_tiny(tiny_dir)
    model, report = prune_model(loaded.model, StructuredConfig(num_layers=2, num_kv_heads=2, intermediate_size=64),
                                calibration=calibration(), progress=False)
    loaded.model, loaded.config = model, model.config
    pruned = save_pruned(loaded, report, tmp_path / "pruned")
    quantized = quantize(str(pruned), Int8WeightOnlyConfig(), dtype="float32", progress=False)
    assert quantized.config.num_layers == 2 and quantized.config.num_kv_heads == 2
    out = save_quantized(quantized, tmp_path / "int8")
    prompt = "pruned, then quantized"
    ids = quantized.tokenizer.encode(prompt)
    expected: list[int] = []
    for _ in range(6):  # greedy by hand through the quantized model in memory
        expected.append(int(prompt_logits(quantized.model, ids + expected)[-1].argmax()))
    llm = LLM(str(out), dtype="float32", device="cpu", max_num_seqs=2, kv_cache_memory=2**22)
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert offline.token_ids == expected
    with live_server(llm) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == offline.text and answer.usage.completion_tokens == 6
        server.wait_idle()
