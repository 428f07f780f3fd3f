// GGUF Q4_0 / Q4_1 / Q8_0 weights times activations on the CPU, as llama.cpp does it (native_gguf.py):
// the activations are quantized to int8 per row and block of 32 (d = amax / 127, q = round(x / d): Q8_0,
// with the block's sum of q kept as Q8_1 does), and each weight block meets them in exact integer dot
// products; the float scales apply once per block:
//
//   Q4_0  w = dw (q4 - 8):    dot = dw dx (sum q4 qx - 8 sum qx)
//   Q4_1  w = dw q4 + mw:     dot = dw dx sum q4 qx + mw dx sum qx
//   Q8_0  w = dw q8:          dot = dw dx sum q8 qx
//
// The weight is the file's rows as stored (uint8 [N, K / 32 * S], kernels/gguf_blocks.py); a 4-bit block's
// 16 bytes hold values 0..15 in their low nibbles and 16..31 in their high ones.
//
// Two instruction paths, chosen at run time (the caller passes ``isa``; every function carries its own
// target attribute, so one build has both whatever -march says):
//   isa 2  AVX-512 VNNI: two blocks per 512-bit register, _mm512_dpbusd_epi32 (u8 x s8 summed in int32;
//          Q8_0's signed weight offset by 128 to be unsigned, the offset taken back with sum qx)
//   isa 1  AVX2: one block per register, _mm256_maddubs_epi16 (pairs in int16: 15 * 127 * 2 and, with
//          Q8_0's sign trick |w| * sign(x, w), 128 * 127 * 2 fit) then _mm256_madd_epi16
// Threads split the output rows (at::parallel_for); up to 4 activation rows share each decoded weight block.
//
//   gguf_gemv(x [M, K] f32, w [N, row bytes] uint8, qtype (0 Q4_0, 1 Q4_1, 2 Q8_0), isa, levels) -> [M, N] f32
//       levels 1: x in int8 (llama.cpp's accuracy); 2: x and its rounding error in int8 each (see quantize_x)
//   gguf_dequantize(w, qtype, K) -> [N, K] f32      (the large-batch path: a float panel for the GEMM)
//   gguf_isa_supported(isa) -> bool                 (this CPU runs that path)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define HS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define HS_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

namespace {

constexpr int64_t kBlock = 32;
constexpr int kMaxRows = 4;  // activation rows per pass over a weight row

enum QType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

inline int64_t block_bytes(int64_t qtype) { return qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : 34; }

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// The activations, quantized: per row and block, q int8 [32], d, and sum(q) as int and as d * sum(q).
struct QuantX {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, KB]
  std::vector<int32_t> isum;  // [M, KB]
  std::vector<float> fsum;   // [M, KB]  d * isum
};

// One block of 32 to int8: d = amax / 127, q = round(x / d) (half to even, as torch.round); returns d.
inline float quantize_block(const float* xb, int8_t* q, int32_t& isum) {
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    float v = std::nearbyint(xb[j] * id);
    v = std::min(127.0f, std::max(-127.0f, v));
    q[j] = static_cast<int8_t>(v);
    sum += static_cast<int32_t>(v);
  }
  isum = sum;
  return d;
}

// levels 1: row m of x is quantized row m (llama.cpp's Q8_0/Q8_1: ~0.7% relative error per GEMM on SmolLM2's
// activations). levels 2: quantized rows 2m and 2m + 1 are x's int8 blocks and the int8 blocks of what they
// leave, r = x - d q (|r| <= d / 2), so x = d q + d2 q2 to within d2 / 2 = amax / 64516: ~260x less error
// for twice the integer work, and the two rows' outputs are summed.
void quantize_x(const float* x, int64_t M, int64_t K, int levels, QuantX& out) {
  const int64_t KB = K / kBlock, rows = M * levels;
  out.q.resize(rows * K);
  out.d.resize(rows * KB);
  out.isum.resize(rows * KB);
  out.fsum.resize(rows * KB);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    float r[kBlock];
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < KB; ++b) {
        const float* xb = x + m * K + b * kBlock;
        const int64_t i = m * levels * KB + b;  // quantized row m * levels, block b
        int8_t* q = out.q.data() + i * kBlock;
        const float d = quantize_block(xb, q, out.isum[i]);
        out.d[i] = d;
        out.fsum[i] = d * static_cast<float>(out.isum[i]);
        if (levels == 2) {
          for (int j = 0; j < kBlock; ++j) r[j] = xb[j] - d * static_cast<float>(q[j]);
          const int64_t i2 = i + KB;  // the next quantized row, same block
          const float d2 = quantize_block(r, out.q.data() + i2 * kBlock, out.isum[i2]);
          out.d[i2] = d2;
          out.fsum[i2] = d2 * static_cast<float>(out.isum[i2]);
        }
      }
    }
  });
}

// ---- AVX2 ---------------------------------------------------------------------------------------------

HS_AVX2 inline float h2f_avx2(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

HS_AVX2 inline __m256i q4_block_avx2(const uint8_t* qs) {  // 16 bytes -> 32 values 0..15 in order
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

HS_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int64_t QT, int R>
HS_AVX2 void rows_avx2(const QuantX& xq, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                       int64_t m0, float* out, int64_t N) {
  const int64_t KB = K / kBlock, S = block_bytes(QT);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[R];
    float extra[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      extra[r] = 0.0f;
    }
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* blk = wr + b * S;
      const float dw = h2f_avx2(blk);
      __m256i wv;
      float mw = 0.0f;
      if constexpr (QT == kQ8_0) wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      else if constexpr (QT == kQ4_1) {
        mw = h2f_avx2(blk + 2);
        wv = q4_block_avx2(blk + 4);
      } else wv = q4_block_avx2(blk + 2);
      const __m256i aw = QT == kQ8_0 ? _mm256_sign_epi8(wv, wv) : wv;
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * KB + b;
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + i * kBlock));
        if constexpr (QT == kQ8_0) xv = _mm256_sign_epi8(xv, wv);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);  // 8 x int32
        const float dd = dw * xq.d[i];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dd), acc[r]);
        if constexpr (QT == kQ4_0) extra[r] -= 8.0f * dw * xq.fsum[i];
        if constexpr (QT == kQ4_1) extra[r] += mw * xq.fsum[i];
      }
    }
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = hsum_avx2(acc[r]) + extra[r];
  }
}

// ---- AVX-512 VNNI -------------------------------------------------------------------------------------

HS_AVX512 inline float h2f_avx512(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

HS_AVX512 inline __m256i q4_block_avx512(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

template <int64_t QT>
HS_AVX512 inline __m256i weight_block_avx512(const uint8_t* blk) {  // 32 unsigned bytes
  if constexpr (QT == kQ8_0) {  // w + 128 as unsigned
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), _mm256_set1_epi8(-128));
  } else {
    return q4_block_avx512(blk + (QT == kQ4_1 ? 4 : 2));
  }
}

template <int64_t QT, int R>
HS_AVX512 void rows_avx512(const QuantX& xq, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                           int64_t m0, float* out, int64_t N) {
  const int64_t KB = K / kBlock, S = block_bytes(QT);
  const float offset = QT == kQ4_0 ? 8.0f : QT == kQ8_0 ? 128.0f : 0.0f;  // sum of (w + offset) qx
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m512 acc[R];
    float extra[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_ps();
      extra[r] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 2 <= KB; b += 2) {  // two blocks: lanes 0-7 block b, 8-15 block b + 1
      const uint8_t* b0 = wr + b * S;
      const uint8_t* b1 = b0 + S;
      const float dw0 = h2f_avx512(b0), dw1 = h2f_avx512(b1);
      const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(weight_block_avx512<QT>(b0)),
                                            weight_block_avx512<QT>(b1), 1);
      const float mw0 = QT == kQ4_1 ? h2f_avx512(b0 + 2) : 0.0f, mw1 = QT == kQ4_1 ? h2f_avx512(b1 + 2) : 0.0f;
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * KB + b;
        const __m512i xv = _mm512_loadu_si512(xq.q.data() + i * kBlock);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);  // 16 x int32
        const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(dw0 * xq.d[i]), _mm256_set1_ps(dw1 * xq.d[i + 1]), 1);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dd, acc[r]);
        if constexpr (QT == kQ4_1) extra[r] += mw0 * xq.fsum[i] + mw1 * xq.fsum[i + 1];
        else extra[r] -= offset * (dw0 * xq.fsum[i] + dw1 * xq.fsum[i + 1]);
      }
    }
    for (; b < KB; ++b) {  // an odd last block: 256-bit VNNI
      const uint8_t* b0 = wr + b * S;
      const float dw = h2f_avx512(b0), mw = QT == kQ4_1 ? h2f_avx512(b0 + 2) : 0.0f;
      const __m256i wv = weight_block_avx512<QT>(b0);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * KB + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + i * kBlock));
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
        const __m512 pf = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xq.d[i])));
        acc[r] = _mm512_add_ps(acc[r], _mm512_maskz_mov_ps(0xFF, pf));
        if constexpr (QT == kQ4_1) extra[r] += mw * xq.fsum[i];
        else extra[r] -= offset * dw * xq.fsum[i];
      }
    }
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]) + extra[r];
  }
}

// ---- dispatch -----------------------------------------------------------------------------------------

using RowsFn = void (*)(const QuantX&, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);

template <int64_t QT>
RowsFn pick(int64_t isa, int rows) {
  if (isa == 2) {
    switch (rows) {
      case 1: return rows_avx512<QT, 1>;
      case 2: return rows_avx512<QT, 2>;
      case 3: return rows_avx512<QT, 3>;
      default: return rows_avx512<QT, 4>;
    }
  }
  switch (rows) {
    case 1: return rows_avx2<QT, 1>;
    case 2: return rows_avx2<QT, 2>;
    case 3: return rows_avx2<QT, 3>;
    default: return rows_avx2<QT, 4>;
  }
}

RowsFn pick_fn(int64_t qtype, int64_t isa, int rows) {
  switch (qtype) {
    case kQ4_0: return pick<kQ4_0>(isa, rows);
    case kQ4_1: return pick<kQ4_1>(isa, rows);
    default: return pick<kQ8_0>(isa, rows);
  }
}

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  if (isa == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return false;
}

void check(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype >= 0 && qtype <= 2, "gguf_gemm: qtype must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0), got ", qtype);
  TORCH_CHECK(K % kBlock == 0, "gguf_gemm: K = ", K, " is not a multiple of 32");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf_gemm: the weight must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(qtype), "gguf_gemm: weight rows have ", w.size(1),
              " bytes, a row of ", K, " values of this type has ", K / kBlock * block_bytes(qtype));
}

at::Tensor gguf_gemv(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t isa, int64_t levels) {
  TORCH_CHECK(x_in.dim() == 2, "gguf_gemv: x must be [M, K]");
  TORCH_CHECK(levels == 1 || levels == 2, "gguf_gemv: levels must be 1 or 2 int8 levels, got ", levels);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), MQ = M * levels;
  check(w, qtype, K);
  TORCH_CHECK(isa_supported(isa), "gguf_gemv: this CPU cannot run instruction path ", isa,
              " (1 AVX2, 2 AVX-512 VNNI)");
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor outq = levels == 1 ? out : at::empty({MQ, N}, x.options());  // [M * levels, N]
  QuantX xq;
  quantize_x(x.data_ptr<float>(), M, K, static_cast<int>(levels), xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = outq.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  const int64_t grain = std::max<int64_t>(8, N / (4 * at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < MQ; m0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, MQ - m0));
      pick_fn(qtype, isa, rows)(xq, K, wp, row_bytes, n0, n1, m0, op, N);
    }
  });
  if (levels == 2) {  // out[m] = outq[2m] + outq[2m + 1]
    float* o = out.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) o[m * N + n] = op[2 * m * N + n] + op[(2 * m + 1) * N + n];
  }
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t K) {
  check(w, qtype, K);
  const int64_t N = w.size(0), KB = K / kBlock, S = block_bytes(qtype), row_bytes = w.size(1);
  at::Tensor out = at::empty({N, K}, at::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* blk = wp + n * row_bytes + b * S;
        float* o = op + n * K + b * kBlock;
        const float d = half_to_float(blk);
        if (qtype == kQ8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(q[j]);
        } else {
          const uint8_t* q = blk + (qtype == kQ4_1 ? 4 : 2);
          if (qtype == kQ4_1) {
            const float m = half_to_float(blk + 2);
            for (int j = 0; j < 16; ++j) {
              o[j] = d * static_cast<float>(q[j] & 0xF) + m;
              o[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
            }
          } else {
            for (int j = 0; j < 16; ++j) {
              o[j] = d * static_cast<float>((q[j] & 0xF) - 8);
              o[j + 16] = d * static_cast<float>((q[j] >> 4) - 8);
            }
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(halserve_cpu_gguf, m) {
  m.def("gguf_gemv(Tensor x, Tensor w, int qtype, int isa, int levels=1) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int qtype, int k) -> Tensor");
  m.def("gguf_isa_supported(int isa) -> bool", &isa_supported);
}

TORCH_LIBRARY_IMPL(halserve_cpu_gguf, CPU, m) {
  m.impl("gguf_gemv", gguf_gemv);
  m.impl("gguf_dequantize", gguf_dequantize);
}
