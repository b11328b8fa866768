// The Python module of tokenmill's CPU kernels: one entry per kernel file (declared in kernels.h).
//
// Every argument has its name; ``path`` (a KernelPath) is keyword-only and defaults to FASTEST,
// so Python code never passes a bare flag and the engine never passes it at all.

#include <pybind11/native_enum.h>
#include <torch/python.h>  // pybind11 and its tensor casters, without torch/all.h (C++ frontend, autograd)

#include "amx.h"
#include "kernels.h"

// decoder.cpp: rms_norm, qkv_rope, act_mul, LinearKind, Linear and DecodeStack
void bind_decoder(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::native_enum<KernelPath>(m, "KernelPath", "enum.Enum",
                              "Which implementation a kernel runs: FASTEST (what the engine uses), PORTABLE (plain "
                              "loops, for tests to compare against) or VECTOR (AVX-512 without AMX tiles or fixed-point x)")
      .value("FASTEST", KernelPath::Fastest, "the vectorized path this build has, else the portable one")
      .value("PORTABLE", KernelPath::Portable, "plain C++ loops")
      .value("VECTOR", KernelPath::Vector, "the AVX-512 vector path even where AMX tiles or fixed-point products would run")
      .finalize();
  const auto path = py::arg("path") = KernelPath::Fastest;
  // The kernels touch no Python object: they run without the GIL, so that a server's HTTP thread
  // (tokenmill.server.async_engine) is not held up by a step's LM head or attention, nor the step
  // by it beyond its own work.
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("argmax_rows", &argmax_rows, nogil,
        "torch.argmax(x, -1) of float32 [rows, vocab] logits: the lowest index of each row's largest value, a NaN "
        "counting as the largest (CPU)", py::arg("x"), py::kw_only(), path);
  m.def("int4_range_search", &int4_range_search, nogil,
        "int4 range search: each group's (scale, zero) with the least squared rounding error among min-max, ranges "
        "trimmed by trims at either end and their least-squares refits, as dtype (0 float32, 1 bfloat16, 2 float16) "
        "rounds them (CPU)",
        py::arg("w"), py::arg("importance"), py::arg("trims"), py::arg("dtype"));
  m.def("gptq_columns", &gptq_columns, nogil,
        "GPTQ's column loop over columns begin..end of one block, in place: levels q - 8 and errors scaled by the "
        "Cholesky factor's diagonal into levels and err, each error pushed onto the block's later columns (CPU)",
        py::arg("w"), py::arg("h"), py::arg("scale"), py::arg("zero"), py::arg("begin"), py::arg("end"),
        py::arg("levels"), py::arg("err"));
  m.def("paged_decode_attention", &paged_decode_attention, nogil, "paged decode attention (CPU)", py::arg("q"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("key_scale"), py::arg("value_scale"),
        py::arg("block_tables"), py::arg("key_start"), py::arg("key_end"), py::arg("scale"), py::kw_only(), path);
  m.def("supports_head_dim", &supports_head_dim,
        "whether paged_decode_attention and paged_prefill_attention handle this head_dim", py::arg("head_dim"));
  m.def("paged_prefill_attention", &paged_prefill_attention, nogil, "paged causal prefill attention (CPU)", py::arg("q"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("key_start"), py::arg("key_end"), py::arg("window"), py::arg("scale"), py::kw_only(), path);
  m.def("int8_weight_linear", &int8_weight_linear, nogil, "weight-only int8 linear, any number of rows (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("scale"), py::kw_only(), path);
  m.def("int4_linear_fast", &int4_linear_fast, "whether int4_weight_linear has its AVX-512 BF16 path");
  m.def("int4_weight_linear", &int4_weight_linear, nogil, "weight-only int4 linear, group-wise, any number of rows (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("scales_zeros"), py::arg("group_size"), py::kw_only(), path);
  m.def("group_linear_fast", &group_linear_fast, "whether group_weight_linear has its AVX-512 BF16 path");
  m.def("fixed_point_rows", &fixed_point_rows,
        "grouped-code calls with bfloat16 x and fewer rows than this take integer products, x in 16-bit fixed point "
        "per group (0: none on this build); KernelPath.VECTOR keeps the bfloat16 products");
  m.def("dequant_rows", &dequant_rows,
        "grouped-code calls with bfloat16 x and at least this many rows run the bfloat16 GEMM over weights rounded to "
        "bfloat16 once per call (every host with the AVX-512 BF16 path; 0: none); KernelPath.VECTOR keeps the "
        "group-by-group sums");
  m.def("group_weight_linear", &group_weight_linear, nogil,
        "weight-only linear over grouped codes (w = code * scale + min, bits 4, 5, 7 or 8), any number of rows (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("sz"), py::arg("group_size"), py::arg("bits"), py::kw_only(),
        py::arg("out_float32") = false, path);
  m.def("int8_copy_linear_fast", &int8_copy_linear_fast,
        "whether int8_copy_linear has its AVX-512 VNNI path (else it runs plain loops)");
  m.def("int8_copy_linear", &int8_copy_linear, nogil,
        "grouped codes' int8 copy (int8_copy_pack; offset: its symmetric code offset, or -1 where it holds mins) times x "
        "in two int8 parts per row and group of group_size (one_part: one), "
        "any number of rows (CPU)",
        py::arg("x"), py::arg("copy"), py::arg("out_features"), py::arg("group_size"), py::arg("offset"),
        py::arg("bias"),
        py::kw_only(), py::arg("out_float32") = false, py::arg("one_part") = false, path);
  m.def("bf16_linear_fast", &bf16_linear_fast, "whether bf16_packed_linear can run here (AVX-512 BF16)");
  m.def("bf16_pack", &bf16_pack, nogil, "pack a bfloat16 [N, K] weight for bf16_packed_linear", py::arg("weight"));
  m.def("bf16_packed_linear", &bf16_packed_linear, nogil, "bfloat16 linear over a packed weight, any number of rows (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias"), py::kw_only(),
        py::arg("out_float32") = false, path);
  m.def("amx_tiles", &amx_tiles,
        "whether bfloat16 products run on AMX tiles here (bfloat16 x, calls of amx_min_rows() rows or more)");
  m.def("amx_min_rows", &amx_min_rows, "the fewest rows a call runs on AMX tiles with (0: no tiles here)");
  m.def("sparse_linear_fast", &sparse_linear_fast,
        "whether sparse_bf16_linear can run here (AVX-512 BF16 and VBMI2)");
  m.def("sparse_bf16_pack", &sparse_bf16_pack, nogil,
        "a bfloat16 [N, K] weight without its zeros: (values, masks, offsets) for sparse_bf16_linear",
        py::arg("weight"));
  m.def("sparse_bf16_linear", &sparse_bf16_linear, nogil,
        "bfloat16 linear over sparse_bf16_pack's tensors, bit-identical to bf16_packed_linear (CPU)", py::arg("x"),
        py::arg("values"), py::arg("masks"), py::arg("offsets"), py::arg("bias"), py::arg("out_features"),
        py::kw_only(), py::arg("out_float32") = false);
  m.def("write_quantized_kv", &write_quantized_kv, nogil, "quantize new K or V rows into an int8 / fp8 cache (CPU)",
        py::arg("x"), py::arg("slots"), py::arg("rows"), py::arg("scales"));
  m.def("lora_add", &lora_add, nogil,
        "batched multi-LoRA, in place: y[t] += B[s] @ (A[s] @ x[t]) per part, s = slots[t] (rows with s < 0 "
        "untouched); A and B in x's dtype, or int8 with float32 per-row scales A_scale [S, P, R] and "
        "B_scale [S, N] (CPU)",
        py::arg("x"), py::arg("y"), py::arg("slots"), py::arg("A"), py::arg("B"), py::arg("part_starts"),
        py::kw_only(), py::arg("A_scale") = py::none(), py::arg("B_scale") = py::none(), path);
  bind_decoder(m);
}
