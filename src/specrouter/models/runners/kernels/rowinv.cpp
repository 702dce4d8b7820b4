// Row-invariant CPU kernels for the native runner (float32 and bfloat16, AVX2 + FMA).
//
// Every output element is computed by one fixed sequence of instructions that depends only on
// the shapes of the weights (and, for attention, on the query's own position), never on how
// many rows run in the same call, how they are split among threads, or what else is in the
// batch. So a position's logits are bitwise the same in a 1-token step, a k-token
// verification and a ragged multi-row batch: exact speculative decoding by construction.
//
// The linears live in their own files: linear256.cpp (AVX2, the op `linear`), linear512.cpp
// (AVX-512, `linear512`) and linearamx.cpp (AMX, `linear_amx`); `decoder_layers` below calls them.
// rope_attention: RoPE of q and k, the write of k and v into the slot cache, and for each
//   (row, head, query) its own softmax over keys [0, pos] in order, float32 throughout; with
//   `parents` (a token tree), over the prefix and the query's ancestors, in position order.
// rms_norm, silu_mul: per row, float32 inside.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>
#include <x86intrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16.h"

namespace specrouter {  // linear256.cpp, linear512.cpp, linearamx.cpp
at::Tensor linear256(const at::Tensor& x, const at::Tensor& weight, int64_t O, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual);
at::Tensor linear512(const at::Tensor& x, const at::Tensor& weight, int64_t O, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual, bool dp);
void linear256_tiles(bool bf, const float* x, int64_t N, int64_t K, const void* w, int64_t O, const void* bias,
                     const void* residual, void* y, int64_t t0, int64_t t1);
void linear512_tiles(int mode, const void* x, int64_t N, int64_t K, const void* w, int64_t O, const void* bias,
                     const void* residual, void* y, int64_t t0, int64_t t1);
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& weight, int64_t O, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual);
void linear_amx_tiles(const void* x, int64_t N, int64_t K, const void* w, int64_t O, const void* bias,
                      const void* residual, void* y, int64_t t0, int64_t t1);
void check_amx();
void amx_hold(bool on);
}

namespace {

using namespace specrouter_bf16;  // bf16, to_f, store, load8, store8 (bf16.h)

// fixed-order horizontal sum of 8 lanes: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// exp of 8 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial (Cephes
// expf's coefficients), about 1 ulp; lanes below -87.3 give 0. Fixed instructions: the same
// bits for a lane whatever the other lanes hold.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// exp of n floats in place (a tail of < 8 goes through a padded vector: the same bits)
inline void exp_n(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
  if (i < n) {
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = i; j < n; ++j) t[j - i] = v[j];
    _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
    for (int64_t j = i; j < n; ++j) v[j] = t[j - i];
  }
}

// fixed-order dot of a float32 query and a key of length D read in its own dtype (bf16 widened
// in registers, exactly): 8 lanes over the whole blocks of 8, the horizontal sum, then the last
// D % 8 elements in order (head sizes such as 12 or 20)
template <typename T>
inline float dot_q(const float* q, const T* k, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t d8 = D / 8 * 8;
  for (int64_t i = 0; i < d8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
  float s = hsum(acc);
  for (int64_t i = d8; i < D; ++i) s = std::fma(q[i], to_f(k[i]), s);
  return s;
}

// The query heads of one token that share a KV head (GQA) attend the same keys: up to GQ of them
// run side by side, so each key and value row is loaded once for all of them. Every query's
// chains are its own (one 8-lane FMA chain per key over the head dimension, one FMA chain per
// value lane over the keys in order), so its bits are those of running it alone.
constexpr int GQ = 3;

// hsum of 8 vectors at once: lane i = hsum(v[i]). The same additions of the same operands as
// hsum's (lo + hi, then lanes 0 + 2 and 1 + 3, then those two), 8 lanes at a time, so the same
// bits; 7 adds and 14 shuffles for 8 sums instead of 24 adds and 32 shuffles
inline __m256 hsum8(const __m256* v) {
  __m256 s[4];  // [lo + hi of v[i] | lo + hi of v[i + 4]]
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20), _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
  const __m256 r01 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
  const __m256 r23 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(r01, r23, 0x88), _mm256_shuffle_ps(r01, r23, 0xDD));
}

// hsum of 4 vectors at once: lane i = hsum(v[i]), hsum8's additions on 4 lanes
inline __m128 hsum4(const __m256* v) {
  __m128 s[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) s[i] = _mm_add_ps(_mm256_castps256_ps128(v[i]), _mm256_extractf128_ps(v[i], 1));
  const __m128 r01 = _mm_add_ps(_mm_shuffle_ps(s[0], s[1], 0x44), _mm_shuffle_ps(s[0], s[1], 0xEE));
  const __m128 r23 = _mm_add_ps(_mm_shuffle_ps(s[2], s[3], 0x44), _mm_shuffle_ps(s[2], s[3], 0xEE));
  return _mm_add_ps(_mm_shuffle_ps(r01, r23, 0x88), _mm_shuffle_ps(r01, r23, 0xDD));
}

// dots of G queries (D % 8 == 0) with 4 consecutive keys (float32, or bfloat16 widened in
// registers, exactly): out[g][j..j+3]. Each of the 4 G accumulators is one 8-lane FMA chain over
// the head dimension (dot_q's, without its tail), and
// the 4 G sums are reduced together (hsum8, hsum4: hsum's bits), no horizontal sum per query and
// key. A step loads the G queries' 8 lanes, then one key at a time: 12 accumulators, 3 queries
// and a key fill AVX2's 16 registers, no spill.
template <int G, typename T>
inline void dot_g4(const float* const* q, const T* k, int64_t D, float* const* out, int64_t j) {
  __m256 a[4 * G];  // query g, key c: a[4 g + c]
#pragma GCC unroll 12
  for (int i = 0; i < 4 * G; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    __m256 qi[G];
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) qi[g] = _mm256_loadu_ps(q[g] + i);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256 kc = load8(k + c * D + i);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) a[4 * g + c] = _mm256_fmadd_ps(qi[g], kc, a[4 * g + c]);
    }
  }
  if constexpr (G >= 2) {
    const __m256 r = hsum8(a);
    _mm_storeu_ps(out[0] + j, _mm256_castps256_ps128(r));
    _mm_storeu_ps(out[1] + j, _mm256_extractf128_ps(r, 1));
  }
  if constexpr (G != 2) _mm_storeu_ps(out[G - 1] + j, hsum4(a + 4 * (G - 1)));
}

// acc[g][d] = sum over j = 0..L-1, in order, of p[g][j] * values[j, d] (one FMA per j) for G
// queries over the same value rows (float32, or bfloat16 widened in registers), d in NB blocks
// of 8 from d0. A step broadcasts the G weights, then loads one block of the
// value row at a time: 12 accumulators, 3 weights and a block fit the 16 registers.
template <int G, int NB, typename T>
inline void pv_g(const float* const* p, const T* values, int64_t L, int64_t D, int64_t d0, float* const* acc) {
  __m256 a[G][NB];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) a[g][b] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const T* vj = values + j * D + d0;
    __m256 pj[G];
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) pj[g] = _mm256_set1_ps(p[g][j]);
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const __m256 v = load8(vj + 8 * b);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) a[g][b] = _mm256_fmadd_ps(pj[g], v, a[g][b]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(acc[g] + d0 + 8 * b, a[g][b]);
}

// pv_g over the whole head dimension, then the D % 8 tail in order (the same bits per query
// whatever G)
template <int G, typename T>
inline void weighted_values_g(const float* const* p, const T* values, int64_t L, int64_t D, float* const* acc) {
  const int64_t d8 = D / 8 * 8;
  int64_t d0 = 0;
  for (; d0 + 32 <= d8; d0 += 32) pv_g<G, 4, T>(p, values, L, D, d0, acc);
  for (; d0 < d8; d0 += 8) pv_g<G, 1, T>(p, values, L, D, d0, acc);
  for (int g = 0; g < G; ++g)
    for (int64_t d = d8; d < D; ++d) {  // the D % 8 tail
      float s = 0.f;
      for (int64_t j = 0; j < L; ++j) s = std::fma(p[g][j], to_f(values[j * D + d]), s);
      acc[g][d] = s;
    }
}

// weighted_values_g for one query over value rows given by pointer (a token tree's keys: the
// prefix, then the query's ancestors): the same FMAs in the same order as weighted_values_g on
// rows laid side by side, so the same bits
template <int NB>
inline void pv_blocks_rows(const float* p, const float* const* rows, int64_t L, int64_t d0, float* acc) {
  __m256 a[NB];
  for (int b = 0; b < NB; ++b) a[b] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = rows[j] + d0;
    for (int b = 0; b < NB; ++b) a[b] = _mm256_fmadd_ps(pj, load8(vj + 8 * b), a[b]);
  }
  for (int b = 0; b < NB; ++b) _mm256_storeu_ps(acc + d0 + 8 * b, a[b]);
}

inline void weighted_values_rows(const float* p, const float* const* rows, int64_t L, int64_t D, float* acc) {
  const int64_t d8 = D / 8 * 8;
  int64_t d0 = 0;
  for (; d0 + 64 <= d8; d0 += 64) pv_blocks_rows<8>(p, rows, L, d0, acc);
  for (; d0 + 32 <= d8; d0 += 32) pv_blocks_rows<4>(p, rows, L, d0, acc);
  for (; d0 < d8; d0 += 8) pv_blocks_rows<1>(p, rows, L, d0, acc);
  for (int64_t d = d8; d < D; ++d) {  // the D % 8 tail
    float a = 0.f;
    for (int64_t j = 0; j < L; ++j) a = std::fma(p[j], rows[j][d], a);
    acc[d] = a;
  }
}

template <typename T>
inline void load_f(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

// the max of p[0..n) (exact in any order); the sum of p[0..n) in a fixed order that depends on
// n only: 8 lanes over the whole blocks of 8, the fixed horizontal sum, then the tail in order
inline float max_n(const float* p, int64_t n) {
  __m256 acc = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_max_ps(_mm256_loadu_ps(p + j), acc);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  float m = _mm_cvtss_f32(s);
  for (; j < n; ++j) m = p[j] > m ? p[j] : m;
  return m;
}
inline float sum_n(const float* p, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + j));
  float s = hsum(acc);
  for (; j < n; ++j) s += p[j];
  return s;
}

// n elements -> float32, exactly (8 at a time, then the tail)
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}

constexpr int64_t ITEMS_PER_THREAD = 3;  // attention: work items per thread where the tokens allow

// RoPE of one head in float32: out = x * cos + [x2, x1] * sin_signed
inline void rope_head(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float swapped = d < h ? x[d + h] : x[d - h];
    out[d] = x[d] * cos[d] + swapped * sin[d];
  }
}

// Phase 1 (`write`, per valid token): rotate k, write k and v at the token's position of its slot.
// Phase 2 (`attend`, per work item (row, KV head, a chunk of tokens)): per valid query rotate q,
// softmax over keys [0, pos] in order, weighted sum of values in order, all float32; padding
// queries get zeros. A query's sequence of operations depends only on its position, never on
// the other queries of its work item nor on which thread runs the item. `rope_attention` runs
// the phases on at::parallel_for; `decoder_layers` on its own threads, one barrier between them.
template <typename T>
struct Attention {
  const T* qkv;  // (rows, nh + 2 nkv, D): token (b, t) at row rows[b * Tq + t] (rows null: b * Tq + t)
  int64_t B, Tq, nh, nkv, D;
  const float* cos;
  const float* sin;
  T* kc;  // (S, nkv, P, D)
  T* vc;
  int64_t P;
  const int64_t* slots;
  const int64_t* starts;
  const int64_t* nums;
  T* out;  // (rows, nh, D)
  const int64_t* depth = nullptr;  // a token tree (B * Tq): RoPE depth; path (B * Tq, Tq): node indices, root first
  const int64_t* path = nullptr;
  const int64_t* rows = nullptr;  // (B * Tq) packed row of each valid token, or null: the padded layout

  int64_t heads() const { return nh + 2 * nkv; }
  int64_t groups() const { return nh / nkv; }
  int64_t threads = 1;  // the threads that share the items
  // work items: (row b, KV head, a chunk of up to tchunk() of its tokens): per token, the `groups`
  // query heads of the KV head, GQ at a time. An item widens its bfloat16 keys and values once
  // for all its queries, so its chunk is as long as leaves about ITEMS_PER_THREAD items a thread
  // (1 row, 3 KV heads, 2 threads: 6 items, 9 tokens each at 17). No bit depends on the chunks:
  // a query's operations are the same whichever item holds it.
  int64_t tchunk() const {
    const int64_t want = ITEMS_PER_THREAD * threads, per = B * nkv;
    const int64_t chunks = std::min(Tq, std::max<int64_t>(1, (want + per - 1) / per));
    return (Tq + chunks - 1) / chunks;
  }
  int64_t chunks() const { return (Tq + tchunk() - 1) / tchunk(); }
  int64_t items() const { return B * nkv * chunks(); }
  int64_t row(int64_t i) const { return rows ? rows[i] : i; }
  int64_t max_len() const {
    int64_t m = 1;
    for (int64_t b = 0; b < B; ++b) m = std::max(m, starts[b] + nums[b]);
    return m;
  }

  // phase 1 over tokens [i0, i1) of B * Tq
  void write(int64_t i0, int64_t i1) const {
    std::vector<float> x(D), r(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Tq, t = i % Tq;
      if (t >= nums[b]) continue;
      const int64_t pos = starts[b] + (depth ? depth[i] : t);  // a tree node: RoPE at its depth
      const T* tok = qkv + row(i) * heads() * D;
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t at = ((slots[b] * nkv + h) * P + starts[b] + t) * D;  // stored at its index
        load_f(tok + (nh + h) * D, x.data(), D);
        rope_head(x.data(), cos + pos * D, sin + pos * D, D, r.data());
        for (int64_t d = 0; d < D; ++d) store(&kc[at + d], r[d]);
        std::memcpy(&vc[at], tok + (nh + nkv + h) * D, D * sizeof(T));
      }
    }
  }

  // a thread's buffers for phase 2 (sized for the longest row)
  struct Scratch {
    std::vector<float> pbuf, x, qbuf, abuf, kf, vf;  // kf, vf: an item's bfloat16 keys and values widened
    std::vector<const float*> vrows;
    float* p[GQ];
    float* q[GQ];
    float* acc[GQ];
    explicit Scratch(const Attention& a) {
      const int64_t L = a.max_len(), D = a.D;
      pbuf.resize(GQ * L), x.resize(D), qbuf.resize(GQ * D), abuf.resize(GQ * D);
      vrows.resize(a.depth ? L : 0);
      for (int g = 0; g < GQ; ++g) p[g] = &pbuf[g * L], q[g] = &qbuf[g * D], acc[g] = &abuf[g * D];
    }
  };

  // phase 2: work item `item` of items(). Keys and values as stored (float32, or bfloat16 widened in
  // registers, exactly); bfloat16 ones widened into the scratch first, once for the item, where the
  // item has two or more tokens or is a tree (whose value rows go by pointer, float32): the same
  // float32 values either way, so the same bits
  void attend(int64_t item, Scratch& s) const {
    const int64_t TCHUNK = tchunk(), chunks = this->chunks();
    const int64_t c = item % chunks, kv = (item / chunks) % nkv, b = item / (chunks * nkv);
    const int64_t t0 = c * TCHUNK, t1 = std::min(Tq, t0 + TCHUNK);
    const int64_t Lc = std::min(t1, nums[b]) > t0 ? starts[b] + std::min(t1, nums[b]) : 0;  // keys [0, Lc)
    const int64_t base = (slots[b] * nkv + kv) * P * D;
    const T* keys = kc + base;
    const T* values = vc + base;
    if constexpr (sizeof(T) == 2) {
      if (depth || std::min(t1, nums[b]) - t0 >= 2) {
        if (static_cast<int64_t>(s.kf.size()) < Lc * D) s.kf.resize(Lc * D), s.vf.resize(Lc * D);
        widen(keys, s.kf.data(), Lc * D);
        widen(values, s.vf.data(), Lc * D);
        tokens<float>(b, kv, t0, t1, s.kf.data(), s.vf.data(), s);
        return;
      }
    }
    tokens<T>(b, kv, t0, t1, keys, values, s);
  }

  // tokens [t0, t1) of row b, KV head kv: keys and values (P, D) of element type K
  template <typename K>
  void tokens(int64_t b, int64_t kv, int64_t t0, int64_t t1, const K* keys, const K* values, Scratch& s) const {
    const int64_t H = heads(), groups = this->groups();
    float* const* p = s.p;
    float* const* q = s.q;
    float* const* acc = s.acc;
    const float* fvalues = reinterpret_cast<const float*>(values);  // a tree's (float32 here)
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = b * Tq + t;
      if (t >= nums[b]) {
        if (rows) continue;  // packed: a padding token has no output row
        for (int64_t g = 0; g < groups; ++g) {
          T* o = out + (i * nh + kv * groups + g) * D;
          for (int64_t d = 0; d < D; ++d) store(&o[d], 0.f);
        }
        continue;
      }
      const int64_t pos = starts[b] + (depth ? depth[i] : t), L = pos + 1;
      // keys in position order: [0, start) of the cache, then (a tree) the query's ancestors
      // and itself, stored at start + their node index; a chain: start + t for depth t
      const int64_t Lk = depth ? starts[b] : L;  // keys read side by side
      const int64_t* anc = depth ? path + i * Tq : nullptr;  // node indices, root first
      for (int64_t g0 = 0; g0 < groups; g0 += GQ) {
        const int G = static_cast<int>(std::min<int64_t>(GQ, groups - g0));
        for (int g = 0; g < G; ++g) {
          load_f(qkv + (row(i) * H + kv * groups + g0 + g) * D, s.x.data(), D);
          rope_head(s.x.data(), cos + pos * D, sin + pos * D, D, q[g]);
        }
        int64_t j = 0;
        if (D % 8 == 0)
          for (; j + 4 <= Lk; j += 4) {
            if (G == 3) dot_g4<3>(q, keys + j * D, D, p, j);
            else if (G == 2) dot_g4<2>(q, keys + j * D, D, p, j);
            else dot_g4<1>(q, keys + j * D, D, p, j);
          }
        for (int g = 0; g < G; ++g) {
          int64_t k = j;
          for (; k < Lk; ++k) p[g][k] = dot_q(q[g], keys + k * D, D);
          for (; k < L; ++k) p[g][k] = dot_q(q[g], keys + (starts[b] + anc[k - Lk]) * D, D);
        }
        float inv[GQ];
        for (int g = 0; g < G; ++g) {
          const float m = max_n(p[g], L);
          for (int64_t k = 0; k < L; ++k) p[g][k] -= m;
          exp_n(p[g], L);
          inv[g] = 1.f / sum_n(p[g], L);
        }
        if (depth) {  // (K is float32 for a tree: attend widened its bfloat16 values)
          for (j = 0; j < Lk; ++j) s.vrows[j] = fvalues + j * D;
          for (; j < L; ++j) s.vrows[j] = fvalues + (starts[b] + anc[j - Lk]) * D;
          for (int g = 0; g < G; ++g) weighted_values_rows(p[g], s.vrows.data(), L, D, acc[g]);
        } else if (G == 3) {
          weighted_values_g<3>(p, values, L, D, acc);
        } else if (G == 2) {
          weighted_values_g<2>(p, values, L, D, acc);
        } else {
          weighted_values_g<1>(p, values, L, D, acc);
        }
        for (int g = 0; g < G; ++g) {
          T* o = out + (row(i) * nh + kv * groups + g0 + g) * D;
          for (int64_t d = 0; d < D; ++d) store(&o[d], acc[g][d] * inv[g]);
        }
      }
    }
  }

  void run() {  // both phases on at::parallel_for
    threads = at::get_num_threads();
    at::parallel_for(0, B * Tq, 16, [&](int64_t i0, int64_t i1) { write(i0, i1); });
    at::parallel_for(0, items(), 1, [&](int64_t i0, int64_t i1) {
      Scratch s(*this);
      for (int64_t item = i0; item < i1; ++item) attend(item, s);
    });
  }
};

// a token tree: parents (B, T) int64, each valid token's parent among the row's new tokens
// (< its own index), -1 for a child of the cached prefix -> depth (B * T) and path (B * T, T).
// Node t sits at RoPE position start + depth(t) and attends [0, start) plus its ancestors and
// itself in depth order: the keys, positions and order of sequential decoding of its path (a
// chain: parents t - 1)
void tree_paths(const at::Tensor& parents, int64_t B, int64_t Tq, const int64_t* nums, std::vector<int64_t>& depth,
                std::vector<int64_t>& path) {
  auto pa = parents.to(at::kLong).contiguous();
  TORCH_CHECK(pa.dim() == 2 && pa.size(0) == B && pa.size(1) == Tq, "parents: (B, T)");
  const int64_t* pp = pa.data_ptr<int64_t>();
  depth.assign(B * Tq, 0), path.assign(B * Tq * Tq, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < nums[b]; ++t) {
      const int64_t i = b * Tq + t, par = pp[i];
      TORCH_CHECK(par >= -1 && par < t, "row ", b, " token ", t, ": parent ", par, " is not an earlier token");
      depth[i] = par < 0 ? 0 : depth[b * Tq + par] + 1;
      if (par >= 0) std::memcpy(&path[i * Tq], &path[(b * Tq + par) * Tq], depth[i] * sizeof(int64_t));
      path[i * Tq + depth[i]] = t;
    }
}

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// qkv (B, T, nh + 2 nkv, D) from the qkv projection (q already scaled by 1/sqrt(D)); cos /
// sin_signed (P', D) float32 tables; k_cache / v_cache (S, nkv, P, D), written in place at each
// valid token's position; slots / starts / nums (B,) int64 -> attention output (B, T, nh, D).
// Query t of row b sits at position starts[b] + t and attends keys [0, starts[b] + t] of slot
// slots[b]; tokens t >= nums[b] are padding: not written, zero output.
// the checked inputs of attention beside qkv: slots / starts / nums as int64, a tree's depth and path
struct AttentionInputs {
  at::Tensor sl, st, nu;
  std::vector<int64_t> depth, path;
  const int64_t* slots() const { return sl.data_ptr<int64_t>(); }
  const int64_t* starts() const { return st.data_ptr<int64_t>(); }
  const int64_t* nums() const { return nu.data_ptr<int64_t>(); }
  template <typename T>
  Attention<T> bind(const T* qkv, int64_t B, int64_t Tq, int64_t nh, int64_t D, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, T* out) const {
    return Attention<T>{qkv, B, Tq, nh, k_cache.size(1), D, cos.data_ptr<float>(), sin.data_ptr<float>(),
                        ptr<T>(k_cache), ptr<T>(v_cache), k_cache.size(2), slots(), starts(), nums(), out,
                        depth.empty() ? nullptr : depth.data(), path.empty() ? nullptr : path.data()};
  }
};

// checks the caches, tables and rows of an attention of (B, Tq) tokens, nh query heads of size D
AttentionInputs attention_inputs(at::ScalarType dt, int64_t B, int64_t Tq, int64_t nh, int64_t heads, int64_t D,
                                 const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& starts,
                                 const at::Tensor& nums, const std::optional<at::Tensor>& parents) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "the caches are (S, nkv, P, D)");
  TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt, "caches: dtype of qkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(), "cos / sin: contiguous float32 tables");
  const int64_t nkv = k_cache.size(1), P = k_cache.size(2);
  TORCH_CHECK(heads == nh + 2 * nkv && k_cache.size(3) == D && nh % nkv == 0 && D % 2 == 0,
              "head counts / sizes do not match (", heads, " heads of qkv, ", nh, " query heads, cache ",
              k_cache.sizes(), ")");
  TORCH_CHECK(cos.size(1) == D && sin.sizes() == cos.sizes(), "cos / sin: (positions, D)");
  AttentionInputs in{slots.to(at::kLong).contiguous(), starts.to(at::kLong).contiguous(),
                     nums.to(at::kLong).contiguous(), {}, {}};
  TORCH_CHECK(in.sl.numel() == B && in.st.numel() == B && in.nu.numel() == B, "slots/starts/nums: (B,)");
  const int64_t* sp = in.slots();
  const int64_t* tp = in.starts();
  const int64_t* np = in.nums();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < k_cache.size(0), "slot ", sp[b], " out of range");
    TORCH_CHECK(np[b] >= 0 && np[b] <= Tq && tp[b] >= 0 && tp[b] + np[b] <= std::min(P, cos.size(0)),
                "row ", b, " reaches past the cache");
  }
  if (parents.has_value() && parents->defined()) tree_paths(*parents, B, Tq, np, in.depth, in.path);
  return in;
}

at::Tensor rope_attention(const at::Tensor& qkv, int64_t num_heads, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& nums,
                          const std::optional<at::Tensor>& parents) {
  TORCH_CHECK(qkv.dim() == 4, "qkv is (B, T, heads, D)");
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rope_attention: float32 or bfloat16, got ", dt);
  const int64_t B = qkv.size(0), Tq = qkv.size(1), D = qkv.size(3), nh = num_heads;
  const AttentionInputs in = attention_inputs(dt, B, Tq, nh, qkv.size(2), D, cos, sin, k_cache, v_cache, slots,
                                              starts, nums, parents);
  at::Tensor x = qkv.contiguous();
  at::Tensor out = at::empty({B, Tq, nh, D}, qkv.options());
  if (dt == at::kFloat)
    in.bind<float>(ptr<float>(x), B, Tq, nh, D, cos, sin, k_cache, v_cache, ptr<float>(out)).run();
  else
    in.bind<bf16>(ptr<bf16>(x), B, Tq, nh, D, cos, sin, k_cache, v_cache, ptr<bf16>(out)).run();
  return out;
}

// RMSNorm of each row: x * (1 / sqrt(mean(x^2) + eps)) * w, the sum of squares in float32 in a
// fixed order. float32: (x * inv) * w. bfloat16 follows transformers: x * inv rounded to
// bfloat16, then times the bfloat16 weight, rounded again.
// rows [n0, n1); xf: H floats of scratch
template <typename T>
void rms_norm_rows(const T* x, const T* w, int64_t n0, int64_t n1, int64_t H, float eps, T* y, float* xf) {
    for (int64_t n = n0; n < n1; ++n) {
      widen(x + n * H, xf, H);
      __m256 acc = _mm256_setzero_ps();
      const int64_t h8 = H / 8 * 8;
      for (int64_t i = 0; i < h8; i += 8) {
        const __m256 v = _mm256_loadu_ps(&xf[i]);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float ss = hsum(acc);
      for (int64_t i = h8; i < H; ++i) ss += xf[i] * xf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      const __m256 vinv = _mm256_set1_ps(inv);
      int64_t i = 0;
      for (; i < h8; i += 8) {  // 8 at a time, the ops of the scalar loop below
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(&xf[i]), vinv);
        if constexpr (sizeof(T) == 2) t = _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(t), 16));
        store8(&y[n * H + i], _mm256_mul_ps(t, load8(w + i)));
      }
      for (; i < H; ++i) {
        float t = xf[i] * inv;
        if constexpr (sizeof(T) == 2) {
          T r;
          store(&r, t);
          t = to_f(r);
        }
        store(&y[n * H + i], t * to_f(w[i]));
      }
    }
}

template <typename T>
void rms_norm_impl(const T* x, const T* w, int64_t N, int64_t H, float eps, T* y) {
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    std::vector<float> xf(H);
    rms_norm_rows<T>(x, w, n0, n1, H, eps, y, xf.data());
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_2d(x, "x");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rms_norm: float32 or bfloat16, got ", dt);
  TORCH_CHECK(weight.scalar_type() == dt && weight.numel() == x.size(1), "weight: (H,), dtype of x");
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  if (dt == at::kFloat)
    rms_norm_impl<float>(ptr<float>(xc), ptr<float>(wc), x.size(0), x.size(1), eps, ptr<float>(y));
  else
    rms_norm_impl<bf16>(ptr<bf16>(xc), ptr<bf16>(wc), x.size(0), x.size(1), eps, ptr<bf16>(y));
  return y;
}

// gu (N, 2I) = [gate | up] -> silu(gate) * up (N, I), float32 inside, one rounding
// rows [n0, n1), columns [c0, c1) of I: 8 at a time, then the tail through the same ops (exp8 is
// lane-independent): an element's bits do not depend on the columns computed beside it
template <typename T>
void silu_cols(const T* gu, int64_t n0, int64_t n1, int64_t I, int64_t c0, int64_t c1, T* y) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = gu + n * 2 * I;
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8) {  // 8 at a time, the ops of the tail below
      const __m256 gate = load8(row + i);
      const __m256 e = exp8(_mm256_xor_ps(gate, sign));  // exp(-gate)
      store8(&y[n * I + i], _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(one, e)), load8(row + I + i)));
    }
    float g[8];
    const int64_t i8 = i;
    for (; i < c1; ++i) g[i - i8] = -to_f(row[i]);
    exp_n(g, c1 - i8);  // exp(-gate) of the tail
    for (i = i8; i < c1; ++i) store(&y[n * I + i], to_f(row[i]) / (1.f + g[i - i8]) * to_f(row[I + i]));
  }
}

template <typename T>
void silu_mul_impl(const T* gu, int64_t N, int64_t I, T* y) {
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) { silu_cols<T>(gu, n0, n1, I, 0, I, y); });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_2d(gu, "gu");
  const auto dt = gu.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "silu_mul: float32 or bfloat16, got ", dt);
  TORCH_CHECK(gu.size(1) % 2 == 0, "gu: (N, 2I)");
  at::Tensor x = gu.contiguous();
  const int64_t N = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({N, I}, x.options());
  if (dt == at::kFloat)
    silu_mul_impl<float>(ptr<float>(x), N, I, ptr<float>(y));
  else
    silu_mul_impl<bf16>(ptr<bf16>(x), N, I, ptr<bf16>(y));
  return y;
}

// How `decoder_layers` shares its work items (tiles of outputs, attention items) among its
// threads: 0 static (contiguous ranges, as at::parallel_for splits; the default), 1 dynamic (a
// thread takes the next `chunk` items when done), 2 guided; -1 runs each op in its own
// at::parallel_for (the per-op form, for comparison). Bits never depend on it: each output's
// sequence of instructions is fixed whichever thread runs it. Measured on a 2-core Zen 4
// (docs/kernels.md): dynamic 20-30% slower at every token count, quiet or beside a busy process;
// guided and a static split with stealing at the end no better than static. Every phase ends at
// a barrier, so a preempted thread stalls the step however the items are shared.
int g_schedule = 0, g_chunk = 1;
constexpr int64_t SPLIT_NORM = 4;  // decoder_layers: from this many rows its threads split a norm's rows

// stack_profile: per thread and phase (0 norm, 1 qkv, 2 RoPE + cache writes, 3 attention, 4 o,
// 5 norm, 6 gate|up + silu, 7 down) the TSC cycles of work and of waiting at the phase's barrier
constexpr int PHASES = 8, MAX_PROF_THREADS = 64;
bool g_profile = false;
std::vector<double> g_prof(MAX_PROF_THREADS * PHASES * 2, 0.0);

at::Tensor stack_profile(bool on) {
  at::Tensor t = at::tensor(g_prof, at::kDouble).view({MAX_PROF_THREADS, PHASES, 2});
  std::fill(g_prof.begin(), g_prof.end(), 0.0);
  g_profile = on;
  return t;
}

void set_stack_schedule(const std::string& kind, int64_t chunk) {
  TORCH_CHECK(chunk >= 1, "set_stack_schedule: chunk >= 1");
  if (kind == "static") g_schedule = 0;
  else if (kind == "dynamic") g_schedule = 1;
  else if (kind == "guided") g_schedule = 2;
  else if (kind == "ops") g_schedule = -1;
  else TORCH_CHECK(false, "set_stack_schedule: static, dynamic, guided or ops, got ", kind);
  g_chunk = static_cast<int>(chunk);
}

// the work items [0, U) of one phase of decoder_layers among the region's threads, by g_schedule:
// 0 static (thread tid takes [U tid / n, U (tid + 1) / n): contiguous weight streams), else
// OpenMP's schedule(runtime). No barrier at the end (the caller's).
template <typename F>
void share(int64_t U, int tid, int nth, F&& body) {
  if (g_schedule == 0) {
    for (int64_t u = U * tid / nth; u < U * (tid + 1) / nth; ++u) body(u);
    return;
  }
#pragma omp for schedule(runtime) nowait
  for (int64_t u = 0; u < U; ++u) body(u);
}

// The per-op form of decoder_layers: each op its own at::parallel_for (its own fork and join).
at::Tensor decoder_layers_ops(const at::Tensor& x0, at::TensorList params, at::IntArrayRef outs, int64_t kernel,
                              at::TensorList k_caches, at::TensorList v_caches, int64_t B, int64_t T, int64_t nh,
                              int64_t D, double eps, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& nums,
                              const std::optional<at::Tensor>& valid, const std::optional<at::Tensor>& parents) {
  constexpr int64_t P = 10;
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const bool packed = valid.has_value() && valid->defined();
  auto lin = [&](const at::Tensor& in, int64_t l, int64_t i, const std::optional<at::Tensor>& res) {
    const at::Tensor& b = params[l * P + (i == 0 ? 2 : i == 1 ? 4 : i == 2 ? 7 : 9)];
    const at::Tensor& w = params[l * P + (i == 0 ? 1 : i == 1 ? 3 : i == 2 ? 6 : 8)];
    const std::optional<at::Tensor> bias = b.numel() ? std::optional<at::Tensor>(b) : std::nullopt;
    const int64_t O = outs[4 * l + i];
    if (kernel == 3) return specrouter::linear_amx(in, w, O, bias, res);
    return kernel == 0 ? specrouter::linear256(in, w, O, bias, res) : specrouter::linear512(in, w, O, bias, res, kernel == 2);
  };
  at::Tensor x = x0;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor qkv = lin(rms_norm(x, params[l * P], eps), l, 0, std::nullopt);  // (N, (nh + 2 nkv) D)
    if (packed) qkv = at::zeros({B * T, qkv.size(1)}, qkv.options()).index_copy_(0, *valid, qkv);
    at::Tensor o = rope_attention(qkv.view({B, T, -1, D}), nh, cos, sin, k_caches[l], v_caches[l], slots, starts, nums,
                                  parents)
                       .view({B * T, nh * D});
    if (packed) o = o.index_select(0, *valid);
    x = lin(o, l, 1, x);
    x = lin(silu_mul(lin(rms_norm(x, params[l * P + 5], eps), l, 2, std::nullopt)), l, 3, x);
  }
  return x;
}

// one linear of decoder_layers: raw pointers, checked once before the threads start
struct StackLinear {
  const void* w;
  const void* bias;  // or null
  int64_t K, O;
};

// The whole decoder stack in one call (runners/llama.py `_hidden_native` without the Python
// between the ops): per layer the ops above in the order the Python loop runs them, the same
// kernels on the same inputs, so the same bits. x (N, H): the valid tokens (all B*T of them, or
// packed: `valid` (N,) their flat indices into B*T). `params`: per layer ln1, w_qkv, b_qkv, w_o,
// b_o, ln2, w_gu, b_gu, w_down, b_down (a bias of 0 elements: none); `outs`: per layer the 4
// linears' output widths; `kernel`: 0 the AVX2 linear, 1 linear512 on FMAs, 2 on vdpbf16ps,
// 3 linear_amx (AMX tiles, bfloat16 only).
//
// One OpenMP parallel region runs the whole stack (the per-op form forked and joined ~8 times a
// layer, and the threads waited while one of them did the host work between ops). Per layer:
// every thread computes the RMSNorm of every row itself (a few microseconds; no barrier before
// the linear), the qkv tiles shared out | RoPE + cache writes | attention items | the o tiles,
// adding the residual in place | the norm again, then gate and up tiles paired (gate tile j and
// up tile j, then silu * up of their columns: no pass of its own) | the down tiles, adding the
// residual in place; "|" is a barrier. Packed rows reach attention through a row map instead of
// a scatter into (B * T) and a gather back.
at::Tensor decoder_layers(const at::Tensor& x0, at::TensorList params, at::IntArrayRef outs, int64_t kernel,
                          at::TensorList k_caches, at::TensorList v_caches, int64_t B, int64_t T, int64_t nh,
                          int64_t D, double eps, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& nums,
                          const std::optional<at::Tensor>& valid, const std::optional<at::Tensor>& parents) {
  constexpr int64_t P = 10;
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == P * layers && static_cast<int64_t>(outs.size()) == 4 * layers &&
                  static_cast<int64_t>(v_caches.size()) == layers && kernel >= 0 && kernel <= 3,
              "decoder_layers: ", P, " params and 4 widths per layer, one K and one V cache per layer");
  if (g_schedule < 0 || layers == 0)
    return decoder_layers_ops(x0, params, outs, kernel, k_caches, v_caches, B, T, nh, D, eps, cos, sin, slots,
                              starts, nums, valid, parents);
  check_2d(x0, "x");
  const auto dt = x0.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "decoder_layers: float32 or bfloat16, got ", dt);
  TORCH_CHECK(kernel < 2 || dt == at::kBFloat16, "decoder_layers: vdpbf16ps and AMX take bfloat16");
  if (kernel == 3) specrouter::check_amx();  // no tile instruction without the tile data state (SIGILL)
  const int64_t N = x0.size(0), H = x0.size(1), nkv = k_caches[0].size(1), heads = nh + 2 * nkv;
  const int64_t TILE = kernel == 0 ? 16 : 32;               // linear256 / linear512 tiles of outputs
  const int64_t UNIT = kernel == 0 ? 8 : 1;                 // tiles a work item (linear256 groups 8)
  const int64_t O_qkv = heads * D, I = outs[2] / 2;
  TORCH_CHECK(nh > 0 && nkv > 0 && outs[2] % 2 == 0, "decoder_layers: head counts / gate|up width");
  // the linears: (l, i) -> weights; every layer has the widths of layer 0
  std::vector<StackLinear> lins(4 * layers);
  const int64_t Ks[4] = {H, nh * D, H, I}, Os[4] = {O_qkv, H, 2 * I, H};
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t i = 0; i < 4; ++i) {
      const at::Tensor& w = params[l * P + (i == 0 ? 1 : i == 1 ? 3 : i == 2 ? 6 : 8)];
      const at::Tensor& b = params[l * P + (i == 0 ? 2 : i == 1 ? 4 : i == 2 ? 7 : 9)];
      const int64_t O = outs[4 * l + i], K = Ks[i], tiles = (O + TILE - 1) / TILE;
      TORCH_CHECK(O == Os[i], "decoder_layers: layer ", l, " linear ", i, " has ", O, " outputs, expected ", Os[i]);
      TORCH_CHECK(w.scalar_type() == dt && w.is_contiguous() && w.numel() == tiles * K * TILE && w.size(0) == tiles &&
                      (dt == at::kFloat || K % 2 == 0),
                  "decoder_layers: layer ", l, " linear ", i, ": weight not packed (tile ", TILE, ") for K=", K,
                  " and O=", O);
      TORCH_CHECK(b.numel() == 0 || (b.scalar_type() == dt && b.is_contiguous() && b.numel() == O),
                  "decoder_layers: layer ", l, " linear ", i, ": bias (", O, ",) of the dtype of x");
      lins[4 * l + i] = {w.data_ptr(), b.numel() ? b.data_ptr() : nullptr, K, O};
    }
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t i : {0, 5}) {
      const at::Tensor& ln = params[l * P + i];
      TORCH_CHECK(ln.scalar_type() == dt && ln.is_contiguous() && ln.numel() == H, "decoder_layers: norm weight (H,)");
    }
  std::vector<AttentionInputs> ins;  // layer 0's rows, trees; then every layer's caches checked
  ins.push_back(attention_inputs(dt, B, T, nh, heads, D, cos, sin, k_caches[0], v_caches[0], slots, starts, nums,
                                 parents));
  for (int64_t l = 1; l < layers; ++l)
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes() &&
                    k_caches[l].scalar_type() == dt && v_caches[l].scalar_type() == dt &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous(),
                "decoder_layers: every layer's caches like layer 0's");
  const AttentionInputs& in = ins[0];
  // packed rows: valid must be the flat indices of the tokens t < nums[b], in order
  std::vector<int64_t> rowmap;
  if (valid.has_value() && valid->defined()) {
    auto v = valid->to(at::kLong).contiguous();
    const int64_t* vp = v.data_ptr<int64_t>();
    int64_t count = 0;
    for (int64_t b = 0; b < B; ++b) count += in.nums()[b];
    TORCH_CHECK(v.numel() == N && count == N, "decoder_layers: valid (N,) indexes the N valid tokens");
    rowmap.assign(B * T, -1);
    for (int64_t j = 0; j < N; ++j) {
      TORCH_CHECK(vp[j] >= 0 && vp[j] < B * T && (j == 0 || vp[j] > vp[j - 1]) && vp[j] % T < in.nums()[vp[j] / T],
                  "decoder_layers: valid holds the flat indices of the valid tokens, in order");
      rowmap[vp[j]] = j;
    }
  } else {
    TORCH_CHECK(N == B * T, "decoder_layers: x has ", N, " rows, B * T = ", B * T);
  }
  at::Tensor x = x0.contiguous().clone();  // updated in place: the o and down linears add their residual
  const auto opt = x.options();
  at::Tensor qkv = at::empty({N, O_qkv}, opt), att = at::empty({N, nh * D}, opt), gu = at::empty({N, 2 * I}, opt),
             act = at::empty({N, I}, opt);
  const int nt = std::max(1, std::min(MAX_PROF_THREADS, at::get_num_threads()));
  const bool widen_in = kernel < 2 && dt == at::kBFloat16;  // float32 activations for the FMA kernels
  const int64_t Kmax = std::max({H, nh * D, I});
  at::Tensor normed = at::empty({nt + 1, N, H}, opt);  // per thread, then the shared one
  at::Tensor wide_norm = at::empty({widen_in ? N : 0, H}, opt.dtype(at::kFloat));
  at::Tensor wide = at::empty({widen_in ? nt : 0, N, Kmax}, opt.dtype(at::kFloat));
  const bool fused_silu = I % TILE == 0;  // gate tile j and up tile j side by side
  const int64_t esize = x.element_size();
  char* xp = static_cast<char*>(x.data_ptr());
  char* qkvp = static_cast<char*>(qkv.data_ptr());
  char* attp = static_cast<char*>(att.data_ptr());
  char* gup = static_cast<char*>(gu.data_ptr());
  char* actp = static_cast<char*>(act.data_ptr());
  const float feps = static_cast<float>(eps);

  omp_sched_t saved_kind;
  int saved_chunk;
  omp_get_schedule(&saved_kind, &saved_chunk);
  omp_set_schedule(g_schedule == 1 ? omp_sched_dynamic : g_schedule == 2 ? omp_sched_guided : omp_sched_static,
                   g_schedule > 0 ? g_chunk : 0);
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    const int nth = omp_get_num_threads();
    std::vector<float> xf(H);
    char* nb = static_cast<char*>(normed.data_ptr()) + tid * N * H * esize;
    float* wb = widen_in ? wide.data_ptr<float>() + tid * N * Kmax : nullptr;
    // the input of a linear as its kernel takes it: bfloat16 widened (exactly) for the FMA kernels
    auto input = [&](const char* src, int64_t K) -> const void* {
      if (!widen_in) return src;
      widen(reinterpret_cast<const bf16*>(src), wb, N * K);
      return wb;
    };
    // tiles [t0, t1) of linear (l, i): input xin (N, K), residual and output y (N, O)
    auto tiles = [&](int64_t l, int64_t i, const void* xin, const void* res, char* y, int64_t t0, int64_t t1) {
      const StackLinear& s = lins[4 * l + i];
      if (kernel == 3)
        specrouter::linear_amx_tiles(xin, N, s.K, s.w, s.O, s.bias, res, y, t0, t1);
      else if (kernel == 0)
        specrouter::linear256_tiles(dt == at::kBFloat16, static_cast<const float*>(xin), N, s.K, s.w, s.O, s.bias, res,
                                    y, t0, t1);
      else
        specrouter::linear512_tiles(kernel == 2 ? 2 : dt == at::kBFloat16 ? 1 : 0, xin, N, s.K, s.w, s.O, s.bias, res,
                                    y, t0, t1);
    };
    // the tiles of a linear of O outputs among the threads, f(t0, t1) per share: the static
    // schedule gives each thread one contiguous range balanced to a tile, in one call (linear256
    // and linear_amx group tiles side by side within a call: units of 8 left one thread 20 of
    // the 36 tiles of the o and down linears at 576 outputs, the other 16; one AMX tile per call
    // never paired two weight streams, session 15); the others units of UNIT tiles by `share`
    auto share_tiles = [&](int64_t O, auto&& f) {
      const int64_t T = (O + TILE - 1) / TILE;
      if (g_schedule == 0) {
        const int64_t t0 = T * tid / nth, t1 = T * (tid + 1) / nth;
        if (t1 > t0) f(t0, t1);
        return;
      }
      share((T + UNIT - 1) / UNIT, tid, nth, [&](int64_t u) { f(u * UNIT, std::min(T, u * UNIT + UNIT)); });
    };
    // per-thread timers (stack_profile): cycles of work and of waiting at the barrier per phase
    uint64_t last = g_profile ? __rdtsc() : 0;
    auto mark = [&](int phase) {
      if (!g_profile) return;
      const uint64_t now = __rdtsc();
      g_prof[(tid * PHASES + phase) * 2] += static_cast<double>(now - last);
      last = now;
    };
    auto sync = [&](int phase) {
      mark(phase);
#pragma omp barrier
      if (!g_profile) return;
      const uint64_t now = __rdtsc();
      g_prof[(tid * PHASES + phase) * 2 + 1] += static_cast<double>(now - last);
      last = now;
    };
    // RMSNorm of x with norm weight i of layer l, as the next linear takes it: each thread its share
    // of the rows into the shared buffers, then a barrier; a few rows: every thread all of them
    // into its own buffers (no barrier)
    auto norm = [&](int64_t l, int64_t i) -> const void* {
      const bool split = N >= SPLIT_NORM && nth > 1;
      const int64_t n0 = split ? N * tid / nth : 0, n1 = split ? N * (tid + 1) / nth : N;
      char* y = split ? static_cast<char*>(normed.data_ptr()) + nt * N * H * esize : nb;
      if (dt == at::kFloat)
        rms_norm_rows<float>(reinterpret_cast<const float*>(xp), params[l * P + i].data_ptr<float>(), n0, n1, H,
                             feps, reinterpret_cast<float*>(y), xf.data());
      else
        rms_norm_rows<bf16>(reinterpret_cast<const bf16*>(xp), ptr<bf16>(params[l * P + i]), n0, n1, H, feps,
                            reinterpret_cast<bf16*>(y), xf.data());
      float* wy = widen_in ? (split ? wide_norm.data_ptr<float>() : wb) : nullptr;
      if (wy) widen(reinterpret_cast<const bf16*>(y) + n0 * H, wy + n0 * H, (n1 - n0) * H);
      if (split) sync(i == 0 ? 0 : 5);
      else mark(i == 0 ? 0 : 5);
      return wy ? static_cast<const void*>(wy) : y;
    };
    typename Attention<float>::Scratch* sf = nullptr;
    typename Attention<bf16>::Scratch* sb = nullptr;
    if (kernel == 3) specrouter::amx_hold(true);  // one tile configuration per thread for the region
    for (int64_t l = 0; l < layers; ++l) {
      // RMSNorm, the qkv tiles
      const void* xin = norm(l, 0);
      share_tiles(O_qkv, [&](int64_t t0, int64_t t1) { tiles(l, 0, xin, nullptr, qkvp, t0, t1); });
      sync(1);
      // RoPE and the cache writes, then attention
      // E: the cache's element type (float or bf16); s: this thread's scratch for it, made on the first layer
      auto attend = [&](auto*& s, auto* e_tag) {
        using E = std::remove_pointer_t<decltype(e_tag)>;
        using Scratch = std::remove_pointer_t<std::remove_reference_t<decltype(s)>>;
        Attention<E> a = in.bind<E>(reinterpret_cast<const E*>(qkvp), B, T, nh, D, cos, sin, k_caches[l], v_caches[l],
                                    reinterpret_cast<E*>(attp));
        a.rows = rowmap.empty() ? nullptr : rowmap.data();
        a.threads = nth;
        a.write(B * T * tid / nth, B * T * (tid + 1) / nth);
        sync(2);
        if (!s) s = new Scratch(a);
        share(a.items(), tid, nth, [&](int64_t item) { a.attend(item, *s); });
        sync(3);
      };
      if (dt == at::kFloat)
        attend(sf, static_cast<float*>(nullptr));
      else
        attend(sb, static_cast<bf16*>(nullptr));
      // the o tiles, + the residual in place
      xin = input(attp, nh * D);
      share_tiles(H, [&](int64_t t0, int64_t t1) { tiles(l, 1, xin, xp, xp, t0, t1); });
      sync(4);
      // RMSNorm, gate | up, silu * up
      xin = norm(l, 5);
      if (fused_silu) {
        share_tiles(I, [&](int64_t t0, int64_t t1) {
          tiles(l, 2, xin, nullptr, gup, t0, t1);                          // gate
          tiles(l, 2, xin, nullptr, gup, t0 + I / TILE, t1 + I / TILE);    // up
          const int64_t c0 = t0 * TILE, c1 = std::min(I, t1 * TILE);
          if (dt == at::kFloat)
            silu_cols<float>(reinterpret_cast<const float*>(gup), 0, N, I, c0, c1, reinterpret_cast<float*>(actp));
          else
            silu_cols<bf16>(reinterpret_cast<const bf16*>(gup), 0, N, I, c0, c1, reinterpret_cast<bf16*>(actp));
        });
        sync(6);
      } else {
        share_tiles(2 * I, [&](int64_t t0, int64_t t1) { tiles(l, 2, xin, nullptr, gup, t0, t1); });
#pragma omp barrier
        const int64_t n0 = N * tid / nth, n1 = N * (tid + 1) / nth;
        if (dt == at::kFloat)
          silu_cols<float>(reinterpret_cast<const float*>(gup), n0, n1, I, 0, I, reinterpret_cast<float*>(actp));
        else
          silu_cols<bf16>(reinterpret_cast<const bf16*>(gup), n0, n1, I, 0, I, reinterpret_cast<bf16*>(actp));
        sync(6);
      }
      // the down tiles, + the residual in place
      xin = input(actp, I);
      share_tiles(H, [&](int64_t t0, int64_t t1) { tiles(l, 3, xin, xp, xp, t0, t1); });
      sync(7);
    }
    if (kernel == 3) specrouter::amx_hold(false);
    delete sf;
    delete sb;
  }
  omp_set_schedule(saved_kind, saved_chunk);
  return x;
}

}  // namespace

TORCH_LIBRARY(specrouter_rowinv, m) {
  m.def("rope_attention(Tensor qkv, int num_heads, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor starts, Tensor nums, Tensor? parents=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("set_stack_schedule(str kind, int chunk=1) -> ()", &set_stack_schedule);
  m.def("stack_profile(bool on) -> Tensor", &stack_profile);
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor[] params, int[] outs, int kernel, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int B, int T, int num_heads, int head_dim, float eps, Tensor cos, Tensor sin, Tensor slots, Tensor starts, Tensor nums, Tensor? valid=None, Tensor? parents=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) {
  m.impl("rope_attention", &rope_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("decoder_layers", &decoder_layers);
}
