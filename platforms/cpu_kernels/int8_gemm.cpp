// The cpu platform's W8A8 int8 GEMM in C++ (native_int8.py, onednn_int8_gemm.py): exact int32 sums, then
// one epilogue in the reference's order (kernels/reference.py), rounded once to the output dtype:
//
//   out[m, n] = (float(sum_k a[m, k] b[n, k]) * scale_a[m]) * scale_b[n] + bias[n]
//
// fp-contract off keeps every product and sum rounded as the torch ops round them, and bfloat16 is
// rounded to nearest even as c10::BFloat16 does, so results are bitwise the reference's.
//
//   amx_int8_gemm(a [M, K] int8, qpack [P, KB, 2, 16, 64] int8, scale_a [M, 1] | [1], scale_b [N, 1] | [1],
//                 bias [N] | None, N, out_dtype) -> [M, N]
//       AMX int8 tiles (tdpbssd). qpack is the weight b [N, K] in B-tile order, N padded to P 32-column
//       panels and K to KB blocks of 64 with zeros: byte j of tile row r of tile t, block kb of panel p
//       is b[32 p + 16 t + j / 4, 64 kb + 4 r + j % 4] (native_int8.pack_int8). Each thread takes a run of
//       panels, in blocks of ~512 KB that stay in L2; 32 rows at a time go across a block, a 2 x 2 block
//       of C tiles per panel summed over the whole K, then the epilogue writes those 32 x 32 outputs.
//       The first pass over a block prefetches each next panel: at decode the weight streams from memory.
//   scaled_epilogue(acc [M, N] f32, scale_a, scale_b, bias, out_dtype) -> [M, N]
//       the epilogue alone, for oneDNN's exact float32 sums (onednn_int8_gemm.py, CPUs without AMX).
//   amx_int8_ready() -> bool: built with AMX-INT8 and the OS grants tile data to this process.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define HALSERVE_INT8_AMX 1
#include "amx.h"
#endif

#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t kBlockK = 64;       // k per block: an int8 tile row holds 16 columns x 4 k
constexpr int64_t kPanelN = 32;       // columns per panel: two 16-column tiles
constexpr int64_t kTileBytes = 1024;  // 16 rows x 64 bytes
constexpr int64_t kBlockBytes = 512 << 10;  // weight per block of panels: stays in L2

struct Scales {
  const float* a;  // [M] or [1]
  const float* b;  // [N] or [1]
  const float* bias;  // [N] or nullptr
  bool scalar_a, scalar_b;
};

// ---- epilogue: one row of up to 32 sums (int32 from AMX, or oneDNN's exact float32) -> out ----

template <typename Acc, typename T>
inline void scale_tail(const Acc* acc, const Scales& s, float sa, int64_t col0, int64_t cols, T* o) {
  for (int64_t c = 0; c < cols; ++c) {
    float v = static_cast<float>(acc[c]) * sa;
    v = v * (s.scalar_b ? s.b[0] : s.b[col0 + c]);
    if (s.bias) v = v + s.bias[col0 + c];
    o[c] = static_cast<T>(v);
  }
}

#if defined(__AVX512F__)
inline __m512 load_sums(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512(p)); }
inline __m512 load_sums(const float* p) { return _mm512_loadu_ps(p); }

inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
inline void store16(c10::BFloat16* o, __m512 v) {
  // round to nearest even on the bits, NaN -> 0x7fc0: c10::BFloat16(float) exactly
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
}
inline void store16(c10::Half* o, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// out row o[0 .. cols) = epilogue of acc[0 .. cols), columns col0.. of the output
template <typename Acc, typename T>
inline void scale_row(const Acc* acc, const Scales& s, int64_t m, int64_t col0, int64_t cols, T* o) {
  const float sa = s.scalar_a ? s.a[0] : s.a[m];
  int64_t c = 0;
#if defined(__AVX512F__)
  const __m512 va = _mm512_set1_ps(sa);
  for (; c + 16 <= cols; c += 16) {
    const __m512 w = s.scalar_b ? _mm512_set1_ps(s.b[0]) : _mm512_loadu_ps(s.b + col0 + c);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(load_sums(acc + c), va), w);
    if (s.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(s.bias + col0 + c));
    store16(o + c, v);
  }
#endif
  scale_tail(acc + c, s, sa, col0 + c, cols - c, o + c);
}

// ---- AMX ----

#ifdef HALSERVE_INT8_AMX
bool amx_ready() { return halserve_amx::tile_data_granted(); }

// Rows of a, 16 at a time: blocks below main_rows read a itself, the last partial block a zero-padded copy.
struct ARows {
  const int8_t* main;
  const int8_t* tail;  // [16, ld], or nullptr
  int64_t main_rows, ld;
  const int8_t* block(int64_t m) const { return m < main_rows ? main + m * ld : tail + (m - main_rows) * ld; }
};

// Rows m .. m + rows - 1 (rows <= 32) against one panel: a 2 x 2 block of C tiles summed over all KB
// blocks, then the epilogue writes the 32 x 32 outputs. `next`: a panel to prefetch into L2 meanwhile.
template <typename T>
void block32(const ARows& ar, int64_t m, int64_t rows, const int8_t* panel, const int8_t* next, int64_t KB,
             const Scales& s, T* out, int64_t N, int64_t col0) {
  alignas(64) int32_t acc[32 * kPanelN];
  const bool two = rows > 16;
  const int8_t* a0 = ar.block(m);
  const int8_t* a1 = two ? ar.block(m + 16) : nullptr;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int8_t* b = panel + kb * 2 * kTileBytes;
    if (next != nullptr) {
      const char* nb = reinterpret_cast<const char*>(next + kb * 2 * kTileBytes);
      for (int64_t l = 0; l < 2 * kTileBytes; l += 64) _mm_prefetch(nb + l, _MM_HINT_T1);
    }
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kTileBytes, 64);
    _tile_loadd(4, a0 + kb * kBlockK, ar.ld);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if (two) {
      _tile_loadd(5, a1 + kb * kBlockK, ar.ld);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
  const int64_t ld = kPanelN * sizeof(int32_t);
  _tile_stored(0, acc, ld);
  _tile_stored(1, acc + 16, ld);
  if (two) {
    _tile_stored(2, acc + 16 * kPanelN, ld);
    _tile_stored(3, acc + 16 * kPanelN + 16, ld);
  }
  const int64_t cols = std::min<int64_t>(kPanelN, N - col0);
  for (int64_t i = 0; i < rows; ++i) scale_row(acc + i * kPanelN, s, m + i, col0, cols, out + (m + i) * N + col0);
}

// Threads split the panels (each streams its own part of the weight), then, with threads to spare, the
// rows. A task walks its panels in blocks of ~512 KB of weight, which stay in L2 while every 32-row
// pass goes across them: each output row is written in one contiguous run per block. (Panel by
// panel down all rows instead, the strided 64-byte writes dominated: 6.5 ms at M = 2048, K = 768,
// N = 4096 on 2 cores against 3.3 ms.)
template <typename T>
void amx_gemm(const ARows& ar, int64_t M, int64_t KB, const int8_t* qpack, int64_t P, const Scales& s, T* out,
              int64_t N) {
  const int64_t panel_bytes = KB * 2 * kTileBytes;
  const int64_t block_panels = std::max<int64_t>(1, kBlockBytes / panel_bytes);
  const int64_t threads = at::get_num_threads(), passes = (M + 31) / 32;
  const int64_t panel_groups = std::min(threads, P);
  const int64_t row_groups = std::max<int64_t>(1, std::min(threads / panel_groups, passes));
  at::parallel_for(0, panel_groups * row_groups, 1, [&](int64_t begin, int64_t end) {
    halserve_amx::configure_tiles();  // 0-3: C (2 row blocks x 2 column tiles), 4-5: A, 6-7: B
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / row_groups, r = t % row_groups;
      const int64_t p_end = P * (g + 1) / panel_groups;
      const int64_t m_begin = passes * r / row_groups * 32, m_end = std::min(M, passes * (r + 1) / row_groups * 32);
      for (int64_t b0 = P * g / panel_groups; b0 < p_end; b0 += block_panels) {
        const int64_t b1 = std::min(p_end, b0 + block_panels);
        for (int64_t m = m_begin; m < m_end; m += 32) {
          for (int64_t p = b0; p < b1; ++p) {
            const int8_t* panel = qpack + p * panel_bytes;
            // the first pass over a block brings it in (at decode, from memory): prefetch ahead
            const int8_t* next = m == m_begin && p + 1 < b1 ? panel + panel_bytes : nullptr;
            block32(ar, m, std::min<int64_t>(32, m_end - m), panel, next, KB, s, out, N, p * kPanelN);
          }
        }
      }
    }
    _tile_release();
  });
}
#else
bool amx_ready() { return false; }
#endif

Scales make_scales(const at::Tensor& sa, const at::Tensor& sb, const at::Tensor& bias, int64_t M, int64_t N) {
  TORCH_CHECK(sa.numel() == 1 || sa.numel() == M, "scale_a must hold 1 or M = ", M, " values, got ", sa.sizes());
  TORCH_CHECK(sb.numel() == 1 || sb.numel() == N, "scale_b must hold 1 or N = ", N, " values, got ", sb.sizes());
  TORCH_CHECK(!bias.defined() || bias.numel() == N, "bias must hold N = ", N, " values, got ", bias.sizes());
  return {sa.data_ptr<float>(), sb.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
          sa.numel() == 1, sb.numel() == 1};
}

void check_out_dtype(at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
}

template <typename Fn>
void dispatch_out(at::ScalarType out_dtype, at::Tensor& out, const Fn& fn) {
  if (out_dtype == at::kBFloat16) fn(out.data_ptr<c10::BFloat16>());
  else if (out_dtype == at::kHalf) fn(out.data_ptr<c10::Half>());
  else fn(out.data_ptr<float>());
}

at::Tensor as_float(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

at::Tensor scaled_epilogue(const at::Tensor& acc, const at::Tensor& scale_a, const at::Tensor& scale_b,
                           const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kFloat && acc.is_contiguous(),
              "scaled_epilogue: acc must be contiguous float32 [M, N], got ", acc.scalar_type(), " ", acc.sizes());
  check_out_dtype(out_dtype);
  const int64_t M = acc.size(0), N = acc.size(1);
  const at::Tensor sa = as_float(scale_a), sb = as_float(scale_b), b = bias ? as_float(*bias) : at::Tensor();
  const Scales s = make_scales(sa, sb, b, M, N);
  at::Tensor out = at::empty({M, N}, acc.options().dtype(out_dtype));
  const float* ap = acc.data_ptr<float>();
  // ~16K outputs per task: one decode row of a wide layer stays on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  dispatch_out(out_dtype, out, [&](auto* op) {
    at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) scale_row(ap + m * N, s, m, 0, N, op + m * N);
    });
  });
  return out;
}

at::Tensor amx_int8_gemm(const at::Tensor& a, const at::Tensor& qpack, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias, int64_t N,
                         at::ScalarType out_dtype) {
  TORCH_CHECK(amx_ready(), "amx_int8_gemm: this build or this process has no AMX-INT8 (check amx_int8_ready())");
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kChar, "amx_int8_gemm: a must be int8 [M, K], got ",
              a.scalar_type(), " ", a.sizes());
  TORCH_CHECK(qpack.dim() == 5 && qpack.scalar_type() == at::kChar && qpack.is_contiguous() && qpack.size(2) == 2 &&
                  qpack.size(3) == 16 && qpack.size(4) == kBlockK,
              "amx_int8_gemm: qpack must be contiguous int8 [P, KB, 2, 16, 64], got ", qpack.sizes());
  check_out_dtype(out_dtype);
  const int64_t M = a.size(0), K = a.size(1), P = qpack.size(0), KB = qpack.size(1), Kp = KB * kBlockK;
  TORCH_CHECK(K <= Kp && Kp - K < kBlockK && N <= P * kPanelN && P * kPanelN - N < kPanelN,
              "amx_int8_gemm: qpack ", qpack.sizes(), " does not hold a weight of K = ", K, ", N = ", N);
  const at::Tensor sa = as_float(scale_a), sb = as_float(scale_b), b = bias ? as_float(*bias) : at::Tensor();
  const Scales s = make_scales(sa, sb, b, M, N);
  at::Tensor out = at::empty({M, N}, a.options().dtype(out_dtype));
  if (M == 0 || N == 0) return out;
#ifdef HALSERVE_INT8_AMX
  // a as 16-row blocks of Kp columns: itself when K == Kp, the partial last block from a padded copy
  at::Tensor ac = a.contiguous(), padded, tail;
  ARows ar{nullptr, nullptr, M / 16 * 16, Kp};
  if (K != Kp) {
    padded = at::zeros({(M + 15) / 16 * 16, Kp}, a.options());
    padded.narrow(0, 0, M).narrow(1, 0, K).copy_(ac);
    ar.main = padded.data_ptr<int8_t>();
    ar.main_rows = padded.size(0);
  } else {
    ar.main = ac.data_ptr<int8_t>();
    if (M % 16) {
      tail = at::zeros({16, Kp}, a.options());
      tail.narrow(0, 0, M % 16).copy_(ac.narrow(0, ar.main_rows, M % 16));
      ar.tail = tail.data_ptr<int8_t>();
    }
  }
  dispatch_out(out_dtype, out, [&](auto* op) { amx_gemm(ar, M, KB, qpack.data_ptr<int8_t>(), P, s, op, N); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(halserve_cpu_int8, m) {
  m.def("amx_int8_gemm(Tensor a, Tensor qpack, Tensor scale_a, Tensor scale_b, Tensor? bias, int N, "
        "ScalarType out_dtype) -> Tensor",
        &amx_int8_gemm);
  m.def("scaled_epilogue(Tensor acc, Tensor scale_a, Tensor scale_b, Tensor? bias, ScalarType out_dtype) -> Tensor",
        &scaled_epilogue);
  m.def("amx_int8_ready() -> bool", &amx_ready);
}
