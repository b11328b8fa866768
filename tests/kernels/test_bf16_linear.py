"""tokenmill's bfloat16 CPU linear over packed weights (bf16_linear.cpp) against a float64
reference and oneDNN, and the model's use of it (tokenmill.models.layers.linear)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.kernel_utils import cpu_flags, require_kernels
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
@pytest.mark.parametrize("path", ["FASTEST", "VECTOR"], ids=["fastest", "avx512"])
def test_matches_float64_reference_as_well_as_onednn(path, m, n, k, bias):
    x, w, b = _case(m, n, k)
    b = b if bias else None
    got = kernels.bf16_packed_linear(x, kernels.bf16_pack(w), n, b if b is not None else torch.empty(0),
                                     path=kernels.KernelPath[path])
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    expected = x.double() @ w.double().T + (b.double() if b is not None else 0)
    onednn = torch.nn.functional.linear(x, w, b)
    # both sum in float32 and round once to bfloat16: the same error, up to a rounding step
    err, ref_err = (got.double() - expected).abs(), (onednn.double() - expected).abs()
    assert err.max() <= ref_err.max() * 1.01 + 1e-6
    assert (got != onednn).float().mean() < 0.02  # differ only where float32 summation order flips a rounding


@pytest.mark.parametrize("m", [13, 40])
@pytest.mark.parametrize("path", ["FASTEST", "VECTOR"], ids=["fastest", "avx512"])
def test_float32_out_holds_the_bfloat16_outputs_exactly(path, m):
    """out_float32 (logits): the bfloat16 outputs, bias included, widened; N = 300 ends in a partial tile."""
    x, w, b = _case(m, 300, 576)
    packed = kernels.bf16_pack(w)
    kernel_path = kernels.KernelPath[path]
    wide = kernels.bf16_packed_linear(x, packed, 300, b, out_float32=True, path=kernel_path)
    assert wide.dtype == torch.float32 and wide.shape == (m, 300)
    assert torch.equal(wide, kernels.bf16_packed_linear(x, packed, 300, b, path=kernel_path).float())


@pytest.mark.parametrize("path", ["FASTEST", "VECTOR"], ids=["fastest", "avx512"])
def test_rows_do_not_depend_on_the_batch_nor_the_threads(path):
    """Alone, in any batch and on any number of threads. Where the fastest path has AMX tiles, calls
    of amx_min_rows() rows or more run on them: a row's result is then the same in every such call
    (row tiles of 16 and their tails included), and in a smaller call it is the vector path's."""
    x, w, b = _case(70, 300, 576)
    packed = kernels.bf16_pack(w)

    def mm(rows, kernel_path=kernels.KernelPath[path]):
        return kernels.bf16_packed_linear(rows, packed, 300, b, path=kernel_path)

    together = mm(x)
    tiles = path == "FASTEST" and kernels.amx_tiles()
    few = mm(x, kernels.KernelPath.VECTOR) if tiles else together
    want = (lambda m: together if m >= kernels.amx_min_rows() else few) if tiles else (lambda m: together)
    for i in range(37):
        assert torch.equal(mm(x[i:i + 1])[0], want(1)[i])
    for m in (2, 3, 4, 5, 15, 16, 17, 32, 33):
        assert torch.equal(mm(x[:m]), want(m)[:m])
        assert torch.equal(mm(x[m:2 * m]), want(m)[m:2 * m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mm(x), together)
    finally:
        torch.set_num_threads(threads)


def test_amx_tiles_run_where_the_cpu_has_them():
    """On Linux, a host whose CPU flags name AMX-BF16 runs bfloat16 products on tiles (the build is
    -march=native, the process asks the kernel for the tile state); any other host on vectors."""
    flags = cpu_flags()
    assert kernels.amx_tiles() == ({"amx_tile", "amx_bf16"} <= flags)
    assert kernels.amx_min_rows() == (4 if kernels.amx_tiles() else 0)


def test_tokenmill_amx_0_keeps_the_vector_paths():
    """TOKENMILL_AMX=0 (read once per process): no tiles, so every row count computes as hosts
    without AMX do."""
    import os
    import subprocess
    import sys

    code = "from tests.kernel_utils import require_kernels; print(require_kernels().amx_tiles())"
    env = {**os.environ, "TOKENMILL_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


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
