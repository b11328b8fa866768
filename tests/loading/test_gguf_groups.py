"""GGUF weights in grouped form: ``code * scale + min`` in float32 must be ``gguf.quants.dequantize``,
bit for bit (the one exception, by design: a zero weight of a symmetric type under a negative scale
is +0.0 here, -0.0 there; see tokenmill/loading/gguf_groups.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from tokenmill.errors import ModelFormatError, UnsupportedModelError
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.gguf_groups import CODE_BITS, GROUP_SIZES, NATIVE_TYPES, GroupedWeight, gguf_groups
from tokenmill.loading.weights import unpermute_rope_rows

TYPES = sorted(NATIVE_TYPES)
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # what gguf.quants can also quantize
HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
          Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82)}  # byte offsets of each block's f16 fields
EXACT_ZERO_SIGN = {Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K}  # same operations as the reference: even -0.0 agrees
CODE_MAX = {Q.Q4_0: 15, Q.Q4_1: 15, Q.Q4_K: 15, Q.Q5_0: 31, Q.Q5_1: 31, Q.Q5_K: 31, Q.Q6_K: 63, Q.Q8_0: 255}


def reference(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    with np.errstate(all="ignore"):
        return quants.dequantize(raw.reshape(shape[0], -1), qtype).astype(np.float32).reshape(shape)


def random_blocks(qtype: Q, shape: tuple[int, int], rng: np.random.Generator, full_range: bool,
                  std: float = 0.01) -> np.ndarray:
    """Random bytes of a ``qtype`` tensor: every field random, each f16 field a finite half, drawn from
    the whole range (subnormals, negatives, up to 65504) or as a small scale (normal, ``std``)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // block
    blocks = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    for at in HALVES[qtype]:
        if full_range:
            bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
            halves = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits).astype(np.uint16)  # no inf / NaN
        else:
            halves = (rng.standard_normal(n) * std).astype(np.float16).view(np.uint16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(n, 2)
    return blocks.reshape(-1)


def assert_bit_exact(ours: torch.Tensor, ref: np.ndarray, qtype: Q) -> None:
    got = ours.numpy()
    zero = np.float32(0)  # x + 0 turns -0.0 into +0.0 and leaves every other value (and its bits) alone
    np.testing.assert_array_equal((got + zero).view(np.int32), (ref + zero).view(np.int32))
    differ = got.view(np.int32) != ref.view(np.int32)
    if qtype in EXACT_ZERO_SIGN:
        assert not differ.any()
    else:  # the only other difference allowed: -0.0 in the reference where we have +0.0
        assert (ref[differ] == 0).all() and np.signbit(ref[differ]).all() and not np.signbit(got[differ]).any()


def grouped(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupedWeight:
    return gguf_groups(torch.from_numpy(raw.copy()), qtype, shape)


@pytest.mark.parametrize("full_range", [False, True], ids=["small-scales", "every-half"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_dequantize_bit_for_bit(qtype: Q, full_range: bool) -> None:
    rng = np.random.default_rng(int(qtype) + 100 * full_range)
    shape = (48, 768)
    raw = random_blocks(qtype, shape, rng, full_range)
    w = grouped(raw, qtype, shape)
    assert_bit_exact(w.dequantize(), reference(raw, qtype, shape), qtype)
    assert w.codes.dtype == torch.uint8 and w.scale.dtype == w.min.dtype == torch.float32
    assert (w.group_size, w.bits) == (GROUP_SIZES[qtype], CODE_BITS[qtype])
    assert w.scale.shape == w.min.shape == (48, 768 // w.group_size)
    assert int(w.codes.max()) == CODE_MAX[qtype] and int(w.codes.min()) == 0  # the full code range is used


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_tensors_dequantize_bit_for_bit(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    shape = (32, 512)
    raw = np.ascontiguousarray(quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)).reshape(-1)
    assert_bit_exact(grouped(raw, qtype, shape).dequantize(), reference(raw, qtype, shape), qtype)


def test_concat_of_mixed_types_regroups_exactly() -> None:
    rng = np.random.default_rng(7)
    parts = [(Q.Q6_K, (16, 512)), (Q.Q4_0, (32, 512)), (Q.Q8_0, (16, 512)), (Q.Q4_K, (16, 512))]
    raws = [random_blocks(q, s, rng, False) for q, s in parts]
    joined = GroupedWeight.concat([grouped(r, q, s) for r, (q, s) in zip(raws, parts)])
    assert (joined.group_size, joined.bits) == (16, 8)
    assert joined.shape == (80, 512) and joined.scale.shape == (80, 32)
    expected = np.concatenate([reference(r, q, s) for r, (q, s) in zip(raws, parts)])
    np.testing.assert_array_equal(joined.dequantize().numpy(), expected)
    fours = GroupedWeight.concat([grouped(raws[1], *parts[1]), grouped(raws[3], *parts[3])])
    assert (fours.group_size, fours.bits) == (32, 4)  # 4-bit codes stay 4-bit when every part has them


def test_concat_refuses_different_widths() -> None:
    rng = np.random.default_rng(8)
    a = grouped(random_blocks(Q.Q4_0, (16, 64), rng, False), Q.Q4_0, (16, 64))
    b = grouped(random_blocks(Q.Q4_0, (16, 128), rng, False), Q.Q4_0, (16, 128))
    with pytest.raises(ModelFormatError, match="different widths"):
        GroupedWeight.concat([a, b])


def test_rows_permute_like_the_float_weight() -> None:
    rng = np.random.default_rng(9)
    raw = random_blocks(Q.Q6_K, (64, 256), rng, False)
    w = grouped(raw, Q.Q6_K, (64, 256))
    permuted = w.map_rows(lambda t: unpermute_rope_rows(t, 4))
    torch.testing.assert_close(permuted.dequantize(), unpermute_rope_rows(w.dequantize(), 4), rtol=0, atol=0)


@pytest.mark.parametrize("qtype, shape, nbytes, needle", [
    (Q.Q4_0, (4, 64), 4 * 2 * 18 - 1, "expected 144 bytes"),
    (Q.Q4_K, (4, 128), 4 * 144, "not a multiple of the Q4_K block size 256"),
    (Q.Q8_0, (128,), 4 * 34, "2-D"),
    (Q.Q6_K, (2, 256), 0, "expected 420 bytes"),
])
def test_bad_sizes_raise_model_format_error(qtype: Q, shape: tuple[int, ...], nbytes: int, needle: str) -> None:
    with pytest.raises(ModelFormatError, match=needle):
        gguf_groups(torch.zeros(nbytes, dtype=torch.uint8), qtype, shape, name="blk.0.attn_q.weight")


def test_wrong_dtype_and_unsupported_type() -> None:
    with pytest.raises(ModelFormatError, match="float32"):
        gguf_groups(torch.zeros(36, dtype=torch.float32), Q.Q4_0, (2, 64))
    with pytest.raises(UnsupportedModelError, match="Q2_K has no grouped form"):
        gguf_groups(torch.zeros(84, dtype=torch.uint8), Q.Q2_K, (1, 256))


def test_the_result_owns_its_memory() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q4_1, (16, 64), np.random.default_rng(3), False))
    w = gguf_groups(raw, Q.Q4_1, (16, 64))
    before = w.dequantize().clone()
    raw.zero_()
    assert torch.equal(w.dequantize(), before)


SHIPPED = {
    "smollm2-135m-instruct": ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "blk.29.attn_v.weight"],
    "gemma3-270m": ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                    "blk.1.ffn_down.weight", "blk.2.ffn_down.weight", "blk.5.ffn_up.weight"],
}


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_tensors_dequantize_bit_for_bit(name: str) -> None:
    from tokenmill.loading.sources import resolve_model

    with GGUFFile(resolve_model(name).path) as f:
        tensors = SHIPPED[name]
        types = {f.tensor_info(t)[0] for t in tensors}
        assert types == {"smollm2-135m-instruct": {Q.Q4_1}, "gemma3-270m": {Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K}}[name]
        for tensor in tensors:
            qtype, shape = f.tensor_info(tensor)
            raw = f.raw_tensor(tensor).numpy()
            assert_bit_exact(f.load_grouped(tensor).dequantize(), reference(raw, qtype, shape), qtype)
        # the token embedding (Q8_0 in both): its first rows, through the same decoder
        qtype, (rows, cols) = f.tensor_info("token_embd.weight")
        assert qtype == Q.Q8_0
        raw = f.raw_tensor("token_embd.weight")[: 512 * cols // 32 * 34]
        assert_bit_exact(gguf_groups(raw, qtype, (512, cols)).dequantize(), reference(raw.numpy(), qtype, (512, cols)),
                         qtype)
