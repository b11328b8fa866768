"""tokenmill's CPU batched multi-LoRA kernel (``lora_add``) against a float64 reference: both
dtypes and both paths, fused projections of 1 to 3 parts, ranks that are not multiples of 16,
tokens without an adapter, a strided y, batch invariance and the errors it raises; the same with
int8 weights and float32 per-row scales (against the reference on the dequantized weights)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import require_kernels

kernels = require_kernels()

DTYPES = [torch.float32, torch.bfloat16]
PATHS = pytest.mark.parametrize("path", ["FASTEST", "PORTABLE"], ids=["avx512", "portable"])


def make(t: int, k: int, parts: list[int], r: int, s: int, dtype: torch.dtype, seed: int = 0,
         slots: list[int] | None = None):
    """x [T, K], y [T, N], slots int32 [T] (-1 some of them), A [S, P, R, K], B [S, N, R], part_starts."""
    g = torch.Generator().manual_seed(seed)
    n, p = sum(parts), len(parts)
    x = torch.randn(t, k, generator=g).to(dtype)
    y = (torch.randn(t, n, generator=g) * 0.5).to(dtype)
    a = (torch.randn(s, p, r, k, generator=g) * k ** -0.5).to(dtype)
    b = (torch.randn(s, n, r, generator=g) * r ** -0.5).to(dtype)
    if slots is None:
        slots_t = torch.randint(-1, s, (t,), generator=g, dtype=torch.int32)
    else:
        slots_t = torch.tensor(slots, dtype=torch.int32)
    starts = torch.tensor([0] + [sum(parts[:i + 1]) for i in range(p)], dtype=torch.int64)
    return x, y, slots_t, a, b, starts


def quantize(w: torch.Tensor, generator: torch.Generator | None = None):
    """float [..., n] -> (int8 q, float32 scale [...]): w ~ q * scale, by rows of the last dimension,
    symmetric; with a generator, some entries of q then set to the extremes (-128 and 127)."""
    w = w.float()
    scale = w.abs().amax(dim=-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    if generator is not None:
        pick = torch.rand(q.shape, generator=generator)
        q[pick < 0.02] = -128
        q[pick > 0.98] = 127
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()[..., None]


def make_int8(t: int, k: int, parts: list[int], r: int, s: int, dtype: torch.dtype, seed: int = 0,
              slots: list[int] | None = None):
    """make()'s tensors with A and B int8 (extremes included): x, y, slots, A_q, A_scale, B_q,
    B_scale, part_starts."""
    x, y, slots_t, a, b, starts = make(t, k, parts, r, s, torch.float32, seed, slots)
    g = torch.Generator().manual_seed(seed + 1)
    a_q, a_scale = quantize(a, g)
    b_q, b_scale = quantize(b, g)
    return x.to(dtype), y.to(dtype), slots_t, a_q, a_scale, b_q, b_scale, starts


def reference(x, y, slots, a, b, starts):
    """float64: y + B[s] (A[s] x) per part, and the same with every term's absolute value (a bound
    on the rounding errors' scale)."""
    s_count, p, r, k = a.shape
    out, bound = y.double().clone(), y.double().abs()
    for s in range(s_count):
        idx = (slots == s).nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        xs = x.double()[idx]
        h = (xs @ a[s].double().reshape(p * r, k).T).reshape(-1, p, r)
        h_abs = (xs.abs() @ a[s].double().abs().reshape(p * r, k).T).reshape(-1, p, r)
        for i in range(p):
            o0, o1 = int(starts[i]), int(starts[i + 1])
            out[idx, o0:o1] += h[:, i] @ b[s, o0:o1].double().T
            bound[idx, o0:o1] += h_abs[:, i] @ b[s, o0:o1].double().abs().T
    return out, bound


def lora_add(x, y, slots, a, b, starts, path="FASTEST", a_scale=None, b_scale=None):
    kernels.lora_add(x=x, y=y, slots=slots, A=a, B=b, part_starts=starts, A_scale=a_scale, B_scale=b_scale,
                     path=kernels.KernelPath[path])


def check_close(got, expected, bound, k, r, dtype, extra=2):
    """Within the float32 summation error bound ((K + R + extra) units of 2^-24 of the terms'
    absolute sum), plus for bfloat16 the one rounding of the result to bfloat16 (2^-8 relative)."""
    tol = (k + r + extra) * 2.0 ** -24 * bound
    if dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * expected.abs()
    err = (got.double() - expected).abs()
    assert (err <= tol).all(), f"max error {err.max():.3g}, at most {(err / tol.clamp_min(1e-30)).max():.3g} x tol"


SHAPES = [
    # T, K, parts, R, S
    (1, 576, [576, 192, 192], 16, 4),  # SmolLM2 fused qkv, one decode token
    (16, 576, [1536, 1536], 16, 8),  # gate_up, decode batch spread over slots
    (7, 37, [5, 11], 5, 3),  # odd everything, P = 2
    (40, 100, [33], 24, 5),  # R not a multiple of 16, P = 1
    (300, 576, [576], 64, 2),  # prefill-sized runs (> 128 tokens a slot)
    (9, 48, [16, 16, 16], 1, 2),  # rank 1
    (12, 64, [20, 44], 80, 3),  # rank above 64
    (5, 40, [19, 30], 16, 3),  # rank 16, parts not multiples of 16 (few tokens a slot)
    (40, 40, [19, 30], 16, 2),  # the same, many tokens a slot
]


@pytest.mark.parametrize("t,k,parts,r,s", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@PATHS
def test_matches_float64_reference(path, dtype, t, k, parts, r, s):
    x, y, slots, a, b, starts = make(t, k, parts, r, s, dtype, seed=t + k + r)
    expected, bound = reference(x, y, slots, a, b, starts)
    got = y.clone()
    assert lora_add(x, got, slots, a, b, starts, path) is None
    assert got.dtype == dtype and got.shape == y.shape
    check_close(got, expected, bound, k, r, dtype)
    skipped = slots < 0
    assert torch.equal(got[skipped], y[skipped])  # rows without an adapter: bit for bit


@pytest.mark.parametrize("t,k,parts,r,s", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@PATHS
def test_int8_matches_float64_reference(path, dtype, t, k, parts, r, s):
    """int8 A and B with per-row scales: the reference on the dequantized weights, with two more
    roundings (each scale's product) in the bound."""
    x, y, slots, a_q, a_scale, b_q, b_scale, starts = make_int8(t, k, parts, r, s, dtype, seed=t + k + r)
    expected, bound = reference(x, y, slots, dequantize(a_q, a_scale), dequantize(b_q, b_scale), starts)
    got = y.clone()
    assert lora_add(x, got, slots, a_q, b_q, starts, path, a_scale, b_scale) is None
    assert got.dtype == dtype and got.shape == y.shape
    check_close(got, expected, bound, k, r, dtype, extra=4)
    skipped = slots < 0
    assert torch.equal(got[skipped], y[skipped])  # rows without an adapter: bit for bit


@PATHS
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_scales_apply_to_the_sums(dtype, path):
    """Small exact case: h = 0.25 * (1 - 4 + 9) = 1.5; delta = [0.5 * 2 * 1.5, 2 * -3 * 1.5]."""
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=dtype)
    a = torch.tensor([[[[1, -2, 3]]]], dtype=torch.int8)
    b = torch.tensor([[[2], [-3]]], dtype=torch.int8)
    y = torch.tensor([[1.0, 0.0]], dtype=dtype)
    lora_add(x, y, torch.zeros(1, dtype=torch.int32), a, b, torch.tensor([0, 2]), path,
             torch.tensor([[[0.25]]]), torch.tensor([[0.5, 2.0]]))
    assert y.tolist() == [[2.5, -9.0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_paths_agree(dtype):
    x, y, slots, a, b, starts = make(50, 576, [576, 192, 192], 16, 6, dtype, seed=3)
    fast, portable = y.clone(), y.clone()
    lora_add(x, fast, slots, a, b, starts, "FASTEST")
    lora_add(x, portable, slots, a, b, starts, "PORTABLE")
    diff = (fast.double() - portable.double()).abs()
    if dtype == torch.float32:
        assert diff.max() <= 1e-5 * portable.abs().max()
    else:  # each rounds float(y) + delta once: one bfloat16 step apart at most
        assert (diff <= 2.0 ** -7 * portable.double().abs()).all()
    assert torch.equal(fast[slots < 0], portable[slots < 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_paths_agree(dtype):
    x, y, slots, a_q, a_scale, b_q, b_scale, starts = make_int8(50, 576, [576, 192, 192], 16, 6, dtype, seed=3)
    fast, portable = y.clone(), y.clone()
    lora_add(x, fast, slots, a_q, b_q, starts, "FASTEST", a_scale, b_scale)
    lora_add(x, portable, slots, a_q, b_q, starts, "PORTABLE", a_scale, b_scale)
    diff = (fast.double() - portable.double()).abs()
    if dtype == torch.float32:
        assert diff.max() <= 1e-5 * portable.abs().max()
    else:
        assert (diff <= 2.0 ** -7 * portable.double().abs()).all()
    assert torch.equal(fast[slots < 0], portable[slots < 0])


@PATHS
def test_h_stays_float32_and_y_is_rounded_once(path):
    """bfloat16: h = 2^-8 + 2^-17 (not a bfloat16) and y = 1 + h rounds once, to 1 + 2^-7; rounding
    h (or the delta) to bfloat16 first would give 1 + 2^-8, a tie, rounded to even: 1."""
    x = torch.tensor([[2.0 ** -8, 2.0 ** -17]], dtype=torch.bfloat16)
    a = torch.ones(1, 1, 1, 2, dtype=torch.bfloat16)
    b = torch.ones(1, 1, 1, dtype=torch.bfloat16)
    y = torch.ones(1, 1, dtype=torch.bfloat16)
    lora_add(x, y, torch.zeros(1, dtype=torch.int32), a, b, torch.tensor([0, 1]), path)
    assert y.item() == 1 + 2.0 ** -7
    # and between shrink and expand: h0 = 1 + 2^-12, h1 = 1, delta = h0 - h1 = 2^-12 (0 if rounded)
    x = torch.tensor([[1.0, 2.0 ** -12]], dtype=torch.bfloat16)
    a = torch.tensor([[[[1.0, 1.0], [1.0, 0.0]]]], dtype=torch.bfloat16)
    b = torch.tensor([[[1.0, -1.0]]], dtype=torch.bfloat16)
    y = torch.zeros(1, 1, dtype=torch.bfloat16)
    lora_add(x, y, torch.zeros(1, dtype=torch.int32), a, b, torch.tensor([0, 1]), path)
    assert y.item() == 2.0 ** -12


@PATHS
def test_int8_h_stays_float32_and_y_is_rounded_once(path):
    """The same two cases with int8 weights (scales 1, then scales that are powers of two)."""
    one = torch.ones(1, 1, 1)
    x = torch.tensor([[2.0 ** -8, 2.0 ** -17]], dtype=torch.bfloat16)
    y = torch.ones(1, 1, dtype=torch.bfloat16)
    lora_add(x, y, torch.zeros(1, dtype=torch.int32), torch.ones(1, 1, 1, 2, dtype=torch.int8),
             torch.ones(1, 1, 1, dtype=torch.int8), torch.tensor([0, 1]), path, one, one[0])
    assert y.item() == 1 + 2.0 ** -7
    x = torch.tensor([[1.0, 2.0 ** -12]], dtype=torch.bfloat16)
    a = torch.tensor([[[[2, 2], [2, 0]]]], dtype=torch.int8)
    b = torch.tensor([[[4, -4]]], dtype=torch.int8)
    y = torch.zeros(1, 1, dtype=torch.bfloat16)
    lora_add(x, y, torch.zeros(1, dtype=torch.int32), a, b, torch.tensor([0, 1]), path,
             torch.full((1, 1, 2), 0.5), torch.full((1, 1), 0.25))
    assert y.item() == 2.0 ** -12


WEIGHTS = pytest.mark.parametrize("weights", ["float", "int8"])


def make_any(weights: str, t: int, k: int, parts: list[int], r: int, s: int, dtype: torch.dtype, seed: int = 0,
             slots: list[int] | None = None):
    """x, y, slots, part_starts and the weights' keyword arguments for lora_add (a, b, a_scale,
    b_scale): in x's dtype or int8."""
    if weights == "int8":
        x, y, slots_t, a_q, a_scale, b_q, b_scale, starts = make_int8(t, k, parts, r, s, dtype, seed, slots)
        return x, y, slots_t, starts, {"a": a_q, "b": b_q, "a_scale": a_scale, "b_scale": b_scale}
    x, y, slots_t, a, b, starts = make(t, k, parts, r, s, dtype, seed, slots)
    return x, y, slots_t, starts, {"a": a, "b": b}


@WEIGHTS
@pytest.mark.parametrize("dtype", DTYPES)
@PATHS
def test_tokens_without_adapter_are_untouched(path, dtype, weights):
    x, y, _, starts, w = make_any(weights, 12, 96, [64, 32], 8, 3, dtype)
    slots = torch.tensor([-1, 0, -1, -1, 2, 1, -1, 0, 0, -1, 2, -1], dtype=torch.int32)
    got = y.clone()
    lora_add(x, got, slots, starts=starts, path=path, **w)
    assert torch.equal(got[slots < 0], y[slots < 0])
    assert not torch.equal(got[slots >= 0], y[slots >= 0])
    none = y.clone()
    lora_add(x, none, torch.full((12,), -1, dtype=torch.int32), starts=starts, path=path, **w)
    assert torch.equal(none, y)


@WEIGHTS
@pytest.mark.parametrize("dtype", DTYPES)
@PATHS
def test_strided_y_changes_only_its_slice(path, dtype, weights):
    x, y, slots, starts, w = make_any(weights, 20, 64, [48, 40], 16, 4, dtype)
    wide = torch.randn(20, 200).to(dtype)
    wide[:, 37:37 + 88] = y
    before = wide.clone()
    view = wide[:, 37:37 + 88]
    assert view.stride() == (200, 1)
    lora_add(x, view, slots, starts=starts, path=path, **w)
    contiguous = y.clone()
    lora_add(x, contiguous, slots, starts=starts, path=path, **w)
    assert torch.equal(wide[:, 37:37 + 88], contiguous)
    assert torch.equal(wide[:, :37], before[:, :37]) and torch.equal(wide[:, 37 + 88:], before[:, 37 + 88:])


INVARIANCE_SHAPES = [(576, [64, 32, 32], 16), (100, [40, 24, 37], 24)]


@WEIGHTS
@pytest.mark.parametrize("k,parts,r", INVARIANCE_SHAPES, ids=["r16", "odd"])
@pytest.mark.parametrize("dtype", DTYPES)
@PATHS
def test_a_tokens_result_does_not_depend_on_its_batch(path, dtype, k, parts, r, weights):
    """Bit-identical: each token alone, in a mixed batch of 300 (runs of one slot longer than a
    chunk, interleaved decode-like stretches, tokens without an adapter), among copies of itself
    (the many-tokens path), and with one thread."""
    g = torch.Generator().manual_seed(7)
    slots = torch.cat([torch.full((150,), 2), torch.randint(-1, 4, (100,), generator=g), torch.full((50,), 0)])
    x, y, slots, starts, w = make_any(weights, 300, k, parts, r, 4, dtype, seed=11, slots=slots.tolist())
    batch = y.clone()
    lora_add(x, batch, slots, starts=starts, path=path, **w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = y.clone()
        lora_add(x, single, slots, starts=starts, path=path, **w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batch)
    for t in list(range(0, 300, 7)) + [149, 150, 151, 299]:
        alone = y[t:t + 1].clone()
        lora_add(x[t:t + 1], alone, slots[t:t + 1], starts=starts, path=path, **w)
        assert torch.equal(alone[0], batch[t]), f"token {t} (slot {int(slots[t])}) alone"
        for copies in (2, 3, 5, 9):
            many = y[t:t + 1].repeat(copies, 1)
            lora_add(x[t:t + 1].repeat(copies, 1), many, slots[t:t + 1].repeat(copies), starts=starts, path=path,
                     **w)
            assert all(torch.equal(row, batch[t]) for row in many), f"token {t} among {copies} copies"


def test_empty_batch_is_a_no_op():
    x, y, slots, a, b, starts = make(0, 32, [16], 4, 2, torch.float32)
    lora_add(x, y, slots, a, b, starts)
    assert y.shape == (0, 16)


def _args(**overrides):
    x, y, slots, a, b, starts = make(4, 32, [16, 8], 4, 3, torch.float32, slots=[0, 1, -1, 2])
    args = {"x": x, "y": y, "slots": slots, "A": a, "B": b, "part_starts": starts}
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,message", [
    ({"x": torch.zeros(4, 32, dtype=torch.float16)}, "float32 or bfloat16"),
    ({"y": torch.zeros(4, 24, dtype=torch.bfloat16)}, "same dtype"),
    ({"A": torch.zeros(3, 2, 4, 32, dtype=torch.bfloat16)}, "same dtype"),
    ({"y": torch.zeros(5, 24)}, "rows"),
    ({"A": torch.zeros(3, 2, 4, 30)}, "has K = 30"),
    ({"B": torch.zeros(3, 24, 5)}, r"B must be \[S, N, R\]"),
    ({"B": torch.zeros(2, 24, 4)}, r"B must be \[S, N, R\]"),
    ({"A": torch.zeros(3, 2, 32, 4).transpose(2, 3)}, "contiguous"),
    ({"slots": torch.tensor([0, 1, -1, 2])}, "slots must be int32"),
    ({"slots": torch.tensor([0, 1, -1], dtype=torch.int32)}, "entries"),
    ({"slots": torch.tensor([0, 3, -1, 2], dtype=torch.int32)}, "slot out of range"),
    ({"part_starts": torch.tensor([0, 16, 24], dtype=torch.int32)}, "part_starts must be int64"),
    ({"part_starts": torch.tensor([0, 24])}, r"P \+ 1"),
    ({"part_starts": torch.tensor([0, 16, 20])}, "from 0 to N"),
    ({"part_starts": torch.tensor([0, 24, 24])}, "increase"),
    ({"y": torch.zeros(24, 4).T}, "last dimension"),
    ({"y": torch.zeros(48).as_strided((4, 24), (8, 1))}, "overlap"),
    ({"x": torch.zeros(4, 32, 1)}, r"x \[T, K\]"),
])
def test_bad_input_is_rejected(overrides, message):
    args = _args(**overrides)
    before = args["y"].clone()
    with pytest.raises(RuntimeError, match=message):
        kernels.lora_add(**args)
    assert torch.equal(args["y"], before)  # nothing written


def _int8_args(**overrides):
    x, y, slots, a_q, a_scale, b_q, b_scale, starts = make_int8(4, 32, [16, 8], 4, 3, torch.bfloat16,
                                                                slots=[0, 1, -1, 2])
    args = {"x": x, "y": y, "slots": slots, "A": a_q, "B": b_q, "part_starts": starts, "A_scale": a_scale,
            "B_scale": b_scale}
    args.update(overrides)
    return {key: value for key, value in args.items() if value is not None}


@pytest.mark.parametrize("overrides,message", [
    ({"A_scale": None}, "int8 A needs A_scale"),
    ({"B_scale": None}, "int8 B needs B_scale"),
    ({"A_scale": None, "B_scale": None}, "int8 A needs A_scale"),
    ({"B": torch.zeros(3, 24, 4, dtype=torch.bfloat16)}, "both int8"),
    ({"A": torch.zeros(3, 2, 4, 32, dtype=torch.bfloat16)}, "both int8"),
    ({"A": torch.zeros(3, 2, 4, 32), "B": torch.zeros(3, 24, 4)}, "same dtype"),
    ({"A": torch.zeros(3, 2, 4, 32, dtype=torch.bfloat16), "B": torch.zeros(3, 24, 4, dtype=torch.bfloat16)},
     "A_scale is only for int8 A"),
    ({"A": torch.zeros(3, 2, 4, 32, dtype=torch.bfloat16), "B": torch.zeros(3, 24, 4, dtype=torch.bfloat16),
      "A_scale": None}, "B_scale is only for int8 B"),
    ({"A_scale": torch.ones(3, 2, 4, dtype=torch.bfloat16)}, "A_scale must be float32"),
    ({"B_scale": torch.ones(3, 24, dtype=torch.float64)}, "B_scale must be float32"),
    ({"A_scale": torch.ones(3, 8)}, r"A_scale must be \[S, P, R\]"),
    ({"A_scale": torch.ones(3, 2, 5)}, r"A_scale must be \[S, P, R\]"),
    ({"B_scale": torch.ones(3, 24, 1)}, r"B_scale must be \[S, N\]"),
    ({"B_scale": torch.ones(2, 24)}, r"B_scale must be \[S, N\]"),
    ({"A_scale": torch.ones(3, 4, 2).transpose(1, 2)}, "A_scale must be contiguous"),
    ({"B_scale": torch.ones(24, 3).T}, "B_scale must be contiguous"),
    ({"x": torch.zeros(4, 32, dtype=torch.int8)}, "float32 or bfloat16"),
    ({"y": torch.zeros(4, 24, dtype=torch.int8)}, "same dtype"),
    ({"A": torch.zeros(3, 2, 4, 30, dtype=torch.int8)}, "has K = 30"),
])
def test_bad_int8_input_is_rejected(overrides, message):
    args = _int8_args(**overrides)
    before = args["y"].clone()
    with pytest.raises(RuntimeError, match=message):
        kernels.lora_add(**args)
    assert torch.equal(args["y"], before)  # nothing written


def test_good_int8_input_is_accepted():
    """_int8_args itself is valid (the cases above fail for their one reason)."""
    args = _int8_args()
    kernels.lora_add(**args)
