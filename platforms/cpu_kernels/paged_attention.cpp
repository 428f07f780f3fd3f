// Paged attention for the CPU platform's `cpu_native` backend: float32, or bfloat16 q,
// cache and output with float32 arithmetic (the kernels are templates over the storage
// type T; the float32 instantiation does exactly what the float32-only kernels did), and
// float32 q and output over a bfloat16 or float16 cache (kv_cache_dtype="bfloat16" / "float16": the
// cache type C apart from T; a decode step reads half the bytes; float16 is llama.cpp's default cache).
//
// Cache layout, one tensor per layer: kv_cache [2, num_blocks, Hk, B * D] where
//   keys   kv_cache[0][blk][h] is [D, B]   (token-minor: B consecutive tokens per d)
//   values kv_cache[1][blk][h] is [B, D]   (row per token)
// Keys are stored transposed so that q . k for the B tokens of a block is D vector
// FMAs of width B with no horizontal sums; values keep rows so p * v is D-wide FMAs.
//
//   decode(q [N, Hq, D], kv_cache, block_table [N, max_blocks] int32, seq_lens [N] int32)
//     one query per request at position seq_len - 1; keys t with
//     seq_len - 1 - window < t < seq_len are visible (window 0 = no window).
// Work is split over (request, kv head) pairs with at::parallel_for (torch's thread
// pool); each task reads its head's blocks once and serves the G = Hq / Hk query heads
// that share it. Blocks of 16k tokens with head sizes of 16k take the fast path: scores
// written in place, a vectorised softmax (exp16), blocks software-prefetched two ahead into L2
// (scattered blocks defeat the hardware prefetchers). Measured on W1's shapes (64
// requests x 192 tokens x 12/4 heads x 64, 300 MB of cache per step): 21 -> 11 ms per
// step against the scalar-softmax version. One task per request (all its heads, each
// block read as one contiguous run) measured slower and was dropped.
//
// Also here: write_kv (the step's K/V into the cache layout). paged_prefill.cpp has the
// prefill kernel, elementwise.cpp the fused norm/rotary/SiLU kernels, vec16.h the
// vector helpers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {

using namespace halserve_cpu;

// s[g][0:16] = scale * sum_d q[g][d] * kb[d * ldk + 0:16]: the 16 keys starting at kb of
// a block stored [D, ldk] (tokens innermost), G accumulators in registers.
template <int G, typename T>
inline void score16(const float* qh, const T* kb, int64_t D, int64_t ldk, float scale, float* s, int64_t s_stride) {
  v16 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = v16{};
  for (int64_t d = 0; d < D; ++d) {
    const v16 k = load16(kb + d * ldk);
    for (int g = 0; g < G; ++g) acc[g] += qh[g * D + d] * k;
  }
  for (int g = 0; g < G; ++g) store16(s + g * s_stride, acc[g] * scale);
}

// acc[g][0:D] += sum_{t in [lo, hi)} p[g][t - base] * v[t - t0][0:D] for one block stored
// [B, D]; D = 16 * chunks, one 16-wide column chunk at a time so G accumulators stay in
// registers whatever D is.
template <int G, typename T>
inline void pv16(const T* vb, const float* p, int64_t p_stride, int64_t base, int64_t lo, int64_t hi, int64_t t0,
                 int64_t D, float* acc) {
  for (int64_t c = 0; c < D; c += 16) {
    v16 a[G];
    for (int g = 0; g < G; ++g) a[g] = load16(acc + g * D + c);
    for (int64_t t = lo; t < hi; ++t) {
      const v16 v = load16(vb + (t - t0) * D + c);
      for (int g = 0; g < G; ++g) a[g] += p[g * p_stride + (t - base)] * v;
    }
    for (int g = 0; g < G; ++g) store16(acc + g * D + c, a[g]);
  }
}

// Generic scoring: any block size, any group size.
template <typename T>
inline void score_block(const float* qh, const T* kb, int64_t D, int64_t B, int64_t G, float* s) {
  std::fill(s, s + G * B, 0.f);
  for (int64_t d = 0; d < D; ++d) {
    const T* kd = kb + d * B;
    for (int64_t g = 0; g < G; ++g) {
      const float qv = qh[g * D + d];
      float* sg = s + g * B;
#pragma omp simd
      for (int64_t t = 0; t < B; ++t) sg[t] += qv * to_float(kd[t]);
    }
  }
}

template <typename T>
inline void pv_generic(const T* vb, const float* p, int64_t p_stride, int64_t base, int64_t lo, int64_t hi, int64_t t0,
                       int64_t G, int64_t D, float* acc) {
  for (int64_t t = lo; t < hi; ++t) {
    const T* v = vb + (t - t0) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float pg = p[g * p_stride + (t - base)];
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += pg * to_float(v[d]);
    }
  }
}

// Everything one (request, kv head) task needs; T is the output element type, C the cache's (T, or bfloat16 /
// float16 under a float32 model: kv_cache_dtype="bfloat16" / "float16").
template <typename T, typename C>
struct DecodeTask {
  const float* qh;        // [G, D] the query heads of this kv head (widened to float)
  const C* kp;            // key cache base
  const C* vp;            // value cache base
  const int32_t* row;     // block-table row
  int64_t head_off;       // h * B * D
  int64_t block_stride;   // Hk * B * D
  int64_t NB, B, D, G;
  int64_t start, len;     // visible keys: [start, len)
  float scale, cap;
  T* out;                 // [G, D]
};

template <typename Task, typename C>
inline const C* block_ptr(const Task& k, const C* base, int64_t lb) {
  const int64_t blk = k.row[lb];
  TORCH_CHECK(blk >= 0 && blk < k.NB, "block id out of range");
  return base + blk * k.block_stride + k.head_off;
}

// Cache blocks in flight per decode task (into L2: vec16.h's prefetch_lines). 1, 2, 4 and 8 measured within
// 10% of each other on a 2-core Zen 4 (BENCHMARKS.md, "A bfloat16 KV cache"); 2 was the best.
constexpr int64_t kPrefetchBlocks = 2;

// Fast path: B a multiple of 16, D a multiple of 16, G <= 8. Scores of whole blocks are
// written in place (span is a whole number of blocks), the edges masked to -inf, then a
// vectorised softmax (exp16) and the unnormalised p * V, divided by the sum at the end.
template <int G, typename T, typename C>
void decode_task_fast(const DecodeTask<T, C>& k, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t B = k.B, D = k.D;
  const int64_t first_blk = k.start / B, last_blk = (k.len - 1) / B;
  const int64_t base = first_blk * B, span = (last_blk + 1) * B - base;
  scores.resize(G * span);
  float* sc = scores.data();
  const float ninf = -std::numeric_limits<float>::infinity();
  // Blocks are scattered, which hardware prefetchers cannot follow: keep kPrefetchBlocks blocks in flight,
  // keys then (past the last key block) this task's first values.
  const int64_t nblk = last_blk - first_blk + 1;
  auto prefetch_block = [&](int64_t i) {  // i-th block of the keys then values sequence
    if (i < nblk) prefetch_lines(block_ptr(k, k.kp, first_blk + i), B * D);
    else if (i < 2 * nblk) prefetch_lines(block_ptr(k, k.vp, first_blk + i - nblk), B * D);
  };
  for (int64_t i = 1; i < kPrefetchBlocks; ++i) prefetch_block(i);  // (block 0: the previous task fetched it)
  for (int64_t lb = first_blk; lb <= last_blk; ++lb) {
    const C* kb = block_ptr(k, k.kp, lb);
    prefetch_block(lb - first_blk + kPrefetchBlocks);
    const int64_t t0 = lb * B;
    for (int64_t j = 0; j < B; j += 16) score16<G, C>(k.qh, kb + j, D, B, k.scale, sc + (t0 - base) + j, span);
  }
  for (int g = 0; g < G; ++g) {
    float* s = sc + g * span;
    for (int64_t t = base; t < k.start; ++t) s[t - base] = ninf;
    for (int64_t t = k.len; t < base + span; ++t) s[t - base] = ninf;
    if (k.cap > 0.f)
      for (int64_t t = k.start; t < k.len; ++t) s[t - base] = std::tanh(s[t - base] / k.cap) * k.cap;
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* s = sc + g * span;
    v16 m = splat16(ninf);
    for (int64_t i = 0; i < span; i += 16) {
      const v16 x = load16(s + i);
      m = max16(x, m);
    }
    const v16 mx = splat16(hmax16(m));
    v16 sum = v16{};
    for (int64_t i = 0; i < span; i += 16) {
      const v16 e = exp16(load16(s + i) - mx);
      store16(s + i, e);
      sum += e;
    }
    inv[g] = 1.f / hsum16(sum);
  }
  acc.assign(G * D, 0.f);
  for (int64_t lb = first_blk; lb <= last_blk; ++lb) {
    const C* vb = block_ptr(k, k.vp, lb);
    prefetch_block(nblk + lb - first_blk + kPrefetchBlocks);
    const int64_t t0 = lb * B;
    pv16<G, C>(vb, sc, span, base, std::max(k.start, t0), std::min(k.len, t0 + B), t0, D, acc.data());
  }
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) k.out[g * D + d] = from_float<T>(acc[g * D + d] * inv[g]);
}

// Any block size, head size and group size.
template <typename T, typename C>
void decode_task_generic(const DecodeTask<T, C>& k, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t B = k.B, D = k.D, G = k.G;
  const int64_t first_blk = k.start / B, last_blk = (k.len - 1) / B;
  const int64_t base = first_blk * B, span = (last_blk + 1) * B - base;
  scores.assign(G * span, -std::numeric_limits<float>::infinity());
  std::vector<float> sblk(G * B);
  for (int64_t lb = first_blk; lb <= last_blk; ++lb) {
    score_block(k.qh, block_ptr(k, k.kp, lb), D, B, G, sblk.data());
    const int64_t t0 = lb * B;
    const int64_t lo = std::max(k.start, t0), hi = std::min(k.len, t0 + B);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = lo; t < hi; ++t) {
        float x = sblk[g * B + (t - t0)] * k.scale;
        if (k.cap > 0.f) x = std::tanh(x / k.cap) * k.cap;
        scores[g * span + (t - base)] = x;
      }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * span;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < span; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < span; ++i) {
      const float e = std::exp(s[i] - mx);
      s[i] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < span; ++i) s[i] *= inv;
  }
  acc.assign(G * D, 0.f);
  for (int64_t lb = first_blk; lb <= last_blk; ++lb) {
    const int64_t t0 = lb * B;
    pv_generic(block_ptr(k, k.vp, lb), scores.data(), span, base, std::max(k.start, t0), std::min(k.len, t0 + B), t0,
               G, D, acc.data());
  }
  for (int64_t i = 0; i < G * D; ++i) k.out[i] = from_float<T>(acc[i]);
}

template <typename T, typename C>
using TaskFn = void (*)(const DecodeTask<T, C>&, std::vector<float>&, std::vector<float>&);

template <typename T, typename C>
TaskFn<T, C> pick_task_fn(int64_t B, int64_t D, int64_t G) {
  if (B % 16 == 0 && D % 16 == 0) {
    switch (G) {
      case 1: return decode_task_fast<1, T, C>;
      case 2: return decode_task_fast<2, T, C>;
      case 3: return decode_task_fast<3, T, C>;
      case 4: return decode_task_fast<4, T, C>;
      case 5: return decode_task_fast<5, T, C>;
      case 6: return decode_task_fast<6, T, C>;
      case 7: return decode_task_fast<7, T, C>;
      case 8: return decode_task_fast<8, T, C>;
      default: break;
    }
  }
  return decode_task_generic<T, C>;
}

bool is_storage_dtype(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

// The cache holds q's dtype, or a 16-bit type under float32 q (kv_cache_dtype="bfloat16" or "float16": half the
// bytes a decode step reads; the arithmetic stays float32).
bool cache_dtype_ok(const torch::Tensor& q, const torch::Tensor& kv) {
  return kv.scalar_type() == q.scalar_type() ||
         (q.scalar_type() == torch::kFloat &&
          (kv.scalar_type() == torch::kBFloat16 || kv.scalar_type() == torch::kHalf));
}

void check(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& bt, const torch::Tensor& sl) {
  TORCH_CHECK(q.dim() == 3 && is_storage_dtype(q) && q.is_contiguous(),
              "q must be contiguous float32 or bfloat16 [N, Hq, D]");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && cache_dtype_ok(q, kv) && kv.is_contiguous(),
              "kv_cache must be contiguous [2, num_blocks, Hk, B*D] of q's dtype (or bfloat16 or float16 under "
              "float32 q)");
  TORCH_CHECK(bt.scalar_type() == torch::kInt && sl.scalar_type() == torch::kInt, "block_table/seq_lens must be int32");
  TORCH_CHECK(bt.size(0) == q.size(0) && sl.size(0) == q.size(0), "one block-table row and seq_len per query");
}

template <typename T, typename C>
void run_decode(const T* qp, const C* kp, T* op, const int32_t* btp, const int32_t* slp, int64_t N, int64_t Hq,
                int64_t Hk, int64_t D, int64_t NB, int64_t B, int64_t max_blocks, float fscale, float cap,
                int64_t sliding_window) {
  const int64_t G = Hq / Hk;
  const C* vp = kp + NB * Hk * B * D;
  const int64_t head_stride = B * D;       // elements of one (block, head)
  const int64_t block_stride = Hk * B * D;  // elements of one block
  const TaskFn<T, C> task_fn = pick_task_fn<T, C>(B, D, G);
  at::parallel_for(0, N * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, qbuf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / Hk, h = task % Hk;
      const int64_t len = slp[n];
      TORCH_CHECK(len >= 1 && len <= max_blocks * B, "seq_len out of range for the block table");
      DecodeTask<T, C> k;
      const T* qh = qp + (n * Hq + h * G) * D;
      if constexpr (std::is_same_v<T, float>) {
        k.qh = qh;
      } else {  // the G query rows widened once, read D times each by the scoring loop
        qbuf.resize(G * D);
        for (int64_t i = 0; i < G * D; ++i) qbuf[i] = to_float(qh[i]);
        k.qh = qbuf.data();
      }
      k.kp = kp;
      k.vp = vp;
      k.row = btp + n * max_blocks;
      k.head_off = h * head_stride;
      k.block_stride = block_stride;
      k.NB = NB;
      k.B = B;
      k.D = D;
      k.G = G;
      k.start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      k.len = len;
      k.scale = fscale;
      k.cap = cap;
      k.out = op + (n * Hq + h * G) * D;
      if (task + 1 < end) {  // the next task's first key block, fetched while this one runs
        const int64_t n1 = (task + 1) / Hk, h1 = (task + 1) % Hk, len1 = slp[n1];
        if (len1 >= 1 && len1 <= max_blocks * B) {
          const int64_t start1 = sliding_window > 0 ? std::max<int64_t>(0, len1 - sliding_window) : 0;
          const int64_t blk1 = btp[n1 * max_blocks + start1 / B];
          if (blk1 >= 0 && blk1 < NB) prefetch_lines(kp + blk1 * block_stride + h1 * head_stride, B * D);
        }
      }
      task_fn(k, scores, acc);
    }
  });
}

template <typename T, typename C>
void run_write_kv(C* keys, const T* kp, const T* vp, const int64_t* sp, int64_t T_, int64_t Hk, int64_t D, int64_t NB,
                  int64_t B) {
  C* values = keys + NB * Hk * B * D;
  at::parallel_for(0, T_, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const int64_t blk = slot / B, off = slot % B;
      for (int64_t h = 0; h < Hk; ++h) {
        const T* ks = kp + (t * Hk + h) * D;
        const T* vs = vp + (t * Hk + h) * D;
        C* kt = keys + (blk * Hk + h) * B * D + off;      // [D, B] tile, column off
        C* vt = values + (blk * Hk + h) * B * D + off * D;  // [B, D] tile, row off
        if constexpr (std::is_same_v<T, C>) {
          for (int64_t d = 0; d < D; ++d) kt[d * B] = ks[d];
          std::copy(vs, vs + D, vt);
        } else {  // float32 k/v into a bfloat16 or float16 cache: rounded to nearest even
          for (int64_t d = 0; d < D; ++d) kt[d * B] = from_float<C>(ks[d]);
          for (int64_t d = 0; d < D; ++d) vt[d] = from_float<C>(vs[d]);
        }
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                           int64_t block_size, double scale, int64_t sliding_window, double soft_cap) {
  check(q, kv_cache, block_table, seq_lens);
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), Hk = kv_cache.size(2), B = block_size;
  TORCH_CHECK(kv_cache.size(3) == B * D, "kv_cache last dim must be block_size * head_size");
  TORCH_CHECK(Hq % Hk == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t max_blocks = block_table.size(1);
  auto bt = block_table.contiguous();
  auto sl = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  if (q.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kBFloat16)
    run_decode<float, c10::BFloat16>(q.data_ptr<float>(), kv_cache.data_ptr<c10::BFloat16>(), out.data_ptr<float>(),
                                     btp, slp, N, Hq, Hk, D, NB, B, max_blocks, fscale, cap, sliding_window);
  else if (q.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kHalf)
    run_decode<float, c10::Half>(q.data_ptr<float>(), kv_cache.data_ptr<c10::Half>(), out.data_ptr<float>(), btp, slp,
                                 N, Hq, Hk, D, NB, B, max_blocks, fscale, cap, sliding_window);
  else if (q.scalar_type() == torch::kFloat)
    run_decode<float, float>(q.data_ptr<float>(), kv_cache.data_ptr<float>(), out.data_ptr<float>(), btp, slp, N, Hq,
                             Hk, D, NB, B, max_blocks, fscale, cap, sliding_window);
  else
    run_decode<c10::BFloat16, c10::BFloat16>(q.data_ptr<c10::BFloat16>(), kv_cache.data_ptr<c10::BFloat16>(),
                              out.data_ptr<c10::BFloat16>(), btp, slp, N, Hq, Hk, D, NB, B, max_blocks, fscale, cap,
                              sliding_window);
  return out;
}

// Writes the step's new keys and values into the cache: token t goes to slot
// slot_mapping[t] = block * B + offset; its key column-wise into the block's [D, B] key
// tile, its value as row `offset` of the [B, D] value tile. Negative slots (padding) are
// skipped. Values are copied as they are when k, v and the cache share one dtype; float32 k/v into a
// bfloat16 or float16 cache (kv_cache_dtype="bfloat16" / "float16") are rounded to it.
void write_kv(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping, int64_t block_size) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 &&
                  (is_storage_dtype(kv_cache) || kv_cache.scalar_type() == torch::kHalf) && kv_cache.is_contiguous(),
              "kv_cache must be contiguous float32, bfloat16 or float16 [2, num_blocks, Hk, B*D]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
                  is_storage_dtype(k) && cache_dtype_ok(k, kv_cache),
              "k and v must be [T, Hk, D] of one shape and the cache's dtype (or float32 into a bfloat16 or float16 "
              "cache)");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0), "one slot per token");
  const int64_t T = k.size(0), Hk = k.size(1), D = k.size(2), B = block_size, NB = kv_cache.size(1);
  TORCH_CHECK(kv_cache.size(2) == Hk && kv_cache.size(3) == B * D, "kv_cache does not match k/v heads, head size and block size");
  auto kc = k.contiguous(), vc = v.contiguous();
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < NB * B, "slot ", sp[t], " is outside the cache (", NB, " blocks of ", B, ")");
  if (k.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kBFloat16)
    run_write_kv<float, c10::BFloat16>(kv_cache.data_ptr<c10::BFloat16>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                                       sp, T, Hk, D, NB, B);
  else if (k.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kHalf)
    run_write_kv<float, c10::Half>(kv_cache.data_ptr<c10::Half>(), kc.data_ptr<float>(), vc.data_ptr<float>(), sp, T,
                                   Hk, D, NB, B);
  else if (kv_cache.scalar_type() == torch::kFloat)
    run_write_kv<float, float>(kv_cache.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), sp, T, Hk, D,
                               NB, B);
  else
    run_write_kv<c10::BFloat16, c10::BFloat16>(kv_cache.data_ptr<c10::BFloat16>(), kc.data_ptr<c10::BFloat16>(),
                                vc.data_ptr<c10::BFloat16>(), sp, T, Hk, D, NB, B);
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
std::vector<torch::Tensor> rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos_sin,
                                  int64_t head_size, bool is_neox);

bool paged_prefill_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size);
void paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                   torch::Tensor token_start, torch::Tensor query_len, torch::Tensor seq_len, torch::Tensor row,
                   int64_t block_size, double scale, int64_t sliding_window, double soft_cap);

torch::Tensor silu_and_mul(torch::Tensor x);

// One decode step's attention from the fused projection's output, for a caller that runs the layers itself
// (models/llama_flat.py): qkv [T, (Hq + 2 Hk) D] -> [T, Hq D], exactly rotary(q, k) then write_kv(k, v) then
// paged_decode(q), the same functions on the same views, in one call instead of ~11 Python-level ones a layer.
torch::Tensor rotary_write_decode(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_sin, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_size, bool is_neox, torch::Tensor kv_cache,
                                  torch::Tensor slot_mapping, torch::Tensor block_table, torch::Tensor seq_lens,
                                  int64_t block_size, double scale, int64_t sliding_window, double soft_cap) {
  const int64_t D = head_size, q_size = num_heads * D, kv_size = num_kv_heads * D;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == q_size + 2 * kv_size,
              "qkv must be [T, (num_heads + 2 num_kv_heads) head_size] = [T, ", q_size + 2 * kv_size, "]");
  const int64_t T = qkv.size(0);
  auto rotated = rotary(positions, qkv.narrow(1, 0, q_size), qkv.narrow(1, q_size, kv_size), cos_sin, D, is_neox);
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).contiguous();
  write_kv(kv_cache, rotated[1].view({T, num_kv_heads, D}), v.view({T, num_kv_heads, D}), slot_mapping, block_size);
  auto out = paged_decode(rotated[0].view({T, num_heads, D}), kv_cache, block_table, seq_lens, block_size, scale,
                          sliding_window, soft_cap);
  return out.view({T, q_size});
}

void register_decode_plan(pybind11::module& m);  // decode_plan.cpp

int64_t shm_all_reduce(torch::Tensor buffer, torch::Tensor x, int64_t rank, int64_t world, int64_t slot_bytes,
                       int64_t seq);
int64_t shm_all_gather(torch::Tensor buffer, torch::Tensor x, torch::Tensor out, int64_t rank, int64_t world,
                       int64_t slot_bytes, int64_t seq);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_plan(m);
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm (float32)");
  m.def("rotary", &rotary, "rotary embedding of q and k (float32, neox or gpt-j pairs)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (float32)");
  m.def("write_kv", &write_kv,
        "write new K/V into a [2, blocks, Hk, B*D] float32, bfloat16 or float16 cache (keys stored [D, B] per block)");
  m.def("rotary_write_decode", &rotary_write_decode,
        "a decode step's attention from the fused qkv rows: rotary, write_kv, paged_decode in one call");
  m.def("paged_prefill_supported", &paged_prefill_supported, "whether paged_prefill runs this head/block configuration");
  m.def("paged_prefill", &paged_prefill,
        "flash-style prefill attention over the paged [2, blocks, Hk, B*D] float32/bfloat16/float16 cache, all spans "
        "at once");
  m.def("shm_all_reduce", &shm_all_reduce, "sum x over the ranks mapping one shared buffer, in place");
  m.def("shm_all_gather", &shm_all_gather, "every rank's x, through one shared buffer");
  m.def("paged_decode", &paged_decode,
        "paged attention decode over a [2, blocks, Hk, B*D] float32, bfloat16 or float16 cache (keys stored [D, B] per "
        "block)");
}
