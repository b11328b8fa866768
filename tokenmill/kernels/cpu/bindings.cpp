// The Python module of tokenmill's CPU kernels: one entry per kernel file.

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor key_scale, torch::Tensor value_scale, torch::Tensor block_tables,
                                     torch::Tensor key_start, torch::Tensor key_end, double scale, bool generic);
bool supports_head_dim(int64_t D);
torch::Tensor int8_weight_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale, bool generic);
bool int4_linear_fast();
torch::Tensor int4_weight_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros, int64_t group_size,
                                 bool generic);
void write_quantized_kv(torch::Tensor x, torch::Tensor slots, torch::Tensor rows, torch::Tensor scales);
void bind_decoder(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("supports_head_dim", &supports_head_dim, "whether paged_decode_attention handles this head_dim");
  m.def("int8_weight_linear", &int8_weight_linear, "weight-only int8 linear, any number of rows (CPU)");
  m.def("int4_linear_fast", &int4_linear_fast, "whether int4_weight_linear has its AVX-512 BF16 path");
  m.def("int4_weight_linear", &int4_weight_linear, "weight-only int4 linear, group-wise, any number of rows (CPU)");
  m.def("write_quantized_kv", &write_quantized_kv, "quantize new K or V rows into an int8 / fp8 cache (CPU)");
  bind_decoder(m);
}
