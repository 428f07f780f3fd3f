// MLA (DeepSeek-V2/V3) decode attention over the paged latent cache, for the CPU platform's
// cpu_native backend (attention_backends/cpu_native.py): the absorbed decode of
// attention_backends/torch_ref.py's forward_mla, reading the cache in place.
//
//   mla_decode(q [N, H, E] float32, cache [NB, B, E] float32 | bfloat16 | float16 | float8_e4m3fn | float8_e5m2,
//              block_table [N, max_blocks] int32, seq_lens [N] int32, rank r, scale, k_scale)
//     -> o_lat [N, H, r] float32
//
// q[n, h] = cat(W_UK[h]^T q_nope[n, h], q_pe[n, h]) with E = r + dr, built in torch. Position t of
// request n is the row cache[block_table[n][t / B]][t % B] = cat(kv_c_t, k_pe_t) (fp8 rows times
// k_scale), for t < seq_lens[n]:
//
//   s[h][t] = scale * q[n, h] . row_t          o_lat[n, h] = sum_t softmax_t(s[h])[t] * row_t[0:r]
//
// Every head reads the same rows (one latent "kv head" for all H query heads), so the 16 vector lanes
// run over heads, not over the row: q is transposed to qT [E][16] (16 heads per task, missing heads
// zero) and the output accumulates transposed, oT [r][16]:
//
//   acc[t]   += qT[k] * row_t[k]        one 16-head vector times one broadcast cache value
//   oT[j]    += p[t]  * row_t[j]
//
// No horizontal sums and no transposing of the cache, whatever B, E and r are. Rows go TT at a time
// (kTile: 8 with AVX-512, where 8 accumulators and 8 row pointers stay in registers; 4 with AVX2, where
// a v16 is two ymm): score the tile, online softmax (a running max and sum per head lane; oT rescaled
// only when a max grows), then p . rows while the tile's rows are still in L1: one pass over the cache.
// bfloat16, float16 and fp8 rows are widened into a float tile first (16 values at a time), then the float path
// runs. A tile past the end of the context repeats its last row with the score masked to -inf.
//
// Tasks are (request, group of 16 heads, split of the context). With fewer (request, group) pairs than
// twice the threads, each context is split (flash-decoding) into at most one split per 256 positions;
// every split keeps its own max, sum and unnormalised oT, and a second pass merges them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec16.h"

namespace {

using namespace halserve_cpu;

constexpr int kLanes = 16;  // heads per task
#if defined(__AVX512F__)
constexpr int kTile = 8;  // rows scored together
constexpr int kCols = 8;  // output columns accumulated together
#else
constexpr int kTile = 4;
constexpr int kCols = 4;
#endif
constexpr int64_t kMinSplit = 256;  // positions: the shortest context split worth a task of its own

enum class Rows { kFloat, kBFloat16, kHalf, kE4M3, kE5M2 };

// fp8 -> float, exactly (every fp8 value is a float). The magnitude's exponent and mantissa bits move
// to the float's (re-biased by kBias); a subnormal (exponent 0) is read as the normal with exponent 1
// minus that normal's implicit one. The NaN/inf codes are not decoded: the cache writer saturates.
template <Rows R>
struct Fp8 {
  static constexpr int kShift = R == Rows::kE4M3 ? 20 : 21;        // float mantissa bits below the fp8's
  static constexpr uint32_t kBias = R == Rows::kE4M3 ? 120 : 112;  // 127 - the fp8's exponent bias
  static constexpr uint32_t kOne = R == Rows::kE4M3 ? 8 : 4;       // the lowest exponent bit
  static constexpr uint32_t kMinNormal = (kOne << kShift) + (kBias << 23);  // bits of 2^-6 / 2^-14
};

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <Rows R>
inline float fp8_to_float(uint8_t x) {
  using F = Fp8<R>;
  const uint32_t mag = x & 0x7Fu;
  const float f = mag < F::kOne ? bits_to_float(((mag | F::kOne) << F::kShift) + (F::kBias << 23)) -
                                      bits_to_float(F::kMinNormal)
                                : bits_to_float((mag << F::kShift) + (F::kBias << 23));
  return (x & 0x80u) ? -f : f;
}

#if defined(__AVX512F__)
typedef uint8_t vb16 __attribute__((vector_size(16), aligned(1)));
inline vi16 load_bytes16(const uint8_t* p) {
  vb16 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi16);
}
#else
typedef uint8_t vb8 __attribute__((vector_size(8), aligned(1)));
inline vi16 load_bytes16(const uint8_t* p) {
  vb8 a, b;
  std::memcpy(&a, p, sizeof a);
  std::memcpy(&b, p + 8, sizeof b);
  return {__builtin_convertvector(a, vi8), __builtin_convertvector(b, vi8)};
}
#endif

template <Rows R>
inline v16 fp8x16_to_float(const uint8_t* p) {
  using F = Fp8<R>;
  const vi16 x = load_bytes16(p);
  const vi16 mag = x & 0x7F;
  const v16 normal = as_v16((mag << F::kShift) + static_cast<int32_t>(F::kBias << 23));
  const v16 sub = as_v16(((mag | static_cast<int32_t>(F::kOne)) << F::kShift) + static_cast<int32_t>(F::kBias << 23)) -
                  bits_to_float(F::kMinNormal);
  const v16 f = select16(lt16(mag, static_cast<int32_t>(F::kOne)), sub, normal);
  return select16(gt16(x & 0x80, 0), -f, f);
}

// Row `src` of the cache (E elements of the storage type) as float32 in `dst`.
template <Rows R>
inline void widen_row(const uint8_t* src, float* dst, int64_t E, float k_scale) {
  int64_t i = 0;
  if constexpr (R == Rows::kBFloat16) {
    const auto* s = reinterpret_cast<const c10::BFloat16*>(src);
    for (; i + 16 <= E; i += 16) store16(dst + i, load16(s + i));
    for (; i < E; ++i) dst[i] = static_cast<float>(s[i]);
  } else if constexpr (R == Rows::kHalf) {
    const auto* s = reinterpret_cast<const c10::Half*>(src);
    for (; i + 16 <= E; i += 16) store16(dst + i, load16(s + i));
    for (; i < E; ++i) dst[i] = static_cast<float>(s[i]);
  } else {
    for (; i + 16 <= E; i += 16) store16(dst + i, fp8x16_to_float<R>(src + i) * k_scale);
    for (; i < E; ++i) dst[i] = fp8_to_float<R>(src[i]) * k_scale;
  }
}

// s[t] = sum_k qT[k] * rows[t][k]: the TT rows' scores for all 16 head lanes (scale is in qT).
template <int TT>
inline void score_tile(const float* qT, const float* const* rows, int64_t E, v16* s) {
  const float* r[TT];
  v16 acc[TT];
  for (int t = 0; t < TT; ++t) {
    r[t] = rows[t];
    acc[t] = v16{};
  }
  for (int64_t k = 0; k < E; ++k) {
    const v16 qk = load16(qT + k * kLanes);
    for (int t = 0; t < TT; ++t) acc[t] += qk * r[t][k];
  }
  for (int t = 0; t < TT; ++t) s[t] = acc[t];
}

// oT[j] += sum_t p[t] * rows[t][j] for j < rank, kCols columns at a time (their accumulators in
// registers across the TT rows).
template <int TT>
inline void pv_tile(const v16* p, const float* const* rows, int64_t rank, float* oT) {
  int64_t j = 0;
  for (; j + kCols <= rank; j += kCols) {
    v16 a[kCols];
    for (int c = 0; c < kCols; ++c) a[c] = load16(oT + (j + c) * kLanes);
    for (int t = 0; t < TT; ++t) {
      const float* row = rows[t] + j;
      const v16 pt = p[t];
      for (int c = 0; c < kCols; ++c) a[c] += pt * row[c];
    }
    for (int c = 0; c < kCols; ++c) store16(oT + (j + c) * kLanes, a[c]);
  }
  for (; j < rank; ++j) {
    v16 a = load16(oT + j * kLanes);
    for (int t = 0; t < TT; ++t) a += p[t] * rows[t][j];
    store16(oT + j * kLanes, a);
  }
}

struct Problem {
  const float* q;           // [N, H, E]
  const uint8_t* cache;     // [NB, B, E] of elem-byte values
  const int32_t* block_table;
  const int32_t* seq_lens;
  int64_t N, H, E, rank, B, max_blocks, elem;
  int64_t num_groups;       // ceil(H / 16)
  int64_t num_splits;       // context splits per (request, group)
  float scale, k_scale;
};

// What one task leaves: oT [rank][16] unnormalised, and the running max and sum per head lane.
struct Partial {
  float* oT;
  float* m;
  float* l;
};

// Per-thread scratch, reused by the thread's tasks.
struct Scratch {
  std::vector<float> qT, oT, tile, m, l;
};

// One (request n, head group g, positions [lo, hi)) task; hi > lo.
template <Rows R>
void attend(const Problem& pb, int64_t n, int64_t g, int64_t lo, int64_t hi, Scratch& sc, Partial out) {
  const int64_t E = pb.E, rank = pb.rank, B = pb.B;
  const int64_t heads = std::min<int64_t>(kLanes, pb.H - g * kLanes);
  sc.qT.assign(E * kLanes, 0.f);
  const float* q = pb.q + (n * pb.H + g * kLanes) * E;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t k = 0; k < E; ++k) sc.qT[k * kLanes + h] = q[h * E + k] * pb.scale;
  std::fill(out.oT, out.oT + rank * kLanes, 0.f);
  if constexpr (R != Rows::kFloat) sc.tile.resize(kTile * E);
  const int32_t* row_blocks = pb.block_table + n * pb.max_blocks;
  const int64_t row_bytes = E * pb.elem;
  auto row_ptr = [&](int64_t t) { return pb.cache + (static_cast<int64_t>(row_blocks[t / B]) * B + t % B) * row_bytes; };

  const float ninf = -std::numeric_limits<float>::infinity();
  v16 m = splat16(ninf), l = v16{};
  const float* rows[kTile];
  v16 s[kTile];
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    for (int i = 0; i < kTile; ++i) {
      const uint8_t* src = row_ptr(std::min(t0 + i, hi - 1));
      if constexpr (R == Rows::kFloat) {
        rows[i] = reinterpret_cast<const float*>(src);
      } else {
        widen_row<R>(src, sc.tile.data() + i * E, E, pb.k_scale);
        rows[i] = sc.tile.data() + i * E;
      }
    }
    // blocks are scattered, which hardware prefetchers cannot follow: fetch the next tile's rows
    // that start a block while this tile is computed
    for (int64_t t = t0 + kTile; t < std::min(hi, t0 + 2 * kTile); ++t)
      if (t % B == 0 || t == t0 + kTile) prefetch_lines(row_ptr(t), row_bytes);
    score_tile<kTile>(sc.qT.data(), rows, E, s);
    for (int i = 0; i < kTile; ++i)
      if (t0 + i >= hi) s[i] = splat16(ninf);
    v16 m_new = m;
    for (int i = 0; i < kTile; ++i) m_new = max16(m_new, s[i]);
    if (hmax16(m_new - m) > 0.f) {  // a head's max grew: rescale what it has accumulated
      const v16 corr = exp16(m - m_new);
      for (int64_t j = 0; j < rank; ++j) store16(out.oT + j * kLanes, load16(out.oT + j * kLanes) * corr);
      l = l * corr;
      m = m_new;
    }
    for (int i = 0; i < kTile; ++i) {
      s[i] = exp16(s[i] - m);
      l += s[i];
    }
    pv_tile<kTile>(s, rows, rank, out.oT);
  }
  store16(out.m, m);
  store16(out.l, l);
}

// o_lat[n, g * 16 + h, j] = oT[j][h] / l[h] for the group's heads.
void finish(const Problem& pb, int64_t n, int64_t g, const float* oT, const float* l, float* o_lat) {
  const int64_t heads = std::min<int64_t>(kLanes, pb.H - g * kLanes);
  float* o = o_lat + (n * pb.H + g * kLanes) * pb.rank;
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / l[h];
    for (int64_t j = 0; j < pb.rank; ++j) o[h * pb.rank + j] = oT[j * kLanes + h] * inv;
  }
}

// Positions [lo, hi) of split s of a context of len positions (empty past the end).
inline void split_range(int64_t len, int64_t num_splits, int64_t s, int64_t& lo, int64_t& hi) {
  const int64_t chunk = ((len + num_splits - 1) / num_splits + kTile - 1) / kTile * kTile;
  lo = std::min(len, s * chunk);
  hi = std::min(len, lo + chunk);
}

template <Rows R>
void run(const Problem& pb, float* o_lat) {
  const int64_t S = pb.num_splits, G = pb.num_groups;
  const int64_t partial_size = pb.rank * kLanes + 2 * kLanes;  // oT, m, l
  std::vector<float> partials(S > 1 ? pb.N * G * S * partial_size : 0);
  at::parallel_for(0, pb.N * G * S, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task % S, g = (task / S) % G, n = task / (S * G);
      int64_t lo, hi;
      split_range(pb.seq_lens[n], S, s, lo, hi);
      if (S == 1) {
        sc.oT.resize(pb.rank * kLanes);
        sc.m.resize(kLanes);
        sc.l.resize(kLanes);
        attend<R>(pb, n, g, lo, hi, sc, Partial{sc.oT.data(), sc.m.data(), sc.l.data()});
        finish(pb, n, g, sc.oT.data(), sc.l.data(), o_lat);
        continue;
      }
      float* base = partials.data() + task * partial_size;
      Partial part{base, base + pb.rank * kLanes, base + pb.rank * kLanes + kLanes};
      if (lo < hi) {
        attend<R>(pb, n, g, lo, hi, sc, part);
      } else {  // an empty split: weight zero in the merge
        std::fill(part.oT, part.oT + pb.rank * kLanes, 0.f);
        std::fill(part.m, part.m + kLanes, -std::numeric_limits<float>::infinity());
        std::fill(part.l, part.l + kLanes, 0.f);
      }
    }
  });
  if (S == 1) return;
  // merge: o = sum_s exp(m_s - M) oT_s / sum_s exp(m_s - M) l_s, M = max_s m_s (split 0 is never empty)
  at::parallel_for(0, pb.N * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> oT(pb.rank * kLanes), l(kLanes);
    std::vector<v16> w(S);
    for (int64_t pair = begin; pair < end; ++pair) {
      const float* first = partials.data() + pair * S * partial_size;
      v16 M = splat16(-std::numeric_limits<float>::infinity());
      for (int64_t s = 0; s < S; ++s) M = max16(M, load16(first + s * partial_size + pb.rank * kLanes));
      v16 L = v16{};
      for (int64_t s = 0; s < S; ++s) {
        const float* part = first + s * partial_size;
        w[s] = exp16(load16(part + pb.rank * kLanes) - M);
        L += w[s] * load16(part + pb.rank * kLanes + kLanes);
      }
      for (int64_t j = 0; j < pb.rank; ++j) {
        v16 acc = v16{};
        for (int64_t s = 0; s < S; ++s) acc += w[s] * load16(first + s * partial_size + j * kLanes);
        store16(oT.data() + j * kLanes, acc);
      }
      store16(l.data(), L);
      finish(pb, pair / G, pair % G, oT.data(), l.data(), o_lat);
    }
  });
}

torch::Tensor mla_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table, torch::Tensor seq_lens,
                         int64_t rank, double scale, double k_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "q must be contiguous float32 [N, H, kv_lora_rank + qk_rope_head_dim]");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(2) == q.size(2),
              "cache must be contiguous [num_blocks, block_size, E] with E = q's last dimension");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == torch::kInt && seq_lens.dim() == 1 &&
                  seq_lens.scalar_type() == torch::kInt,
              "block_table [N, max_blocks] and seq_lens [N] must be int32");
  TORCH_CHECK(block_table.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "one block-table row and seq_len per query");
  TORCH_CHECK(rank >= 1 && rank <= q.size(2), "rank must be in [1, E], got ", rank);
  Rows rows;
  switch (cache.scalar_type()) {
    case torch::kFloat: rows = Rows::kFloat; break;
    case torch::kBFloat16: rows = Rows::kBFloat16; break;
    case torch::kHalf: rows = Rows::kHalf; break;
    case torch::kFloat8_e4m3fn: rows = Rows::kE4M3; break;
    case torch::kFloat8_e5m2: rows = Rows::kE5M2; break;
    default: TORCH_CHECK(false, "the MLA cache must be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, got ",
                         cache.scalar_type());
  }
  auto bt = block_table.contiguous();
  auto sl = seq_lens.contiguous();
  Problem pb;
  pb.N = q.size(0);
  pb.H = q.size(1);
  pb.E = q.size(2);
  pb.rank = rank;
  pb.B = cache.size(1);
  pb.max_blocks = bt.size(1);
  pb.elem = cache.element_size();
  pb.q = q.data_ptr<float>();
  pb.cache = static_cast<const uint8_t*>(cache.data_ptr());
  pb.block_table = bt.data_ptr<int32_t>();
  pb.seq_lens = sl.data_ptr<int32_t>();
  pb.scale = static_cast<float>(scale);
  pb.k_scale = static_cast<float>(k_scale);
  pb.num_groups = (pb.H + kLanes - 1) / kLanes;
  // every block a context reads must be in the cache: checked here so the tasks need not
  const int64_t num_blocks = cache.size(0);
  int64_t max_len = 0;
  for (int64_t n = 0; n < pb.N; ++n) {
    const int64_t len = pb.seq_lens[n];
    TORCH_CHECK(len >= 1 && len <= pb.max_blocks * pb.B, "seq_len ", len, " of request ", n,
                " is out of range for ", pb.max_blocks, " blocks of ", pb.B);
    for (int64_t b = 0; b < (len + pb.B - 1) / pb.B; ++b) {
      const int32_t blk = pb.block_table[n * pb.max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " of request ", n, " is outside the cache (",
                  num_blocks, " blocks)");
    }
    max_len = std::max(max_len, len);
  }
  const int64_t pairs = pb.N * pb.num_groups, threads = at::get_num_threads();
  pb.num_splits = pairs >= 2 * threads ? 1
                                       : std::max<int64_t>(1, std::min((2 * threads + pairs - 1) / pairs, max_len / kMinSplit));
  auto out = torch::empty({pb.N, pb.H, rank}, q.options());
  if (pb.N == 0) return out;
  float* op = out.data_ptr<float>();
  switch (rows) {
    case Rows::kFloat: run<Rows::kFloat>(pb, op); break;
    case Rows::kBFloat16: run<Rows::kBFloat16>(pb, op); break;
    case Rows::kHalf: run<Rows::kHalf>(pb, op); break;
    case Rows::kE4M3: run<Rows::kE4M3>(pb, op); break;
    case Rows::kE5M2: run<Rows::kE5M2>(pb, op); break;
  }
  return out;
}

// Whether this build has AVX-512 (kTile 8) or not (4): for benchmarks' and tests' logs.
bool mla_decode_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(halserve_cpu_mla, m) {
  m.def("mla_decode(Tensor q, Tensor cache, Tensor block_table, Tensor seq_lens, int rank, float scale, "
        "float k_scale) -> Tensor");
  m.def("mla_decode_avx512() -> bool", &mla_decode_avx512);
}

TORCH_LIBRARY_IMPL(halserve_cpu_mla, CPU, m) {
  m.impl("mla_decode", mla_decode);
}
