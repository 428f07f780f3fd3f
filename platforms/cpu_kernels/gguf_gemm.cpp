// GGUF Q4_0 / Q4_1 / Q8_0 (and Q4_K / Q5_K / Q6_K: see "K-quants" below) weights times activations on the CPU,
// as llama.cpp does it (native_gguf.py):
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
//   gguf_dequantize(w, qtype, K) -> [N, K] f32      (the large-batch path: a float panel for the GEMM; Q4_0, Q4_1,
//                                                    Q8_0 only: the K types' panel dequantizes in torch)
//   gguf_isa_supported(isa) -> bool                 (this CPU runs that path)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#define HS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define HS_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

namespace {

constexpr int64_t kBlock = 32;
constexpr int kMaxRows = 4;  // activation rows per pass over a weight row
constexpr int kTwoLevelRatio = 255;  // the second int8 level's scale is the first's / 255 (quantize_x)

enum QType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };

inline bool is_k_type(int64_t qtype) { return qtype >= kQ4_K; }
inline int64_t block_values(int64_t qtype) { return is_k_type(qtype) ? 256 : 32; }
inline int64_t block_bytes(int64_t qtype) {
  constexpr int64_t bytes[] = {18, 20, 34, 144, 176, 210};
  return bytes[qtype];
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// A buffer that quantize_x fills whole: resize does not zero it (a 2048-row prompt's int8 blocks are 2.4 MB).
template <typename T>
struct Buf {
  std::unique_ptr<T[]> p;
  size_t n = 0;
  void resize(size_t k) {
    if (k != n) p.reset(new T[k]);
    n = k;
  }
  T* data() { return p.get(); }
  const T* data() const { return p.get(); }
  T& operator[](size_t i) { return p[i]; }
  const T& operator[](size_t i) const { return p[i]; }
  T* begin() { return p.get(); }
  T* end() { return p.get() + n; }
};

// The activations, quantized: per row and block, q int8 [32], d, and sum(q) as int and as d * sum(q).
// q's layout: tile 0 row-major ([quantized rows][K], what gguf_gemv reads); tile t > 0 the packed tiles' (for the
// tile of real rows m0 .. m0 + t - 1, from m0 LV K on, block-major: block c's R = rows LV quantized rows of 32
// one after another, so a tile reads them from one pointer with constant offsets).
struct QuantX {
  Buf<int8_t> q;     // [M, K]
  Buf<float> d;      // [M, KB]
  Buf<int32_t> isum;  // [M, KB]
  Buf<float> fsum;   // [M, KB]  d * isum
  Buf<int32_t> isum16;  // [M, 2 KB]  sum(q) per half block of 16 (Q6_K's sub-blocks)
  int64_t rows = 0, KB = 0, tile = 0;  // real rows, blocks a row, q's layout
  int levels = 1;
};

// Where quantized row qrow's blocks go in q: block c at p + c * stride.
struct QRow {
  int8_t* p;
  int64_t stride;
};
inline QRow q_row(QuantX& x, int64_t qrow) {
  if (x.tile == 0) return {x.q.data() + qrow * x.KB * kBlock, kBlock};
  const int64_t m = qrow / x.levels, m0 = m - m % x.tile, R = std::min(x.tile, x.rows - m0) * x.levels;
  return {x.q.data() + (m0 * x.levels * x.KB + qrow - m0 * x.levels) * kBlock, R * kBlock};
}

HS_AVX2 inline int32_t hsum_epi32_avx2(__m256i a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// One block of 32 to int8 at scale d: q = round(x * (1 / d)) to nearest even (as torch.round), clamped to +-127
// (0 where d is 0); also the sum of q and of its first 16.
HS_AVX2 inline void quantize_block_at_avx2(const float* xb, float d, int8_t* q, int32_t& isum, int32_t& isum16) {
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  const __m256 idv = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  __m256i qi[4];
  for (int j = 0; j < 4; ++j) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[j] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
  }
  const __m256i s01 = _mm256_add_epi32(qi[0], qi[1]), s23 = _mm256_add_epi32(qi[2], qi[3]);
  isum16 = hsum_epi32_avx2(s01);
  isum = isum16 + hsum_epi32_avx2(s23);
  // int32 -> int8 in order: packs work per 128-bit lane, so permute back
  const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
  __m256i p = _mm256_packs_epi16(p01, p23);
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
}

// One block of 32 to int8: d = amax / 127 (kernels/gguf_blocks.quantize_activations_q8), q as above; returns d.
HS_AVX2 inline float quantize_block_avx2(const float* xb, int8_t* q, int32_t& isum, int32_t& isum16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * j)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.0f;
  quantize_block_at_avx2(xb, d, q, isum, isum16);
  return d;
}

// levels 1: row m of x is quantized row m (llama.cpp's Q8_0/Q8_1: ~0.7% relative error per GEMM on SmolLM2's
// activations). levels 2: quantized rows 2m and 2m + 1 are x's int8 blocks and the int8 blocks of what they
// leave, r = x - d q (|r| <= d / 2), at the fixed scale d2 = d / 255 (kTwoLevelRatio): |r| / d2 <= 127.5, so
// q2 = round(r / d2) clamped to +-127 is within 1/2 of r / d2 and x = d q + d2 q2 to within d2 / 2 = amax /
// 64770: ~255x less error for twice the integer work. A fixed ratio lets the packed tile sum the two levels'
// integer dot products as 255 dot1 + dot2 (exact in int32) and scale them once (packed_tile_avx512); the other
// paths sum the two rows' float outputs. AVX2 (every caller has checked the CPU).
// A quantized block's bookkeeping once its q and sums are written: its scale, the second half's sum, d * sum(q).
inline void record_block(QuantX& out, int64_t i, float d) {
  out.isum16[2 * i + 1] = out.isum[i] - out.isum16[2 * i];
  out.d[i] = d;
  out.fsum[i] = d * static_cast<float>(out.isum[i]);
}

// One block's halves v0, v1 at the inverse scale id: q = round(v id) clamped to +-127 (as quantize_at_avx512) into
// q [32]; q0, q1 the same values as floats.
HS_AVX512 inline void quantize_halves_avx512(__m512 v0, __m512 v1, __m512 id, int8_t* q, __m512& q0, __m512& q1) {
  const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  q0 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(v0, id), kRound)));
  q1 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(v1, id), kRound)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q0)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q1)));
}

// quantize_x's block, AVX-512: the same numbers as quantize_block_avx2 (and its residual), two blocks of 16.
HS_AVX512 inline void quantize_at_avx512(__m512 v0, __m512 v1, float d, int8_t* q, int32_t& isum, int32_t& isum16,
                                         __m512& q0, __m512& q1) {
  quantize_halves_avx512(v0, v1, _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f), q, q0, q1);
  isum16 = _mm512_reduce_add_epi32(_mm512_cvttps_epi32(q0));
  isum = isum16 + _mm512_reduce_add_epi32(_mm512_cvttps_epi32(q1));
}

// Lane j of the result = the sum (Add) or maximum of v[j]'s 16 lanes, for 16 vectors at once: 45 shuffles and
// operations where 16 separate reductions take ~130. Sums of whole numbers below 2^24 are exact in any order.
template <bool Add>
HS_AVX512 inline __m512 reduce16x16(const __m512* v) {
  auto op = [](__m512 a, __m512 b) { return Add ? _mm512_add_ps(a, b) : _mm512_max_ps(a, b); };
  __m512 u[8], w[4], y[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: (a0 + a2, b0 + b2, a1 + a3, b1 + b3)
    u[k] = op(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: the lane's sums of vectors 4k .. 4k + 3
    w[k] = op(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; ++k)  // 128-bit lanes summed in pairs
    y[k] = op(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return op(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 consecutive blocks of one quantized row, from their (scales d, first halves' and whole blocks' sums of q as
// floats): the bookkeeping record_block does, for 16 blocks with vector stores.
HS_AVX512 inline void record_16_blocks(QuantX& out, int64_t i, __m512 d, const __m512* half, const __m512* whole) {
  const __m512i h = _mm512_cvtps_epi32(reduce16x16<true>(half)), t = _mm512_cvtps_epi32(reduce16x16<true>(whole));
  _mm512_storeu_ps(out.d.data() + i, d);
  _mm512_storeu_si512(out.isum.data() + i, t);
  _mm512_storeu_ps(out.fsum.data() + i, _mm512_mul_ps(d, _mm512_cvtepi32_ps(t)));
  const __m512i second = _mm512_sub_epi32(t, h);  // isum16 [2 i]: (first half, second half) per block
  _mm512_storeu_si512(out.isum16.data() + 2 * i,
                      _mm512_permutex2var_epi32(h, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                                                     7, 23), second));
  _mm512_storeu_si512(out.isum16.data() + 2 * i + 16,
                      _mm512_permutex2var_epi32(h, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
                                                                     14, 30, 15, 31), second));
}

// Blocks b0 .. b0 + 15 of row m, as quantize_rows_avx512's per-block loop does them (the same numbers: the same
// float operations on each value, the scales' divisions done for 16 blocks at once, sums of q exact), the 16
// blocks' maxima and sums reduced together (reduce16x16) instead of one horizontal reduction each.
HS_AVX512 void quantize_16_blocks_avx512(const float* xr, int64_t b0, int64_t m, QuantX& out, QRow q1r, QRow q2r) {
  const int64_t KB = out.KB;
  const int levels = out.levels;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 am[16];
  for (int j = 0; j < 16; ++j) {
    const float* xb = xr + (b0 + j) * kBlock;
    am[j] = _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(xb)), _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + 16)));
  }
  const __m512 d = _mm512_div_ps(reduce16x16<false>(am), _mm512_set1_ps(127.0f));
  const __m512 d2 = _mm512_div_ps(d, _mm512_set1_ps(static_cast<float>(kTwoLevelRatio)));
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  alignas(64) float dv[16], idv[16], id2v[16];
  _mm512_store_ps(dv, d);
  _mm512_store_ps(idv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ), one, d));
  _mm512_store_ps(id2v, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d2, zero, _CMP_GT_OQ), one, d2));
  const int64_t i = m * levels * KB + b0, i2 = i + KB;  // quantized rows m levels (and + 1), block b0
  __m512 half[16], whole[16], half2[16], whole2[16];
  for (int j = 0; j < 16; ++j) {
    const float* xb = xr + (b0 + j) * kBlock;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    __m512 q0, q1;
    quantize_halves_avx512(v0, v1, _mm512_set1_ps(idv[j]), q1r.p + (b0 + j) * q1r.stride, q0, q1);
    half[j] = q0;
    whole[j] = _mm512_add_ps(q0, q1);
    if (levels == 2) {
      const __m512 dj = _mm512_set1_ps(dv[j]);
      const __m512 r0 = _mm512_fnmadd_ps(dj, q0, v0), r1 = _mm512_fnmadd_ps(dj, q1, v1);  // x - d q
      quantize_halves_avx512(r0, r1, _mm512_set1_ps(id2v[j]), q2r.p + (b0 + j) * q2r.stride, q0, q1);
      half2[j] = q0;
      whole2[j] = _mm512_add_ps(q0, q1);
    }
  }
  record_16_blocks(out, i, d, half, whole);
  if (levels == 2) record_16_blocks(out, i2, d2, half2, whole2);
}

// Rows m0 .. m1 - 1 of x into out, sized by size_quant_x (its K = KB 32 and levels).
HS_AVX512 void quantize_rows_avx512(const float* x, int64_t m0, int64_t m1, QuantX& out) {
  const int64_t KB = out.KB, K = KB * kBlock;
  const int levels = out.levels;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t m = m0; m < m1; ++m) {
    const QRow q1r = q_row(out, m * levels), q2r = levels == 2 ? q_row(out, m * levels + 1) : q1r;
    const int64_t whole16 = KB / 16 * 16;
    for (int64_t b = 0; b < whole16; b += 16) quantize_16_blocks_avx512(x + m * K, b, m, out, q1r, q2r);
    for (int64_t b = whole16; b < KB; ++b) {
      const float* xb = x + m * K + b * kBlock;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
      const float d = amax / 127.0f;
      const int64_t i = m * levels * KB + b;  // quantized row m * levels, block b
      __m512 q0, q1;
      quantize_at_avx512(v0, v1, d, q1r.p + b * q1r.stride, out.isum[i], out.isum16[2 * i], q0, q1);
      record_block(out, i, d);
      if (levels == 2) {
        const __m512 dv = _mm512_set1_ps(d);
        const __m512 r0 = _mm512_fnmadd_ps(dv, q0, v0), r1 = _mm512_fnmadd_ps(dv, q1, v1);  // x - d q
        const int64_t i2 = i + KB;
        const float d2 = d / static_cast<float>(kTwoLevelRatio);
        quantize_at_avx512(r0, r1, d2, q2r.p + b * q2r.stride, out.isum[i2], out.isum16[2 * i2], q0, q1);
        record_block(out, i2, d2);
      }
    }
  }
}

HS_AVX2 void quantize_rows_avx2(const float* x, int64_t m0, int64_t m1, QuantX& out);

// isa 2 (AVX-512) or 1 (AVX2): the same numbers either way (a residual's fused multiply-add apart, at a tie).
// tile: q's layout (QuantX). Every entry is written by the quantizers.
void size_quant_x(int64_t M, int64_t K, int levels, QuantX& out, int64_t tile = 0) {
  const int64_t KB = K / kBlock, rows = M * levels;
  out.rows = M;
  out.KB = KB;
  out.levels = levels;
  out.tile = tile;
  out.q.resize(rows * K);
  out.d.resize(rows * KB);
  out.isum.resize(rows * KB);
  out.fsum.resize(rows * KB);
  out.isum16.resize(rows * KB * 2);
}

// Rows m0 .. m1 - 1 of x into out (sized by size_quant_x) with the isa's quantizer.
inline void quantize_rows(const float* x, int64_t m0, int64_t m1, QuantX& out, int64_t isa) {
  if (isa == 2) quantize_rows_avx512(x, m0, m1, out);
  else quantize_rows_avx2(x, m0, m1, out);
}

void quantize_x(const float* x, int64_t M, int64_t K, int levels, QuantX& out, int64_t isa, int64_t tile = 0) {
  size_quant_x(M, K, levels, out, tile);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) { quantize_rows(x, m0, m1, out, isa); });
}

HS_AVX2 void quantize_rows_avx2(const float* x, int64_t m0, int64_t m1, QuantX& out) {
  const int64_t KB = out.KB, K = KB * kBlock;
  const int levels = out.levels;
  alignas(32) float r[kBlock];
  for (int64_t m = m0; m < m1; ++m) {
    const QRow q1r = q_row(out, m * levels), q2r = levels == 2 ? q_row(out, m * levels + 1) : q1r;
    for (int64_t b = 0; b < KB; ++b) {
      const float* xb = x + m * K + b * kBlock;
      const int64_t i = m * levels * KB + b;  // quantized row m * levels, block b
      int8_t* q = q1r.p + b * q1r.stride;
      const float d = quantize_block_avx2(xb, q, out.isum[i], out.isum16[2 * i]);
      record_block(out, i, d);
      if (levels == 2) {
        for (int j = 0; j < kBlock; ++j) r[j] = xb[j] - d * static_cast<float>(q[j]);
        const int64_t i2 = i + KB;  // the next quantized row, same block
        const float d2 = d / static_cast<float>(kTwoLevelRatio);
        quantize_block_at_avx2(r, d2, q2r.p + b * q2r.stride, out.isum[i2], out.isum16[2 * i2]);
        record_block(out, i2, d2);
      }
    }
  }
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


// ---- K-quants: super-blocks of 256 as 8 chunks of 32 -------------------------------------------------
//
// Each chunk c of 32 weights is decoded to unsigned bytes u (0..63) with a float scale per int32 lane s[8]
// (a lane sums 4 neighbouring products, so lanes 0-3 are values 0-15 and lanes 4-7 values 16-31) and an
// offset per half of 16 values, so that w = s u + off. The activations keep their int8 blocks of 32 (finer
// than llama.cpp's Q8_K of 256: its error or less), and the dot per chunk and activation row is
//   sum_lanes s[lane] dx p[lane] + dx (off_a isum16_a + off_b isum16_b),  p = int32 lane sums of u qx
//   Q4_K / Q5_K  u = q (4 or 5 bits)  s = d sc_j             off = -dmin m_j
//   Q6_K         u = q + 32 (6 bits)  s = d sc_{2c}, d sc_{2c+1}  off = -32 d sc_{2c}, -32 d sc_{2c+1}
// (Q4_1 is the same form with one chunk per block: the K types reuse its integer dot products.)

struct KChunks {
  __m256i u[8];
  __m256 s[8];
  float off_a[8], off_b[8];
};

HS_AVX2 inline void decode_k(int64_t qt, const uint8_t* blk, KChunks& kc) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  if (qt == kQ6_K) {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = h2f_avx2(blk + 208);
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {  // halves of 128 values: ql[64], qh[32]
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4);
      const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4);
      const __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4);
      kc.u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), h0);
      kc.u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), h1);
      kc.u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), h2);
      kc.u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), h3);
    }
    for (int c = 0; c < 8; ++c) {
      const float a = d * sc[2 * c], b = d * sc[2 * c + 1];
      kc.s[c] = _mm256_setr_ps(a, a, a, a, b, b, b, b);
      kc.off_a[c] = -32.0f * a;
      kc.off_b[c] = -32.0f * b;
    }
    return;
  }
  const float d = h2f_avx2(blk), dmin = h2f_avx2(blk + 2);
  const uint8_t* sm = blk + 4;  // 12 bytes: 6-bit scales and mins
  const uint8_t* qs = blk + (qt == kQ5_K ? 48 : 16);
  __m256i qh = _mm256_setzero_si256();
  if (qt == kQ5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
  const __m256i one = _mm256_set1_epi8(1);
  for (int j = 0; j < 4; ++j) {  // 32 bytes of qs: chunk 2j low nibbles, chunk 2j + 1 high ones
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (qt == kQ5_K) {  // bit c of qh[l] is the fifth bit of chunk c's value l
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
    }
    kc.u[2 * j] = lo;
    kc.u[2 * j + 1] = hi;
  }
  for (int c = 0; c < 8; ++c) {  // llama.cpp's get_scale_min_k4
    int sc, mn;
    if (c < 4) {
      sc = sm[c] & 63;
      mn = sm[c + 4] & 63;
    } else {
      sc = (sm[c + 4] & 0xF) | ((sm[c - 4] >> 6) << 4);
      mn = (sm[c + 4] >> 4) | ((sm[c] >> 6) << 4);
    }
    kc.s[c] = _mm256_set1_ps(d * static_cast<float>(sc));
    kc.off_a[c] = kc.off_b[c] = -dmin * static_cast<float>(mn);
  }
}

// The body of both instruction paths; DOT(u, xv) is 8 int32 lane sums of u (unsigned) times xv (signed).
#define HS_ROWS_K_BODY(DOT)                                                                               \
  const int64_t KB = K / kBlock, S = block_bytes(QT);                                                     \
  KChunks kc;                                                                                             \
  for (int64_t n = n0; n < n1; ++n) {                                                                     \
    const uint8_t* wr = w + n * row_bytes;                                                                \
    __m256 acc[R];                                                                                        \
    float extra[R];                                                                                       \
    for (int r = 0; r < R; ++r) {                                                                         \
      acc[r] = _mm256_setzero_ps();                                                                       \
      extra[r] = 0.0f;                                                                                    \
    }                                                                                                     \
    for (int64_t sb = 0; sb < KB / 8; ++sb) {                                                             \
      decode_k(QT, wr + sb * S, kc);                                                                      \
      for (int c = 0; c < 8; ++c) {                                                                       \
        for (int r = 0; r < R; ++r) {                                                                     \
          const int64_t i = (m0 + r) * KB + sb * 8 + c;                                                   \
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + i * kBlock)); \
          const float dx = xq.d[i];                                                                       \
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(kc.u[c], xv)), _mm256_mul_ps(kc.s[c], _mm256_set1_ps(dx)), \
                                   acc[r]);                                                               \
          extra[r] += dx * (kc.off_a[c] * static_cast<float>(xq.isum16[2 * i]) +                          \
                            kc.off_b[c] * static_cast<float>(xq.isum16[2 * i + 1]));                      \
        }                                                                                                 \
      }                                                                                                   \
    }                                                                                                     \
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = hsum_avx2(acc[r]) + extra[r];                    \
  }

HS_AVX2 inline __m256i dot_avx2(__m256i u, __m256i x) {  // u <= 63: pairs 63 * 127 * 2 fit int16
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

HS_AVX512 inline __m256i dot_vnni(__m256i u, __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
}

template <int64_t QT, int R>
HS_AVX2 void rows_k_avx2(const QuantX& xq, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                         int64_t m0, float* out, int64_t N) {
  HS_ROWS_K_BODY(dot_avx2)
}

template <int64_t QT, int R>
HS_AVX512 void rows_k_avx512(const QuantX& xq, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                             int64_t n1, int64_t m0, float* out, int64_t N) {
  HS_ROWS_K_BODY(dot_vnni)
}
#undef HS_ROWS_K_BODY

// ---- dispatch -----------------------------------------------------------------------------------------

using RowsFn = void (*)(const QuantX&, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);

template <int64_t QT>
RowsFn pick(int64_t isa, int rows) {
  if constexpr (QT >= kQ4_K) {
    if (isa == 2) {
      switch (rows) {
        case 1: return rows_k_avx512<QT, 1>;
        case 2: return rows_k_avx512<QT, 2>;
        case 3: return rows_k_avx512<QT, 3>;
        default: return rows_k_avx512<QT, 4>;
      }
    }
    switch (rows) {
      case 1: return rows_k_avx2<QT, 1>;
      case 2: return rows_k_avx2<QT, 2>;
      case 3: return rows_k_avx2<QT, 3>;
      default: return rows_k_avx2<QT, 4>;
    }
  }
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
    case kQ4_K: return pick<kQ4_K>(isa, rows);
    case kQ5_K: return pick<kQ5_K>(isa, rows);
    case kQ6_K: return pick<kQ6_K>(isa, rows);
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
  TORCH_CHECK(qtype >= 0 && qtype <= 5, "gguf_gemm: qtype must be 0 (Q4_0), 1 (Q4_1), 2 (Q8_0), 3 (Q4_K), 4 (Q5_K) ",
              "or 5 (Q6_K), got ", qtype);
  const int64_t B = block_values(qtype);
  TORCH_CHECK(K % B == 0, "gguf_gemm: K = ", K, " is not a multiple of ", B);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf_gemm: the weight must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(w.size(1) == K / B * block_bytes(qtype), "gguf_gemm: weight rows have ", w.size(1),
              " bytes, a row of ", K, " values of this type has ", K / B * block_bytes(qtype));
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
  quantize_x(x.data_ptr<float>(), M, K, static_cast<int>(levels), xq, isa);
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
  TORCH_CHECK(!is_k_type(qtype), "gguf_dequantize: the K types dequantize in torch (kernels/gguf_blocks.py)");
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


// ---- Packed (repacked) weights: a tile of activation rows per pass over each weight block -----------------
//
// gguf_repack(w, qtype, K, isa) rewrites the GGUF rows once (at the first batched call; the GGUF bytes stay the
// source of truth, native_gguf.py keeps the copy beside them) into groups of 16 output rows (N padded to 16 with
// zero scales). Per group and block c of 32 values, every row's values are stored as unsigned bytes u with a
// scale s and offset o per row (per half block of 16 for Q6_K), so that w = s u + o:
//   Q4_0  u = q       s = d        o = -8 d          Q4_K  u = q (4 bits)   s = d sc_j     o = -dmin m_j
//   Q4_1  u = q       s = d        o = m             Q5_K  u = q (5 bits)   s = d sc_j     o = -dmin m_j
//   Q8_0  u = q + 128 s = d        o = -128 d        Q6_K  u = q (6 bits)   s = d sc per 16, o = -32 s
//         (AVX2: q kept signed, o = 0: its maddubs would overflow int16 on u up to 255; the sign trick instead)
// Layout of a group: block after block, each its values then its scales. One block's values are
// [j = 0..7][row 0..15][4 bytes: values 4j..4j+3] (512 bytes), or for the 4-bit types
// [t = 0..3][row][4 bytes, low nibbles values 4t.., high nibbles values 16 + 4t..] (256). (All of a group's
// values before all its scales, which keeps every value load 64-byte aligned, read 1.6x slower at one row:
// BENCHMARKS.md.) Its scales take as few bytes as keep them exact (a decode step reads every byte once: this is its memory traffic): Q4_0 and
// Q8_0 s[16] as float16 (GGUF's own d), o = -8 s / -128 s computed, not stored; Q4_1 s[16] and o[16] as
// float16 (its d and m); the K types s[16], o[16] as float32 (d sc_j is not a float16) and s2[16], o2[16] for
// Q6_K's second half. So one 512-bit register holds four values of 16 rows,
// and _mm512_dpbusd_epi32 against four activation bytes broadcast gives 16 outputs' partial sums at once
// (llama.cpp's Q4_0x8 repacking, generalized); AVX2 takes each group as two halves of 8.
// Memory per value: Q4_0 4.5 bits, Q4_1 5, Q8_0 8.5 (each its GGUF size), Q4_K 4 + 2, Q5_K 8 + 2, Q6_K 8 + 4.
//
//   gguf_repack(w [N, row bytes] uint8, qtype, K, isa) -> uint8 [ceil(N / 16) * K / 32 * block bytes]
//   gguf_gemm_packed(x [M, K] f32, packed, qtype, N, K, isa, levels) -> [M, N] f32

constexpr int kGroup = 16;

inline bool packed_nibbles(int64_t qt) { return qt == kQ4_0 || qt == kQ4_1 || qt == kQ4_K; }
inline bool packed_halves(int64_t qt) { return qt == kQ6_K; }
inline int64_t packed_qbytes(int64_t qt) { return packed_nibbles(qt) ? 256 : 512; }
// How a block's scales are stored: float32 s and o (the K types), float16 s and o (Q4_1), float16 s with
// o = implicit_offset(qt) * s computed (Q4_0, Q8_0).
enum ScaleKind { kScaleF32 = 0, kScaleF16 = 1, kScaleF16Implicit = 2 };
inline int scale_kind(int64_t qt) { return is_k_type(qt) ? kScaleF32 : qt == kQ4_1 ? kScaleF16 : kScaleF16Implicit; }
inline int64_t packed_scale_bytes(int64_t qt) {
  const int kind = scale_kind(qt);
  return kind == kScaleF32 ? (packed_halves(qt) ? 256 : 128) : kind == kScaleF16 ? 64 : 32;
}
inline int64_t packed_block_bytes(int64_t qt) { return packed_qbytes(qt) + packed_scale_bytes(qt); }
// The computed offset's factor (o = factor * s) for kScaleF16Implicit: Q4_0 -8; Q8_0 -128 where its values are
// stored as q + 128 (VNNI), none on AVX2 (q kept signed).
inline float implicit_offset(int64_t qt, int64_t isa) { return qt == kQ4_0 ? -8.0f : isa == 2 ? -128.0f : 0.0f; }
inline uint16_t float_to_half_bits(float f) { return c10::Half(f).x; }

// One row's block c of 32 values -> u[32], s[2], o[2] (the halves' scale and offset; equal but for Q6_K).
HS_AVX2 void decode_row_block(int64_t qt, int64_t isa, const uint8_t* row, int64_t c, uint8_t* u, float* s, float* o) {
  if (is_k_type(qt)) {
    KChunks kc;
    decode_k(qt, row + (c / 8) * block_bytes(qt), kc);
    const int ch = static_cast<int>(c % 8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), kc.u[ch]);
    float lanes[8];
    _mm256_storeu_ps(lanes, kc.s[ch]);
    s[0] = lanes[0];
    s[1] = lanes[4];
    o[0] = kc.off_a[ch];
    o[1] = kc.off_b[ch];
    return;
  }
  const uint8_t* blk = row + c * block_bytes(qt);
  const float d = half_to_float(blk);
  s[0] = s[1] = d;
  if (qt == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) u[j] = isa == 2 ? static_cast<uint8_t>(q[j] + 128) : static_cast<uint8_t>(q[j]);
    o[0] = o[1] = isa == 2 ? -128.0f * d : 0.0f;
    return;
  }
  const uint8_t* q = blk + (qt == kQ4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) {
    u[j] = q[j] & 0xF;
    u[j + 16] = q[j] >> 4;
  }
  o[0] = o[1] = qt == kQ4_1 ? half_to_float(blk + 2) : -8.0f * d;
}

at::Tensor gguf_repack(const at::Tensor& w, int64_t qtype, int64_t K, int64_t isa) {
  check(w, qtype, K);
  TORCH_CHECK(isa_supported(isa), "gguf_repack: this CPU cannot run instruction path ", isa);
  const int64_t N = w.size(0), KB = K / kBlock, NG = (N + kGroup - 1) / kGroup, row_bytes = w.size(1);
  const int64_t QB = packed_qbytes(qtype), PB = packed_block_bytes(qtype);
  at::Tensor out = at::zeros({NG * KB * PB}, at::kByte);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const bool nib = packed_nibbles(qtype), halves = packed_halves(qtype);
  const int kind = scale_kind(qtype);
  at::parallel_for(0, NG, 1, [&](int64_t g0, int64_t g1) {
    uint8_t u[32];
    float s[2], o[2];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t c = 0; c < KB; ++c) {
        uint8_t* pb = op + (g * KB + c) * PB;
        float* sc = reinterpret_cast<float*>(pb + QB);
        uint16_t* sc16 = reinterpret_cast<uint16_t*>(sc);
        for (int l = 0; l < kGroup; ++l) {
          const int64_t n = g * kGroup + l;
          if (n >= N) break;  // padding rows: zero values and scales
          decode_row_block(qtype, isa, wp + n * row_bytes, c, u, s, o);
          if (nib) {
            for (int t = 0; t < 4; ++t)
              for (int e = 0; e < 4; ++e) pb[t * 64 + l * 4 + e] = u[4 * t + e] | (u[16 + 4 * t + e] << 4);
          } else {
            for (int j = 0; j < 8; ++j)
              for (int e = 0; e < 4; ++e) pb[j * 64 + l * 4 + e] = u[4 * j + e];
          }
          if (kind != kScaleF32) {  // s (and Q4_1's o) are GGUF's float16 d (m): exact
            sc16[l] = float_to_half_bits(s[0]);
            if (kind == kScaleF16) sc16[16 + l] = float_to_half_bits(o[0]);
            continue;
          }
          sc[l] = s[0];
          sc[16 + l] = o[0];
          if (halves) {
            sc[32 + l] = s[1];
            sc[48 + l] = o[1];
          }
        }
      }
    }
  });
  return out;
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Per activation row and block, what the AVX-512 tile needs to scale its integer dot products once per level
// set (prepare_row_terms): dc the scale of the combined dot (d at one level; d2 = d / 255 at two, where the
// combined dot is 255 dot1 + dot2), and the offset term's factor: ioff = off (isum1 255 + isum2) as an integer
// for the computed offsets (Q4_0 -8, Q8_0 -128: added to the dot in int32, exact), fc = d1 isum1 + d2 isum2 for
// a stored offset per block (Q4_1, Q4_K, Q5_K), fc16 the same per half block (Q6_K).
struct RowTerms {
  Buf<float> dc;        // [M, KB]
  Buf<int32_t> ioff;    // [M, KB]
  Buf<float> fc;        // [M, KB]
  Buf<float> fc16;      // [M, 2 KB]
};

// The terms are kept in the order the tiles read them: for the tile of real rows m0 .. m0 + rows - 1 (`tile` rows
// at most), from m0 KB on, block-major ([c][r]); tile 1 is row-major ([m][c]).
inline int64_t term_index(int64_t m, int64_t c, int64_t M, int64_t KB, int64_t tile) {
  const int64_t m0 = m - m % tile, rows = std::min(tile, M - m0);
  return m0 * KB + c * rows + (m - m0);
}

void size_row_terms(int64_t M, int64_t KB, int64_t qtype, RowTerms& t) {  // every entry is written by prepare_row_terms
  t.dc.resize(M * KB);
  if (scale_kind(qtype) == kScaleF16Implicit) t.ioff.resize(M * KB);
  else if (packed_halves(qtype)) t.fc16.resize(M * KB * 2);
  else t.fc.resize(M * KB);
}

// Rows m0 .. m1 - 1 of the terms (t sized by size_row_terms for M rows).
void prepare_row_terms(const QuantX& xq, int64_t M, int64_t KB, int levels, int64_t qtype, int64_t isa,
                       int64_t tile, RowTerms& t, int64_t m0, int64_t m1) {
  const int kind = scale_kind(qtype);
  const int32_t off = static_cast<int32_t>(implicit_offset(qtype, isa));
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < KB; ++b) {
      const int64_t i = term_index(m, b, M, KB, tile), i1 = m * levels * KB + b, i2 = i1 + KB;  // its quantized rows
      t.dc[i] = xq.d[levels == 2 ? i2 : i1];
      if (kind == kScaleF16Implicit) {
        t.ioff[i] = off * (levels == 2 ? kTwoLevelRatio * xq.isum[i1] + xq.isum[i2] : xq.isum[i1]);
      } else if (packed_halves(qtype)) {
        for (int h = 0; h < 2; ++h)
          t.fc16[2 * i + h] = xq.d[i1] * static_cast<float>(xq.isum16[2 * i1 + h]) +
                              (levels == 2 ? xq.d[i2] * static_cast<float>(xq.isum16[2 * i2 + h]) : 0.0f);
      } else {
        t.fc[i] = xq.fsum[i1] + (levels == 2 ? xq.fsum[i2] : 0.0f);
      }
    }
}

// 255 a1 + a2 (int32, exact: a dot of 32 u8 x s8 products is at most 255 * 127 * 32)
HS_AVX512 inline __m512i combine_levels(__m512i a1, __m512i a2) {
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(a1, 8), a1), a2);
}

// Real activation rows m0 .. m0 + RR - 1 (LV int8 levels each: quantized rows m LV .. m LV + LV - 1) against group
// g. SC: the ScaleKind. Per block and row, the levels' int32 dots are combined (255 dot1 + dot2) and the computed
// offset added in int32, so the float work is one conversion, one scale product and one FMA (+ one FMA for a stored
// offset): the FMA unit is the one _mm512_dpbusd_epi32 issues on (Zen 4), integer adds and conversions are not.
template <bool NIB, bool HALVES, int SC, int LV, int RR>
HS_AVX512 void packed_tile_avx512(const int8_t* xt, const RowTerms& rt, int64_t KB, const uint8_t* gp, int64_t m0,
                                  float* out, int64_t N, int64_t n0) {
  constexpr int R = RR * LV;  // quantized rows
  constexpr int64_t QB = NIB ? 256 : 512;
  constexpr int64_t PB = QB + (SC == kScaleF32 ? (HALVES ? 256 : 128) : SC == kScaleF16 ? 64 : 32);
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512 acc[RR];
  for (int r = 0; r < RR; ++r) acc[r] = _mm512_setzero_ps();
  const float* dcp = rt.dc.data();
  const int32_t* ioffp = SC == kScaleF16Implicit ? rt.ioff.data() : nullptr;
  const float* fcp = SC != kScaleF16Implicit && !HALVES ? rt.fc.data() : nullptr;
  for (int64_t c = 0; c < KB; ++c) {
    const uint8_t* pb = gp + c * PB;
    const int8_t* xc = xt + c * R * kBlock;  // the tile's R quantized rows of block c, one after another
    __m512i ia[R], ib[R];
    for (int r = 0; r < R; ++r) ia[r] = ib[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv;
      if constexpr (NIB) {
        const __m512i raw = _mm512_loadu_si512(pb + 64 * (j & 3));
        wv = j < 4 ? _mm512_and_si512(raw, m4) : _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      } else {
        wv = _mm512_loadu_si512(pb + 64 * j);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(load_i32(xc + r * kBlock + 4 * j));
        if (HALVES && j >= 4) ib[r] = _mm512_dpbusd_epi32(ib[r], wv, xv);
        else ia[r] = _mm512_dpbusd_epi32(ia[r], wv, xv);
      }
    }
    const float* sc = reinterpret_cast<const float*>(pb + QB);
    const uint16_t* sc16 = reinterpret_cast<const uint16_t*>(sc);
    __m512 s, o;
    if constexpr (SC == kScaleF32) {
      s = _mm512_loadu_ps(sc);
      o = _mm512_loadu_ps(sc + 16);
    } else {
      s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc16)));
      o = SC == kScaleF16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc16 + 16))) : s;
    }
    for (int r = 0; r < RR; ++r) {
      const int64_t ir = m0 * KB + c * RR + r;  // (prepare_row_terms' order)
      __m512i a = LV == 2 ? combine_levels(ia[2 * r], ia[2 * r + 1]) : ia[r];
      const __m512 dc = _mm512_set1_ps(dcp[ir]);
      if constexpr (SC == kScaleF16Implicit) {  // o = off s: off (sum q) joins the integer dot
        a = _mm512_add_epi32(a, _mm512_set1_epi32(ioffp[ir]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, dc), acc[r]);
      } else if constexpr (HALVES) {
        const __m512i b = LV == 2 ? combine_levels(ib[2 * r], ib[2 * r + 1]) : ib[r];
        const __m512 s2 = _mm512_loadu_ps(sc + 32), o2 = _mm512_loadu_ps(sc + 48);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, dc), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_mul_ps(s2, dc), acc[r]);
        acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(rt.fc16[2 * ir]), acc[r]);
        acc[r] = _mm512_fmadd_ps(o2, _mm512_set1_ps(rt.fc16[2 * ir + 1]), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, dc), acc[r]);
        acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(fcp[ir]), acc[r]);
      }
    }
  }
  const int64_t cols = std::min<int64_t>(kGroup, N - n0);
  const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < RR; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * N + n0, mask, acc[r]);
}

HS_AVX2 inline __m256i combine_levels_avx2(__m256i a1, __m256i a2) {  // 255 a1 + a2, as combine_levels
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(a1, 8), a1), a2);
}

// AVX2: half h of group g (8 output rows) against real rows m0 .. m0 + RR - 1 (LV levels each), maddubs, its int16
// pair sums added in int16 while they fit (J16); SIGNED (Q8_0): |w| times x with w's sign. The levels' int32 dots
// are combined and scaled once per block as in packed_tile_avx512.
template <bool NIB, bool HALVES, bool SIGNED, int SC, int LV, int RR>
HS_AVX2 void packed_tile_avx2(const int8_t* xt, const RowTerms& rt, int64_t KB, const uint8_t* gp, int h, int64_t m0,
                              float* out, int64_t N, int64_t n0) {
  constexpr int R = RR * LV;  // quantized rows
  constexpr int64_t QB = NIB ? 256 : 512;
  constexpr int64_t PB = QB + (SC == kScaleF32 ? (HALVES ? 256 : 128) : SC == kScaleF16 ? 64 : 32);
  // j steps summed in int16 before widening: a maddubs pair sum is at most 2 * 127 * max u, so 8 of them fit
  // for 4-bit values (30480), 4 for Q5_K's 5 bits (31496), 2 for Q6_K's 6 (32004, within a half), 1 for Q8_0
  constexpr int J16 = SIGNED ? 1 : NIB ? 8 : HALVES ? 2 : 4;
  const __m256i m4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  __m256 acc[RR];
  for (int r = 0; r < RR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < KB; ++c) {
    const uint8_t* pb = gp + c * PB + 32 * h;
    const int8_t* xc = xt + c * R * kBlock;  // the tile's R quantized rows of block c (QuantX's tile layout)
    __m256i ia[R], ib[R], s16[R];
    for (int r = 0; r < R; ++r) ia[r] = ib[r] = s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i wv;
      if constexpr (NIB) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 64 * (j & 3)));
        wv = j < 4 ? _mm256_and_si256(raw, m4) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      } else {
        wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 64 * j));
      }
      const __m256i aw = SIGNED ? _mm256_sign_epi8(wv, wv) : wv;
      for (int r = 0; r < R; ++r) {
        __m256i xv = _mm256_set1_epi32(load_i32(xc + r * kBlock + 4 * j));
        if constexpr (SIGNED) xv = _mm256_sign_epi8(xv, wv);
        const __m256i p = _mm256_maddubs_epi16(aw, xv);  // 16 int16 pair sums
        s16[r] = j % J16 == 0 ? p : _mm256_add_epi16(s16[r], p);
        if (j % J16 == J16 - 1) {  // the run ends: widen to int32 once
          const __m256i p32 = _mm256_madd_epi16(s16[r], ones);
          if (HALVES && j >= 4) ib[r] = _mm256_add_epi32(ib[r], p32);
          else ia[r] = _mm256_add_epi32(ia[r], p32);
        }
      }
    }
    const uint8_t* scb = pb - 32 * h + QB;
    const float* sc = reinterpret_cast<const float*>(scb) + 8 * h;
    const uint16_t* sc16 = reinterpret_cast<const uint16_t*>(scb) + 8 * h;
    __m256 s, o;
    if constexpr (SC == kScaleF32) {
      s = _mm256_loadu_ps(sc);
      o = _mm256_loadu_ps(sc + 16);
    } else {
      s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc16)));
      o = SC == kScaleF16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc16 + 16))) : s;
    }
    for (int r = 0; r < RR; ++r) {
      const int64_t i = m0 * KB + c * RR + r;  // (prepare_row_terms' order)
      __m256i a = LV == 2 ? combine_levels_avx2(ia[2 * r], ia[2 * r + 1]) : ia[r];
      const __m256 dc = _mm256_set1_ps(rt.dc[i]);
      if constexpr (SC == kScaleF16Implicit) {  // Q4_0's o = -8 s joins the integer dot; Q8_0 (SIGNED) has none
        if constexpr (!SIGNED) a = _mm256_add_epi32(a, _mm256_set1_epi32(rt.ioff[i]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(s, dc), acc[r]);
      } else if constexpr (HALVES) {
        const __m256i b = LV == 2 ? combine_levels_avx2(ib[2 * r], ib[2 * r + 1]) : ib[r];
        const __m256 s2 = _mm256_loadu_ps(sc + 32), o2 = _mm256_loadu_ps(sc + 48);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(s, dc), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_mul_ps(s2, dc), acc[r]);
        acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(rt.fc16[2 * i]), acc[r]);
        acc[r] = _mm256_fmadd_ps(o2, _mm256_set1_ps(rt.fc16[2 * i + 1]), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(s, dc), acc[r]);
        acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(rt.fc[i]), acc[r]);
      }
    }
  }
  const int64_t cols = std::min<int64_t>(8, N - n0);
  for (int r = 0; r < RR; ++r) {
    float* o = out + (m0 + r) * N + n0;
    if (cols == 8) {
      _mm256_storeu_ps(o, acc[r]);
    } else {
      float tmp[8];
      _mm256_storeu_ps(tmp, acc[r]);
      for (int64_t l = 0; l < cols; ++l) o[l] = tmp[l];
    }
  }
}

constexpr int kTile512 = 8, kTile2 = 4;  // quantized activation rows per tile (even: a row's two levels together)

using Tile512Fn = void (*)(const int8_t*, const RowTerms&, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t);

// first(thread, threads) on every thread of one OpenMP team, a barrier, then then(thread, threads): one fork and
// join for a GEMM call's two phases (the activations' quantization by rows, then the tiles), where two
// at::parallel_for calls (and the serial work between them) cost a 64-row decode GEMM ~10-20 us. Serial inside
// another parallel region (as at::parallel_for is). first_serial: the first phase runs on the calling thread before
// the team starts (one tile of rows: nothing to share, and a barrier saved).
template <class First, class Then>
void two_phases(const First& first, const Then& then, bool first_serial) {
  const int want = at::get_num_threads();
  if (first_serial) {  // one tile of rows (a decode row): the first phase is one thread's anyway; no barrier
    first(0, 1);
    at::parallel_for(0, want, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) then(static_cast<int>(t), want);
    });
    return;
  }
  if (want <= 1 || at::in_parallel_region() || omp_in_parallel()) {
    first(0, 1);
    then(0, 1);
    return;
  }
#pragma omp parallel num_threads(want)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    first(tid, nt);
#pragma omp barrier
    then(tid, nt);
  }
}

// Thread tid's share [lo, hi) of n items split in contiguous chunks, as at::parallel_for splits them.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt) {
  const int64_t chunk = (n + nt - 1) / nt, lo = std::min(n, tid * chunk);
  return {lo, std::min(n, lo + chunk)};
}
using Tile2Fn = void (*)(const int8_t*, const RowTerms&, int64_t, const uint8_t*, int, int64_t, float*, int64_t,
                         int64_t);

template <bool NIB, bool HALVES, int SC, int LV, int... Rows>
Tile512Fn pick512_of(int rows, std::integer_sequence<int, Rows...>) {
  Tile512Fn fn = nullptr;
  ((rows == Rows + 1 ? (fn = packed_tile_avx512<NIB, HALVES, SC, LV, Rows + 1>, 0) : 0), ...);
  return fn;
}

template <bool NIB, bool HALVES, int SC, int LV>
Tile512Fn pick512(int rows) {  // rows: real rows, 1 .. kTile512 / LV
  return pick512_of<NIB, HALVES, SC, LV>(rows, std::make_integer_sequence<int, kTile512 / LV>{});
}

template <bool NIB, bool HALVES, int SC>
Tile512Fn pick512_levels(int levels, int rows) {
  return levels == 2 ? pick512<NIB, HALVES, SC, 2>(rows) : pick512<NIB, HALVES, SC, 1>(rows);
}

// The tile for qtype (its value layout and ScaleKind), this many int8 levels and this many real rows.
Tile512Fn pick512_for(int64_t qt, int levels, int rows) {
  switch (qt) {
    case kQ4_0: return pick512_levels<true, false, kScaleF16Implicit>(levels, rows);
    case kQ4_1: return pick512_levels<true, false, kScaleF16>(levels, rows);
    case kQ8_0: return pick512_levels<false, false, kScaleF16Implicit>(levels, rows);
    case kQ4_K: return pick512_levels<true, false, kScaleF32>(levels, rows);
    case kQ5_K: return pick512_levels<false, false, kScaleF32>(levels, rows);
    default: return pick512_levels<false, true, kScaleF32>(levels, rows);  // Q6_K
  }
}

template <bool NIB, bool HALVES, bool SIGNED, int SC, int LV>
Tile2Fn pick2(int rows) {  // rows: real rows, up to kTile2 / LV
  if constexpr (LV == 2) {
    return rows == 1 ? packed_tile_avx2<NIB, HALVES, SIGNED, SC, 2, 1> : packed_tile_avx2<NIB, HALVES, SIGNED, SC, 2, 2>;
  } else {
    switch (rows) {
      case 1: return packed_tile_avx2<NIB, HALVES, SIGNED, SC, 1, 1>;
      case 2: return packed_tile_avx2<NIB, HALVES, SIGNED, SC, 1, 2>;
      case 3: return packed_tile_avx2<NIB, HALVES, SIGNED, SC, 1, 3>;
      default: return packed_tile_avx2<NIB, HALVES, SIGNED, SC, 1, 4>;
    }
  }
}

template <bool NIB, bool HALVES, bool SIGNED, int SC>
Tile2Fn pick2_levels(int levels, int rows) {
  return levels == 2 ? pick2<NIB, HALVES, SIGNED, SC, 2>(rows) : pick2<NIB, HALVES, SIGNED, SC, 1>(rows);
}

Tile2Fn pick2_for(int64_t qt, int levels, int rows) {
  switch (qt) {
    case kQ4_0: return pick2_levels<true, false, false, kScaleF16Implicit>(levels, rows);
    case kQ4_1: return pick2_levels<true, false, false, kScaleF16>(levels, rows);
    case kQ8_0: return pick2_levels<false, false, true, kScaleF16Implicit>(levels, rows);  // q signed: the sign trick
    case kQ4_K: return pick2_levels<true, false, false, kScaleF32>(levels, rows);
    case kQ5_K: return pick2_levels<false, false, false, kScaleF32>(levels, rows);
    default: return pick2_levels<false, true, false, kScaleF32>(levels, rows);  // Q6_K
  }
}

at::Tensor gguf_gemm_packed(const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype, int64_t N, int64_t K,
                            int64_t isa, int64_t levels) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "gguf_gemm_packed: x must be [M, K = ", K, "]");
  TORCH_CHECK(levels == 1 || levels == 2, "gguf_gemm_packed: levels must be 1 or 2 int8 levels, got ", levels);
  TORCH_CHECK(qtype >= 0 && qtype <= 5, "gguf_gemm_packed: qtype must be 0..5, got ", qtype);
  TORCH_CHECK(K % block_values(qtype) == 0, "gguf_gemm_packed: K = ", K, " is not a multiple of ", block_values(qtype));
  TORCH_CHECK(isa_supported(isa), "gguf_gemm_packed: this CPU cannot run instruction path ", isa);
  const int64_t KB = K / kBlock, NG = (N + kGroup - 1) / kGroup, PB = packed_block_bytes(qtype);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == NG * KB * PB,
              "gguf_gemm_packed: packed must be gguf_repack's uint8 [", NG * KB * PB, "] for N = ", N, ", K = ", K);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int lv = static_cast<int>(levels);
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  // Phase 1 per thread, on whole tiles of rows: quantize (QuantX, in the tiles' layout) and the tiles' row terms;
  // phase 2: the tiles against the weight groups (group-major: a group's weights stay in cache over its row tiles).
  const int64_t tile = isa == 2 ? kTile512 / lv : kTile2 / lv, tiles = (M + tile - 1) / tile;  // real rows per tile
  QuantX xq;
  size_quant_x(M, K, lv, xq, tile);
  RowTerms rt;
  size_row_terms(M, KB, qtype, rt);
  auto quantize = [&](int tid, int nt) {
    const auto [t0, t1] = share(tiles, tid, nt);
    const int64_t m0 = t0 * tile, m1 = std::min(M, t1 * tile);
    if (m0 >= m1) return;
    quantize_rows(xp, m0, m1, xq, isa);
    prepare_row_terms(xq, M, KB, lv, qtype, isa, tile, rt, m0, m1);
  };
  if (isa == 2) {
    two_phases(quantize, [&](int tid, int nt) {
      const auto [t0, t1] = share(NG * tiles, tid, nt);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t g = t / tiles, m0 = (t % tiles) * tile;
        const int rows = static_cast<int>(std::min<int64_t>(tile, M - m0));
        pick512_for(qtype, lv, rows)(xq.q.data() + m0 * lv * K, rt, KB, pp + g * KB * PB, m0, op, N,
                                     g * kGroup);
      }
    }, tiles == 1);
  } else {
    const int64_t halves_n = (N + 7) / 8;
    two_phases(quantize, [&](int tid, int nt) {
      const auto [t0, t1] = share(halves_n * tiles, tid, nt);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t hg = t / tiles, m0 = (t % tiles) * tile;
        const int rows = static_cast<int>(std::min<int64_t>(tile, M - m0));
        pick2_for(qtype, lv, rows)(xq.q.data() + m0 * lv * K, rt, KB, pp + (hg / 2) * KB * PB,
                                   static_cast<int>(hg % 2), m0, op, N, hg * 8);
      }
    }, tiles == 1);
  }
  return out;
}

// R rows' outputs n0 .. n0 + len - 1 (l1 = their one-level logits, row stride ldl; a = absw's groups from n0 / 16
// on, each [KB][16], read once for the R rows; e = the rows' e[R][KB]): the widened bound w = 1.001 sum_b e_b a[b]
// + 1e-5 |l1| + 1e-30 per output; best_out[r] = max (l1 - w), and each group of 16's max (l1 + w) to gmax (row
// stride ldg).
HS_AVX2 inline float hmax8_avx2(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

template <int R>
HS_AVX2 void argmax_bounds_avx2(const float* l1, int64_t ldl, const float* a, const float* e, int64_t KB, int64_t len,
                                float* gmax, int64_t ldg, float* best_out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m256 slack = _mm256_set1_ps(1.001f), rel = _mm256_set1_ps(1e-5f), tiny = _mm256_set1_ps(1e-30f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 best[R];
  for (int r = 0; r < R; ++r) best[r] = _mm256_set1_ps(neg_inf);
  int64_t g0 = 0;
  for (; g0 + kGroup <= len; g0 += kGroup) {
    __m256 b0[R], b1[R];
    for (int r = 0; r < R; ++r) b0[r] = b1[r] = _mm256_setzero_ps();
    const float* ag = a + g0 * KB;  // this group's [KB][16]
    for (int64_t b = 0; b < KB; ++b) {
      const __m256 a0 = _mm256_loadu_ps(ag + b * kGroup), a1 = _mm256_loadu_ps(ag + b * kGroup + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 eb = _mm256_set1_ps(e[r * KB + b]);
        b0[r] = _mm256_fmadd_ps(eb, a0, b0[r]);
        b1[r] = _mm256_fmadd_ps(eb, a1, b1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* lr = l1 + r * ldl + g0;
      const __m256 v0 = _mm256_loadu_ps(lr), v1 = _mm256_loadu_ps(lr + 8);
      const __m256 w0 = _mm256_add_ps(_mm256_fmadd_ps(rel, _mm256_andnot_ps(sign, v0), _mm256_mul_ps(b0[r], slack)), tiny);
      const __m256 w1 = _mm256_add_ps(_mm256_fmadd_ps(rel, _mm256_andnot_ps(sign, v1), _mm256_mul_ps(b1[r], slack)), tiny);
      best[r] = _mm256_max_ps(best[r], _mm256_max_ps(_mm256_sub_ps(v0, w0), _mm256_sub_ps(v1, w1)));
      gmax[r * ldg + g0 / kGroup] = hmax8_avx2(_mm256_max_ps(_mm256_add_ps(v0, w0), _mm256_add_ps(v1, w1)));
    }
  }
  for (int r = 0; r < R; ++r) {
    float best_s = hmax8_avx2(best[r]);
    if (g0 < len) {  // the last, partial group
      float top = neg_inf;
      for (int64_t n = g0; n < len; ++n) {
        float acc = 0.0f;
        for (int64_t b = 0; b < KB; ++b) acc = std::fma(e[r * KB + b], a[g0 * KB + b * kGroup + (n - g0)], acc);
        const float v = l1[r * ldl + n], wide = std::fma(1e-5f, std::fabs(v), acc * 1.001f) + 1e-30f;
        top = std::max(top, v + wide);
        best_s = std::max(best_s, v - wide);
      }
      gmax[r * ldg + g0 / kGroup] = top;
    }
    best_out[r] = best_s;
  }
}

// ---- Logits that only feed an argmax (greedy sampling): one int8 level, the near ties recomputed at two ----------
//
// A greedy row's token is the argmax of its logits. gguf_gemm_packed_argmax gives logits whose argmax (first
// maximum) is exactly the two-level call's, for the cost of one level plus the few groups that can hold it:
//   1. L1 = the one-level logits (the rows' int8 blocks q1, d1: the first level of the two-level call);
//   2. the second level changes logit n by at most B_n = sum_b e_b A[b, n], e_b = 127 d2 (d2 = d1 / 255, the
//      second level's scale in block b) and A[b, n] = sum of |w| over row n's block b (absw:
//      per group of 16 outputs its [K / 32][16], so a group's bound reads 16 consecutive floats a block), since
//      the second level adds sum_i w_i d2 q2_i with |d2 q2_i| <= 127 d2 = e_b; B is taken a little wider (slack
//      for float rounding: relative 1e-3 and 1e-5 |L1|);
//   3. thr = max_n (L1_n - B_n) is at most the two-level maximum, so any n with L1_n + B_n < thr is below it;
//      every group of 16 outputs holding an n with L1_n + B_n >= thr (the candidates: a few per row) is
//      recomputed with the two-level tile, whose per-row arithmetic is the two-level call's (bit-identical).
// So the two-level argmax is a candidate with its exact two-level logit, every other logit is below it, and the
// row's first maximum is the same token with the same logit. The other logits are one level's (llama.cpp's).
//   gguf_gemm_packed_argmax(x [M, K] f32, packed, qtype, N, K, isa, absw [ceil(N / 16), K / 32, 16] f32) -> [M, N] f32
at::Tensor gguf_gemm_packed_argmax(const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype, int64_t N,
                                   int64_t K, int64_t isa, const at::Tensor& absw) {
  at::Tensor out = gguf_gemm_packed(x_in, packed, qtype, N, K, isa, 1);  // [M, N]: L1 (checks the arguments)
  const int64_t KB = K / kBlock, NG = (N + kGroup - 1) / kGroup, PB = packed_block_bytes(qtype), M = out.size(0);
  TORCH_CHECK(absw.scalar_type() == at::kFloat && absw.dim() == 3 && absw.size(0) == NG && absw.size(1) == KB &&
                  absw.size(2) == kGroup && absw.is_contiguous(),
              "gguf_gemm_packed_argmax: absw must be float32 [ceil(N / 16) = ", NG, ", K / 32 = ", KB,
              ", 16] (NativeGgufGemm.abs_block_sums)");
  if (M == 0 || N == 0) return out;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  QuantX xq;  // both levels: rows 2m (the first level, as L1's) and 2m + 1 (the residual's)
  quantize_x(x.data_ptr<float>(), M, K, 2, xq, isa, 1);  // (tiles of one row: pass 2's layout)
  RowTerms rt;
  size_row_terms(M, KB, qtype, rt);
  prepare_row_terms(xq, M, KB, 2, qtype, isa, 1, rt, 0, M);
  float* op = out.data_ptr<float>();
  const float* ap = absw.data_ptr<float>();
  std::vector<float> e(M * KB);  // e[m, b] = 127 d2 (the most a second-level value |d2 q2| can be)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < KB; ++b) e[m * KB + b] = 127.0f * xq.d[(2 * m + 1) * KB + b];
  // Pass 1, per chunk of outputs (its A slice stays in L2 over the rows): thr[m] = max_n (L1 - B), and each group's
  // max of L1 + B (gmax [M, NG]) for pass 2
  const int64_t chunk = 2048;  // (a multiple of kGroup)
  const int64_t chunks = (N + chunk - 1) / chunk;
  std::vector<float> chunk_max(M * chunks), gmax(M * NG);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * chunk, len = std::min(N, n0 + chunk) - n0;
      for (int64_t m = 0; m < M; m += 4) {
        float best[4];
        const int rows = static_cast<int>(std::min<int64_t>(4, M - m));
        using BoundsFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, int64_t, float*, int64_t,
                                  float*);
        const BoundsFn fn = rows == 4 ? argmax_bounds_avx2<4> : rows == 3 ? argmax_bounds_avx2<3>
                            : rows == 2 ? argmax_bounds_avx2<2> : argmax_bounds_avx2<1>;
        fn(op + m * N + n0, N, ap + n0 * KB, e.data() + m * KB, KB, len, gmax.data() + m * NG + n0 / kGroup, NG, best);
        for (int r = 0; r < rows; ++r) chunk_max[(m + r) * chunks + c] = best[r];
      }
    }
  });
  std::vector<float> thr(M, -std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c) thr[m] = std::max(thr[m], chunk_max[m * chunks + c]);
  // Pass 2: the (row, group) pairs holding a candidate, recomputed at two levels in place
  std::vector<int64_t> pairs;  // m * NG + g
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < NG; ++g)
      if (gmax[m * NG + g] >= thr[m]) pairs.push_back(m * NG + g);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, static_cast<int64_t>(pairs.size()), 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t m = pairs[p] / NG, g = pairs[p] % NG;
      if (isa == 2) {
        pick512_for(qtype, 2, 1)(xq.q.data() + m * 2 * K, rt, KB, pp + g * KB * PB, m, op, N, g * kGroup);
      } else {
        for (int h = 0; h < 2 && g * kGroup + 8 * h < N; ++h)
          pick2_for(qtype, 2, 1)(xq.q.data() + m * 2 * K, rt, KB, pp + g * KB * PB, h, m, op, N,
                                 g * kGroup + 8 * h);
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
  m.def("gguf_repack(Tensor w, int qtype, int k, int isa) -> Tensor");
  m.def("gguf_gemm_packed(Tensor x, Tensor packed, int qtype, int n, int k, int isa, int levels=1) -> Tensor");
  m.def("gguf_gemm_packed_argmax(Tensor x, Tensor packed, int qtype, int n, int k, int isa, Tensor absw) -> Tensor");
}

TORCH_LIBRARY_IMPL(halserve_cpu_gguf, CPU, m) {
  m.impl("gguf_gemv", gguf_gemv);
  m.impl("gguf_dequantize", gguf_dequantize);
  m.impl("gguf_repack", gguf_repack);
  m.impl("gguf_gemm_packed", gguf_gemm_packed);
  m.impl("gguf_gemm_packed_argmax", gguf_gemm_packed_argmax);
}
