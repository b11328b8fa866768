"""GGUF quantized linears run natively (GroupedLinear over the file's own codes), not dequantized at load.

How close is "the same model"? Every grouped weight is exactly the dequantized model's float32
weight (checked with ``torch.equal``), so the only differences are in the arithmetic:

- float32 activations: the kernel keeps about 16 bits of each input (a bfloat16 high and low part)
  and sums in float32, so logits agree with the dequantized float32 model to a relative 1e-5 of
  their largest value in practice; the tests allow 1e-4 (``F32_RTOL``).
- bfloat16 activations (the default): both the native model and the dequantized bfloat16 model
  round every activation to bfloat16 (2^-9 relative), and the latter also rounds its weights. Taking
  the dequantized float32 model as the reference, each bfloat16 model is off by that rounding; the
  native one must be off by no more than ``BF16_RATIO`` (1.5) times what the dequantized bfloat16
  model is, in the largest and in the RMS difference over every logit of the prompt. (Its distance to
  the dequantized bfloat16 model is then at most 2.5 times that, by the triangle inequality.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, quants
from gguf import GGMLQuantizationType as Q
from torch import nn

from tests.kernel_utils import require_kernels
from tests.loading.test_gguf_groups import random_blocks
from tests.model_utils import BLOCK, prompt_logits
from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.config import layer_groups
from tokenmill.loading.gguf_groups import NATIVE_TYPES, gguf_groups
from tokenmill.loading.sources import ModelSource
from tokenmill.loading.tokenizer import byte_alphabet
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import load_float_model
from tokenmill.paths import default_cache_dir
from tokenmill.quantization.gguf_native import load_gguf_native
from tokenmill.quantization.grouped import GroupedLinear

OPS = require_kernels()
FAST = OPS.group_linear_fast()
needs_fast = pytest.mark.skipif(not FAST, reason="the loader runs GGUF natively only with AVX-512 BF16")

F32_RTOL = 1e-4
BF16_RATIO = 1.5

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2  # K types need rows of 256
TOKENS = [*byte_alphabet().values(), "ab", "<|endoftext|>"]
SHAPES = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
EVERY_TYPE = [  # each of the 8 types in the linears; layer 1's q/k/v joins groups of 16 and 32
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q4_K,
     "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q6_K, "attn_k": Q.Q8_0, "attn_v": Q.Q4_K, "attn_output": Q.Q8_0, "ffn_gate": Q.Q5_1,
     "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1},
]
BLOCK_STD = {Q.Q4_K: 2e-4, Q.Q5_K: 1e-4, Q.Q6_K: 3e-5}  # the halves of random blocks: weights of ~0.05


def tensor_data(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """What GGUFWriter.add_tensor takes for a random ``qtype`` tensor: floats, or the packed bytes."""
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    if qtype in (Q.F32, Q.F16):
        return w.astype(np.float32 if qtype == Q.F32 else np.float16)
    if qtype in BLOCK_STD or qtype == Q.Q2_K:  # gguf.quants cannot quantize these: random valid blocks
        return random_blocks(qtype, shape, rng, False, std=BLOCK_STD.get(qtype, 1e-3)).reshape(shape[0], -1)
    return quants.quantize(w, qtype)


def write_llama_gguf(path: Path, layer_types: list[dict[str, Q]], embed: Q = Q.Q8_0, output: Q | None = None,
                     norm: Q = Q.F32, shapes: dict[str, tuple[int, int]] | None = None) -> Path:
    """A tiny random Llama GGUF (byte-level gpt2 tokenizer) with the given storage types; tied
    unless ``output`` gives the LM head's. ``shapes``: linears of other shapes than SHAPES'."""
    shapes = {**SHAPES, **(shapes or {})}
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(len(layer_types))
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 1) + [3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(len(TOKENS) - 1)

    def add(name: str, qtype: Q, shape: tuple[int, ...]) -> None:
        data = tensor_data(qtype, shape, rng)
        if norm == qtype and len(shape) == 1:
            data = (1 + data).astype(data.dtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)

    add("token_embd.weight", embed, (len(TOKENS), HIDDEN))
    for i, types in enumerate(layer_types):
        add(f"blk.{i}.attn_norm.weight", norm, (HIDDEN,))
        add(f"blk.{i}.ffn_norm.weight", norm, (HIDDEN,))
        for part, qtype in types.items():
            add(f"blk.{i}.{part}.weight", qtype, shapes[part])
    add("output_norm.weight", Q.F32, (HIDDEN,))
    if output is not None:
        add("output.weight", output, (len(TOKENS), HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def linears(model: CausalLM) -> dict[str, nn.Module]:
    """Every linear module of the model, the LM head (tied or not) included."""
    out = {name: m for name, m in model.named_modules()
           if isinstance(m, (nn.Linear, GroupedLinear)) and name != "embed"}
    if model.lm_head is None:
        out["lm_head"] = None
    return out


def assert_all_native(model: CausalLM) -> None:
    not_native = [name for name, m in linears(model).items() if not (isinstance(m, GroupedLinear) and m.native)]
    assert not_native == [], f"served dequantized: {not_native}"


def assert_same_weights(native: CausalLM, dequantized: CausalLM) -> None:
    """Each grouped weight is the dequantized model's float32 weight, exactly (torch.equal: -0.0 == 0.0)."""
    for name, module in native.named_modules():
        if isinstance(module, GroupedLinear):
            ref = dequantized.embed.weight if name == "lm_head" and dequantized.lm_head is None \
                else dequantized.get_submodule(name).weight
            assert torch.equal(module.dequantize(), ref), name


def assert_logits_close(native: torch.Tensor, dequantized_bf16: torch.Tensor, reference: torch.Tensor) -> None:
    """The bfloat16 criterion of the module docstring."""
    def rms(t: torch.Tensor) -> float:
        return float(t.double().pow(2).mean().sqrt())

    ours, theirs = native - reference, dequantized_bf16 - reference
    assert float(ours.abs().max()) <= BF16_RATIO * float(theirs.abs().max())
    assert rms(ours) <= BF16_RATIO * rms(theirs)


def assert_logits_f32(native: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(native, reference, rtol=0, atol=F32_RTOL * float(reference.abs().max()))


def source(path: Path) -> ModelSource:
    return ModelSource(path.stem, "gguf", path)


# --------------------------------------------------------------------------- the layer

@pytest.mark.parametrize("rows", [48, 40])  # 40: rows padded to 48 for the kernel, the output cut
@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES), ids=lambda t: t.name)
def test_grouped_linear_multiplies_by_the_files_weights(qtype: Q, rows: int) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = torch.from_numpy(np.ascontiguousarray(tensor_data(qtype, (rows, 512), rng)).reshape(-1))
    weight = gguf_groups(raw, qtype, (rows, 512))
    layer = GroupedLinear.from_gguf(weight)
    assert layer.native and set(layer.state_dict()) == {"packed", "sz"}  # the kernel's layout, held once
    unpacked = layer.grouped_weight()
    for field in ("codes", "scale", "min"):
        assert torch.equal(getattr(unpacked, field), getattr(weight, field)), field
    assert (unpacked.group_size, unpacked.bits) == (weight.group_size, weight.bits)
    w = weight.dequantize().double()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
        ref = x.double() @ w.T
        y = layer(x)
        assert y.dtype == dtype and y.shape == (5, rows)
        # float32 sums of exact products; bfloat16 output rounding on top
        bound = 2.0 ** -8 * ref.abs() + 1e-5 * (x.double().abs() @ w.abs().T) if dtype == torch.bfloat16 \
            else 1e-5 * (x.double().abs() @ w.abs().T)
        assert ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(layer.dequantize(), weight.dequantize())


def test_grouped_linear_without_the_kernels_dequantizes(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.kernels import dispatch

    rng = np.random.default_rng(5)
    weight = gguf_groups(torch.from_numpy(random_blocks(Q.Q4_K, (24, 256), rng, False)), Q.Q4_K, (24, 256))
    monkeypatch.setattr(dispatch, "cpu_ops", lambda: None)
    layer = GroupedLinear.from_gguf(weight)
    assert not layer.native and layer.cpu_kernel_spec() is None
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight.dequantize().to(torch.bfloat16)))


def test_grouped_linear_spec_for_the_decode_stack() -> None:
    from tokenmill.kernels.linear_spec import LinearKind

    rng = np.random.default_rng(3)
    weight = gguf_groups(torch.from_numpy(random_blocks(Q.Q6_K, (40, 256), rng, False)), Q.Q6_K, (40, 256))
    spec = GroupedLinear.from_gguf(weight).cpu_kernel_spec()
    assert spec.kind is LinearKind.GROUPED and (spec.out_features, spec.in_features) == (40, 256)
    assert (spec.group_size, spec.bits) == (16, 7)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_a_bf16_copy_takes_the_bf16_calls_of_its_rows(qtype: Q) -> None:
    """keep_bf16_copy(8): bfloat16 calls of 8 rows or more multiply by the weight rounded to
    bfloat16, exactly as a bfloat16 nn.Linear does on tokenmill's kernel; fewer rows and float32
    calls keep the codes. The decode stack's Linear dispatches the same way."""
    from tokenmill.kernels import dispatch
    from tokenmill.models.layers import linear

    rng = np.random.default_rng(int(qtype))
    weight = gguf_groups(torch.from_numpy(random_blocks(qtype, (40, 256), rng, False)), qtype, (40, 256))
    plain, layer = GroupedLinear.from_gguf(weight), GroupedLinear.from_gguf(weight)
    assert layer.keep_bf16_copy(8) >= 40 * 256 * 2
    dense = nn.Linear(256, 40, bias=False).bfloat16()
    with torch.no_grad():
        dense.weight.copy_(weight.dequantize().bfloat16())
    g = torch.Generator().manual_seed(2)
    x8, x7 = torch.randn(8, 256, generator=g).bfloat16(), torch.randn(7, 256, generator=g).bfloat16()
    assert torch.equal(layer(x8), linear(dense, x8)) and not torch.equal(layer(x8), plain(x8))
    assert torch.equal(layer(x7), plain(x7))
    assert torch.equal(layer(x8.float()), plain(x8.float()))
    assert torch.equal(layer.matmul_float32(x8), linear(dense, x8, out_float32=True))  # logits
    stacked = layer.cpu_kernel_spec()
    assert stacked.bf16_copy_rows == 8 and plain.cpu_kernel_spec().bf16_copy is None
    native = stacked.native(dispatch.cpu_ops())
    assert torch.equal(native(x8), layer(x8)) and torch.equal(native(x7), plain(x7))
    with pytest.raises(ValueError, match="at least 1"):
        layer.keep_bf16_copy(0)


@pytest.mark.skipif(not OPS.int8_copy_linear_fast(), reason="the int8 copy needs AVX-512 VNNI")
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_an_int8_copy_takes_the_bf16_calls_below_the_bf16_copys_rows(qtype: Q) -> None:
    """keep_int8_copy(): bfloat16 calls of fewer rows than the bfloat16 copy's run int8_copy_linear over
    the codes' int8 copy (symmetric where the type is), as close to the exact products as bfloat16's
    output rounding; the bfloat16 copy keeps its rows, float32 calls keep the codes; the decode stack's
    Linear dispatches the same way."""
    from tokenmill.kernels import dispatch
    from tokenmill.quantization.grouped import int8_copy_pack

    rng = np.random.default_rng(int(qtype))
    weight = gguf_groups(torch.from_numpy(random_blocks(qtype, (40, 256), rng, False)), qtype, (40, 256))
    plain, copied, layer = (GroupedLinear.from_gguf(weight) for _ in range(3))
    assert 40 * 256 <= layer.keep_int8_copy() <= 48 * 256 * 1.25
    for m in (copied, layer):
        m.keep_bf16_copy(8)
    copy, offset = int8_copy_pack(weight)
    assert offset == {Q.Q4_1: -1, Q.Q5_0: 16, Q.Q6_K: 32, Q.Q8_0: 128}[qtype]
    g = torch.Generator().manual_seed(2)
    x8, x7 = torch.randn(8, 256, generator=g).bfloat16(), torch.randn(7, 256, generator=g).bfloat16()
    expected = OPS.int8_copy_linear(x7, copy, 40, weight.group_size, offset, torch.empty(0))
    assert torch.equal(layer(x7), expected) and not torch.equal(layer(x7), plain(x7))
    exact = x7.double() @ weight.dequantize().double().T
    assert (layer(x7).double() - exact).abs().max() <= 2**-8 * exact.abs().max()
    assert torch.equal(layer(x8), copied(x8)) and torch.equal(layer(x7.float()), plain(x7.float()))
    assert torch.equal(layer.matmul_float32(x7), expected.float())
    spec = layer.cpu_kernel_spec()
    assert spec.int8_copy is not None and spec.int8_copy_offset == offset and plain.cpu_kernel_spec().int8_copy is None
    native = spec.native(dispatch.cpu_ops())
    assert torch.equal(native(x7), layer(x7)) and torch.equal(native(x8), layer(x8))


def test_bf16_copy_rows_must_be_a_whole_number() -> None:
    from tokenmill.config import LoadConfig
    from tokenmill.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="bf16_copy_rows"):
        LoadConfig(bf16_copy_rows=-1)


# --------------------------------------------------------------------------- a tiny GGUF of every type

@pytest.fixture(scope="module")
def every_type_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "every-type.gguf", EVERY_TYPE)


def test_tiny_gguf_of_every_type_loads_natively(every_type_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tokenmill.loading"):
        native = load_gguf_native(source(every_type_gguf)).model
    assert_all_native(native)
    layer0, layer1 = native.layers[0], native.layers[1]
    assert (layer0.attn.qkv.group_size, layer0.attn.qkv.bits) == (32, 5)  # Q4_0 + Q4_1 + Q5_0
    assert (layer1.attn.qkv.group_size, layer1.attn.qkv.bits) == (16, 8)  # Q6_K + Q8_0 + Q4_K
    assert (layer1.mlp.gate_up.group_size, layer1.mlp.gate_up.bits) == (32, 5)  # Q5_1 + Q4_0
    assert (layer1.mlp.down.bits, native.lm_head.bits) == (4, 8)  # Q4_1; the tied head, Q8_0
    assert native.embed.weight.dtype == torch.bfloat16 and native.layers[0].attn_norm.weight.dtype == torch.bfloat16
    lines = {r.getMessage() for r in caplog.records if r.name == "tokenmill.loading"}
    for expected in ["GGUF Q4_0: 2 tensors native (grouped kernel, 4-bit codes)",
                     "GGUF Q5_0: 1 tensor native (grouped kernel, 5-bit codes)",
                     "GGUF Q6_K: 2 tensors native (grouped kernel, 7-bit codes)", "GGUF F32: 5 tensors as float",
                     "GGUF Q8_0: 3 tensors native (grouped kernel, 8-bit codes), token_embd.weight also dequantized for "
                     "the embedding lookup"]:
        assert expected in lines


def test_the_native_head_writes_float32_logits_of_the_bfloat16_values(every_type_gguf: Path) -> None:
    """compute_logits takes the grouped head's float32 output: the bfloat16 logits, widened."""
    native = load_gguf_native(source(every_type_gguf)).model
    h = torch.randn(5, native.config.hidden_size).bfloat16()
    logits = native.compute_logits(h)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, native.lm_head(native.norm(h)).float())


@needs_fast
def test_bf16_copies_by_default_only_where_they_are_small(every_type_gguf: Path) -> None:
    """The default (bf16_copy_rows None): copies when they take at most 1/16 of the machine's
    memory, for calls of 24 rows or more over 4-bit codes and 12 over wider ones, and int8 copies of
    the 8-bit layers for the other bfloat16 calls; a number sets every layer's; 0 turns both off,
    int8_copies=False the int8 ones; a model without grouped layers gets none."""
    from tokenmill import LLM
    from tokenmill.quantization.grouped import AUTO_COPY_ROWS, AUTO_COPY_ROWS_4BIT, auto_bf16_copies

    native = load_gguf_native(source(every_type_gguf)).model
    size = sum(2 * m.out_features * m.in_features for m in native.modules() if isinstance(m, GroupedLinear))
    assert auto_bf16_copies(native, memory_bytes=16 * size)
    assert not auto_bf16_copies(native, memory_bytes=16 * size - 16)
    assert not auto_bf16_copies(load_float_model(source(every_type_gguf), torch.bfloat16).model, 2**40)
    default = LLM(str(every_type_gguf), device="cpu").engine.runner.model
    rows = {(m.bits, m.cpu_kernel_spec().bf16_copy_rows) for m in default.modules() if isinstance(m, GroupedLinear)}
    assert (AUTO_COPY_ROWS_4BIT, AUTO_COPY_ROWS) == (24, 12)
    assert {bits for bits, _ in rows} >= {4, 8} and rows == {(b, 24 if b == 4 else 12) for b, _ in rows}
    fixed = LLM(str(every_type_gguf), device="cpu", bf16_copy_rows=16).engine.runner.model
    assert {m.cpu_kernel_spec().bf16_copy_rows for m in fixed.modules() if isinstance(m, GroupedLinear)} == {16}
    off = LLM(str(every_type_gguf), device="cpu", bf16_copy_rows=0).engine.runner.model  # the file's size
    assert all(m.cpu_kernel_spec().bf16_copy is None and m.cpu_kernel_spec().int8_copy is None
               for m in off.modules() if isinstance(m, GroupedLinear))
    no_int8 = LLM(str(every_type_gguf), device="cpu", int8_copies=False).engine.runner.model
    assert all(m.cpu_kernel_spec().int8_copy is None for m in no_int8.modules() if isinstance(m, GroupedLinear))
    assert no_int8.lm_head.cpu_kernel_spec().bf16_copy is not None
    # int8 copies: the 8-bit layers' (the tied head's among them), on hosts with AVX-512 VNNI
    int8 = {m.bits for m in default.modules() if isinstance(m, GroupedLinear) and m.cpu_kernel_spec().int8_copy is not None}
    assert int8 == ({8} if OPS.int8_copy_linear_fast() else set())
    assert default.lm_head.cpu_kernel_spec().int8_copy is not None or not OPS.int8_copy_linear_fast()


@pytest.mark.skipif(not OPS.int8_copy_linear_fast(), reason="int8 copies need AVX-512 VNNI")
def test_the_8bit_head_takes_x_in_one_int8_part_from_the_copy_rows_to_one_part_below(every_type_gguf: Path) -> None:
    """head_int8_activations (default): the LM head's bfloat16 calls below its bfloat16 copy's rows take
    the int8 copy with x in two parts, from there up to ONE_PART_BELOW - 1 rows in one part, and
    from ONE_PART_BELOW the bfloat16 copy; no other layer changes; off, the copy takes them all."""
    from tokenmill import LLM
    from tokenmill.quantization.grouped import ONE_PART_BELOW

    default = LLM(str(every_type_gguf), device="cpu").engine.runner.model
    head = default.lm_head
    copy, offset = head._int8_copy
    bf16, rows = head._bf16_copy
    assert isinstance(head, GroupedLinear) and rows == 12 and head._one_part_rows == (rows, ONE_PART_BELOW)
    assert all(m._one_part_rows == (0, 0) for m in default.modules() if isinstance(m, GroupedLinear) and m is not head)
    none = torch.empty(0)
    for m, path in ((rows - 1, "two"), (rows, "one"), (ONE_PART_BELOW - 1, "one"), (ONE_PART_BELOW, "bf16")):
        x = torch.randn(m, head.in_features, generator=torch.Generator().manual_seed(m)).bfloat16()
        want = (OPS.bf16_packed_linear(x, bf16, head.out_features, none) if path == "bf16" else
                OPS.int8_copy_linear(x, copy, head.out_features, head.group_size, offset, none,
                                     one_part=path == "one"))
        assert torch.equal(head(x), want), (m, path)
    off = LLM(str(every_type_gguf), device="cpu", head_int8_activations=False).engine.runner.model.lm_head
    x = torch.randn(rows, head.in_features).bfloat16()
    assert torch.equal(off(x), OPS.bf16_packed_linear(x, off._bf16_copy[0], head.out_features, none))


@pytest.mark.skipif(not OPS.int8_copy_linear_fast(), reason="int8 copies need AVX-512 VNNI")
def test_kernel_rows_picks_the_heads_kernel_as_for_that_many_rows(every_type_gguf: Path) -> None:
    """A speculative step's 20 rows of 4 sequences (kernel_rows=4) get, row for row, the bits that 4-row
    plain steps give them (the two-part int8 copy), not the 20-row call's kernel (one part)."""
    from tokenmill import LLM

    head = LLM(str(every_type_gguf), device="cpu").engine.runner.model.lm_head
    x = torch.randn(20, head.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    as_plain = torch.cat([head.forward_float32(x[i:i + 4]) for i in range(0, 20, 4)])
    assert torch.equal(head.forward_float32(x, kernel_rows=4), as_plain)
    assert not torch.equal(head.forward_float32(x), as_plain)  # 20 rows alone: one part


def test_tiny_gguf_of_every_type_matches_its_dequantized_model(every_type_gguf: Path) -> None:
    ids = list(range(3, 250, 7))
    ref = load_float_model(source(every_type_gguf), torch.float32).model
    native32 = load_gguf_native(source(every_type_gguf), torch.float32).model
    assert_same_weights(native32, ref)
    reference = prompt_logits(ref, ids)
    assert_logits_f32(prompt_logits(native32, ids), reference)
    native = load_gguf_native(source(every_type_gguf)).model
    dequantized = load_float_model(source(every_type_gguf), torch.bfloat16).model
    assert_logits_close(prompt_logits(native, ids), prompt_logits(dequantized, ids), reference)


def test_other_types_stay_float_and_an_untied_head_is_native(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    types = [dict(EVERY_TYPE[0]), {**EVERY_TYPE[1], "ffn_down": Q.Q2_K}]
    path = write_llama_gguf(tmp_path / "mixed.gguf", types, embed=Q.Q4_0, output=Q.Q6_K, norm=Q.F16)
    with caplog.at_level(logging.INFO, logger="tokenmill.loading"):
        native = load_gguf_native(source(path), torch.float32).model
    assert type(native.layers[1].mlp.down) is nn.Linear  # Q2_K: no native kernel, dequantized
    assert isinstance(native.lm_head, GroupedLinear) and native.lm_head.group_size == 16
    assert type(native.embed) is nn.Embedding
    lines = {r.getMessage() for r in caplog.records}
    assert {"GGUF Q2_K: 1 tensor dequantized to float", "GGUF F16: 4 tensors as float",
            "GGUF Q4_0: 2 tensors native (grouped kernel, 4-bit codes), 1 tensor dequantized to float"} <= lines
    ref = load_float_model(source(path), torch.float32).model
    assert_same_weights(native, ref)
    ids = list(range(10, 200, 9))
    assert_logits_f32(prompt_logits(native, ids), prompt_logits(ref, ids))


def test_a_layout_that_does_not_fit_the_model_is_named(tmp_path: Path) -> None:
    from tokenmill.errors import ModelFormatError

    path = write_llama_gguf(tmp_path / "bad.gguf", EVERY_TYPE, shapes={"attn_output": (HIDDEN + 32, HEADS * HEAD_DIM)})
    with pytest.raises(ModelFormatError, match=r"layers\.0\.attn\.o from blk\.0\.attn_output\.weight"):
        load_gguf_native(source(path))


@needs_fast
def test_the_loader_decides(every_type_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                            caplog: pytest.LogCaptureFixture) -> None:
    import tokenmill.loader as loader

    auto = loader.load_model(every_type_gguf, device="cpu")
    assert isinstance(auto.model.lm_head, GroupedLinear) and auto.model.embed.weight.dtype == torch.bfloat16
    for dtype, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):  # explicit: dequantized
        model = loader.load_model(every_type_gguf, dtype=dtype, device="cpu").model
        assert model.lm_head is None and type(model.layers[0].attn.qkv) is nn.Linear
        assert model.layers[0].attn.qkv.weight.dtype == expected
    monkeypatch.setattr(loader, "native_unavailable", lambda device: "no kernels in this test")
    with caplog.at_level(logging.INFO, logger="tokenmill.loading"):
        model = loader.load_model(every_type_gguf, device="cpu").model
    assert type(model.layers[0].attn.qkv) is nn.Linear and model.embed.weight.dtype == torch.float32
    assert any("dequantized to float32 (no kernels in this test)" in r.getMessage() for r in caplog.records)


@needs_fast
def test_native_decode_runs_in_the_decode_stack(every_type_gguf: Path) -> None:
    from tokenmill import LLM, SamplingParams

    native = load_gguf_native(source(every_type_gguf)).model
    cfg = native.config
    groups, _ = layer_groups(cfg)
    cache = PagedKVCache(4, BLOCK, groups, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    assert native.fused_decoder(cache) is not None  # every GroupedLinear described itself to the stack
    llm = LLM(str(every_type_gguf), device="cpu", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fused = llm.generate(["abc", "hello"], params)
    try:  # the layer-by-layer path calls the same kernels: the same tokens
        CausalLM.use_fused_decode = False
        layered = llm.generate(["abc", "hello"], params)
    finally:
        CausalLM.use_fused_decode = True
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in layered]


# --------------------------------------------------------------------------- the shipped models

SHIPPED_TYPES = {"smollm2-135m-instruct": {"Q4_1": 210, "Q8_0": 1},
                 "gemma3-270m": {"Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 10}}


@pytest.mark.real_model
@needs_fast
@pytest.mark.parametrize("name", list(SHIPPED_TYPES))
def test_shipped_model_runs_natively(name: str, caplog: pytest.LogCaptureFixture) -> None:
    from tokenmill.loader import load_model

    with caplog.at_level(logging.INFO, logger="tokenmill.loading"):
        loaded = load_model(name, device="cpu")
    native = loaded.model
    assert_all_native(native)
    lines = {r.getMessage() for r in caplog.records}
    for qtype, count in SHIPPED_TYPES[name].items():
        counted = f"{count} tensor{'s' if count > 1 else ''}"
        assert any(line.startswith(f"GGUF {qtype}: {counted} native") for line in lines), (qtype, lines)
    ids = loaded.tokenizer.encode("The capital of France is a city that")
    ours = prompt_logits(native, ids)
    del native, loaded
    dequantized = load_float_model(source_of(name), torch.bfloat16, cache_dir=default_cache_dir()).model
    theirs = prompt_logits(dequantized, ids)
    del dequantized
    ref = load_float_model(source_of(name), torch.float32, cache_dir=default_cache_dir()).model
    assert_logits_close(ours, theirs, prompt_logits(ref, ids))


def source_of(name: str) -> ModelSource:
    from tokenmill.loading.sources import resolve_model

    return resolve_model(name)


@pytest.mark.real_model
@needs_fast
def test_native_smollm2_generates_through_llm() -> None:
    from tokenmill import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", device="cpu")
    assert llm.dtype == torch.bfloat16
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert len(out.token_ids) > 0 and "Paris" in out.text


@pytest.mark.real_model
@needs_fast
def test_bf16_copies_give_the_bfloat16_models_outputs_from_their_rows() -> None:
    """SmolLM2 as stored with bf16_copy_rows=1: every call multiplies by the copies, so prompt
    logits and batched greedy decoding (12 rows a step, through the decode stack) are the
    --dtype bfloat16 model's, bit for bit (as stored, without copies, the logits differ by ~1)."""
    from tokenmill import LLM, SamplingParams

    bf16 = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu")
    copied = LLM("smollm2-135m-instruct", device="cpu", bf16_copy_rows=1)
    assert_all_native(copied.engine.runner.model)
    ids = bf16.tokenizer.encode("The capital of France is a city that")
    assert torch.equal(prompt_logits(copied.engine.runner.model, ids), prompt_logits(bf16.engine.runner.model, ids))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [f"Story {i}: once upon a time" for i in range(12)]
    assert [o.outputs[0].token_ids for o in copied.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in bf16.generate(prompts, params)]


@pytest.mark.skipif(not OPS.int8_copy_linear_fast(), reason="int8 copies need AVX-512 VNNI")
def test_int8_activations_put_every_layer_on_its_int8_copy_in_one_part(every_type_gguf: Path) -> None:
    """int8_activations: every grouped layer whose int8 copy runs here keeps one and takes its bfloat16
    calls of 1 (4-bit codes: INT8_ACTIVATIONS_FROM_4BIT) to ONE_PART_BELOW - 1 rows on it, x in one
    part; a 4-bit layer's fewer rows keep its codes (as without the option), the decode stack's
    Linear picks the same kernels, and without the option no layer but the head takes one part."""
    from tokenmill import LLM
    from tokenmill.quantization.grouped import INT8_ACTIVATIONS_FROM_4BIT, ONE_PART_BELOW, int8_copy_runs

    on = dict(LLM(str(every_type_gguf), device="cpu", int8_activations=True).engine.runner.model.named_modules())
    off = dict(LLM(str(every_type_gguf), device="cpu").engine.runner.model.named_modules())
    layers = {n: m for n, m in on.items() if isinstance(m, GroupedLinear) and int8_copy_runs(m, OPS)}
    assert {m.bits for m in layers.values()} >= {4, 8}
    assert all(m._one_part_rows == (0, 0) for n, m in off.items() if isinstance(m, GroupedLinear) and n != "lm_head")
    for name, m in layers.items():
        start = INT8_ACTIVATIONS_FROM_4BIT if m.bits == 4 else 1
        assert m._one_part_rows == (start, ONE_PART_BELOW), name
        copy, offset = m._int8_copy
        native = m.cpu_kernel_spec().native(OPS)
        for rows in sorted({1, start - 1, start, 20} - {0}):
            x = torch.randn(rows, m.in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
            want = (OPS.int8_copy_linear(x, copy, m.out_features, m.group_size, offset, torch.empty(0), one_part=True)
                    if rows >= start else off[name].matmul(x))
            assert torch.equal(m.matmul(x), want), (name, rows)
            if m.bias is None:
                assert torch.equal(native(x), want), (name, rows, "decode stack")
