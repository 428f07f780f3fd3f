// Prefill (and chunked-prefill) attention for the CPU platform's `cpu_native` backend
// (float32, or bfloat16 q/cache/out with float32 arithmetic), reading keys and values from
// the paged cache, so a chunk after a prefix hit or an earlier chunk is handled like a
// fresh prompt.
//
//   paged_prefill(out [T, Hq, D], q [T, Hq, D], kv_cache [2, NB, Hk, B*D],
//                 block_table [R, max_blocks] int32, token_start [S], query_len [S],
//                 seq_len [S], row [S] (int64 each), B, scale, window, soft_cap)
//
// Span s has query tokens token_start[s] .. + query_len[s] at positions
// seq_len[s] - query_len[s] .. seq_len[s] - 1 and reads block-table row row[s]. Query at
// position p sees keys t with t <= p (causal) and t > p - window (window 0 = none). The
// step's keys must already be in the cache (write_kv runs first).
//
// Flash-attention style: a task is (span, kv head, tile of MQ query positions); its
// MQ * G query rows (G = Hq / Hk heads share the kv head) are scored against 16 keys at a
// time straight from the transposed key tiles ([D, B] per block: one vector load per d,
// MQ * G accumulators in registers), with an online softmax, and p * V accumulated over
// 16-wide column chunks of the value rows. Needs B % 16 == 0, D % 16 == 0, G <= 8; the
// Python side uses SDPA otherwise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec16.h"

namespace {

using namespace halserve_cpu;

struct PrefillTask {
  int64_t span, head, tile;
};

template <typename T, typename C>  // C: the cache's element type (T, or bfloat16 / float16 under float32 q)
struct Problem {
  const T* q;
  T* out;
  const C* keys;
  const C* values;
  const int32_t* block_table;
  int64_t max_blocks, NB, Hq, Hk, D, B, G;
  float scale, cap;
  int64_t window;
};

// One tile: rows r = i * G + g for query position i of the tile and head g of the group.
template <int G, int MQ, typename T, typename C>
void prefill_tile(const Problem<T, C>& P, int64_t token_start, int64_t query_len, int64_t seq_len, const int32_t* row,
                  int64_t h, int64_t tile) {
  constexpr int R = G * MQ;
  const int64_t D = P.D, B = P.B;
  const int64_t context = seq_len - query_len;
  const int64_t i0 = tile * MQ;
  const int64_t rows_here = std::min<int64_t>(MQ, query_len - i0);
  const float ninf = -std::numeric_limits<float>::infinity();

  // Query rows (missing rows of a partial tile repeat the last one; never written out), stored d-major (qt[d R + r])
  // and the output accumulators [D / 16][R][16], so each inner loop addresses its R rows from one pointer with
  // constant offsets and its R accumulators stay in registers (with qbuf[r D + d] GCC spilled the R row pointers and
  // kept every accumulator on the stack: a store per FMA, ~2x slower).
  std::vector<float> qt(D * R), acc(R * D, 0.f);
  int64_t qpos[R];
  for (int i = 0; i < MQ; ++i) {
    const int64_t ii = i0 + std::min<int64_t>(i, rows_here - 1);
    for (int g = 0; g < G; ++g) {
      const T* src = P.q + ((token_start + ii) * P.Hq + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) qt[d * R + i * G + g] = to_float(src[d]);
      qpos[i * G + g] = context + ii;
    }
  }
  float m[R];
  v16 l[R];  // running softmax denominators, summed across lanes at the end
  for (int r = 0; r < R; ++r) {
    m[r] = ninf;
    l[r] = v16{};
  }
  alignas(64) float sc[R * 16];  // a chunk's scores, then its probabilities
  const int64_t pos_lo = context + i0, pos_hi = context + i0 + rows_here - 1;
  const int64_t k_begin = P.window > 0 ? std::max<int64_t>(0, pos_lo - P.window + 1) : 0;
  const int64_t k_end = pos_hi + 1;  // exclusive

  for (int64_t c0 = (k_begin / 16) * 16; c0 < k_end; c0 += 16) {
    const int64_t blk = row[c0 / B];
    TORCH_CHECK(blk >= 0 && blk < P.NB, "block id out of range");
    const int64_t j = c0 % B;
    const C* kb = P.keys + (blk * P.Hk + h) * B * D + j;    // [D, B] tile, column j
    const C* vb = P.values + (blk * P.Hk + h) * B * D + j * D;  // [B, D] tile, row j
    {
      v16 s[R];
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) s[r] = v16{};
      const float* qd = qt.data();
      for (int64_t d = 0; d < D; ++d, qd += R) {
        const v16 k = load16(kb + d * B);
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) s[r] += qd[r] * k;
      }
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) store16(sc + r * 16, s[r]);
    }
    // Masks only where the chunk crosses the causal diagonal or the window's edge.
    const bool edge = c0 + 15 > pos_lo || c0 < k_begin || (P.window > 0 && c0 <= pos_hi - P.window);
    for (int r = 0; r < R; ++r) {
      v16 x = load16(sc + r * 16) * P.scale;
      if (P.cap > 0.f) {
        float lanes[16];
        store16(lanes, x);
        for (int t = 0; t < 16; ++t) lanes[t] = std::tanh(lanes[t] / P.cap) * P.cap;
        x = load16(lanes);
      }
      if (edge) {  // visible: key <= query position, key < seq_len, key > query position - window
        const vi16 kpos = iota16() + static_cast<int32_t>(c0);
        vi16 visible = le16(kpos, static_cast<int32_t>(qpos[r])) & lt16(kpos, static_cast<int32_t>(seq_len));
        if (P.window > 0) visible &= gt16(kpos, static_cast<int32_t>(qpos[r] - P.window));
        x = select16(visible, x, splat16(ninf));
      }
      const float mx = std::max(m[r], hmax16(x));
      if (mx == ninf) {  // nothing visible to this row yet
        store16(sc + r * 16, v16{});
        continue;
      }
      if (mx != m[r]) {
        const float alpha = m[r] == ninf ? 0.f : std::exp(m[r] - mx);
        l[r] *= alpha;
        for (int64_t c = 0; c < D; c += 16) {
          float* a = acc.data() + (c / 16 * R + r) * 16;
          store16(a, load16(a) * alpha);
        }
        m[r] = mx;
      }
      const v16 p = exp16(x - mx);
      l[r] += p;
      store16(sc + r * 16, p);
    }
    const int64_t nkeys = std::min<int64_t>(16, seq_len - c0);
    for (int64_t c = 0; c < D; c += 16) {
      float* ac = acc.data() + c / 16 * R * 16;
      v16 a[R];
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) a[r] = load16(ac + r * 16);
      for (int64_t t = 0; t < nkeys; ++t) {
        const v16 v = load16(vb + t * D + c);
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) a[r] += sc[r * 16 + t] * v;
      }
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) store16(ac + r * 16, a[r]);
    }
  }
  for (int64_t i = 0; i < rows_here; ++i)
    for (int g = 0; g < G; ++g) {
      const int r = i * G + g;
      const float inv = 1.f / hsum16(l[r]);
      T* dst = P.out + ((token_start + i0 + i) * P.Hq + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(acc[(d / 16 * R + r) * 16 + d % 16] * inv);
    }
}

template <typename T, typename C>
using TileFn = void (*)(const Problem<T, C>&, int64_t, int64_t, int64_t, const int32_t*, int64_t, int64_t);

// Query positions per tile for G heads sharing a kv head: about kAccumulatorRows accumulator rows in registers (24
// of 32 zmm; an AVX2 build's v16 is two ymm, so 6 rows there, 12 of 16 ymm), at most 16 positions.
#ifdef __AVX512F__
constexpr int kAccumulatorRows = 24;
#else
constexpr int kAccumulatorRows = 6;
#endif
constexpr int tile_positions(int G) { return std::max(1, std::min(16, kAccumulatorRows / G)); }

// (tile function, query positions per tile)
template <int G, typename T, typename C>
std::pair<TileFn<T, C>, int64_t> tile_fn() {
  return {prefill_tile<G, tile_positions(G), T, C>, tile_positions(G)};
}
template <typename T, typename C>
std::pair<TileFn<T, C>, int64_t> pick_tile_fn(int64_t G) {
  switch (G) {
    case 1: return tile_fn<1, T, C>();
    case 2: return tile_fn<2, T, C>();
    case 3: return tile_fn<3, T, C>();
    case 4: return tile_fn<4, T, C>();
    case 5: return tile_fn<5, T, C>();
    case 6: return tile_fn<6, T, C>();
    case 7: return tile_fn<7, T, C>();
    case 8: return tile_fn<8, T, C>();
    default: return {nullptr, 0};
  }
}

}  // namespace

bool paged_prefill_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size) {
  return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && pick_tile_fn<float, float>(num_heads / num_kv_heads).first &&
         head_size % 16 == 0 && block_size % 16 == 0;
}

namespace {

template <typename T, typename C>
void run_prefill(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                 const at::Tensor& block_table, const int64_t* tsp, const int64_t* qlp, const int64_t* slp,
                 const int64_t* rwp, int64_t S, int64_t B, double scale, int64_t sliding_window, double soft_cap) {
  const int64_t Hq = q.size(1), D = q.size(2), NB = kv_cache.size(1), Hk = kv_cache.size(2);
  const int64_t max_blocks = block_table.size(1), G = Hq / Hk;
  const std::pair<TileFn<T, C>, int64_t> picked = pick_tile_fn<T, C>(G);
  const TileFn<T, C> tile_fn = picked.first;
  const int64_t MQ = picked.second;
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t tiles = (qlp[s] + MQ - 1) / MQ;
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t t = 0; t < tiles; ++t) tasks.push_back({s, h, t});
  }
  Problem<T, C> P;
  P.q = q.data_ptr<T>();
  P.out = out.data_ptr<T>();
  P.keys = kv_cache.data_ptr<C>();
  P.values = P.keys + NB * Hk * B * D;
  P.block_table = block_table.data_ptr<int32_t>();
  P.max_blocks = max_blocks;
  P.NB = NB;
  P.Hq = Hq;
  P.Hk = Hk;
  P.D = D;
  P.B = B;
  P.G = G;
  P.scale = static_cast<float>(scale);
  P.cap = static_cast<float>(soft_cap);
  P.window = sliding_window;
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PrefillTask& t = tasks[i];
      tile_fn(P, tsp[t.span], qlp[t.span], slp[t.span], P.block_table + rwp[t.span] * max_blocks, t.head, t.tile);
    }
  });
}

}  // namespace

void paged_prefill(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_table,
                   at::Tensor token_start, at::Tensor query_len, at::Tensor seq_len, at::Tensor row,
                   int64_t block_size, double scale, int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  q.is_contiguous(), "q must be contiguous float32 or bfloat16 [T, Hq, D]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "out must be contiguous, shaped like q and of its dtype");
  const bool bf16_cache = q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kBFloat16;
  const bool f16_cache = q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kHalf;
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 &&
                  (kv_cache.scalar_type() == q.scalar_type() || bf16_cache || f16_cache) && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, num_blocks, Hk, B*D] of q's dtype (or bfloat16 or float16 under float32 "
              "q)");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "block_table must be contiguous int32 [R, max_blocks]");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hk = kv_cache.size(2), B = block_size;
  TORCH_CHECK(kv_cache.size(3) == B * D, "kv_cache last dim must be block_size * head_size");
  TORCH_CHECK(paged_prefill_supported(Hq, Hk, D, B), "paged_prefill needs num_heads / num_kv_heads <= 8, head_size and "
              "block_size multiples of 16; got ", Hq, "/", Hk, " heads, head size ", D, ", block size ", B);
  auto ts = token_start.to(at::kLong).contiguous(), ql = query_len.to(at::kLong).contiguous();
  auto sl = seq_len.to(at::kLong).contiguous(), rw = row.to(at::kLong).contiguous();
  const int64_t S = ts.size(0);
  TORCH_CHECK(ql.size(0) == S && sl.size(0) == S && rw.size(0) == S, "one token_start, query_len, seq_len, row per span");
  const int64_t *tsp = ts.data_ptr<int64_t>(), *qlp = ql.data_ptr<int64_t>(), *slp = sl.data_ptr<int64_t>(),
                *rwp = rw.data_ptr<int64_t>();
  const int64_t max_blocks = block_table.size(1);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(qlp[s] >= 1 && tsp[s] >= 0 && tsp[s] + qlp[s] <= T, "span ", s, " is outside the batch");
    TORCH_CHECK(slp[s] >= qlp[s] && slp[s] <= max_blocks * B, "span ", s, ": seq_len out of range for the block table");
    TORCH_CHECK(rwp[s] >= 0 && rwp[s] < block_table.size(0), "span ", s, ": block-table row out of range");
  }
  if (bf16_cache)
    run_prefill<float, c10::BFloat16>(out, q, kv_cache, block_table, tsp, qlp, slp, rwp, S, B, scale, sliding_window,
                                      soft_cap);
  else if (f16_cache)
    run_prefill<float, c10::Half>(out, q, kv_cache, block_table, tsp, qlp, slp, rwp, S, B, scale, sliding_window,
                                  soft_cap);
  else if (q.scalar_type() == at::kFloat)
    run_prefill<float, float>(out, q, kv_cache, block_table, tsp, qlp, slp, rwp, S, B, scale, sliding_window, soft_cap);
  else
    run_prefill<c10::BFloat16, c10::BFloat16>(out, q, kv_cache, block_table, tsp, qlp, slp, rwp, S, B, scale, sliding_window,
                               soft_cap);
}
