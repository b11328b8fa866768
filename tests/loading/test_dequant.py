"""Dequantization parity: our torch decoders must match ``gguf.quants.dequantize`` bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from tokenmill.errors import ModelFormatError, UnsupportedModelError
from tokenmill.loading.dequant import SUPPORTED_TYPES, dequantize
from tokenmill.loading.gguf_file import GGUFFile

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# gguf.quants can only dequantize these, so we feed it random blocks with finite scales.
DECODE_ONLY = {  # type -> byte offsets of its f16 scale fields within a block
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """``gguf.quants`` dequantization of packed bytes (its F32/F16 paths need typed input)."""
    typed = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
    data = raw.view(typed) if typed else raw.reshape(shape[0], -1)
    return quants.dequantize(data, qtype).astype(np.float32).reshape(shape)


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for ``n_blocks`` blocks, with every f16 scale set to a finite random half."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for at in DECODE_ONLY[qtype]:
        halves = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def ours(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return dequantize(torch.from_numpy(raw.copy()), qtype, shape).numpy()


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_matches_reference_on_quantized_random_data(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    shape = (6, 512)
    raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    np.testing.assert_array_equal(ours(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", list(DECODE_ONLY), ids=lambda t: t.name)
def test_matches_reference_on_random_blocks(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    shape = (4, 1024)
    raw = random_blocks(qtype, 16, rng)
    np.testing.assert_array_equal(ours(raw, qtype, shape), reference(raw, qtype, shape))


def test_q8_k_is_scale_times_int8() -> None:
    rng = np.random.default_rng(0)
    n = 5
    d = rng.standard_normal(n).astype(np.float32)
    q = rng.integers(-128, 128, (n, 256), dtype=np.int8)
    bsums = rng.integers(-1000, 1000, (n, 16), dtype=np.int16)
    raw = np.concatenate([d.view(np.uint8).reshape(n, 4), q.view(np.uint8), bsums.view(np.uint8)], axis=1)
    expected = (d[:, None] * q.astype(np.float32)).reshape(n, 256)
    np.testing.assert_array_equal(ours(raw.reshape(-1), Q.Q8_K, (n, 256)), expected)


def test_keeps_multi_dimensional_and_1d_shapes() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    raw = quants.quantize(x, Q.Q8_0).reshape(-1)
    out = dequantize(torch.from_numpy(raw.copy()), Q.Q8_0, (2, 3, 64))
    assert out.shape == (2, 3, 64) and out.dtype == torch.float32
    norm = dequantize(torch.from_numpy(x[0, 0].view(np.uint8).copy()), Q.F32, (64,))
    assert norm.shape == (64,)


def test_float_output_never_aliases_input() -> None:
    raw = torch.from_numpy(np.arange(4, dtype=np.float32).view(np.uint8).copy())
    out = dequantize(raw, Q.F32, (4,))
    out.fill_(7.0)
    assert raw.view(torch.float32).tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_unaligned_float_input(qtype: Q) -> None:
    x = np.linspace(-2, 2, 8, dtype=np.float32)
    packed = quants.quantize(x, qtype).view(np.uint8).reshape(-1)
    shifted = torch.from_numpy(np.concatenate([[0], packed]).astype(np.uint8))[1:]
    np.testing.assert_array_equal(dequantize(shifted, qtype, (8,)).numpy(), reference(packed, qtype, (8,)))


def test_supported_types() -> None:
    expected = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
    expected |= {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_K}
    assert SUPPORTED_TYPES == frozenset(expected)


def test_unsupported_type_names_it() -> None:
    raw = torch.zeros(66, dtype=torch.uint8)
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        dequantize(raw, Q.IQ2_XXS, (256,), name="blk.0.ffn_up.weight")


def test_wrong_byte_count_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="'w': expected 68 bytes of Q8_0"):
        dequantize(torch.zeros(67, dtype=torch.uint8), Q.Q8_0, (64,), name="'w'")


def test_wrong_input_dtype_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="float32"):
        dequantize(torch.zeros(17, dtype=torch.float32), Q.Q8_0, (32,))


def test_row_not_whole_blocks_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="not a multiple of the Q4_0 block size 32"):
        dequantize(torch.zeros(36, dtype=torch.uint8), Q.Q4_0, (2, 16))


def pick_tensors(gguf_file: GGUFFile) -> list[str]:
    """Of each stored type: the smallest, a middle-sized and the largest tensor."""
    by_type: dict[Q, list[tuple[int, str]]] = {}
    for name in gguf_file.tensor_names:
        qtype, shape = gguf_file.tensor_info(name)
        by_type.setdefault(qtype, []).append((int(np.prod(shape)), name))
    picked = []
    for entries in by_type.values():
        entries.sort()
        picked += sorted({entries[0][1], entries[len(entries) // 2][1], entries[-1][1]})
    return picked


def leading_rows(
    x: np.ndarray, shape: tuple[int, ...], max_elements: int = 1 << 20
) -> tuple[np.ndarray, tuple[int, ...]]:
    """The first rows of packed bytes ``x`` (and their shape), at most ``max_elements`` values."""
    rows = int(np.prod(shape[:-1]))
    keep = max(1, min(rows, max_elements // shape[-1]))
    return x[: x.size // rows * keep], (keep, shape[-1])


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf"])
def test_real_tensors_match_reference(model: str, request: pytest.FixtureRequest) -> None:
    """Every stored type, including the largest tensors (compared on their leading rows)."""
    path: Path = request.getfixturevalue(model)
    with GGUFFile(path) as f:
        names = pick_tensors(f)
        assert {f.tensor_info(n)[0] for n in names} == {f.tensor_info(n)[0] for n in f.tensor_names}
        for name in names:
            qtype, shape = f.tensor_info(name)
            raw, head = leading_rows(f.raw_tensor(name).numpy(), shape)
            np.testing.assert_array_equal(ours(raw, qtype, head), reference(raw, qtype, head), err_msg=name)
