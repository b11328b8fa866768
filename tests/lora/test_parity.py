"""Outputs with a LoRA adapter equal HF transformers + PEFT with the adapter merged (float32, 1e-3),
alone and mixed in one batch with other adapters and the base model."""

from __future__ import annotations

import pytest
import torch

from tokenmill.loading.checkpoint import open_hf
from tokenmill.lora.adapter import load_adapter
from tokenmill.lora.slots import LoRASlots
from tokenmill.models.builder import build_model
from tests.lora.helpers import hf_logits, lora_logits, merged_logits, random_adapter, tiny_hf_model

IDS = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("variant", [
    dict(r=8, alpha=16),
    dict(r=4, alpha=8, use_rslora=True),
    dict(r=8, alpha=16, targets=["q_proj", "v_proj"]),
    dict(r=8, alpha=16, rank_pattern={"down_proj": 4}, alpha_pattern={"layers.1.self_attn.o_proj": 3}),
], ids=["all-seven", "rslora", "q-v-only", "rank-alpha-patterns"])
def test_adapter_logits_match_peft_merged(family, variant, tmp_path):
    base = tiny_hf_model(family, tmp_path / "base")
    peft_model = random_adapter(base, tmp_path / "adapter", seed=3, **variant)
    expected = merged_logits(peft_model, IDS)
    assert (expected - hf_logits(base, IDS)).abs().max() > 0.05  # the adapter changes the output

    ours = build_model(open_hf(tmp_path / "base"), torch.float32, "cpu")
    adapter = load_adapter("a", tmp_path / "adapter", ours.config)
    slots = LoRASlots(ours.config, 2, 16, torch.float32, "cpu")
    slots.assign(1, adapter)
    got = lora_logits(ours, slots, [IDS], [1])[0]
    assert (got - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_mixed_batch_gives_each_request_what_it_gets_alone(family, tmp_path):
    """8 adapters and the base in one forward pass (float32): each sequence's logits equal those of
    the same sequence run alone with its adapter, and match PEFT merged."""
    base = tiny_hf_model(family, tmp_path / "base")
    ours = build_model(open_hf(tmp_path / "base"), torch.float32, "cpu")
    slots = LoRASlots(ours.config, 8, 16, torch.float32, "cpu")
    peft_models = []
    for i in range(8):
        peft_models.append(random_adapter(base, tmp_path / f"a{i}", seed=10 + i, r=4 + 2 * (i % 3)))
        slots.assign(i, load_adapter(f"a{i}", tmp_path / f"a{i}", ours.config))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (5 + 3 * i,), generator=gen).tolist() for i in range(9)]
    order = [-1, 0, 1, 2, 3, 4, 5, 6, 7]
    together = lora_logits(ours, slots, prompts, order)
    for ids, slot, logits in zip(prompts, order, together):
        alone = lora_logits(ours, slots, [ids], [slot])[0]
        torch.testing.assert_close(logits, alone, rtol=0, atol=1e-5)
        expected = hf_logits(base, ids) if slot < 0 else merged_logits(peft_models[slot], ids)
        assert (logits - expected).abs().max().item() <= 1e-3


def test_base_projection_runs_once_per_step_for_a_mixed_batch(tmp_path):
    """The base GEMM of each projection runs once over the whole mixed batch; adapters add their
    low-rank update to its output."""
    base = tiny_hf_model("llama", tmp_path / "base")
    ours = build_model(open_hf(tmp_path / "base"), torch.float32, "cpu")
    slots = LoRASlots(ours.config, 3, 8, torch.float32, "cpu")
    for i in range(3):
        random_adapter(base, tmp_path / f"a{i}", seed=i)
        slots.assign(i, load_adapter(f"a{i}", tmp_path / f"a{i}", ours.config))
    calls: dict[str, list[int]] = {}
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: calls.setdefault(name, []).append(
        args[0].shape[0])) for name, module in ours.named_modules() if isinstance(module, torch.nn.Linear)]
    prompts = [IDS[:9], IDS[:5], IDS[:7], IDS[:3]]
    lora_logits(ours, slots, prompts, [0, 1, -1, 2])
    for hook in hooks:
        hook.remove()
    layer_linears = {n: c for n, c in calls.items() if n.startswith("layers.")}
    assert len(layer_linears) == 4 * ours.config.num_layers
    assert all(c == [24] for c in layer_linears.values()), layer_linears


def test_adapter_in_bfloat16_as_close_as_peft_in_bfloat16(tmp_path):
    """bfloat16: our logits are about as far from the float32 answer (HF + PEFT merged) as HF + PEFT
    run in bfloat16 are: rounding, not a wrong update (which would be many times further)."""
    base = tiny_hf_model("llama", tmp_path / "base")
    peft_model = random_adapter(base, tmp_path / "adapter", seed=3)
    exact = merged_logits(peft_model, IDS)
    peft_error = (hf_logits(peft_model.to(torch.bfloat16), IDS) - exact).abs().max().item()
    ours = build_model(open_hf(tmp_path / "base"), torch.bfloat16, "cpu")
    slots = LoRASlots(ours.config, 1, 8, torch.bfloat16, "cpu")
    slots.assign(0, load_adapter("a", tmp_path / "adapter", ours.config))
    error = (lora_logits(ours, slots, [IDS], [0])[0] - exact).abs().max().item()
    assert error <= 1.5 * peft_error, (error, peft_error)


def _load_dequantized_into(hf_model, ours) -> None:
    """HF ``hf_model``'s projections and head := the dequantized weights of quantized ``ours``."""
    q, kv = ours.config.num_heads * ours.config.head_dim, ours.config.num_kv_heads * ours.config.head_dim
    inner = ours.config.intermediate_size
    with torch.no_grad():
        for layer, block in zip(hf_model.model.layers, ours.layers):
            wq, wk, wv = block.attn.qkv.dequantize().float().split([q, kv, kv])
            gate, up = block.mlp.gate_up.dequantize().float().split([inner, inner])
            for module, w in ((layer.self_attn.q_proj, wq), (layer.self_attn.k_proj, wk),
                              (layer.self_attn.v_proj, wv), (layer.self_attn.o_proj, block.attn.o.dequantize()),
                              (layer.mlp.gate_proj, gate), (layer.mlp.up_proj, up),
                              (layer.mlp.down_proj, block.mlp.down.dequantize())):
                module.weight.copy_(w.float())
        hf_model.lm_head.weight.copy_(ours.lm_head.dequantize().float())


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_adapter_over_quantized_base_matches_peft_on_dequantized_base(method, tmp_path):
    from tokenmill.quantization.api import quantize_model
    from tokenmill.quantization.config import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    base = tiny_hf_model("llama", tmp_path / "base")
    ours = build_model(open_hf(tmp_path / "base"), torch.float32, "cpu")
    config = Int8WeightOnlyConfig() if method == "int8" else Int4WeightOnlyConfig(group_size=32)
    quantize_model(ours, config, torch.float32, progress=False)
    _load_dequantized_into(base, ours)
    peft_model = random_adapter(base, tmp_path / "adapter", seed=5)
    slots = LoRASlots(ours.config, 1, 8, torch.float32, "cpu")
    slots.assign(0, load_adapter("a", tmp_path / "adapter", ours.config))
    got = lora_logits(ours, slots, [IDS], [0])[0]
    assert (got - merged_logits(peft_model, IDS)).abs().max().item() <= 1e-3


def test_int8_slots_stay_close_to_exact(tmp_path):
    """int8 slot storage (lora_dtype int8): each row of A and B rounded to 127 levels of its own
    scale. With an update of a trained adapter's size (here it moves the logits by about their own
    scale), in float32 the logits stay within 2% of the adapter's effect of the exact ones."""
    base = tiny_hf_model("llama", tmp_path / "base")
    peft_model = random_adapter(base, tmp_path / "adapter", seed=3, b_gain=0.25)
    exact = merged_logits(peft_model, IDS)
    effect = (exact - hf_logits(base, IDS)).abs().max().item()
    ours = build_model(open_hf(tmp_path / "base"), torch.float32, "cpu")
    slots = LoRASlots(ours.config, 1, 8, torch.float32, "cpu", int8=True)
    slots.assign(0, load_adapter("a", tmp_path / "adapter", ours.config))
    assert slots.modules["layers.0.attn.qkv"].A.dtype == torch.int8
    error = (lora_logits(ours, slots, [IDS], [0])[0] - exact).abs().max().item()
    assert 0 < error <= 0.02 * effect and effect > 0.1, (error, effect)


@pytest.mark.real_model
def test_adapter_over_smollm2_int4_gguf_matches_peft_on_the_dequantized_base(smollm2_gguf, tmp_path):
    """SmolLM2-135M as shipped (GGUF Q4_1: int4 codes, groups of 32) run natively by tokenmill with
    float32 activations, with a random rank-8 adapter on all seven projections, against HF
    transformers + PEFT merged on the same GGUF dequantized by transformers."""
    import transformers

    from tokenmill.loading.sources import resolve_model
    from tokenmill.quantization.gguf_native import load_gguf_native
    from tokenmill.quantization.grouped import GroupedLinear

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    peft_model = random_adapter(hf, tmp_path / "adapter", seed=7, b_gain=0.5)
    ids = [1, 504, 3575, 282, 4649, 314, 216, 29, 30, 31, 1183, 2734, 28, 339, 5248]
    expected = merged_logits(peft_model, ids)
    base_expected = hf_logits(hf, ids)
    del hf, peft_model
    assert (expected - base_expected).abs().max() > 0.5  # the adapter changes the output

    ours = load_gguf_native(resolve_model("smollm2-135m-instruct"), torch.float32, "cpu").model
    assert isinstance(ours.layers[0].attn.qkv, GroupedLinear)
    slots = LoRASlots(ours.config, 1, 8, torch.float32, "cpu")
    slots.assign(0, load_adapter("a", tmp_path / "adapter", ours.config))
    base_got, got = lora_logits(ours, slots, [ids, ids], [-1, 0])
    base_error, error = (base_got - base_expected).abs().max().item(), (got - expected).abs().max().item()
    print(f"\nSmolLM2 Q4_1: max |logit diff| vs HF base {base_error:.2e}, with adapter vs PEFT merged {error:.2e}")
    assert error <= 1e-3, (error, base_error)
