// What the native 4-bit GEMM's files share (int4_gemm.cpp: layout, entry point, panel paths;
// int4_gemv.cpp: the few-rows path): ISA switches, the packed layout's constants, the views of
// x and of the prepared weight, and the output writers.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HALSERVE_INT4_BF16 1
#endif
#if defined(HALSERVE_INT4_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HALSERVE_INT4_AMX 1
#endif

namespace halserve_int4 {

using bf16 = c10::BFloat16;

constexpr int64_t kBlockK = 32;                 // rows per k block: an AMX bf16 tile's depth
constexpr int64_t kTileN = 16;                  // columns per tile
constexpr int64_t kPanelN = 32;                 // columns per panel: two tiles
constexpr int64_t kTileBytes = 16 * 16;         // packed bytes per (column tile, k block)
constexpr int64_t kTileElems = 16 * 32;         // bf16 values per dequantized B tile
constexpr int64_t kChunkBytes = 1 << 20;        // bytes of bf16 x one panel is used against
constexpr int64_t kGemvRows = 4;                // up to this many rows: int4_gemv, no bf16 panel

#ifdef HALSERVE_INT4_BF16

// The rows of x in bf16, packed column order: rows below main_rows in main, the rest (AMX's
// zero-padded last 16 rows, when x itself serves as main) in tail; ld elements between rows.
struct XRows {
  const bf16* main;
  const bf16* tail;
  int64_t main_rows, ld;
  const bf16* row(int64_t m) const { return m < main_rows ? main + m * ld : tail + (m - main_rows) * ld; }
};

struct Int4Weight {
  const uint8_t* qpack;
  const float* scales;
  const float* zeros;
  const int32_t* block_group;
  int64_t KB, Np;
};

// out[m, col0 + c] = acc row m (32 floats) for the columns below N
inline void store_row(const float* a, float* o, int64_t cols) {
  if (cols == kPanelN) {
    _mm512_storeu_ps(o, _mm512_loadu_ps(a));
    _mm512_storeu_ps(o + kTileN, _mm512_loadu_ps(a + kTileN));
  } else {
    for (int64_t c = 0; c < cols; ++c) o[c] = a[c];
  }
}

inline void store_row(const float* a, bf16* o, int64_t cols) {
  if (cols == kPanelN) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + kTileN), _mm512_loadu_ps(a));
    _mm512_storeu_si512(o, (__m512i)v);
  } else {
    for (int64_t c = 0; c < cols; ++c) o[c] = bf16(a[c]);
  }
}

template <typename T>
void write_rows(const float* acc, int64_t ld_acc, int64_t rows, T* out, int64_t N, int64_t col0) {
  const int64_t cols = std::min<int64_t>(kPanelN, N - col0);
  for (int64_t m = 0; m < rows; ++m) store_row(acc + m * ld_acc, out + m * N + col0, cols);
}

// up to kGemvRows rows of x against every panel (int4_gemv.cpp)
template <typename T>
void int4_gemv(const XRows& xr, int64_t M, const Int4Weight& w, T* out, int64_t N);

#endif  // HALSERVE_INT4_BF16

}  // namespace halserve_int4
