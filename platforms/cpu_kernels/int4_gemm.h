// The native 4-bit GEMM's weight (int4_gemm.cpp) and its few-rows path (int4_gemv.cpp).
#pragma once

#include "panel_gemm.h"

namespace halserve_panel {

constexpr int64_t kInt4TileBytes = 16 * 16;  // packed bytes per (column tile, k block)
constexpr int64_t kGemvRows = 4;             // up to this many rows: int4_gemv, no bf16 panel

// The prepared 4-bit weight (layout in int4_gemm.cpp); Np columns, KB blocks of 32 rows.
struct Int4Weight {
  const uint8_t* qpack;
  const float* scales;
  const float* zeros;
  const int32_t* block_group;
  int64_t KB, Np;
};

#ifdef HALSERVE_PANEL_BF16
// up to kGemvRows rows of x against every panel
template <typename T>
void int4_gemv(const XRows& xr, int64_t M, const Int4Weight& w, T* out, int64_t N);
#endif

}  // namespace halserve_panel
