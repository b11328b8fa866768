// Quantized KV cache write on CPU: each new row (one token of one KV head, D values) is stored
// as int8 or float8 e4m3 with its own float16 scale, in one pass, the same rounding as
// tokenmill/attention/kv_quant.py's quantize_rows (which the engine uses without these kernels):
//   scale = fp16(max|x| / qmax), one fp16 step up when that rounding fell below max|x| / qmax
//   (never below 2^-24); int8: round-half-even(x / scale) clamped to +-127; fp8: e4m3 of x / scale.

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace {

template <typename T, typename Q>
void write_rows(const T* x, const int64_t* slots, Q* rows, at::Half* scales, int64_t T_, int64_t H, int64_t D,
                float qmax) {
  at::parallel_for(0, T_ * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / H, h = r % H;
      const T* src = x + r * D;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(static_cast<float>(src[d])));
      float want = amax / qmax;
      if (want < 5.9604645e-08f) want = 5.9604645e-08f;  // 2^-24, float16's smallest
      at::Half s(want);
      if (static_cast<float>(s) * qmax < amax) {  // rounded down: the next float16 up
        uint16_t bits;
        std::memcpy(&bits, &s, sizeof(bits));
        ++bits;
        std::memcpy(&s, &bits, sizeof(bits));
      }
      const float sf = static_cast<float>(s);
      Q* dst = rows + (slots[t] * H + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        float y = static_cast<float>(src[d]) / sf;
        y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
        if constexpr (std::is_same_v<Q, int8_t>) {
          dst[d] = static_cast<int8_t>(std::nearbyint(y));
        } else {
          dst[d] = c10::Float8_e4m3fn(y);
        }
      }
      scales[slots[t] * H + h] = s;
    }
  });
}

template <typename T>
void dispatch(const at::Tensor& x, const int64_t* slots, at::Tensor& rows, at::Half* scales, int64_t T_,
              int64_t H, int64_t D) {
  if (rows.scalar_type() == at::kChar) {
    write_rows<T, int8_t>(x.data_ptr<T>(), slots, rows.data_ptr<int8_t>(), scales, T_, H, D, 127.f);
  } else {
    write_rows<T, c10::Float8_e4m3fn>(x.data_ptr<T>(), slots, rows.data_ptr<c10::Float8_e4m3fn>(), scales, T_, H, D,
                                      448.f);
  }
}

}  // namespace

// x [T, H, D] float32 or bfloat16; slots int64 [T]; rows [slots, H, D] int8 or float8_e4m3fn; scales float16 [slots, H]
void write_quantized_kv(at::Tensor x, at::Tensor slots, at::Tensor rows, at::Tensor scales) {
  TORCH_CHECK(x.dim() == 3 && rows.dim() == 3 && scales.dim() == 2 && slots.dim() == 1, "bad shapes");
  TORCH_CHECK(x.is_contiguous() && rows.is_contiguous() && scales.is_contiguous() && slots.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && scales.scalar_type() == at::kHalf, "slots int64, scales float16");
  TORCH_CHECK(rows.scalar_type() == at::kChar || rows.scalar_type() == at::kFloat8_e4m3fn,
              "rows must be int8 or float8_e4m3fn");
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(slots.size(0) == T_ && rows.size(1) == H && rows.size(2) == D && scales.size(0) == rows.size(0) &&
                  scales.size(1) == H, "shapes do not match");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(s[t] >= 0 && s[t] < rows.size(0), "slot out of range");
  auto* sc = scales.data_ptr<at::Half>();
  if (x.scalar_type() == at::kFloat) {
    dispatch<float>(x, s, rows, sc, T_, H, D);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    dispatch<at::BFloat16>(x, s, rows, sc, T_, H, D);
  }
}
