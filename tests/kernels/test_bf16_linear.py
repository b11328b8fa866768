"""tokenmill's bfloat16 CPU linear over packed weights (bf16_linear.cpp) against a float64
reference and oneDNN, and the model's use of it (tokenmill.models.layers.linear)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.kernel_utils import require_kernels
from tokenmill.models.layers import linear

kernels = require_kernels()
pytestmark = pytest.mark.skipif(not kernels.bf16_linear_fast(),
                                reason="no AVX-512 BF16 on this CPU: the bf16 GEMM has no fast path here")


def _case(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 7 * m + n)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    return torch.randn(m, k, generator=g).bfloat16(), w, torch.randn(n, generator=g).bfloat16()


def test_packed_layout():
    """(t, p, j, e) of the packed weight is w[16 t + j, 2 p + e]; rows past N are zeros."""
    w = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).bfloat16()
    packed = kernels.bf16_pack(w)
    assert packed.shape == (2, 3, 16, 2)
    for t, p, j, e in [(0, 0, 0, 0), (0, 2, 15, 1), (1, 1, 3, 0), (1, 2, 3, 1)]:
        assert packed[t, p, j, e] == w[16 * t + j, 2 * p + e]
    assert (packed[1, :, 4:] == 0).all()


# every register block (1-12 rows, 2/4/8 tiles at once), a partial last tile and tile group, bias or not
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 12, 13, 32, 41])
@pytest.mark.parametrize("n,k", [(100, 48), (1536, 576), (37, 1536), (16, 2), (200, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference_as_well_as_onednn(m, n, k, bias):
    x, w, b = _case(m, n, k)
    b = b if bias else None
    got = kernels.bf16_packed_linear(x, kernels.bf16_pack(w), n, b if b is not None else torch.empty(0))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    expected = x.double() @ w.double().T + (b.double() if b is not None else 0)
    onednn = torch.nn.functional.linear(x, w, b)
    # both sum in float32 and round once to bfloat16: the same error, up to a rounding step
    err, ref_err = (got.double() - expected).abs(), (onednn.double() - expected).abs()
    assert err.max() <= ref_err.max() * 1.01 + 1e-6
    assert (got != onednn).float().mean() < 0.02  # differ only where float32 summation order flips a rounding


def test_float32_out_holds_the_bfloat16_outputs_exactly():
    """out_float32 (logits): the bfloat16 outputs, bias included, widened; N = 300 ends in a partial tile."""
    x, w, b = _case(13, 300, 576)
    packed = kernels.bf16_pack(w)
    wide = kernels.bf16_packed_linear(x, packed, 300, b, out_float32=True)
    assert wide.dtype == torch.float32 and wide.shape == (13, 300)
    assert torch.equal(wide, kernels.bf16_packed_linear(x, packed, 300, b).float())


def test_rows_do_not_depend_on_the_batch_nor_the_threads():
    x, w, b = _case(37, 300, 576)
    packed = kernels.bf16_pack(w)
    together = kernels.bf16_packed_linear(x, packed, 300, b)
    for i in range(37):
        assert torch.equal(kernels.bf16_packed_linear(x[i:i + 1], packed, 300, b)[0], together[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.bf16_packed_linear(x, packed, 300, b), together)
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_rejected():
    w = torch.zeros(16, 48, dtype=torch.bfloat16)
    packed = kernels.bf16_pack(w)
    with pytest.raises(RuntimeError, match="even"):
        kernels.bf16_pack(torch.zeros(16, 47, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.bf16_pack(w.float())
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.bf16_packed_linear(torch.zeros(1, 50, dtype=torch.bfloat16), packed, 16, torch.empty(0))
    with pytest.raises(RuntimeError, match="bias"):
        kernels.bf16_packed_linear(torch.zeros(1, 48, dtype=torch.bfloat16), packed, 16, torch.zeros(3))


def test_model_linear_uses_it_and_repacks_a_changed_weight():
    layer = nn.Linear(64, 40, bias=True).bfloat16()
    x = torch.randn(5, 3, 64).bfloat16()
    with torch.inference_mode():
        out = linear(layer, x)
        assert out.shape == (5, 3, 40)
        packed = kernels.bf16_pack(layer.weight)
        want = kernels.bf16_packed_linear(x.reshape(15, 64), packed, 40, layer.bias).view(5, 3, 40)
        assert torch.equal(out, want)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the packed copy must follow
    with torch.inference_mode():
        assert torch.equal(linear(layer, x), kernels.bf16_packed_linear(
            x.reshape(15, 64), kernels.bf16_pack(layer.weight), 40, layer.bias).view(5, 3, 40))
    # gradients wanted (QAT): PyTorch's own linear, differentiable
    xg = x.float().requires_grad_()
    layer = layer.float()
    y = linear(layer, xg)
    y.sum().backward()
    assert xg.grad is not None


def test_hooked_modules_are_called_as_modules():
    """Calibration (GPTQ, SmoothQuant, static W8A8) hooks linears to observe their inputs."""
    layer = nn.Linear(64, 40, bias=False).bfloat16()
    seen = []
    layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    with torch.inference_mode():
        linear(layer, torch.randn(3, 64).bfloat16())
    assert seen == [(3, 64)]
