"""The typed boundary of the one-call decode stack: CpuLinearSpec, its conversion to the C++ Linear
(named enum members, keyword arguments only), and the quantized linears' descriptions of themselves."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import kernels_or_none, off_reason
from tokenmill.kernels import dispatch
from tokenmill.kernels.linear_spec import CpuLinearSpec, LinearKind
from tokenmill.quantization.linear import Int4Linear, Int8Linear

ops = kernels_or_none()
needs_kernels = pytest.mark.skipif(ops is None, reason=off_reason() or "")


def test_spec_invariants():
    w = torch.zeros(16, 64)
    with pytest.raises(ValueError, match="scales"):
        CpuLinearSpec(kind=LinearKind.INT8, weight=w, out_features=16, in_features=64)
    with pytest.raises(ValueError, match="group_size"):
        CpuLinearSpec(kind=LinearKind.INT4, weight=w, out_features=16, in_features=64, scales=w, group_size=0)
    with pytest.raises(ValueError, match="group_size"):
        CpuLinearSpec(kind=LinearKind.INT4, weight=w, out_features=16, in_features=64, scales=w, group_size=48)
    spec = CpuLinearSpec(kind=LinearKind.DENSE, weight=w, out_features=16, in_features=64)
    with pytest.raises(AttributeError):
        spec.kind = LinearKind.INT8  # frozen


def test_grouped_spec_invariants():
    w = torch.zeros(1, 16, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales"):
        CpuLinearSpec(kind=LinearKind.GROUPED, weight=w, out_features=16, in_features=64, group_size=32, bits=4)
    with pytest.raises(ValueError, match="group_size"):
        CpuLinearSpec(kind=LinearKind.GROUPED, weight=w, out_features=16, in_features=64, scales=w, bits=4)
    with pytest.raises(ValueError, match="group_size"):
        CpuLinearSpec(kind=LinearKind.GROUPED, weight=w, out_features=16, in_features=64, scales=w, group_size=48,
                      bits=4)
    for bits in (0, 6, 16):
        with pytest.raises(ValueError, match="bits 4, 5, 7 or 8"):
            CpuLinearSpec(kind=LinearKind.GROUPED, weight=w, out_features=16, in_features=64, scales=w,
                          group_size=32, bits=bits)
    spec = CpuLinearSpec(kind=LinearKind.GROUPED, weight=w, out_features=16, in_features=64, scales=w,
                         group_size=32, bits=8)
    assert spec.bits == 8 and CpuLinearSpec(kind=LinearKind.DENSE, weight=w, out_features=16,
                                            in_features=64).bits == 0


def test_int8_linear_describes_itself():
    lin = Int8Linear.from_float(torch.randn(32, 48), torch.randn(32), torch.float32)
    spec = lin.cpu_kernel_spec()
    assert spec.kind is LinearKind.INT8 and spec.weight is lin.qweight and spec.scales is lin.scale
    assert spec.bias is lin.bias and (spec.out_features, spec.in_features, spec.group_size) == (32, 48, 0)


def test_int4_linear_describes_itself_only_with_the_cpu_kernel():
    lin = Int4Linear.from_float(torch.randn(20, 40), None, torch.bfloat16, 32)
    spec = lin.cpu_kernel_spec()
    if dispatch.for_int4("cpu") is None:
        assert spec is None  # PyTorch's int4 kernel: the decode stack cannot run it
        return
    assert spec.kind is LinearKind.INT4 and spec.bias is None
    assert (spec.out_features, spec.in_features, spec.group_size) == (20, 64, 32)  # K padded to whole groups
    assert spec.weight.shape == (2, 16, 32)  # N padded to 32 rows, in tiles of 16


@needs_kernels
def test_python_and_cpp_kinds_have_the_same_names():
    assert [k.name for k in LinearKind] == [k.name for k in ops.LinearKind]
    assert [p.name for p in ops.KernelPath] == ["FASTEST", "PORTABLE", "VECTOR"]


@needs_kernels
def test_native_linear_takes_named_members_and_keywords_only():
    w, s = torch.zeros(16, 32, dtype=torch.int8), torch.ones(16)
    native = CpuLinearSpec(kind=LinearKind.INT8, weight=w, out_features=16, in_features=32, scales=s).native(ops)
    assert native.kind == ops.LinearKind.INT8 and (native.out_features, native.in_features) == (16, 32)
    with pytest.raises(TypeError):
        ops.Linear(kind=2, weight=w, out_features=16, in_features=32, scales=s)  # a bare int is no kind
    with pytest.raises(TypeError):
        ops.Linear(ops.LinearKind.INT8, w, 16, 32, s)  # positional
    with pytest.raises(RuntimeError, match="scales"):
        ops.Linear(kind=ops.LinearKind.INT4, weight=w, out_features=16, in_features=32, group_size=32)
    with pytest.raises(TypeError):  # bits is a keyword too
        ops.Linear(ops.LinearKind.GROUPED, w, 16, 32, s, None, 32, 4)
    with pytest.raises(TypeError):
        ops.int8_weight_linear(torch.zeros(1, 32), w, s, True)  # the kernel path is keyword-only


@needs_kernels
def test_decode_plans_cross_by_name():
    slots, tables = torch.zeros(2, dtype=torch.long), torch.zeros(2, 3, dtype=torch.int32)
    start, end = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    plan = ops.DecodePlan(slots=slots, block_tables=tables, key_start=start, key_end=end)
    assert plan.block_tables is not None and torch.equal(plan.key_end, end)
    with pytest.raises(TypeError):
        ops.DecodePlan(slots, tables, start, end)  # positional: refused
    stack = ops.DecodeStack(eps=1e-6, cast_before_scale=True)
    with pytest.raises(TypeError):  # the old 4-tuples are no longer accepted
        stack.run(h=torch.zeros(2, 8), ropes=[], plans=[(slots, tables, start, end)])
