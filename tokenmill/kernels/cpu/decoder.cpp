// The decoder layer's small operations on CPU, and a whole decode step of a Llama- or Gemma-style
// stack in one call. Built at first use by tokenmill/kernels/cpu_ops.py.
//
// rms_norm, qkv_rope and act_mul are what tokenmill/models/layers.py calls on CPU for every
// step (prefill and decode), instead of 5 to 10 PyTorch operations each. DecodeStack runs a
// step in which every sequence has one new token through all the layers without returning to
// Python, calling the very same functions in the same order (and the same linear, KV-write and
// attention kernels), so its results are bit-identical to the layer-by-layer path; what it
// saves is the interpreter and dispatch time between them, about half of a batch-1 decode step
// of a 135M model before it existed.
//
// Rounding: every operation computes in float32 and rounds once to the model dtype, except
// where the PyTorch model rounds in between on purpose (Llama's RMSNorm casts before applying
// its weight, Gemma's after; see RMSNorm in layers.py).
//
// A mixture-of-experts layer's MLP (tokenmill.models.moe.SparseMoE, no-drop routing) runs in the
// stack too: the router's float32 logits and scores by the PyTorch operations SparseMoE calls,
// top-k as torch.topk selects, then each active expert once over its gathered rows with the
// linear kernels and act_mul above, summed in float32 in SparseMoE.run_experts' order.

#include <torch/python.h>  // pybind11 and its tensor casters, without torch/all.h (C++ frontend, autograd)
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <pybind11/native_enum.h>

#include "kernels.h"
#include "simd.h"

namespace {

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// a + b, a * b and a / b, each rounded once as PyTorch's kernels round them: through volatile, so
// that -ffast-math (the kernels' flags) can neither fuse a product into a sum nor divide by a
// reciprocal or reorder a sum.
inline float exact_add(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float exact_mul(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float exact_div(float a, float b) {
  volatile float d = b;
  volatile float r = a / d;
  return r;
}

#if defined(__AVX512F__)
// The rounding of the *_round_ps intrinsics (IEEE's default): unlike _mm512_add_ps and
// _mm512_mul_ps, the compiler never fuses them into a multiply-add.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#endif

// One row of C values: out = norm(x) * w, rounded as the model does.
template <typename T, typename W>
inline void rms_row(const T* x, const W* w, T* out, int64_t C, float eps, bool cast_before_scale) {
  float ss = 0.f;
  for (int64_t c = 0; c < C; ++c) {
    const float v = to_f(x[c]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
  if (cast_before_scale) {
    for (int64_t c = 0; c < C; ++c) out[c] = round_to<T>(to_f(round_to<T>(to_f(x[c]) * inv)) * to_f(w[c]));
  } else {
    for (int64_t c = 0; c < C; ++c) out[c] = round_to<T>(to_f(x[c]) * inv * to_f(w[c]));
  }
}

template <typename T, typename W>
void rms_rows(const T* x, const W* w, T* out, int64_t rows, int64_t C, float eps, bool cast_before_scale) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / C), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_row(x + r * C, w, out + r * C, C, eps, cast_before_scale);
  });
}

#define TM_DISPATCH_FLOAT(TYPE, NAME, ...)                                        \
  [&] {                                                                           \
    if ((TYPE) == at::kFloat) {                                              \
      using NAME = float;                                                         \
      return __VA_ARGS__();                                                       \
    }                                                                             \
    TORCH_CHECK((TYPE) == at::kBFloat16, "expected float32 or bfloat16 data"); \
    using NAME = at::BFloat16;                                                    \
    return __VA_ARGS__();                                                         \
  }()

}  // namespace

// x [..., C] float32 or bfloat16; weight [C] float32 or x's dtype.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, bool cast_before_scale) {
  const int64_t C = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == C, "rms_norm: weight must be [", C, "]");
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t rows = C ? xc.numel() / C : 0;
  TM_DISPATCH_FLOAT(xc.scalar_type(), T, [&] {
    TM_DISPATCH_FLOAT(wc.scalar_type(), W, [&] {
      rms_rows(xc.data_ptr<T>(), wc.data_ptr<W>(), out.data_ptr<T>(), rows, C, static_cast<float>(eps),
               cast_before_scale);
    });
  });
  return out;
}

namespace {

// Rotate-half RoPE of one head in place: x[d] * cos[d] + rot[d] * sin[d], rot = (-x2, x1).
template <typename T>
inline void rope_head(T* x, const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  float tmp[512];
  for (int64_t d = 0; d < D; ++d) tmp[d] = to_f(x[d]);
  for (int64_t d = 0; d < half; ++d) {
    x[d] = round_to<T>(tmp[d] * to_f(cos[d]) - tmp[d + half] * to_f(sin[d]));
    x[d + half] = round_to<T>(tmp[d + half] * to_f(cos[d + half]) + tmp[d] * to_f(sin[d + half]));
  }
}

}  // namespace

// qkv [T, (H + 2 Hkv) D] (one linear's output) -> q [T, H, D], k [T, Hkv, D] with QK-norm (when
// its weights are given) and RoPE applied, v [T, Hkv, D]; cos/sin [T, D] in qkv's dtype.
std::vector<at::Tensor> qkv_rope(at::Tensor qkv, int64_t H, int64_t Hkv, int64_t D, at::Tensor cos,
                                    at::Tensor sin, std::optional<at::Tensor> q_norm,
                                    std::optional<at::Tensor> k_norm, double eps, bool cast_before_scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * Hkv) * D, "qkv_rope: qkv must be [T, (H + 2 Hkv) D]");
  TORCH_CHECK(D % 2 == 0 && D <= 512, "qkv_rope: head_dim must be even and at most 512");
  const int64_t T_ = qkv.size(0);
  TORCH_CHECK(cos.size(0) == T_ && cos.size(1) == D && sin.sizes() == cos.sizes(), "qkv_rope: cos/sin must be [T, D]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "qkv_rope: give both QK-norm weights or neither");
  auto src = qkv.contiguous();
  auto opts = src.options();
  auto q = at::empty({T_, H, D}, opts), k = at::empty({T_, Hkv, D}, opts), v = at::empty({T_, Hkv, D}, opts);
  auto cs = cos.to(src.scalar_type()).contiguous(), sn = sin.to(src.scalar_type()).contiguous();
  at::Tensor qn, kn;
  if (q_norm) qn = q_norm->contiguous(), kn = k_norm->contiguous();
  TM_DISPATCH_FLOAT(src.scalar_type(), T, [&] {
    const T* s = src.data_ptr<T>();
    T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    const T *cp = cs.data_ptr<T>(), *sp = sn.data_ptr<T>();
    const int64_t row = (H + 2 * Hkv) * D;
    auto work = [&](auto* qw, auto* kw) {
      at::parallel_for(0, T_, std::max<int64_t>(1, 4096 / row), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const T* in = s + t * row;
          for (int64_t h = 0; h < H + Hkv; ++h) {
            T* out = h < H ? qp + (t * H + h) * D : kp + (t * Hkv + h - H) * D;
            if (qw) rms_row(in + h * D, h < H ? qw : kw, out, D, static_cast<float>(eps), cast_before_scale);
            else std::copy(in + h * D, in + (h + 1) * D, out);
            rope_head(out, cp + t * D, sp + t * D, D);
          }
          std::copy(in + (H + Hkv) * D, in + row, vp + t * Hkv * D);
        }
      });
    };
    if (!q_norm) {
      work(static_cast<const T*>(nullptr), static_cast<const T*>(nullptr));
    } else {
      TM_DISPATCH_FLOAT(qn.scalar_type(), W, [&] { work(qn.data_ptr<W>(), kn.data_ptr<W>()); });
    }
  });
  return {q, k, v};
}

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float gelu_tanh(float x) {
  return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

#if defined(__AVX512F__)
// act(g) * u for 16 values: silu(g) = g / (1 + e^-g); gelu_tanh(g) = g / (1 + e^(-2a)), with
// a = sqrt(2 / pi) (g + 0.044715 g^3) (0.5 (1 + tanh a) = 1 / (1 + e^(-2a))).
inline __m512 act_mul16(__m512 g, __m512 u, bool gelu) {
  __m512 z = gelu ? _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f),
                                  _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g))
                  : _mm512_sub_ps(_mm512_setzero_ps(), g);
  const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(z)));
  return _mm512_mul_ps(act, u);
}
#endif

}  // namespace

// gate_up [T, 2 I] -> act(gate) * up [T, I]; act: silu, or gelu with the tanh approximation.
at::Tensor act_mul(at::Tensor gate_up, bool gelu_tanh_act) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "act_mul: gate_up must be [T, 2 I]");
  auto src = gate_up.contiguous();
  const int64_t T_ = src.size(0), I = src.size(1) / 2;
  auto out = at::empty({T_, I}, src.options());
  TM_DISPATCH_FLOAT(src.scalar_type(), T, [&] {
    const T* s = src.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, T_, std::max<int64_t>(1, 65536 / I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* g = s + t * 2 * I;
        const T* u = g + I;
        T* y = o + t * I;
#if defined(__AVX512F__)
        for (int64_t i = 0; i < I; i += 16) {
          const __mmask16 m = I - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (I - i)) - 1);
          store16(y + i, act_mul16(load16(g + i, m), load16(u + i, m), gelu_tanh_act), m);
        }
#else
        for (int64_t i = 0; i < I; ++i) {
          const float x = to_f(g[i]);
          y[i] = round_to<T>((gelu_tanh_act ? gelu_tanh(x) : silu(x)) * to_f(u[i]));
        }
#endif
      }
    });
  });
  return out;
}

// Which kernel multiplies by a linear layer's weight.
enum class LinearKind {
  Dense,       // at::linear; weight [N, K] in the model dtype
  Bf16Packed,  // bf16_packed_linear; weight packed by bf16_pack from a bfloat16 [N, K]
  Int8,        // int8_weight_linear; weight int8 [N, K], scales [N] in the model dtype
  Int4,        // int4_weight_linear; weight and scales in int4_cpu_pack's layout, N a multiple of 16
  Grouped,     // group_weight_linear; weight and (scale, min) in group_cpu_pack's layout, bits 4, 5, 7 or 8
  SparseBf16,  // sparse_bf16_linear; weight = values, scales = masks, offsets, from sparse_bf16_pack
};

// One linear layer as the model holds it, checked once when the stack is built.
// Invariants: Int8, Int4 and Grouped have scales; Int4 and Grouped have group_size > 0 and
// in_features a whole number of groups (the input is zero-padded up to it), and their output is cut
// to out_features; Grouped has bits 4, 5, 7 or 8; SparseBf16 has scales (its masks) and offsets.
struct Linear {
  LinearKind kind = LinearKind::Dense;
  at::Tensor weight, scales, bias;  // scales, bias: undefined when absent
  at::Tensor offsets;               // SparseBf16 only: where each output tile's values start
  int64_t out_features = 0;
  int64_t in_features = 0;  // columns the kernel takes: the layer's own, or Int4's padded to whole groups
  int64_t group_size = 0;   // Int4 and Grouped only
  int64_t bits = 0;         // Grouped only: 4, 5, 7 or 8
  // Grouped only, optional: the weight dequantized to bfloat16 and bf16_pack'ed, which bfloat16 calls
  // of at least copy_rows rows multiply by instead (undefined / 0: none)
  at::Tensor bf16_copy;
  int64_t copy_rows = 0;
  // Grouped only, optional: the int8 copy (int8_copy_linear.cpp; int8_offset its symmetric offset
  // or -1), which the other bfloat16 calls multiply by (undefined: none)
  at::Tensor int8_copy;
  int64_t int8_offset = -1;
  // whether the int8 copy takes the other bfloat16 calls below copy_rows, x in two parts (else the codes)
  bool int8_two_part = true;
  // bfloat16 calls of one_part_from .. one_part_below - 1 rows take the int8 copy with x in one int8
  // part, before the bfloat16 copy (0, 0: none)
  int64_t one_part_from = 0, one_part_below = 0;

  Linear() = default;
  Linear(LinearKind kind_, at::Tensor weight_, int64_t out_features_, int64_t in_features_,
         std::optional<at::Tensor> scales_, std::optional<at::Tensor> bias_, int64_t group_size_,
         int64_t bits_, std::optional<at::Tensor> offsets_, std::optional<at::Tensor> bf16_copy_,
         int64_t copy_rows_, std::optional<at::Tensor> int8_copy_, int64_t int8_offset_, bool int8_two_part_,
         int64_t one_part_from_, int64_t one_part_below_)
      : kind(kind_), weight(std::move(weight_)), scales(scales_ ? *scales_ : at::Tensor()),
        bias(bias_ ? *bias_ : at::Tensor()), offsets(offsets_ ? *offsets_ : at::Tensor()),
        out_features(out_features_), in_features(in_features_), group_size(group_size_), bits(bits_),
        bf16_copy(bf16_copy_ ? *bf16_copy_ : at::Tensor()), copy_rows(copy_rows_),
        int8_copy(int8_copy_ ? *int8_copy_ : at::Tensor()), int8_offset(int8_offset_), int8_two_part(int8_two_part_),
        one_part_from(one_part_from_), one_part_below(one_part_below_) {
    const bool grouped = kind == LinearKind::Int4 || kind == LinearKind::Grouped;
    TORCH_CHECK(weight.defined() && out_features > 0 && in_features > 0,
                "Linear: a weight, out_features and in_features are required");
    TORCH_CHECK((kind != LinearKind::Int8 && !grouped) || scales.defined(),
                "Linear: INT8, INT4 and GROUPED weights need their scales");
    TORCH_CHECK(!grouped || (group_size > 0 && in_features % group_size == 0),
                "Linear: INT4 and GROUPED need group_size > 0 dividing in_features");
    TORCH_CHECK(kind != LinearKind::Grouped || bits == 4 || bits == 5 || bits == 7 || bits == 8,
                "Linear: GROUPED needs bits 4, 5, 7 or 8, got ",
                bits);
    TORCH_CHECK(kind != LinearKind::SparseBf16 || (scales.defined() && offsets.defined()),
                "Linear: SPARSE_BF16 needs its masks (scales) and offsets");
    TORCH_CHECK(bf16_copy.defined() == (copy_rows > 0) && (!bf16_copy.defined() || kind == LinearKind::Grouped),
                "Linear: a bfloat16 copy goes with a GROUPED weight and copy_rows >= 1");
    TORCH_CHECK(!int8_copy.defined() || kind == LinearKind::Grouped, "Linear: an int8 copy goes with a GROUPED weight");
    TORCH_CHECK(one_part_below == 0 || (int8_copy.defined() && 0 < one_part_from && one_part_from < one_part_below),
                "Linear: one-part rows need an int8 copy and 0 < from < below");
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (one_part_below > 0 && x.size(0) >= one_part_from && x.size(0) < one_part_below &&
        x.scalar_type() == at::kBFloat16)
      return int8_copy_linear(x, int8_copy, out_features, group_size, int8_offset,
                              bias.defined() ? bias : at::Tensor(), false, true);
    if (copy_rows > 0 && x.size(0) >= copy_rows && x.scalar_type() == at::kBFloat16)
      return bf16_packed_linear(x, bf16_copy, out_features, bias.defined() ? bias : at::Tensor());
    if (int8_copy.defined() && int8_two_part && x.scalar_type() == at::kBFloat16)
      return int8_copy_linear(x, int8_copy, out_features, group_size, int8_offset,
                              bias.defined() ? bias : at::Tensor());
    switch (kind) {
      case LinearKind::Dense:
        return at::linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
      case LinearKind::Bf16Packed:
        return bf16_packed_linear(x, weight, out_features, bias.defined() ? bias : at::Tensor());
      case LinearKind::Int8: {
        const auto y = int8_weight_linear(x, weight, scales, KernelPath::Fastest);
        return bias.defined() ? y + bias : y;
      }
      case LinearKind::Int4:
      case LinearKind::Grouped: {
        const auto xp = x.size(1) == in_features ? x : at::constant_pad_nd(x, {0, in_features - x.size(1)});
        auto y = kind == LinearKind::Int4
                     ? int4_weight_linear(xp, weight, scales, group_size, KernelPath::Fastest)
                     : group_weight_linear(xp, weight, scales, group_size, bits, /*out_float32=*/false,
                                                         KernelPath::Fastest);
        if (y.size(1) != out_features) y = y.narrow(1, 0, out_features);
        return bias.defined() ? y + bias : y;
      }
      case LinearKind::SparseBf16:
        return sparse_bf16_linear(x, weight, scales, offsets,
                                  bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, out_features);
    }
    TORCH_CHECK(false, "Linear: unknown kind");
  }
};

// One fused module's stacked LoRA adapter weights (tokenmill.lora.slots.ModuleStack): the update
// lora_add (lora.cpp) adds to the module's output for each token of the step with an adapter slot.
struct LoraWeights {
  at::Tensor A, B, part_starts;
  std::optional<at::Tensor> A_scale, B_scale;  // int8 A and B: their per-row scales
};

// The modules of a layer LoRA may adapt, in the order of Layer::lora.
enum LoraModule : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

// The mixture-of-experts MLP of a layer, as tokenmill.models.moe.SparseMoE computes it without a
// capacity limit: scores = softmax (or sigmoid) of the float32 router logits, the top_k experts of
// each token (weights renormalised to sum to 1 with norm_topk_prob), each expert a gated MLP
// (gate_up, act_mul, down) run once over its tokens' rows, their outputs widened to float32,
// scaled by the weights and summed (experts in ascending order), plus the shared expert (scaled by
// sigmoid(shared_gate x) when it has a gate), rounded once to the model dtype.
struct MoE {
  at::Tensor router;                 // float32 [E, hidden]
  int64_t top_k = 0;
  bool norm_topk_prob = false;
  bool sigmoid = false;                 // scores: sigmoid per expert, else softmax over the experts
  std::vector<Linear> gate_up, down;    // expert e's: [2 I, hidden], [hidden, I]
  Linear shared_gate_up, shared_down;   // the shared expert's; weight undefined: none
  at::Tensor shared_gate;            // float32 [1, hidden], or undefined: no gate

  int64_t experts() const { return router.size(0); }
};

struct Layer {
  Linear qkv, o, gate_up, down;  // gate_up, down: undefined weights for an MoE layer
  std::optional<MoE> moe;        // the layer's MLP is this mixture of experts (add_moe)
  std::array<std::optional<LoraWeights>, 4> lora;  // qkv, o, gate_up, down: set_lora's, else none
  at::Tensor attn_norm, ffn_norm, post_attn_norm, post_ffn_norm, q_norm, k_norm;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, rope = 0, plan = 0;
  double scale = 1.0;
  bool gelu_tanh = false;
  at::Tensor keys, values, key_scales, value_scales;  // this layer's cache blocks
};

// One attention plan of a decode step: what the layers that share a KV group and window read and
// write for each sequence b of the batch.
struct DecodePlan {
  at::Tensor slots;         // int64 [B]: the cache slot of b's new key and value
  at::Tensor block_tables;  // int32 [B, W]: b's blocks, padded with the null block
  at::Tensor key_start;     // int32 [B]: b attends to keys key_start[b] .. key_end[b] - 1
  at::Tensor key_end;       // int32 [B]
};

// A stack of decoder layers bound to one KV cache: run() takes the hidden states of a step whose
// sequences all have one new token and returns them after the last layer (before the final norm).
class DecodeStack {
 public:
  DecodeStack(double eps, bool cast_before_scale) : eps_(eps), cast_(cast_before_scale) {}

  // rope: which of run()'s RoPE tables the layer uses; plan: which of its attention plans.
  // gate_up, down: the dense MLP, or none for a layer whose MLP add_moe gives next; gelu_tanh: the
  // MLP's activation (every expert's, for an MoE layer).
  void add_layer(std::vector<at::Tensor> norms, std::vector<at::Tensor> qk_norms, Linear qkv, Linear o,
                 std::optional<Linear> gate_up, std::optional<Linear> down, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, double scale, bool gelu_tanh, int64_t rope, int64_t plan,
                 std::vector<at::Tensor> cache) {
    TORCH_CHECK(gate_up.has_value() == down.has_value(), "add_layer: give gate_up and down, or neither (MoE)");
    TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "norms: attn, ffn (and post_attn, post_ffn)");
    TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2, "qk_norms: none or q and k");
    TORCH_CHECK(cache.size() == 2 || cache.size() == 4, "cache: keys, values (and their scales)");
    Layer l;
    l.attn_norm = norms[0], l.ffn_norm = norms[1];
    if (norms.size() == 4) l.post_attn_norm = norms[2], l.post_ffn_norm = norms[3];
    if (!qk_norms.empty()) l.q_norm = qk_norms[0], l.k_norm = qk_norms[1];
    l.qkv = std::move(qkv), l.o = std::move(o);
    if (gate_up) l.gate_up = std::move(*gate_up), l.down = std::move(*down);
    l.heads = heads, l.kv_heads = kv_heads, l.head_dim = head_dim, l.scale = scale, l.gelu_tanh = gelu_tanh;
    l.rope = rope, l.plan = plan;
    l.keys = cache[0], l.values = cache[1];
    if (cache.size() == 4) l.key_scales = cache[2], l.value_scales = cache[3];
    layers_.push_back(std::move(l));
  }

  // The MLP of the last layer added (added without gate_up and down) as a mixture of experts: router
  // float32 [E, hidden], top_k of the E experts per token, expert e's gate_up[e] and down[e], and
  // optionally a shared expert (shared_gate_up, shared_down) with its float32 gate [1, hidden].
  // run() hands back each MoE layer's routing, in layer order (its routing_ids, routing_scores).
  void add_moe(at::Tensor router, int64_t top_k, bool norm_topk_prob, bool sigmoid, std::vector<Linear> gate_up,
               std::vector<Linear> down, std::optional<Linear> shared_gate_up, std::optional<Linear> shared_down,
               std::optional<at::Tensor> shared_gate) {
    TORCH_CHECK(!layers_.empty(), "add_moe: add its layer first");
    Layer& l = layers_.back();
    TORCH_CHECK(!l.moe && !l.gate_up.weight.defined(), "add_moe: the last layer already has its MLP");
    const int64_t hidden = l.ffn_norm.size(0);
    TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat && router.size(1) == hidden &&
                    router.size(0) > 0 && router.is_contiguous(),
                "add_moe: router must be a contiguous float32 [experts, ", hidden, "]");
    const int64_t E = router.size(0);
    TORCH_CHECK(top_k >= 1 && top_k <= E, "add_moe: top_k must be in 1..", E);
    TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == E && static_cast<int64_t>(down.size()) == E,
                "add_moe: one gate_up and one down per expert");
    for (int64_t e = 0; e < E; ++e)
      TORCH_CHECK(gate_up[e].out_features % 2 == 0 && down[e].out_features == hidden,
                  "add_moe: expert ", e, " must be gate_up [2 I, hidden], down [hidden, I]");
    TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(),
                "add_moe: give the shared expert's gate_up and down, or neither");
    TORCH_CHECK(!shared_gate || shared_gate_up, "add_moe: a shared gate needs a shared expert");
    TORCH_CHECK(!shared_gate || (shared_gate->scalar_type() == at::kFloat && shared_gate->dim() == 2 &&
                                 shared_gate->size(0) == 1 && shared_gate->size(1) == hidden),
                "add_moe: shared_gate must be float32 [1, ", hidden, "]");
    MoE m;
    m.router = std::move(router), m.top_k = top_k, m.norm_topk_prob = norm_topk_prob, m.sigmoid = sigmoid;
    m.gate_up = std::move(gate_up), m.down = std::move(down);
    if (shared_gate_up) {
      TORCH_CHECK(shared_gate_up->out_features % 2 == 0 && shared_down->out_features == hidden,
                  "add_moe: the shared expert must be gate_up [2 I, hidden], down [hidden, I]");
      m.shared_gate_up = std::move(*shared_gate_up), m.shared_down = std::move(*shared_down);
    }
    if (shared_gate) m.shared_gate = std::move(*shared_gate);
    l.moe = std::move(m);
  }

  // The LoRA stacks of ``module`` (LoraModule) of ``layer``: run() with lora_slots adds their update.
  // The tensors are held, not copied: assigning a slot in place is seen by the next run().
  void set_lora(int64_t layer, int64_t module, at::Tensor A, at::Tensor B, at::Tensor part_starts,
                std::optional<at::Tensor> A_scale, std::optional<at::Tensor> B_scale) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && module >= 0 && module < 4,
                "set_lora: no layer ", layer, " module ", module);
    TORCH_CHECK(module < kGateUp || !layers_[layer].moe, "set_lora: layer ", layer,
                "'s MLP is a mixture of experts, which adapters do not target");
    layers_[layer].lora[module] = LoraWeights{std::move(A), std::move(B), std::move(part_starts), std::move(A_scale),
                                              std::move(B_scale)};
  }

  void clear_lora() {
    for (Layer& l : layers_) l.lora.fill(std::nullopt);
  }

  // Tensors whose change leaves the stack stale (the weights it holds packed copies of):
  // unchanged() tells whether each still has the data, version and shape it had when watched. An
  // nn.Parameter assigned its .data keeps its version but not its data pointer.
  void watch(std::vector<at::Tensor> tensors) {
    for (auto& t : tensors) {
      Watched w{t, t._version(), t.data_ptr(), t.sizes().vec()};
      watched_.push_back(std::move(w));
    }
  }

  bool unchanged() const {
    for (const Watched& w : watched_) {
      if (w.tensor._version() != w.version || w.tensor.data_ptr() != w.data || !w.tensor.sizes().equals(w.sizes))
        return false;
    }
    return true;
  }

  // h [B, hidden]; ropes: (cos, sin) [B, head_dim] per RoPE table; plans: one DecodePlan per
  // attention plan (a layer's ``plan`` indexes them); lora_slots: int32 [B], each token's LoRA
  // slot (-1: none) in the stacks set_lora gave, or none (no adapter this step).
  // routing_ids int64 [M, B, top_k], routing_scores float32 [M, B, experts] (contiguous; M the
  // stack's MoE layers), when given, receive each MoE layer's expert ids and router scores, as
  // tokenmill.models.moe.route returns them.
  at::Tensor run(at::Tensor h, std::vector<std::pair<at::Tensor, at::Tensor>> ropes,
                    std::vector<DecodePlan> plans, std::optional<at::Tensor> lora_slots,
                    std::optional<at::Tensor> routing_ids, std::optional<at::Tensor> routing_scores) const {
    const int64_t B = h.size(0);
    int64_t moe_layers = 0;
    for (const Layer& l : layers_) moe_layers += l.moe.has_value();
    if (routing_ids)
      TORCH_CHECK(routing_ids->scalar_type() == at::kLong && routing_ids->is_contiguous() &&
                      routing_ids->dim() == 3 && routing_ids->size(0) == moe_layers && routing_ids->size(1) == B,
                  "DecodeStack.run: routing_ids must be a contiguous int64 [", moe_layers, ", ", B, ", top_k]");
    if (routing_scores)
      TORCH_CHECK(routing_scores->scalar_type() == at::kFloat && routing_scores->is_contiguous() &&
                      routing_scores->dim() == 3 && routing_scores->size(0) == moe_layers &&
                      routing_scores->size(1) == B,
                  "DecodeStack.run: routing_scores must be a contiguous float32 [", moe_layers, ", ", B,
                  ", experts]");
    MoEScratch scratch;
    int64_t moe_index = 0;
    auto adapt = [&](const Layer& l, LoraModule m, const at::Tensor& x, at::Tensor& y) {
      if (!lora_slots || !l.lora[m]) return;
      const LoraWeights& w = *l.lora[m];
      lora_add(x, y, *lora_slots, w.A, w.B, w.part_starts, w.A_scale, w.B_scale, KernelPath::Fastest);
    };
    for (const Layer& l : layers_) {
      TORCH_CHECK(l.rope < static_cast<int64_t>(ropes.size()) && l.plan < static_cast<int64_t>(plans.size()),
                  "DecodeStack.run: missing RoPE table or attention plan");
      const auto& [cos, sin] = ropes[l.rope];
      const DecodePlan& plan = plans[l.plan];
      auto x = rms_norm(h, l.attn_norm, eps_, cast_);
      auto fused_qkv = l.qkv(x);
      adapt(l, kQkv, x, fused_qkv);
      auto qkv = qkv_rope(fused_qkv, l.heads, l.kv_heads, l.head_dim, cos, sin,
                          l.q_norm.defined() ? std::optional<at::Tensor>(l.q_norm) : std::nullopt,
                          l.k_norm.defined() ? std::optional<at::Tensor>(l.k_norm) : std::nullopt, eps_, cast_);
      write_kv(l, plan.slots, qkv[1], qkv[2]);
      auto attn = paged_decode_attention(qkv[0], l.keys, l.values, l.key_scales.defined() ? l.key_scales : empty_,
                                         l.value_scales.defined() ? l.value_scales : empty_, plan.block_tables,
                                         plan.key_start, plan.key_end,
                                         l.scale, KernelPath::Fastest);
      auto heads_out = attn.view({B, l.heads * l.head_dim});
      auto a = l.o(heads_out);
      adapt(l, kO, heads_out, a);
      if (l.post_attn_norm.defined()) a = rms_norm(a, l.post_attn_norm, eps_, cast_);
      h = h + a;
      auto x2 = rms_norm(h, l.ffn_norm, eps_, cast_);
      at::Tensor m;
      if (l.moe) {
        const MoE& moe = *l.moe;
        TORCH_CHECK(!routing_ids || routing_ids->size(2) == moe.top_k,
                    "DecodeStack.run: routing_ids must have top_k = ", moe.top_k, " columns");
        TORCH_CHECK(!routing_scores || routing_scores->size(2) == moe.experts(),
                    "DecodeStack.run: routing_scores must have ", moe.experts(), " columns");
        m = moe_mlp(moe, x2, l.gelu_tanh, routing_ids ? (*routing_ids)[moe_index] : at::Tensor(),
                    routing_scores ? (*routing_scores)[moe_index] : at::Tensor(), scratch);
        ++moe_index;
      } else {
        TORCH_CHECK(l.gate_up.weight.defined(), "DecodeStack.run: a layer without its MLP (add_moe missing)");
        auto gate_up = l.gate_up(x2);
        adapt(l, kGateUp, x2, gate_up);
        auto inner = act_mul(gate_up, l.gelu_tanh);
        m = l.down(inner);
        adapt(l, kDown, inner, m);
      }
      if (l.post_ffn_norm.defined()) m = rms_norm(m, l.post_ffn_norm, eps_, cast_);
      h = h + m;
    }
    return h;
  }

 private:
  // Per-run buffers of the MoE layers (sized once for the step's batch, reused by every layer).
  struct MoEScratch {
    std::vector<std::pair<float, int64_t>> queue;  // one token's (score, expert), for top-k
    std::vector<float> weights;                     // [B, top_k]
    std::vector<int64_t> ids;                       // [B, top_k], when run() was given no routing_ids
    std::vector<int64_t> counts, starts;            // [E]: assignments per expert, first row of each
    std::vector<int64_t> row_token;                 // [B top_k]: the token of each gathered row
    std::vector<float> row_weight;                  // [B top_k]: its weight
  };

  // SparseMoE.forward of x [B, hidden] (ffn_norm's output) without a capacity limit -> [B, hidden]
  // in x's dtype. ids [B, top_k] and scores [B, E] (views into run()'s routing outputs, or
  // undefined) receive the routing.
  static at::Tensor moe_mlp(const MoE& moe, const at::Tensor& x, bool gelu, at::Tensor ids,
                               at::Tensor scores, MoEScratch& s) {
    const int64_t B = x.size(0), H = x.size(1), E = moe.experts(), K = moe.top_k;
    // Router: float32 logits and scores, by the very operations route() runs.
    const auto xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    const auto logits = at::linear(xf, moe.router);
    if (scores.defined()) {
      if (moe.sigmoid) at::sigmoid_out(scores, logits);
      else at::_softmax_out(scores, logits, -1, false);
    } else {
      scores = moe.sigmoid ? at::sigmoid(logits) : at::_softmax(logits, -1, false);
    }
    const float* sc = scores.data_ptr<float>();
    s.queue.resize(E), s.weights.resize(B * K);
    int64_t* id = ids.defined() ? ids.data_ptr<int64_t>() : (s.ids.resize(B * K), s.ids.data());
    for (int64_t t = 0; t < B; ++t) top_k(sc + t * E, E, K, s.queue, s.weights.data() + t * K, id + t * K);
    if (moe.norm_topk_prob) normalize_top_k(s.weights.data(), B, K);

    // Assignments grouped by expert (ascending), each expert's tokens in ascending order; the
    // rows gathered in that order, as SparseMoE.run_experts' stable argsort orders them.
    s.counts.assign(E, 0), s.starts.resize(E);
    for (int64_t i = 0; i < B * K; ++i) ++s.counts[id[i]];
    for (int64_t e = 0, start = 0; e < E; start += s.counts[e++]) s.starts[e] = start;
    s.row_token.resize(B * K), s.row_weight.resize(B * K);
    auto gathered = at::empty({B * K, H}, x.options());
    const auto row_bytes = H * x.element_size();
    TORCH_CHECK(x.is_contiguous(), "DecodeStack: the MoE input must be contiguous");
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(gathered.data_ptr());
    for (int64_t t = 0; t < B; ++t) {
      for (int64_t j = 0; j < K; ++j) {
        const int64_t row = s.starts[id[t * K + j]]++;
        s.row_token[row] = t, s.row_weight[row] = s.weights[t * K + j];
        std::memcpy(dst + row * row_bytes, src + t * row_bytes, row_bytes);
      }
    }

    // Each active expert once over its rows; out[token] += float(y[row]) * weight, float32.
    auto out = at::zeros({B, H}, x.options().dtype(at::kFloat));
    float* acc = out.data_ptr<float>();
    for (int64_t e = 0, start = 0; e < E; start += s.counts[e++]) {
      const int64_t n = s.counts[e];
      if (!n) continue;
      const auto y = moe.down[e](act_mul(moe.gate_up[e](gathered.narrow(0, start, n)), gelu));
      TM_DISPATCH_FLOAT(y.scalar_type(), T, [&] {
        const T* yp = y.data_ptr<T>();
        for (int64_t r = 0; r < n; ++r) {
          const int64_t row = start + r;
          add_scaled_row(acc + s.row_token[row] * H, yp + r * y.stride(0), s.row_weight[row], H);
        }
      });
    }

    // The shared expert (gated), then the one rounding to the model dtype.
    at::Tensor shared, gate;
    if (moe.shared_gate_up.weight.defined()) {
      shared = moe.shared_down(act_mul(moe.shared_gate_up(x), gelu));
      if (moe.shared_gate.defined()) gate = at::sigmoid(at::linear(xf, moe.shared_gate));
    }
    if (x.scalar_type() == at::kFloat && !shared.defined()) return out;
    auto result = x.scalar_type() == at::kFloat ? out : at::empty({B, H}, x.options());
    TM_DISPATCH_FLOAT(x.scalar_type(), T, [&] {
      T* res = result.data_ptr<T>();
      if (!shared.defined()) {
        for (int64_t t = 0; t < B; ++t)
          finish_row(acc + t * H, static_cast<const T*>(nullptr), 1.f, false, res + t * H, H);
        return;
      }
      const T* sh = shared.data_ptr<T>();
      const float* g = gate.defined() ? gate.data_ptr<float>() : nullptr;
      for (int64_t t = 0; t < B; ++t)
        finish_row(acc + t * H, sh + t * shared.stride(0), g ? g[t] : 1.f, g != nullptr, res + t * H, H);
    });
    return result;
  }

  // The k largest of E scores (scores and expert ids, largest first; NaN above all), selected as
  // torch.topk does on CPU (a partial sort when k * 64 <= E, else nth_element, then sorted), so
  // that ties come out in the same order.
  static void top_k(const float* scores, int64_t E, int64_t k, std::vector<std::pair<float, int64_t>>& queue,
                    float* weights, int64_t* ids) {
    for (int64_t e = 0; e < E; ++e) queue[e] = {scores[e], e};
    const auto before = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
      return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
    };
    if (k * 64 <= E) {
      std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
    } else {
      std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), before);
      std::sort(queue.begin(), queue.begin() + k - 1, before);
    }
    for (int64_t j = 0; j < k; ++j) weights[j] = queue[j].first, ids[j] = queue[j].second;
  }

  // weights [B, k] /= their row sums, rounded as weights / weights.sum(-1, keepdim=True): a row of
  // at most 4 is summed left to right by PyTorch's CPU sum (whatever its vector width); a longer one
  // is summed by at::sum itself.
  static void normalize_top_k(float* weights, int64_t B, int64_t k) {
    at::Tensor sums;
    if (k > 4) sums = at::sum(at::from_blob(weights, {B, k}, at::kFloat), -1);
    for (int64_t t = 0; t < B; ++t) {
      float* w = weights + t * k;
      float total;
      if (k > 4) {
        total = sums.data_ptr<float>()[t];
      } else {
        total = 0.f;
        for (int64_t j = 0; j < k; ++j) total = exact_add(total, w[j]);
      }
      for (int64_t j = 0; j < k; ++j) w[j] = exact_div(w[j], total);
    }
  }

  // acc[c] = acc[c] + float(y[c]) * w for c < H: a product, then a sum, each rounded (no fused
  // multiply-add), as SparseMoE.run_experts' y.float() * w and index_add_ round them.
  template <typename T>
  static void add_scaled_row(float* acc, const T* y, float w, int64_t H) {
#if defined(__AVX512F__)
    const __m512 wv = _mm512_set1_ps(w);
    for (int64_t c = 0; c < H; c += 16) {
      const __mmask16 m = H - c >= 16 ? 0xffff : static_cast<__mmask16>((1u << (H - c)) - 1);
      const __m512 p = _mm512_mul_round_ps(load16(y + c, m), wv, kNearest);
      store16(acc + c, _mm512_add_round_ps(load16(acc + c, m), p, kNearest), m);
    }
#else
    for (int64_t c = 0; c < H; ++c) acc[c] = exact_add(acc[c], exact_mul(to_f(y[c]), w));
#endif
  }

  // res[c] = T(acc[c] + g * float(shared[c])) (gated), T(acc[c] + float(shared[c])), or T(acc[c])
  // without a shared expert (shared null); each operation rounded in float32.
  template <typename T>
  static void finish_row(const float* acc, const T* shared, float g, bool gated, T* res, int64_t H) {
#if defined(__AVX512F__)
    const __m512 gv = _mm512_set1_ps(g);
    for (int64_t c = 0; c < H; c += 16) {
      const __mmask16 m = H - c >= 16 ? 0xffff : static_cast<__mmask16>((1u << (H - c)) - 1);
      __m512 v = load16(acc + c, m);
      if (shared) {
        __m512 sv = load16(shared + c, m);
        if (gated) sv = _mm512_mul_round_ps(gv, sv, kNearest);
        v = _mm512_add_round_ps(v, sv, kNearest);
      }
      store16(res + c, v, m);
    }
#else
    for (int64_t c = 0; c < H; ++c) {
      float v = acc[c];
      if (shared) v = exact_add(v, gated ? exact_mul(g, to_f(shared[c])) : to_f(shared[c]));
      res[c] = round_to<T>(v);
    }
#endif
  }

  // cache.flatten(0, 1).index_copy_(0, slots, rows), as PagedLayer.write does; for a contiguous
  // cache and rows of its dtype a memcpy per row (index_copy_'s dispatch cost 7 us a call, twice per
  // layer of every decode step).
  static void copy_rows(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rows) {
    if (!cache.is_contiguous() || !rows.is_contiguous() || rows.scalar_type() != cache.scalar_type() ||
        slots.scalar_type() != at::kLong || !slots.is_contiguous() || rows.dim() != cache.dim() - 1 ||
        rows.size(0) != slots.size(0) || rows[0].numel() * cache.size(0) * cache.size(1) != cache.numel()) {
      cache.flatten(0, 1).index_copy_(0, slots, rows);
      return;
    }
    const int64_t total = cache.size(0) * cache.size(1), row_bytes = rows[0].numel() * rows.element_size();
    const int64_t* s = slots.data_ptr<int64_t>();
    auto* dst = static_cast<char*>(cache.data_ptr());
    const auto* src = static_cast<const char*>(rows.data_ptr());
    for (int64_t t = 0; t < slots.size(0); ++t) {
      TORCH_CHECK(s[t] >= 0 && s[t] < total, "DecodeStack.run: KV slot ", s[t], " outside the cache's ", total);
      std::memcpy(dst + s[t] * row_bytes, src + t * row_bytes, row_bytes);
    }
  }

  // As PagedLayer.write: the rows into their slots, or the quantized write.
  static void write_kv(const Layer& l, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
    if (!l.key_scales.defined()) {
      copy_rows(l.keys, slots, k);
      copy_rows(l.values, slots, v);
      return;
    }
    write_quantized_kv(k, slots, l.keys.flatten(0, 1), l.key_scales.flatten(0, 1));
    write_quantized_kv(v, slots, l.values.flatten(0, 1), l.value_scales.flatten(0, 1));
  }

  struct Watched {
    at::Tensor tensor;
    int64_t version;
    const void* data;
    std::vector<int64_t> sizes;
  };

  double eps_;
  bool cast_;
  std::vector<Layer> layers_;
  std::vector<Watched> watched_;
  at::Tensor empty_ = at::empty({0});
};

void bind_decoder(pybind11::module& m) {
  namespace py = pybind11;
  m.def("rms_norm", &rms_norm, "RMSNorm of the last dimension (CPU)");
  m.def("qkv_rope", &qkv_rope, "split a fused QKV output into heads, QK-norm and RoPE (CPU)");
  m.def("act_mul", &act_mul, "act(gate) * up of a fused gate_up output (CPU)");
  py::native_enum<LinearKind>(m, "LinearKind", "enum.Enum", "Which kernel multiplies by a linear layer's weight")
      .value("DENSE", LinearKind::Dense, "at::linear")
      .value("BF16_PACKED", LinearKind::Bf16Packed, "bf16_packed_linear over a bf16_pack'ed weight")
      .value("INT8", LinearKind::Int8, "int8_weight_linear")
      .value("INT4", LinearKind::Int4, "int4_weight_linear over an int4_cpu_pack'ed weight")
      .value("GROUPED", LinearKind::Grouped, "group_weight_linear over a group_cpu_pack'ed weight")
      .value("SPARSE_BF16", LinearKind::SparseBf16, "sparse_bf16_linear over sparse_bf16_pack's tensors")
      .finalize();
  py::class_<Linear>(m, "Linear", "one linear layer of a DecodeStack")
      .def(py::init<LinearKind, at::Tensor, int64_t, int64_t, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, int64_t, int64_t, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, int64_t, std::optional<at::Tensor>, int64_t, bool, int64_t,
                    int64_t>(),
           py::kw_only(), py::arg("kind"), py::arg("weight"), py::arg("out_features"), py::arg("in_features"),
           py::arg("scales") = py::none(), py::arg("bias") = py::none(), py::arg("group_size") = 0,
           py::arg("bits") = 0, py::arg("offsets") = py::none(), py::arg("bf16_copy") = py::none(),
           py::arg("bf16_copy_rows") = 0, py::arg("int8_copy") = py::none(), py::arg("int8_copy_offset") = -1,
           py::arg("int8_copy_two_part") = true, py::arg("int8_one_part_from") = 0,
           py::arg("int8_one_part_below") = 0)
      .def("__call__", &Linear::operator(), py::call_guard<py::gil_scoped_release>(), py::arg("x"),
           "y = x W^T (+ bias) [M, out_features], as DecodeStack.run multiplies by this layer")
      .def_property_readonly("kind", [](const Linear& l) { return l.kind; })
      .def_property_readonly("out_features", [](const Linear& l) { return l.out_features; })
      .def_property_readonly("in_features", [](const Linear& l) { return l.in_features; })
      .def_property_readonly("group_size", [](const Linear& l) { return l.group_size; })
      .def_property_readonly("bits", [](const Linear& l) { return l.bits; });
  py::class_<DecodePlan>(m, "DecodePlan", "one attention plan of a decode step (DecodeStack.run)")
      .def(py::init([](at::Tensor slots, at::Tensor block_tables, at::Tensor key_start,
                       at::Tensor key_end) {
             return DecodePlan{std::move(slots), std::move(block_tables), std::move(key_start), std::move(key_end)};
           }),
           py::kw_only(), py::arg("slots"), py::arg("block_tables"), py::arg("key_start"), py::arg("key_end"))
      .def_readonly("slots", &DecodePlan::slots)
      .def_readonly("block_tables", &DecodePlan::block_tables)
      .def_readonly("key_start", &DecodePlan::key_start)
      .def_readonly("key_end", &DecodePlan::key_end);
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<double, bool>(), py::arg("eps"), py::arg("cast_before_scale"))
      .def("add_layer", &DecodeStack::add_layer, py::kw_only(), py::arg("norms"), py::arg("qk_norms"),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("scale"), py::arg("gelu_tanh"), py::arg("rope"), py::arg("plan"),
           py::arg("cache"), "a decoder layer; gate_up and down None: its MLP is the add_moe that follows")
      .def("add_moe", &DecodeStack::add_moe, py::kw_only(), py::arg("router"), py::arg("top_k"),
           py::arg("norm_topk_prob"), py::arg("sigmoid"), py::arg("gate_up"), py::arg("down"),
           py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = py::none(),
           "the last layer's MLP as a mixture of experts (tokenmill.models.moe.SparseMoE, no-drop routing)")
      .def("set_lora", &DecodeStack::set_lora, py::kw_only(), py::arg("layer"), py::arg("module"), py::arg("A"),
           py::arg("B"), py::arg("part_starts"), py::arg("A_scale") = py::none(), py::arg("B_scale") = py::none(),
           "the LoRA stacks of module 0..3 (qkv, o, gate_up, down) of a layer, applied by run(lora_slots=...)")
      .def("clear_lora", &DecodeStack::clear_lora, "forget every set_lora")
      .def("watch", &DecodeStack::watch, py::arg("tensors"),
           "tensors whose change (in place, or their .data replaced) makes the stack stale")
      .def("unchanged", &DecodeStack::unchanged, "whether every watched tensor is as it was when watched")
      .def("run", &DecodeStack::run, py::call_guard<py::gil_scoped_release>(), py::arg("h"), py::arg("ropes"),
           py::arg("plans"), py::arg("lora_slots") = py::none(), py::kw_only(), py::arg("routing_ids") = py::none(),
           py::arg("routing_scores") = py::none());
}
