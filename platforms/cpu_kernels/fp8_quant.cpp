// fp8 activation quantization of the CPU platform (16 lanes at a time for e4m3fn, vec16.h):
//
//   fp8_quant(x [M, K] f32 | bf16, e5m2, scale [1]?, group) -> (q [M, K] fp8, scale)
//       scale given (static):  q = clamp(x / scale, -fmax, fmax) -> fp8, the scale returned as is
//       group == 0:            one dynamic scale for the tensor               -> scale [1]
//       group > 0:             one per row and group of `group` inputs        -> scale [M, ceil(K / group)]
//   dynamic: scale = max(amax / fmax, 1e-12); a true division and c10's fp8 rounding (round to
//   nearest even, as torch's .to(fp8)), so equal to the torch references bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "vec16.h"

namespace {

using namespace halserve_cpu;

// max |x| (NaNs ignored, as std::max(m, NaN) keeps m); 16 lanes at a time, max being order-free.
template <typename T>
float amax_of(const T* x, int64_t n) {
  int64_t i = 0;
  v16 mv = v16{};
  for (; i + 16 <= n; i += 16) {
    const v16 a = as_v16(as_vu16(load16(x + i)) & 0x7FFFFFFFu);
    mv = max16(a, mv);
  }
  float m = hmax16(mv);
  for (; i < n; ++i) m = std::max(m, std::fabs(static_cast<float>(x[i])));
  return m;
}

// 16 floats -> e4m3fn bytes exactly as c10's fp8e4m3fn_from_fp32_value: magnitudes from 480 up (NaN
// too) -> 0x7F; below 2^-6 the subnormal codes by one float addition (round to nearest even);
// otherwise round to nearest even on the bits.
inline void store_e4m3fn16(c10::Float8_e4m3fn* q, v16 v) {
  // 64-byte GCC vectors whatever v16 is (the AVX2 build lowers these through memory: this is
  // the fp8 quantization path, not a per-step kernel)
  typedef uint8_t vb16 __attribute__((vector_size(16)));
  typedef uint32_t wu16 __attribute__((vector_size(64), aligned(4)));
  typedef float wf16 __attribute__((vector_size(64), aligned(4)));
  const wu16 denorm = wu16{} + (141u << 23);
  wu16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const wu16 sign = bits & 0x80000000u;
  bits ^= sign;
  const wu16 sub = (wu16)((wf16)bits + (wf16)denorm) - denorm;
  const wu16 normal = (bits + ((7u - 127u) << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
  wu16 r = bits >= (1087u << 20) ? wu16{} + 0x7Fu : (bits < (121u << 23) ? sub : normal);
  r = (r & 0xFFu) | (sign >> 24);
  const vb16 b = __builtin_convertvector(r, vb16);
  std::memcpy(q, &b, sizeof(b));
}

template <typename T, typename F8>
void quantize(const T* x, int64_t n, float scale, float fmax, F8* q) {
  int64_t i = 0;
  if constexpr (std::is_same_v<F8, c10::Float8_e4m3fn>) {
    const v16 s = splat16(scale), hi = splat16(fmax), lo = splat16(-fmax);
    for (; i + 16 <= n; i += 16) {
      v16 v = load16(x + i) / s;
      v = select16(lt16(hi, v), hi, select16(lt16(v, lo), lo, v));  // NaN fails both tests and stays NaN
      store_e4m3fn16(q + i, v);
    }
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]) / scale;
    q[i] = F8(std::isnan(v) ? v : std::min(std::max(v, -fmax), fmax));
  }
}

template <typename T, typename F8>
void quant_rows(const T* x, int64_t M, int64_t K, const float* static_scale, int64_t group, float* scales, F8* q) {
  const float fmax = static_cast<float>(std::numeric_limits<F8>::max());
  if (static_scale == nullptr && group == 0) {  // one scale for the tensor
    const float amax = at::parallel_reduce(
        0, M, 16, 0.0f, [&](int64_t b, int64_t e, float m) { return std::max(m, amax_of(x + b * K, (e - b) * K)); },
        [](float a, float b) { return std::max(a, b); });
    scales[0] = std::max(amax / fmax, 1e-12f);
    static_scale = scales;
  }
  const int64_t G = group > 0 ? group : K, num_groups = K == 0 ? 0 : (K + G - 1) / G;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < num_groups; ++g) {
        const int64_t k0 = g * G, n = std::min(G, K - k0);
        const T* xs = x + m * K + k0;
        float s;
        if (static_scale) {
          s = static_scale[0];
        } else {
          s = std::max(amax_of(xs, n) / fmax, 1e-12f);
          scales[m * num_groups + g] = s;
        }
        quantize(xs, n, s, fmax, q + m * K + k0);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fp8_quant(const at::Tensor& x, bool e5m2,
                                                   const c10::optional<at::Tensor>& scale, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "fp8_quant takes float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(group >= 0, "fp8_quant: group must be >= 0 (0: one scale per tensor), got ", group);
  auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn));
  at::Tensor s;
  const float* static_scale = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->numel() == 1, "a static scale must hold one value (per tensor), got ", scale->sizes());
    s = scale->to(at::kFloat).contiguous();
    static_scale = s.data_ptr<float>();
  } else if (group == 0) {
    s = at::full({1}, 1e-12f, x.options().dtype(at::kFloat));
  } else {
    s = at::full({M, K == 0 ? 0 : (K + group - 1) / group}, 1e-12f, x.options().dtype(at::kFloat));
  }
  float* sp = scale.has_value() ? nullptr : s.data_ptr<float>();
  auto run = [&](auto* f8) {
    using F8 = std::remove_pointer_t<decltype(f8)>;
    if (x.scalar_type() == at::kBFloat16)
      quant_rows(xc.data_ptr<c10::BFloat16>(), M, K, static_scale, group, sp, f8);
    else
      quant_rows(xc.data_ptr<float>(), M, K, static_scale, group, sp, f8);
  };
  if (e5m2)
    run(q.data_ptr<c10::Float8_e5m2>());
  else
    run(q.data_ptr<c10::Float8_e4m3fn>());
  return {q, s};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(halserve_cpu, m) {
  m.def("fp8_quant(Tensor x, bool e5m2, Tensor? scale, int group) -> (Tensor, Tensor)");
  m.impl("fp8_quant", c10::DeviceType::CPU, &fp8_quant);
}
