// The Python module of tokenmill's CPU kernels: one entry per kernel file.

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor key_scale, torch::Tensor value_scale, torch::Tensor block_tables,
                                     torch::Tensor key_start, torch::Tensor key_end, double scale, bool generic);
bool supports_head_dim(int64_t D);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor key_start,
                                      torch::Tensor key_end, int64_t window, double scale, bool generic);
torch::Tensor int8_weight_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale, bool generic);
bool int4_linear_fast();
torch::Tensor int4_weight_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros, int64_t group_size,
                                 bool generic);
bool bf16_linear_fast();
torch::Tensor bf16_pack(torch::Tensor weight);
torch::Tensor bf16_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias);
void write_quantized_kv(torch::Tensor x, torch::Tensor slots, torch::Tensor rows, torch::Tensor scales);
void bind_decoder(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("supports_head_dim", &supports_head_dim,
        "whether paged_decode_attention and paged_prefill_attention handle this head_dim");
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal prefill attention (CPU)");
  m.def("int8_weight_linear", &int8_weight_linear, "weight-only int8 linear, any number of rows (CPU)");
  m.def("int4_linear_fast", &int4_linear_fast, "whether int4_weight_linear has its AVX-512 BF16 path");
  m.def("int4_weight_linear", &int4_weight_linear, "weight-only int4 linear, group-wise, any number of rows (CPU)");
  m.def("bf16_linear_fast", &bf16_linear_fast, "whether bf16_packed_linear can run here (AVX-512 BF16)");
  m.def("bf16_pack", &bf16_pack, "pack a bfloat16 [N, K] weight for bf16_packed_linear");
  m.def("bf16_packed_linear", &bf16_packed_linear, "bfloat16 linear over a packed weight, any number of rows (CPU)");
  m.def("write_quantized_kv", &write_quantized_kv, "quantize new K or V rows into an int8 / fp8 cache (CPU)");
  bind_decoder(m);
}
