// The panel GEMM shared by the CPU platform's weight-compressed kernels (int4_gemm.cpp,
// fp8_gemm.cpp): each call turns the weight, one 32-column panel at a time, into bf16 B tiles
// in a per-thread buffer that stays in L2, and multiplies them there with AMX tiles (AVX512-BF16
// dot products where AMX is absent or the OS refuses it), accumulating in float32. A panel
// serves a chunk of up to ~1 MB of x, so the weight is expanded once per chunk, not per row.
//
//   panel_gemm(x rows, M, KB, Np, dequant(nb, panel), epilogue(acc, ld, m, rows, col0), use_amx, group scales?)
//
// A kernel supplies dequant (its packed panel nb -> bf16 [KB][2 tiles][16 rows][32], the AMX
// B-tile "VNNI" order: element j of tile row r of column tile t, k block kb is column
// 16 t + j / 2, row 32 kb + 2 r + j % 2) and the epilogue (float32 sums of rows m..m+rows-1,
// panel columns col0..col0+31, -> its output).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HALSERVE_PANEL_BF16 1
#endif
#if defined(HALSERVE_PANEL_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HALSERVE_PANEL_AMX 1
#include "amx.h"
#endif

namespace halserve_panel {

using bf16 = c10::BFloat16;

constexpr int64_t kBlockK = 32;           // rows per k block: an AMX bf16 tile's depth
constexpr int64_t kTileN = 16;            // columns per tile
constexpr int64_t kPanelN = 32;           // columns per panel: two tiles
constexpr int64_t kTileElems = 16 * 32;   // bf16 values per B tile
constexpr int64_t kChunkBytes = 1 << 20;  // bytes of bf16 x one panel is used against

// Whether the OS granted AMX's tile data to this process (Linux arch_prctl, asked once; oneDNN
// asks the same). False where this build has no AMX.
bool amx_ready();

// "amx", "avx512_bf16" or "" (no panel GEMM in this build)
std::string panel_gemm_isa();

// The rows of x in bf16, packed column order: rows below main_rows in main, the rest (AMX's
// zero-padded last 16 rows, when x itself serves as main) in tail; ld elements between rows.
struct XRows {
  const bf16* main;
  const bf16* tail;
  int64_t main_rows, ld;
  const bf16* row(int64_t m) const { return m < main_rows ? main + m * ld : tail + (m - main_rows) * ld; }
};

// Per-group scales (block-scaled fp8): the sums over each run of `blocks` k blocks (group g) are
// multiplied by unit * row[m * groups + g] * col[min(column / block_n, col_rows - 1) * groups + g]
// before they add up, so the products stay exact. block_n is a multiple of 16 (one scale per tile).
struct GroupScales {
  const float* row;  // [M, groups]
  const float* col;  // [col_rows, groups]
  int64_t blocks, groups, block_n, col_rows;
  float unit;
  float scale(int64_t m, int64_t g, int64_t column) const {
    return unit * row[m * groups + g] * col[std::min(column / block_n, col_rows - 1) * groups + g];
  }
};

// x [M, K] float32 | bfloat16 as XRows of Kp = 32 KB columns: x itself when it is bf16 in the
// packed order, else a bf16 copy (columns src[p], K meaning a zero pad; K..Kp-1 zero without src).
// ``storage`` keeps the copies alive.
XRows prepare_x(const at::Tensor& x, const int64_t* src, int64_t Kp, bool use_amx, at::Tensor& storage);

#ifdef HALSERVE_PANEL_BF16

// out[col0 + c] = a[c] for the panel's columns below N
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

// rows of acc (ld_acc floats apart) -> out rows (N apart), columns col0.. below N
template <typename T>
void write_rows(const float* acc, int64_t ld_acc, int64_t rows, T* out, int64_t N, int64_t col0) {
  const int64_t cols = std::min<int64_t>(kPanelN, N - col0);
  for (int64_t m = 0; m < rows; ++m) store_row(acc + m * ld_acc, out + m * N + col0, cols);
}

// AVX512-BF16: RB rows of x (ld apart, the first is row m) against one panel (columns col0..);
// acc [RB][32] float32. With gs, each group's sums are scaled as they add up.
template <int RB>
void dot_rows(const bf16* x, int64_t ld, const bf16* panel, int64_t KB, float* acc, const GroupScales* gs, int64_t m,
              int64_t col0) {
  __m512 c0[RB], c1[RB], r0[RB], r1[RB];
  for (int i = 0; i < RB; ++i) c0[i] = c1[i] = r0[i] = r1[i] = _mm512_setzero_ps();
  const int64_t run = gs ? gs->blocks : KB;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const bf16* b0 = panel + kb * 2 * kTileElems;
    const bf16* b1 = b0 + kTileElems;
    for (int r = 0; r < 16; ++r) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + r * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + r * 32);
      for (int i = 0; i < RB; ++i) {
        int32_t pair;  // x[i, 32 kb + 2 r], x[i, 32 kb + 2 r + 1]
        std::memcpy(&pair, x + i * ld + kb * kBlockK + 2 * r, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        c0[i] = _mm512_dpbf16_ps(c0[i], a, w0);
        c1[i] = _mm512_dpbf16_ps(c1[i], a, w1);
      }
    }
    if (!gs || ((kb + 1) % run && kb + 1 < KB)) continue;
    const int64_t g = kb / run;  // the group's last block: scale its sums
    for (int i = 0; i < RB; ++i) {
      r0[i] = _mm512_fmadd_ps(c0[i], _mm512_set1_ps(gs->scale(m + i, g, col0)), r0[i]);
      r1[i] = _mm512_fmadd_ps(c1[i], _mm512_set1_ps(gs->scale(m + i, g, col0 + kTileN)), r1[i]);
      c0[i] = c1[i] = _mm512_setzero_ps();
    }
  }
  for (int i = 0; i < RB; ++i) {
    _mm512_storeu_ps(acc + i * kPanelN, gs ? r0[i] : c0[i]);
    _mm512_storeu_ps(acc + i * kPanelN + kTileN, gs ? r1[i] : c1[i]);
  }
}

// rows [m0, m0 + rows) against one panel with AVX512-BF16 (xr.main holds every row)
template <typename Epilogue>
void panel_avx512(const XRows& xr, int64_t m0, int64_t rows, const bf16* panel, int64_t KB, int64_t col0,
                  const Epilogue& epilogue, const GroupScales* gs) {
  float acc[8 * kPanelN];
  for (int64_t m = 0; m < rows;) {
    const int64_t left = rows - m;
    const int rb = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    const bf16* x = xr.row(m0 + m);
    if (rb == 8) dot_rows<8>(x, xr.ld, panel, KB, acc, gs, m0 + m, col0);
    else if (rb == 4) dot_rows<4>(x, xr.ld, panel, KB, acc, gs, m0 + m, col0);
    else if (rb == 2) dot_rows<2>(x, xr.ld, panel, KB, acc, gs, m0 + m, col0);
    else dot_rows<1>(x, xr.ld, panel, KB, acc, gs, m0 + m, col0);
    epilogue(acc, kPanelN, m0 + m, rb, col0);
    m += rb;
  }
}

#ifdef HALSERVE_PANEL_AMX

// tiles 0-3 -> acc [32][32] (rows 16-31 only when two)
inline void store_tiles(float* acc, bool two) {
  const int64_t ld = kPanelN * sizeof(float);
  _tile_stored(0, acc, ld);
  _tile_stored(1, acc + kTileN, ld);
  if (two) {
    _tile_stored(2, acc + 16 * kPanelN, ld);
    _tile_stored(3, acc + 16 * kPanelN + kTileN, ld);
  }
}

// rows [m0, m0 + rows) against one panel with AMX (16-row tiles: xr pads the last ones). With gs,
// each group's sums go through a float32 buffer, scaled, into the total.
template <typename Epilogue>
void panel_amx(const XRows& xr, int64_t m0, int64_t rows, const bf16* panel, int64_t KB, int64_t col0,
               const Epilogue& epilogue, const GroupScales* gs) {
  alignas(64) float acc[32 * kPanelN];
  alignas(64) float part[32 * kPanelN];
  const int64_t x_stride = xr.ld * sizeof(bf16);
  const int64_t run = gs ? gs->blocks : KB;
  for (int64_t m = 0; m < rows; m += 32) {
    const bf16* x0 = xr.row(m0 + m);
    const bool two = rows - m > 16;
    const bf16* x1 = two ? xr.row(m0 + m + 16) : nullptr;
    const int64_t n_rows = std::min<int64_t>(32, rows - m);
    if (gs) std::memset(acc, 0, sizeof(acc));
    for (int64_t k0 = 0; k0 < KB; k0 += run) {
      _tile_zero(0);
      _tile_zero(1);
      if (two) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t kb = k0; kb < std::min(KB, k0 + run); ++kb) {
        const bf16* b = panel + kb * 2 * kTileElems;
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + kTileElems, 64);
        _tile_loadd(4, x0 + kb * kBlockK, x_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, x1 + kb * kBlockK, x_stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      if (!gs) {
        store_tiles(acc, two);
        continue;
      }
      store_tiles(part, two);
      const int64_t g = k0 / run;
      for (int64_t i = 0; i < n_rows; ++i) {
        for (int h = 0; h < 2; ++h) {
          const __m512 s = _mm512_set1_ps(gs->scale(m0 + m + i, g, col0 + h * kTileN));
          float* a = acc + i * kPanelN + h * kTileN;
          _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(part + i * kPanelN + h * kTileN), s, _mm512_load_ps(a)));
        }
      }
    }
    epilogue(acc, kPanelN, m0 + m, n_rows, col0);
  }
}

#endif  // HALSERVE_PANEL_AMX

// x's M rows against all Np / 32 panels, in parallel over panels; gs: per-group scales, or none
template <typename Dequant, typename Epilogue>
void panel_gemm(const XRows& xr, int64_t M, int64_t KB, int64_t Np, const Dequant& dequant, const Epilogue& epilogue,
                bool use_amx, const GroupScales* gs = nullptr) {
  // rows of x per pass over the panels: ~1 MB of bf16 x, a multiple of 32
  const int64_t chunk = std::max<int64_t>(32, kChunkBytes / (KB * kBlockK * int64_t(sizeof(bf16))) / 32 * 32);
  at::parallel_for(0, Np / kPanelN, 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> panel(KB * 2 * kTileElems);
#ifdef HALSERVE_PANEL_AMX
    if (use_amx) halserve_amx::configure_tiles();  // 0-3: C (2 x 2), 4-5: A (x rows), 6-7: B (the panel)
#endif
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t rows = std::min(chunk, M - m0);
      for (int64_t nb = begin; nb < end; ++nb) {
        dequant(nb, panel.data());
#ifdef HALSERVE_PANEL_AMX
        if (use_amx) {
          panel_amx(xr, m0, rows, panel.data(), KB, nb * kPanelN, epilogue, gs);
          continue;
        }
#endif
        panel_avx512(xr, m0, rows, panel.data(), KB, nb * kPanelN, epilogue, gs);
      }
    }
#ifdef HALSERVE_PANEL_AMX
    if (use_amx) _tile_release();
#endif
  });
}

#endif  // HALSERVE_PANEL_BF16

}  // namespace halserve_panel
