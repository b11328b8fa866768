"""gptq_columns (gptq.cpp), GPTQ's column loop on CPU, against the same loop in PyTorch
(gptq._columns): one block column by column, and whole layers with static (act-order) and dynamic
groups. Sums differ in order only, so a level may flip where a weight sits on a rounding boundary."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import require_kernels
from tokenmill.quantization import gptq
from tokenmill.quantization.linear import Int4Linear, pack_int4

ops = require_kernels()


def _block(n: int, b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, b, generator=g) * 0.05
    a = torch.randn(b, 2 * b, generator=g)
    h = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(a @ a.T / b + torch.eye(b))), upper=True)
    scale = torch.rand(n, b, generator=g) * 0.01 + 0.005
    zero = torch.randn(n, b, generator=g) * 0.01
    return w, h.contiguous(), scale, zero


@pytest.mark.parametrize("begin,end", [(0, 96), (32, 64), (95, 96), (10, 10)])
def test_a_block_matches_pytorch(begin, end):
    n, b = 40, 96
    w, h, scale, zero = _block(n, b)
    scale, zero = scale[:, begin:end].contiguous(), zero[:, begin:end].contiguous()
    results = []
    for run in (ops.gptq_columns, gptq._columns):
        w_run, levels, err = w.clone(), torch.zeros(n, b), torch.zeros(n, b)
        run(w_run, h, scale, zero, begin, end, levels, err)
        results.append((w_run, levels, err))
    (w_k, levels_k, err_k), (w_p, levels_p, err_p) = results
    assert (levels_k == levels_p).float().mean().item() >= 0.995
    assert levels_k.min() >= -8 and levels_k.max() <= 7
    assert torch.equal(levels_k[:, :begin], torch.zeros(n, begin)) and torch.equal(w_k[:, :begin], w[:, :begin])
    same = (levels_k == levels_p).all(dim=1)  # rows without a flipped level agree to float rounding
    assert torch.allclose(w_k[same], w_p[same], atol=1e-5) and torch.allclose(err_k[same], err_p[same], atol=1e-4)


@pytest.mark.parametrize("act_order", [True, False], ids=["static groups", "dynamic groups"])
def test_layers_quantize_as_well_as_pytorch(act_order, monkeypatch):
    k, n = 256, 48
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(1024, k, generator=g) @ (torch.randn(k, k, generator=g) * torch.logspace(0, -2, k)[:, None])
    errors = {}
    for name in ("kernel", "pytorch"):
        with monkeypatch.context() as m:
            if name == "pytorch":
                m.setattr(gptq.dispatch, "for_tensors", lambda *tensors: None)
            q, scale, zero = gptq.gptq_quantize(w, x.T @ x, 64, torch.float32, act_order=act_order, range_search=True,
                                                activation_weighted=True)
        layer = Int4Linear(pack_int4(q), scale, zero, k).prepare()
        errors[name] = (layer(x) - x @ w.T).norm().item()
    assert errors["kernel"] == pytest.approx(errors["pytorch"], rel=0.02), errors


def test_bad_arguments_are_named():
    w, h, scale, zero = _block(4, 8)
    out = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="begin <= end"):
        ops.gptq_columns(w, h, scale[:, :2].contiguous(), zero[:, :2].contiguous(), 7, 9, out, out.clone())
    with pytest.raises(RuntimeError, match="scale and zero must be"):
        ops.gptq_columns(w, h, scale, zero, 0, 4, out, out.clone())
    with pytest.raises(RuntimeError, match="h must be"):
        ops.gptq_columns(w, h[:4, :4].contiguous(), scale, zero, 0, 8, out, out.clone())
