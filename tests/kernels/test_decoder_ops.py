"""The decoder layer's CPU operations (rms_norm, qkv_rope, act_mul) against PyTorch float64."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernel_utils import require_kernels

ops = require_kernels()
DTYPES = [torch.float32, torch.bfloat16]


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1.6e-2  # bfloat16: a couple of roundings of 2^-8


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("cast_before_scale", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_rms_norm(dtype, cast_before_scale):
    x = (torch.randn(7, 3, 576) * 4).to(dtype)
    w = torch.randn(576)
    w = w.to(dtype) if cast_before_scale else w  # Gemma keeps its norm weights in float32
    got = ops.rms_norm(x, w, 1e-6, cast_before_scale)
    assert got.dtype == dtype and got.shape == x.shape
    assert _rel(got, _rms(x, w, 1e-6)) <= _tol(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_qkv_rope(dtype, qk_norm):
    T, H, Hkv, D = 5, 6, 2, 64
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(dtype)
    pos = torch.arange(100, 100 + T, dtype=torch.float64)
    freqs = pos[:, None] / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qn, kn = (torch.rand(D).to(dtype) + 0.5, torch.rand(D).to(dtype) + 0.5) if qk_norm else (None, None)
    q, k, v = ops.qkv_rope(qkv, H, Hkv, D, cos, sin, qn, kn, 1e-6, True)
    assert q.shape == (T, H, D) and k.shape == (T, Hkv, D) and v.shape == (T, Hkv, D)
    eq, ek, ev = qkv.double().split([H * D, Hkv * D, Hkv * D], dim=-1)
    eq, ek = eq.view(T, H, D), ek.view(T, Hkv, D)
    if qk_norm:
        eq, ek = _rms(eq, qn, 1e-6), _rms(ek, kn, 1e-6)
    assert _rel(q, _rope(eq, cos.double(), sin.double())) <= _tol(dtype)
    assert _rel(k, _rope(ek, cos.double(), sin.double())) <= _tol(dtype)
    assert torch.equal(v, qkv[:, (H + Hkv) * D:].view(T, Hkv, D))


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_act_mul(dtype, gelu):
    gate_up = (torch.randn(4, 2 * 1536) * 3).to(dtype)
    g, u = gate_up.double().chunk(2, dim=-1)
    act = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) if gelu else g * torch.sigmoid(g)
    got = ops.act_mul(gate_up, gelu)
    assert got.shape == (4, 1536) and _rel(got, act * u) <= _tol(dtype)


def test_bad_input_is_rejected():
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6, True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.ones(8), 1e-6, True)
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.qkv_rope(torch.zeros(2, 10), 1, 1, 4, torch.zeros(2, 4), torch.zeros(2, 4), None, None, 1e-6, True)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ops.act_mul(torch.zeros(2, 3), False)
