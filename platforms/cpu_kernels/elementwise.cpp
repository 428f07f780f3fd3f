// Fused elementwise kernels of the CPU platform (float32 and bfloat16): one pass over memory
// where torch needs several ops (and their temporaries) for the same result.
//
//   add_rms_norm(x [T, H], residual [T, H], weight [H], eps) -> (out, x + residual)
//       s = x + residual; out = s / sqrt(mean(s^2) + eps) * weight
//   rotary(positions [T], q [T, Hq*D], k [T, Hk*D], cos_sin [P, R], D, is_neox) -> (q', k')
//       rotates the first R dims of every head by the angle of its position; cos_sin holds
//       R/2 cosines then R/2 sines per position. neox pairs (i, i + R/2); gpt-j pairs
//       (2i, 2i + 1). q and k may be row-strided views (slices of the fused qkv output).
//   silu_and_mul(x [T, 2I]) -> [T, I] = silu(x[:, :I]) * x[:, I:], silu(g) = g / (1 + e^-g)
//       with the 16-lane exp of vec16.h (about 1 ulp; the torch reference takes two ops
//       and a temporary).
//   scaled_int8_quant(x [M, K], scale [1] | None) -> (q [M, K] int8, scale [M, 1] | [1])
//       dynamic (scale None): s = max(amax|x_row| / 127, 1e-12) per row; q = clamp(rint(x / s),
//       -128, 127). One pass per row for the amax, one writing int8; a true division (as the
//       reference's xf / scale) and round-half-to-even, so equal to it bit for bit. Exposed as
//       torch.ops.halserve_cpu.scaled_int8_quant (a TORCH_LIBRARY op: the pybind module lives
//       in paged_attention.cpp).
//
// bfloat16 inputs go through separate functions (the float32 code is untouched) that compute
// in float32 and round to bf16 where the torch reference ops do (kernels/reference.py): the
// residual sum, x * rsqrt(...) before the weight, silu(gate) before the multiply, the
// rotated values once.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "vec16.h"

// Round after every multiply and add, exactly like the separate torch ops these kernels
// replace (no fused multiply-add contraction), so results are bit-identical to them.
#pragma GCC optimize("fp-contract=off")

using bf16 = c10::BFloat16;
using halserve_cpu::from_float;
using halserve_cpu::to_float;

static std::vector<at::Tensor> add_rms_norm_bf16(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                                    double eps) {
  auto xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  const int64_t T = x.size(0), H = x.size(1);
  auto out = at::empty_like(xc), sum = at::empty_like(xc);
  const bf16 *xp = xc.data_ptr<bf16>(), *rp = rc.data_ptr<bf16>(), *wp = wc.data_ptr<bf16>();
  bf16 *op = out.data_ptr<bf16>(), *sp = sum.data_ptr<bf16>();
  const float feps = static_cast<float>(eps);
  using namespace halserve_cpu;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sf(H);  // the rounded sum, widened once
    for (int64_t t = begin; t < end; ++t) {
      const bf16 *a = xp + t * H, *b = rp + t * H;
      bf16* s = sp + t * H;
      v16 ssv = v16{};
      int64_t i = 0;
      for (; i + 16 <= H; i += 16) {
        const v16 v = round_bf16(load16(a + i) + load16(b + i));
        store16(s + i, v);
        store16(sf.data() + i, v);
        ssv += v * v;
      }
      float ss = hsum16(ssv);
      for (; i < H; ++i) {
        const bf16 v = from_float<bf16>(to_float(a[i]) + to_float(b[i]));
        s[i] = v;
        sf[i] = to_float(v);
        ss += sf[i] * sf[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      bf16* o = op + t * H;
      i = 0;
      for (; i + 16 <= H; i += 16) store16(o + i, round_bf16(load16(sf.data() + i) * inv) * load16(wp + i));
      for (; i < H; ++i) o[i] = from_float<bf16>(to_float(from_float<bf16>(sf[i] * inv)) * to_float(wp[i]));
    }
  });
  return {out, sum};
}

std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes(), "x and residual must be [T, H] of one shape");
  if (x.scalar_type() == at::kBFloat16 && residual.scalar_type() == at::kBFloat16 &&
      weight.scalar_type() == at::kBFloat16)
    return add_rms_norm_bf16(x, residual, weight, eps);
  TORCH_CHECK(x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat, "add_rms_norm takes float32 or bfloat16 (all three alike)");
  auto xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  const int64_t T = x.size(0), H = x.size(1);
  auto out = at::empty_like(xc), sum = at::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *rp = rc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = sum.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *a = xp + t * H, *b = rp + t * H;
      float* s = sp + t * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        const float v = a[i] + b[i];
        s[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      float* o = op + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = s[i] * inv * wp[i];
    }
  });
  return {out, sum};
}

static void rotate_rows(const int64_t* pos, const float* src, int64_t src_stride, float* dst, int64_t T,
                        int64_t heads, int64_t D, const float* cs, int64_t R, bool neox) {
  const int64_t half = R / 2;
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pos[t] * R;  // cos[0:half] then sin[0:half]
      const float* s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = src + t * src_stride + h * D;
        float* y = dst + (t * heads + h) * D;
        if (neox) {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            y[i] = x1 * c[i] - x2 * s[i];
            y[i + half] = x2 * c[i] + x1 * s[i];
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[2 * i], x2 = x[2 * i + 1];
            y[2 * i] = x1 * c[i] - x2 * s[i];
            y[2 * i + 1] = x2 * c[i] + x1 * s[i];
          }
        }
        for (int64_t i = R; i < D; ++i) y[i] = x[i];
      }
    }
  });
}

// rotate_rows for bf16 rows: the same arithmetic on widened values, rounded once.
static void rotate_rows_bf16(const int64_t* pos, const bf16* src, int64_t src_stride, bf16* dst, int64_t T,
                             int64_t heads, int64_t D, const float* cs, int64_t R, bool neox) {
  using namespace halserve_cpu;
  const int64_t half = R / 2;
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pos[t] * R;  // cos[0:half] then sin[0:half]
      const float* s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        const bf16* x = src + t * src_stride + h * D;
        bf16* y = dst + (t * heads + h) * D;
        const int64_t step = neox ? 1 : 2, other = neox ? half : 1;  // pair i: (i, i + half) or (2i, 2i + 1)
        int64_t i = 0;
        if (neox)
          for (; i + 16 <= half; i += 16) {
            const v16 x1 = load16(x + i), x2 = load16(x + i + half), cv = load16(c + i), sv = load16(s + i);
            store16(y + i, x1 * cv - x2 * sv);
            store16(y + i + half, x2 * cv + x1 * sv);
          }
        for (; i < half; ++i) {
          const int64_t i1 = i * step, i2 = i * step + other;
          const float x1 = to_float(x[i1]), x2 = to_float(x[i2]);
          y[i1] = from_float<bf16>(x1 * c[i] - x2 * s[i]);
          y[i2] = from_float<bf16>(x2 * c[i] + x1 * s[i]);
        }
        for (int64_t i = R; i < D; ++i) y[i] = x[i];
      }
    }
  });
}

std::vector<at::Tensor> rotary(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_sin,
                                  int64_t head_size, bool is_neox) {
  const bool is_bf16 = q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16;
  TORCH_CHECK(((q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat) || is_bf16) &&
                  cos_sin.scalar_type() == at::kFloat,
              "rotary takes float32 or bfloat16 q, k and a float32 cos_sin cache");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.stride(1) == 1 && k.stride(1) == 1,
              "q and k must be [T, heads * head_size] with unit column stride");
  auto pos = positions.to(at::kLong).contiguous();
  auto cs = cos_sin.contiguous();
  const int64_t T = q.size(0), R = cs.size(1), D = head_size;
  TORCH_CHECK(R <= D && R % 2 == 0, "rotary dim must be even and at most head_size");
  auto q_out = at::empty({T, q.size(1)}, q.options());
  auto k_out = at::empty({T, k.size(1)}, k.options());
  if (is_bf16) {
    rotate_rows_bf16(pos.data_ptr<int64_t>(), q.data_ptr<bf16>(), q.stride(0), q_out.data_ptr<bf16>(), T, q.size(1) / D,
                     D, cs.data_ptr<float>(), R, is_neox);
    rotate_rows_bf16(pos.data_ptr<int64_t>(), k.data_ptr<bf16>(), k.stride(0), k_out.data_ptr<bf16>(), T, k.size(1) / D,
                     D, cs.data_ptr<float>(), R, is_neox);
    return {q_out, k_out};
  }
  rotate_rows(pos.data_ptr<int64_t>(), q.data_ptr<float>(), q.stride(0), q_out.data_ptr<float>(), T, q.size(1) / D, D,
              cs.data_ptr<float>(), R, is_neox);
  rotate_rows(pos.data_ptr<int64_t>(), k.data_ptr<float>(), k.stride(0), k_out.data_ptr<float>(), T, k.size(1) / D, D,
              cs.data_ptr<float>(), R, is_neox);
  return {q_out, k_out};
}

// silu(gate) rounded to bf16, then times up and rounded again: F.silu(gate).mul_(up) in bf16.
static at::Tensor silu_and_mul_bf16(at::Tensor xc) {
  const int64_t T = xc.size(0), I = xc.size(1) / 2, ld = xc.stride(0);
  auto out = at::empty({T, I}, xc.options());
  const bf16* xp = xc.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  using namespace halserve_cpu;
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* g = xp + t * ld;
      const bf16* u = g + I;
      bf16* o = op + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {
        const v16 gv = load16(g + i);
        store16(o + i, round_bf16(gv / (1.0f + exp16(-gv))) * load16(u + i));
      }
      for (; i < I; ++i) {
        const float gf = to_float(g[i]);
        o[i] = from_float<bf16>(to_float(from_float<bf16>(gf / (1.0f + std::exp(-gf)))) * to_float(u[i]));
      }
    }
  });
  return out;
}

at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "silu_and_mul takes float32 or bfloat16 [T, 2 * I]");
  if (x.scalar_type() == at::kBFloat16) return silu_and_mul_bf16(x.stride(1) == 1 ? x : x.contiguous());
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t T = xc.size(0), I = xc.size(1) / 2, ld = xc.stride(0);
  auto out = at::empty({T, I}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  using namespace halserve_cpu;
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * ld;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {
        const v16 gv = load16(g + i);
        store16(o + i, gv / (1.0f + exp16(-gv)) * load16(u + i));
      }
      for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

#if defined(__AVX512F__)
// 16 lanes straight into a register (a v16 round trip through memory here would split into
// two 32-byte stores and one 64-byte load: a store-forwarding stall per vector).
static inline __m512 load_ps(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load_ps(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// |x| max over a row, in float32 (bf16 widens exactly; max is order-independent).
template <typename T>
static float row_abs_max(const T* x, int64_t K) {
  float r = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= K; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load_ps(x + i)));
  r = _mm512_reduce_max_ps(m);
#endif
  for (; i < K; ++i) r = std::max(r, std::fabs(to_float(x[i])));
  return r;
}

// q[i] = clamp(rint(x[i] / s), -128, 127): clamping before the rounding is the same (the
// bounds are integers) and keeps the float -> int32 conversion in range.
template <typename T>
static void quantize_row(const T* x, int64_t K, float s, int8_t* q) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= K; i += 16) {
    const __m512 f = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(load_ps(x + i), sv), lo), hi);
    // cvtps rounds with MXCSR's mode: nearest-even, like torch.round
    const __m512i n = _mm512_cvtps_epi32(f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(n));
  }
#endif
  for (; i < K; ++i) {
    const float v = std::min(std::max(to_float(x[i]) / s, -128.f), 127.f);
    q[i] = static_cast<int8_t>(std::nearbyint(v));
  }
}

template <typename T>
static void scaled_int8_quant_rows(const T* xp, int64_t M, int64_t K, const float* static_scale, float* sp,
                                   int8_t* qp) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = xp + t * K;
      float s;
      if (static_scale != nullptr) {
        s = *static_scale;
      } else {
        s = std::max(row_abs_max(x, K) / 127.0f, 1e-12f);
        sp[t] = s;
      }
      quantize_row(x, K, s, qp + t * K);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> scaled_int8_quant(const at::Tensor& x,
                                                           const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "scaled_int8_quant takes float32 or bfloat16 [..., K]");
  auto xc = x.contiguous();
  const int64_t K = x.size(-1), M = K == 0 ? 0 : xc.numel() / K;
  auto q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor s;
  const float* static_scale = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->numel() == 1, "a static scale must hold one value (per tensor), got ", scale->sizes());
    s = scale->to(at::kFloat).contiguous();
    static_scale = s.data_ptr<float>();
  } else {
    auto shape = x.sizes().vec();
    shape.back() = 1;
    // K == 0: no row to scan (the reference's amax raises); the scales stay at the floor
    s = K == 0 ? at::full(shape, 1e-12f, x.options().dtype(at::kFloat))
               : at::empty(shape, x.options().dtype(at::kFloat));
  }
  float* sp = scale.has_value() ? nullptr : s.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16)
    scaled_int8_quant_rows(xc.data_ptr<bf16>(), M, K, static_scale, sp, q.data_ptr<int8_t>());
  else
    scaled_int8_quant_rows(xc.data_ptr<float>(), M, K, static_scale, sp, q.data_ptr<int8_t>());
  return {q, s};
}

TORCH_LIBRARY(halserve_cpu, m) {
  m.def("scaled_int8_quant(Tensor x, Tensor? scale=None) -> (Tensor, Tensor)");
  m.impl("scaled_int8_quant", &scaled_int8_quant);
}
