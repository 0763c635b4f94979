// Paged attention on CPU that reads the KV cache in place through the block table.
//
// One entry point serves decode (one query per request) and prefill / mixed
// batches (a chunk of queries continuing a cached context): query j of a
// request with q queries and context length L sits at position L - q + j and
// sees keys 0 .. L - q + j (causal, the query's end aligned to the context's end);
// with a sliding window W only the last W of them, L - q + j - W + 1 .. L - q + j;
// with chunked local attention of C tokens (Llama 4) only those of its chunk,
// from (L - q + j) / C * C on (with both, the later lower bound: first_key).
// A soft-cap c turns each score s (already scaled) into c * tanh(s / c) (Gemma-2).
//
// Work is split into items. A decode item is a request with all its heads (or
// a slice of them when there are too few requests to feed every thread): each
// token's K and V rows are then read once, contiguously. A prefill item is a
// tile of a request's queries for one kv head. An item's rows are (kv head,
// query, query head of the group); it walks the context in key tiles read
// through the block table (the next tile prefetched), with an online softmax
// (running max and sum per row) and fp32 accumulators: nothing is gathered
// into a packed context or padded. Items run on torch's OpenMP pool
// (at::get_num_threads()), scheduled dynamically since their costs differ.
//
// The math is written with GCC vector extensions over 16 floats (one AVX-512
// register, two AVX2 ones): Q.K^T as 16 keys' dot products reduced together,
// P.V as rank-1 updates of 4 rows x 64 columns of accumulators. A prefill
// tile of 8..16 rows keeps its scores transposed instead (one vector per key,
// a lane per row: run_item_t), so Q.K^T needs no horizontal sums and its
// softmax runs lane-wise: about twice the throughput of the row-wise path.
//
// Inputs: q [T, H, D] (last dim contiguous), k_cache / v_cache
// [num_blocks, block_size, Hkv, D] contiguous, float32 or bfloat16 (q and the
// cache alike); query_start_loc [B + 1], seq_lens [B] and block_tables
// [B, max_blocks] int32. Math in fp32; the output has q's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace tokenbudget_cpu {
// small_rows_linear.cpp
at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, int64_t max_rows);
}  // namespace tokenbudget_cpu

namespace {

typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16u __attribute__((vector_size(32), aligned(2)));
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // GCC 11 and older have only their own spelling
#define SHUF(a, b, ...) __builtin_shuffle(a, b, i32x16{__VA_ARGS__})
#endif

constexpr int W = 16;          // floats per vector
constexpr int kKeyTile = 32;   // keys per online-softmax step (a multiple of W)
constexpr int kRowTarget = 16; // prefill rows (queries x heads of a group) per item
constexpr int64_t kMinParallelWork = 1 << 16;  // QK^T multiply-adds below which one thread runs
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vec16 load(const float* p) { return *reinterpret_cast<const vec16u*>(p); }
inline void store(float* p, vec16 v) { *reinterpret_cast<vec16u*>(p) = v; }
inline vec16 splat(float x) { return vec16{} + x; }

inline float hsum(vec16 v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

inline float hmax(vec16 v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

// Lane k of the result is the sum of the lanes of a[k]: 16 dot products
// finished together (15 add + 30 shuffle instructions) instead of one by one.
inline vec16 reduce16(const vec16* a) {
  vec16 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = SHUF(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                30, 31);
  for (int j = 0; j < 4; ++j)
    c[j] = SHUF(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUF(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                31);
  for (int j = 0; j < 2; ++j)
    d[j] = SHUF(c[2 * j], c[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUF(c[2 * j], c[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                31);
  const vec16 e = SHUF(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                  SHUF(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // The tree leaves lane l holding a[bit-reverse(l)]; bit reversal undoes itself.
  return SHUF(e, e, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// exp(x) for x <= 0, lane-wise: 2^n * p(r) with n = round(x / ln2) and
// r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6 (relative error ~2e-7).
// Below -87 (so -inf: a masked key) the result is exactly 0.
inline vec16 exp_nonpos(vec16 x) {
  const vec16 xc = x < -87.0f ? splat(-87.0f) : x;
  const vec16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vec16 n = (xc * 1.44269504088896341f + magic) - magic;
  vec16 r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vec16 p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  return x < -87.0f ? splat(0.0f) : p * (vec16)bits;
}

// c * tanh(s / c), lane-wise, through exp of a non-positive argument.
inline vec16 soft_cap(vec16 s, float c) {
  const vec16 y = s / c;
  const vec16 e = exp_nonpos(-2.0f * (y < 0.0f ? -y : y));
  const vec16 t = (1.0f - e) / (1.0f + e);
  return c * (y < 0.0f ? -t : t);
}

// D elements of a cache row as fp32, padded with zeros to Dp (a multiple of
// W): the row itself when it is fp32 with D == Dp, else converted into buf.
template <typename T>
const float* row_f32(const T* src, float* buf, int D, int Dp) {
  if constexpr (std::is_same_v<T, float>) {
    if (D == Dp) return src;
    std::memcpy(buf, src, sizeof(float) * D);
  } else {
    int d = 0;
    if (D == Dp) {
      for (; d < D; d += W) {
        const u16x16u h = *reinterpret_cast<const u16x16u*>(src + d);
        const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
        store(buf + d, (vec16)w);
      }
    }
    for (; d < D; ++d) buf[d] = static_cast<float>(src[d]);
  }
  std::fill(buf + D, buf + Dp, 0.0f);
  return buf;
}

struct Item {
  int32_t req, q_begin, q_end, head_begin, head_end;  // queries and kv heads of a request
};

struct Problem {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_stride_t, q_stride_h;
  int64_t token_stride;  // Hkv * D elements between a block's token rows
  const int32_t* query_start;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  float scale;
  int64_t window;  // 0: every earlier key
  int64_t chunk;   // 0: no chunks
  float softcap;   // 0: none
};

// The earliest key a query at position ``pos`` sees.
inline int64_t first_key(const Problem& p, int64_t pos) {
  int64_t lo = p.window ? std::max<int64_t>(0, pos - p.window + 1) : 0;
  if (p.chunk) lo = std::max<int64_t>(lo, pos / p.chunk * p.chunk);
  return lo;
}

// Per-thread scratch, sized for the largest item of the call.
struct Scratch {
  int Dp, max_rows;
  std::vector<float> q, acc, scores, row_max, row_sum, kbuf, vbuf, qt, st;
  std::vector<const float*> krow, vrow;
  std::vector<int64_t> offset, next_offset;
  std::vector<int> vis_begin, vis_end;  // keys of the tile that query i sees
  Scratch(int rows, int Dp_)
      : Dp(Dp_), max_rows(rows), q(size_t(rows) * Dp), acc(size_t(rows) * Dp),
        scores(size_t(rows) * kKeyTile), row_max(rows), row_sum(rows),
        kbuf(size_t(kKeyTile) * Dp), vbuf(size_t(kKeyTile) * Dp), krow(kKeyTile),
        vrow(kKeyTile), offset(kKeyTile), next_offset(kKeyTile), vis_begin(rows),
        vis_end(rows), qt(size_t(Dp_) * W), st(size_t(kKeyTile) * W) {}
};

// S[r][t] = q_r . k_t for rows [0, R) of one head and keys [0, n_pad).
template <int NV>
void scores_tile(const float* q, int R, int Dp, const float* const* krow, int n_pad, float* S) {
  const int nv = NV ? NV : Dp / W;
  for (int r = 0; r < R; ++r) {
    const float* qr = q + size_t(r) * Dp;
    for (int t0 = 0; t0 < n_pad; t0 += W) {
      vec16 a[W];
      for (int k = 0; k < W; ++k) {
        const float* kr = krow[t0 + k];
        vec16 s = load(qr) * load(kr);
        for (int v = 1; v < nv; ++v) s += load(qr + v * W) * load(kr + v * W);
        a[k] = s;
      }
      store(S + size_t(r) * kKeyTile + t0, reduce16(a));
    }
  }
}

// acc[r] += sum_t P[r][t] * v_t for rows [0, R) of one head and keys [0, n);
// P[r][t] sits at P[r * rs + t * ts].
template <int NV>
void pv_tile(const float* P, int R, int Dp, const float* const* vrow, int n, float* acc,
             int rs = kKeyTile, int ts = 1) {
  const int nv = NV ? NV : Dp / W;
  int r = 0;
  for (; r + 4 <= R; r += 4) {
    for (int v0 = 0; v0 < nv; v0 += 4) {
      const int cv = std::min(4, nv - v0);
      vec16 a[4][4];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < cv; ++c) a[i][c] = load(acc + size_t(r + i) * Dp + (v0 + c) * W);
      for (int t = 0; t < n; ++t) {
        const float* vr = vrow[t] + v0 * W;
        for (int i = 0; i < 4; ++i) {
          const vec16 p = splat(P[size_t(r + i) * rs + size_t(t) * ts]);
          for (int c = 0; c < cv; ++c) a[i][c] += p * load(vr + c * W);
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < cv; ++c) store(acc + size_t(r + i) * Dp + (v0 + c) * W, a[i][c]);
    }
  }
  for (; r < R; ++r) {
    float* ar = acc + size_t(r) * Dp;
    for (int v0 = 0; v0 < nv; v0 += 8) {
      const int cv = std::min(8, nv - v0);
      vec16 a[8];
      for (int c = 0; c < cv; ++c) a[c] = load(ar + (v0 + c) * W);
      for (int t = 0; t < n; ++t) {
        const vec16 p = splat(P[size_t(r) * rs + size_t(t) * ts]);
        for (int c = 0; c < cv; ++c) a[c] += p * load(vrow[t] + (v0 + c) * W);
      }
      for (int c = 0; c < cv; ++c) store(ar + (v0 + c) * W, a[c]);
    }
  }
}

// Online softmax over one key tile: scores become weights, acc is rescaled.
void softmax_tile(Scratch& s, int rows, int n_pad) {
  const int Dp = s.Dp;
  for (int r = 0; r < rows; ++r) {
    float* sc = s.scores.data() + size_t(r) * kKeyTile;
    vec16 m = load(sc);
    for (int t = W; t < n_pad; t += W) {
      const vec16 x = load(sc + t);
      m = m > x ? m : x;
    }
    const float mx = std::max(s.row_max[r], hmax(m));
    if (mx == kNegInf) {  // nothing seen yet: no weight, nothing to rescale
      std::fill(sc, sc + n_pad, 0.0f);
      continue;
    }
    const float alpha = s.row_max[r] == kNegInf ? 0.0f : std::exp(s.row_max[r] - mx);
    vec16 sum = splat(0.0f);
    for (int t = 0; t < n_pad; t += W) {
      const vec16 e = exp_nonpos(load(sc + t) - mx);
      store(sc + t, e);
      sum += e;
    }
    s.row_sum[r] = s.row_sum[r] * alpha + hsum(sum);
    s.row_max[r] = mx;
    if (alpha != 1.0f) {
      float* a = s.acc.data() + size_t(r) * Dp;
      for (int d = 0; d < Dp; d += W) store(a + d, load(a + d) * alpha);
    }
  }
}

template <typename T>
void prefetch_rows(const T* k_cache, const T* v_cache, const int64_t* offset, int n,
                   int64_t bytes) {
  for (int t = 0; t < n; ++t) {
    const char* kp = reinterpret_cast<const char*>(k_cache + offset[t]);
    const char* vp = reinterpret_cast<const char*>(v_cache + offset[t]);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(kp + b);
      __builtin_prefetch(vp + b);
    }
  }
}

// S^T[t] (lane r: q_r . k_t) for keys [0, n) of a tile: each key element is
// broadcast against a column of Q^T (qt[d * W + r]), eight keys at a time.
template <int NV>
void scores_tile_t(const float* qt, int Dp, const float* const* krow, int n, float* st) {
  const int dn = NV ? NV * W : Dp;
  int t0 = 0;
  for (; t0 + 8 <= n; t0 += 8) {
    vec16 a[8] = {};
    for (int d = 0; d < dn; ++d) {
      const vec16 qd = load(qt + size_t(d) * W);
      for (int k = 0; k < 8; ++k) a[k] += krow[t0 + k][d] * qd;
    }
    for (int k = 0; k < 8; ++k) store(st + size_t(t0 + k) * W, a[k]);
  }
  for (; t0 < n; ++t0) {
    vec16 a = {};
    for (int d = 0; d < dn; ++d) a += krow[t0][d] * load(qt + size_t(d) * W);
    store(st + size_t(t0) * W, a);
  }
}

// A prefill tile of one kv head with 8..16 rows (queries x heads of the
// group): the scores are kept transposed, one vector per key holding every
// row's score, so Q.K^T is a broadcast multiply-add per key element (no
// horizontal sums) and the online softmax runs lane-wise; P.V reads P^T.
// Lanes past the item's rows copy its last query's position and a zero
// query: they compute finite garbage that is never written out.
template <typename T, int NV>
void run_item_t(const Problem& p, const Item& it, const T* q, const T* k_cache, const T* v_cache,
                T* out, Scratch& s) {
  const int D = int(p.head_dim), Dp = s.Dp;
  const int G = int(p.num_heads / p.num_kv_heads);
  const int64_t q0 = p.query_start[it.req];
  const int64_t first_pos = p.seq_lens[it.req] - (p.query_start[it.req + 1] - q0);
  const int nq = it.q_end - it.q_begin, R = nq * G;
  const int64_t kv_end = first_pos + it.q_end;
  const int64_t kv_begin = first_key(p, first_pos + it.q_begin);
  const int32_t* table = p.block_tables + int64_t(it.req) * p.max_blocks;

  float* qt = s.qt.data();
  std::fill(qt, qt + size_t(Dp) * W, 0.0f);
  vec16 pos = {};
  for (int r = 0; r < W; ++r) pos[r] = float(first_pos + it.q_begin + std::min(r, R - 1) / G);
  for (int r = 0; r < R; ++r) {
    const T* src = q + (q0 + it.q_begin + r / G) * p.q_stride_t +
                   (it.head_begin * int64_t(G) + r % G) * p.q_stride_h;
    for (int d = 0; d < D; ++d) qt[size_t(d) * W + r] = static_cast<float>(src[d]) * p.scale;
  }
  vec16 lo;
  for (int r = 0; r < W; ++r) lo[r] = float(first_key(p, int64_t(pos[r])));
  const float min_pos = float(first_pos + it.q_begin), max_lo = lo[R - 1];
  float* acc = s.acc.data();
  std::fill(acc, acc + size_t(R) * Dp, 0.0f);
  vec16 m = splat(kNegInf), l = splat(0.0f);

  const int64_t head_off = int64_t(it.head_begin) * D;
  const int64_t row_bytes = int64_t(D) * int64_t(sizeof(T));
  int64_t block_idx = kv_begin / p.block_size, block_off = kv_begin % p.block_size;
  auto next_tile = [&](int64_t t0, int64_t* offset) {
    const int n = int(std::min<int64_t>(kKeyTile, kv_end - t0));
    for (int t = 0; t < n; ++t) {
      const int64_t slot = int64_t(table[block_idx]) * p.block_size + block_off;
      offset[t] = slot * p.token_stride + head_off;
      if (++block_off == p.block_size) block_off = 0, ++block_idx;
    }
    return n;
  };
  float* st = s.st.data();
  int n_next = next_tile(kv_begin, s.next_offset.data());
  for (int64_t t0 = kv_begin; t0 < kv_end; t0 += kKeyTile) {
    const int n = n_next;
    std::swap(s.offset, s.next_offset);
    if (t0 + kKeyTile < kv_end) {
      n_next = next_tile(t0 + kKeyTile, s.next_offset.data());
      prefetch_rows(k_cache, v_cache, s.next_offset.data(), n_next, row_bytes);
    }
    for (int t = 0; t < n; ++t)
      s.krow[t] = row_f32(k_cache + s.offset[t], s.kbuf.data() + size_t(t) * Dp, D, Dp);
    scores_tile_t<NV>(qt, Dp, s.krow.data(), n, st);
    vec16 mt = splat(kNegInf);
    const bool all_visible = float(t0 + n - 1) <= min_pos && float(t0) >= max_lo;
    for (int t = 0; t < n; ++t) {
      vec16 x = load(st + size_t(t) * W);
      if (p.softcap > 0.0f) x = soft_cap(x, p.softcap);
      if (!all_visible) {
        const float key = float(t0 + t);
        x = (key > pos) | (key < lo) ? splat(kNegInf) : x;
      }
      store(st + size_t(t) * W, x);
      mt = mt > x ? mt : x;
    }
    const vec16 mx = m > mt ? m : mt;
    const vec16 base = mx == kNegInf ? splat(0.0f) : mx;  // nothing seen yet: weights 0
    const vec16 alpha = exp_nonpos(m - base);
    vec16 sum = splat(0.0f);
    for (int t = 0; t < n; ++t) {
      const vec16 e = exp_nonpos(load(st + size_t(t) * W) - base);
      store(st + size_t(t) * W, e);
      sum += e;
    }
    l = l * alpha + sum;
    m = mx;
    for (int r = 0; r < R; ++r)
      if (alpha[r] != 1.0f) {
        float* a = acc + size_t(r) * Dp;
        for (int d = 0; d < Dp; d += W) store(a + d, load(a + d) * alpha[r]);
      }
    for (int t = 0; t < n; ++t)
      s.vrow[t] = row_f32(v_cache + s.offset[t], s.vbuf.data() + size_t(t) * Dp, D, Dp);
    pv_tile<NV>(st, R, Dp, s.vrow.data(), n, acc, 1, W);
  }

  for (int r = 0; r < R; ++r) {
    const float inv = 1.0f / l[r];
    const float* a = acc + size_t(r) * Dp;
    T* dst = out + (q0 + it.q_begin + r / G) * p.num_heads * D +
             (it.head_begin * int64_t(G) + r % G) * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d] * inv);
  }
}

template <typename T, int NV>
void run_item(const Problem& p, const Item& it, const T* q, const T* k_cache, const T* v_cache,
              T* out, Scratch& s) {
  const int D = int(p.head_dim), Dp = s.Dp;
  const int G = int(p.num_heads / p.num_kv_heads);
  const int64_t q0 = p.query_start[it.req];
  const int64_t first_pos = p.seq_lens[it.req] - (p.query_start[it.req + 1] - q0);
  const int nq = it.q_end - it.q_begin, nh = it.head_end - it.head_begin;
  const int R = nq * G;  // rows of one kv head: query i, head g of the group -> i * G + g
  if (nh == 1 && R >= 8 && R <= W) return run_item_t<T, NV>(p, it, q, k_cache, v_cache, out, s);
  const int rows = nh * R;
  const int64_t kv_end = first_pos + it.q_end;  // keys the item's last query sees
  // With a window or chunks the item's first query sees the earliest key any row does.
  const int64_t kv_begin = first_key(p, first_pos + it.q_begin);
  const int32_t* table = p.block_tables + int64_t(it.req) * p.max_blocks;

  for (int hh = 0; hh < nh; ++hh)
    for (int i = 0; i < nq; ++i)
      for (int g = 0; g < G; ++g) {
        const T* src = q + (q0 + it.q_begin + i) * p.q_stride_t +
                       ((it.head_begin + hh) * int64_t(G) + g) * p.q_stride_h;
        float* dst = s.q.data() + size_t(hh * R + i * G + g) * Dp;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * p.scale;
        std::fill(dst + D, dst + Dp, 0.0f);
      }
  std::fill(s.acc.begin(), s.acc.begin() + size_t(rows) * Dp, 0.0f);
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, kNegInf);
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.0f);

  // Token offsets (elements, at the item's first head) of key tiles, one ahead.
  const int64_t head_off = int64_t(it.head_begin) * D;
  const int64_t row_bytes = int64_t(nh) * D * int64_t(sizeof(T));
  int64_t block_idx = kv_begin / p.block_size, block_off = kv_begin % p.block_size;
  auto next_tile = [&](int64_t t0, int64_t* offset) {
    const int n = int(std::min<int64_t>(kKeyTile, kv_end - t0));
    for (int t = 0; t < n; ++t) {
      const int64_t slot = int64_t(table[block_idx]) * p.block_size + block_off;
      offset[t] = slot * p.token_stride + head_off;
      if (++block_off == p.block_size) block_off = 0, ++block_idx;
    }
    return n;
  };
  int n_next = next_tile(kv_begin, s.next_offset.data());
  for (int64_t t0 = kv_begin; t0 < kv_end; t0 += kKeyTile) {
    const int n = n_next;
    std::swap(s.offset, s.next_offset);
    if (t0 + kKeyTile < kv_end) {
      n_next = next_tile(t0 + kKeyTile, s.next_offset.data());
      prefetch_rows(k_cache, v_cache, s.next_offset.data(), n_next, row_bytes);
    }
    const int n_pad = (n + W - 1) / W * W;
    for (int i = 0; i < nq; ++i) {
      const int64_t pos = first_pos + it.q_begin + i;
      s.vis_end[i] = int(std::clamp<int64_t>(pos + 1 - t0, 0, n));
      s.vis_begin[i] = int(std::clamp<int64_t>(first_key(p, pos) - t0, 0, n));
    }

    for (int hh = 0; hh < nh; ++hh) {
      const int64_t off = int64_t(hh) * D;
      for (int t = 0; t < n; ++t)
        s.krow[t] = row_f32(k_cache + s.offset[t] + off, s.kbuf.data() + size_t(t) * Dp, D, Dp);
      for (int t = n; t < n_pad; ++t) s.krow[t] = s.krow[0];  // scored, then masked
      scores_tile<NV>(s.q.data() + size_t(hh) * R * Dp, R, Dp, s.krow.data(), n_pad,
                      s.scores.data() + size_t(hh) * R * kKeyTile);
    }
    if (p.softcap > 0.0f)
      for (int r = 0; r < rows; ++r)
        for (int t = 0; t < n_pad; t += W) {
          float* sc = s.scores.data() + size_t(r) * kKeyTile + t;
          store(sc, soft_cap(load(sc), p.softcap));
        }
    for (int hh = 0; hh < nh; ++hh)
      for (int i = 0; i < nq; ++i) {
        if (s.vis_begin[i] == 0 && s.vis_end[i] == n_pad) continue;
        for (int g = 0; g < G; ++g) {
          float* sc = s.scores.data() + size_t(hh * R + i * G + g) * kKeyTile;
          std::fill(sc, sc + s.vis_begin[i], kNegInf);
          std::fill(sc + s.vis_end[i], sc + n_pad, kNegInf);
        }
      }
    softmax_tile(s, rows, n_pad);
    for (int hh = 0; hh < nh; ++hh) {
      const int64_t off = int64_t(hh) * D;
      for (int t = 0; t < n; ++t)
        s.vrow[t] = row_f32(v_cache + s.offset[t] + off, s.vbuf.data() + size_t(t) * Dp, D, Dp);
      pv_tile<NV>(s.scores.data() + size_t(hh) * R * kKeyTile, R, Dp, s.vrow.data(), n,
                  s.acc.data() + size_t(hh) * R * Dp);
    }
  }

  for (int hh = 0; hh < nh; ++hh)
    for (int i = 0; i < nq; ++i)
      for (int g = 0; g < G; ++g) {
        const int r = hh * R + i * G + g;
        const float inv = 1.0f / s.row_sum[r];
        const float* a = s.acc.data() + size_t(r) * Dp;
        T* dst = out + (q0 + it.q_begin + i) * p.num_heads * D +
                 ((it.head_begin + hh) * int64_t(G) + g) * D;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d] * inv);
      }
}

template <typename T, int NV>
void run_all(const Problem& p, const std::vector<Item>& items, int max_rows, const at::Tensor& q,
             const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out) {
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_cache.const_data_ptr<T>();
  const T* vp = v_cache.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t n = int64_t(items.size());
  const int Dp = int((p.head_dim + W - 1) / W * W);
  // Waking the pool costs more than a few microseconds of attention saves.
  int64_t work = 0;
  for (const Item& it : items) {
    const int64_t q_len = p.query_start[it.req + 1] - p.query_start[it.req];
    work += (p.seq_lens[it.req] - q_len + it.q_end) * (it.q_end - it.q_begin) *
            (it.head_end - it.head_begin);
  }
  work *= (p.num_heads / p.num_kv_heads) * Dp;
  const int threads =
      work < kMinParallelWork ? 1 : int(std::min<int64_t>(at::get_num_threads(), n));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch(max_rows, Dp);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run_item<T, NV>(p, items[i], qp, kp, vp, op, scratch);
  }
}

template <typename T>
void dispatch_head_dim(const Problem& p, const std::vector<Item>& items, int max_rows,
                       const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out) {
  // Compile-time vector counts for the common head sizes; any other size runs
  // the same code with a run-time count (padded to a multiple of 16).
  switch (p.head_dim) {
    case 16: return run_all<T, 1>(p, items, max_rows, q, k, v, out);
    case 32: return run_all<T, 2>(p, items, max_rows, q, k, v, out);
    case 64: return run_all<T, 4>(p, items, max_rows, q, k, v, out);
    case 128: return run_all<T, 8>(p, items, max_rows, q, k, v, out);
    default: return run_all<T, 0>(p, items, max_rows, q, k, v, out);
  }
}

// Decode-like requests (few queries) take all kv heads in one item, split
// into slices only when too few requests would leave threads idle; longer
// query runs are tiled per kv head, the last (longest-context) tile first.
std::vector<Item> plan_items(const Problem& p, int64_t num_reqs, int* max_rows) {
  const int G = int(p.num_heads / p.num_kv_heads);
  const int Hkv = int(p.num_kv_heads);
  const int tile = std::max(1, kRowTarget / G);
  const int64_t want = 4 * int64_t(at::get_num_threads());
  const int slices = int(std::clamp<int64_t>((want + num_reqs - 1) / num_reqs, 1, Hkv));
  const int per_slice = (Hkv + slices - 1) / slices;
  std::vector<Item> items;
  *max_rows = 1;
  for (int32_t b = 0; b < num_reqs; ++b) {
    const int32_t q_len = p.query_start[b + 1] - p.query_start[b];
    if (q_len == 0) continue;
    if (q_len * G <= kRowTarget / 2) {
      for (int h = 0; h < Hkv; h += per_slice) {
        const int h1 = std::min(Hkv, h + per_slice);
        items.push_back({b, 0, q_len, h, h1});
        *max_rows = std::max(*max_rows, q_len * G * (h1 - h));
      }
      continue;
    }
    for (int32_t end = q_len; end > 0; end -= tile) {
      const int32_t begin = std::max(0, end - tile);
      *max_rows = std::max(*max_rows, (end - begin) * G);
      for (int h = 0; h < Hkv; ++h) items.push_back({b, begin, end, h, h + 1});
    }
  }
  return items;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_tables,
                           double scale, int64_t window, double softcap, int64_t chunk) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention_cpu: q [T, H, D], caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention_cpu: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention_cpu: q and the caches differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1,
              "paged_attention_cpu: caches must be contiguous, q's last dim too");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention_cpu: K and V caches differ");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention_cpu: metadata must be contiguous int32 CPU tensors");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) >= num_reqs,
              "paged_attention_cpu: query_start_loc [B+1], seq_lens [B], block_tables [B, n]");
  Problem p;
  p.num_heads = q.size(1);
  p.num_kv_heads = k_cache.size(2);
  p.head_dim = q.size(2);
  TORCH_CHECK(k_cache.size(3) == p.head_dim && p.num_kv_heads > 0 &&
                  p.num_heads % p.num_kv_heads == 0,
              "paged_attention_cpu: head_dim differs or Hkv does not divide H");
  p.block_size = k_cache.size(1);
  p.max_blocks = block_tables.size(1);
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.token_stride = p.num_kv_heads * p.head_dim;
  p.query_start = query_start_loc.const_data_ptr<int32_t>();
  p.seq_lens = seq_lens.const_data_ptr<int32_t>();
  p.block_tables = block_tables.const_data_ptr<int32_t>();
  p.scale = float(scale);
  TORCH_CHECK(window >= 0 && softcap >= 0.0 && chunk >= 0,
              "paged_attention_cpu: window, softcap and chunk >= 0");
  p.window = window;
  p.chunk = chunk;
  p.softcap = float(softcap);
  TORCH_CHECK(p.query_start[0] == 0 && p.query_start[num_reqs] == q.size(0),
              "paged_attention_cpu: query_start_loc does not cover q's ", q.size(0), " tokens");
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int32_t q_len = p.query_start[b + 1] - p.query_start[b];
    TORCH_CHECK(q_len >= 0 && p.seq_lens[b] >= q_len &&
                    p.seq_lens[b] <= p.max_blocks * p.block_size,
                "paged_attention_cpu: request ", b, " has ", q_len, " queries over a context of ",
                p.seq_lens[b], " (its block table holds ", p.max_blocks * p.block_size, ")");
  }
  int max_rows = 1;
  const std::vector<Item> items = plan_items(p, num_reqs, &max_rows);
  at::Tensor out = at::empty(q.sizes(), q.options());  // [T, H, D] contiguous
  if (items.empty()) return out;
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_head_dim<float>(p, items, max_rows, q, k_cache, v_cache, out); break;
    case at::kBFloat16:
      dispatch_head_dim<c10::BFloat16>(p, items, max_rows, q, k_cache, v_cache, out);
      break;
    default: TORCH_CHECK(false, "paged_attention_cpu: dtype ", q.scalar_type(), " not supported");
  }
  return out;
}

// One layer of a compiled decoder's step in one call (worker/compiled.py):
// the step's K/V written into the layer's cache at ``slot_mapping``, then
// paged_attention. Python would spend a dozen dispatches per layer on the
// views, transposes and writes. query [1, H, T, D], key / value
// [1, Hkv, T, D] (transformers' layout), kv_cache [2, num_blocks,
// block_size, Hkv, D]; returns [1, T, H, D], contiguous.
at::Tensor attend_step(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& block_tables, double scale, int64_t window,
                       double softcap, int64_t chunk) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && kv_cache.dim() == 5 &&
                  kv_cache.size(0) == 2 && query.size(0) == 1 && key.size(0) == 1,
              "attend_step: query [1, H, T, D], key/value [1, Hkv, T, D], "
              "kv_cache [2, num_blocks, block_size, Hkv, D]");
  const auto dtype = kv_cache.scalar_type();
  const at::Tensor k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const auto flat = [&](const at::Tensor& c) {
    return c.view({slots, c.size(2), c.size(3)});
  };
  flat(k_cache).index_copy_(0, slot_mapping, key.select(0, 0).transpose(0, 1).to(dtype));
  flat(v_cache).index_copy_(0, slot_mapping, value.select(0, 0).transpose(0, 1).to(dtype));
  const at::Tensor q = query.select(0, 0).transpose(0, 1).to(dtype);  // [T, H, D]
  at::Tensor out = paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                   scale, window, softcap, chunk);
  return out.to(query.scalar_type()).unsqueeze(0);
}

// A linear layer whose weight also exists reordered for oneDNN (``packed``,
// from mkldnn::_reorder_linear_weight). Up to kMaxSmallRows rows (decode
// batches): our kernel on the plain weight (small_rows_linear.cpp), so a step
// reads one copy of the weights whatever its batch size; where that kernel is
// not built (no AVX-512), MKL on the plain weight for one row and oneDNN on the
// packed one from kMinPackedRows rows. One op, so a compiled decoder calls it
// at C++ dispatch cost rather than a Python custom op's (worker/packed_linear.py).
constexpr int64_t kMinPackedRows = 2;  // worker/packed_linear.py's MIN_PACKED_ROWS
constexpr int64_t kMaxSmallRows = 4;   // worker/packed_linear.py's MAX_SMALL_ROWS

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [rows, in_features]");
  if (x.size(0) <= kMaxSmallRows) {
    at::Tensor y = tokenbudget_cpu::small_rows_linear(x, weight, bias, kMaxSmallRows);
    if (y.defined()) return y;
  }
  if (x.size(0) < kMinPackedRows || x.scalar_type() != at::kFloat)
    return at::linear(x, weight, bias);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.emplace_back(x.contiguous());
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>({std::nullopt}));
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY(tokenbudget_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_tables, float scale, int window, float softcap, "
      "int chunk=0) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor");
  m.def(
      "attend_step(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
      "float scale, int window, float softcap, int chunk) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenbudget_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("packed_linear", &packed_linear);
  m.impl("attend_step", &attend_step);
}

// The packed weight is an opaque oneDNN tensor, so dispatch may land here.
TORCH_LIBRARY_IMPL(tokenbudget_cpu, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear); }
