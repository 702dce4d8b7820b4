// Row-invariant CPU kernels for the native runner (float32 and bfloat16, AVX2 + FMA).
//
// Every output element is computed by one fixed sequence of instructions that depends only on
// the shapes of the weights (and, for attention, on the query's own position), never on how
// many rows run in the same call, how they are split among threads, or what else is in the
// batch. So a position's logits are bitwise the same in a 1-token step, a k-token
// verification and a ragged multi-row batch: exact speculative decoding by construction.
//
// The linears live in their own files: linear256.cpp (AVX2, the op `linear`) and linear512.cpp
// (AVX-512, `linear512`); `decoder_layers` below calls them.
// rope_attention: RoPE of q and k, the write of k and v into the slot cache, and for each
//   (row, head, query) its own softmax over keys [0, pos] in order, float32 throughout; with
//   `parents` (a token tree), over the prefix and the query's ancestors, in position order.
// rms_norm, silu_mul: per row, float32 inside.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"

namespace specrouter {  // linear256.cpp, linear512.cpp
at::Tensor linear256(const at::Tensor& x, const at::Tensor& weight, int64_t O, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual);
at::Tensor linear512(const at::Tensor& x, const at::Tensor& weight, int64_t O, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual, bool dp);
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

// dot_q of 4 consecutive keys (D % 8 == 0): four independent chains, each with the bits of dot_q
template <typename T>
inline void dot_q4(const float* q, const T* k, int64_t D, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qi = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qi, load8(k + i), a0);
    a1 = _mm256_fmadd_ps(qi, load8(k + D + i), a1);
    a2 = _mm256_fmadd_ps(qi, load8(k + 2 * D + i), a2);
    a3 = _mm256_fmadd_ps(qi, load8(k + 3 * D + i), a3);
  }
  out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
}

// acc[d] = sum over j = 0..L-1, in order, of p[j] * values[j, d] (one FMA per j), float32; the
// accumulators of NB blocks of 8 stay in registers over the whole j loop
template <int NB, typename T>
inline void pv_blocks(const float* p, const T* values, int64_t L, int64_t D, int64_t d0, float* acc) {
  __m256 a[NB];
  for (int b = 0; b < NB; ++b) a[b] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const T* vj = values + j * D + d0;
    for (int b = 0; b < NB; ++b) a[b] = _mm256_fmadd_ps(pj, load8(vj + 8 * b), a[b]);
  }
  for (int b = 0; b < NB; ++b) _mm256_storeu_ps(acc + d0 + 8 * b, a[b]);
}

template <typename T>
inline void weighted_values(const float* p, const T* values, int64_t L, int64_t D, float* acc) {
  const int64_t d8 = D / 8 * 8;
  int64_t d0 = 0;
  for (; d0 + 64 <= d8; d0 += 64) pv_blocks<8>(p, values, L, D, d0, acc);
  for (; d0 + 32 <= d8; d0 += 32) pv_blocks<4>(p, values, L, D, d0, acc);
  for (; d0 < d8; d0 += 8) pv_blocks<1>(p, values, L, D, d0, acc);
  for (int64_t d = d8; d < D; ++d) {  // the D % 8 tail
    float a = 0.f;
    for (int64_t j = 0; j < L; ++j) a = std::fma(p[j], to_f(values[j * D + d]), a);
    acc[d] = a;
  }
}

// The query heads of one token that share a KV head (GQA) attend the same keys: up to GQ of them
// run side by side, so each key and value row is loaded once for all of them. Every query's
// chains are those of dot_q4 / pv_blocks, so its bits are those of running it alone.
constexpr int GQ = 3;

// dot_q4 of G queries (D % 8 == 0) against 4 consecutive float32 keys: out[g][0..3]
template <int G>
inline void dot_g4(const float* const* q, const float* k, int64_t D, float* const* out, int64_t j) {
  __m256 a[G][4];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + D + i);
    const __m256 k2 = _mm256_loadu_ps(k + 2 * D + i), k3 = _mm256_loadu_ps(k + 3 * D + i);
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) {
      const __m256 qi = _mm256_loadu_ps(q[g] + i);
      a[g][0] = _mm256_fmadd_ps(qi, k0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(qi, k1, a[g][1]);
      a[g][2] = _mm256_fmadd_ps(qi, k2, a[g][2]);
      a[g][3] = _mm256_fmadd_ps(qi, k3, a[g][3]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
    out[g][j] = hsum(a[g][0]), out[g][j + 1] = hsum(a[g][1]), out[g][j + 2] = hsum(a[g][2]), out[g][j + 3] = hsum(a[g][3]);
}

// pv_blocks of G queries over the same float32 value rows: acc[g][d0 ..] of NB blocks of 8
template <int G, int NB>
inline void pv_g(const float* const* p, const float* values, int64_t L, int64_t D, int64_t d0, float* const* acc) {
  __m256 a[G][NB];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) a[g][b] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const float* vj = values + j * D + d0;
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) {
      const __m256 pj = _mm256_set1_ps(p[g][j]);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) a[g][b] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * b), a[g][b]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(acc[g] + d0 + 8 * b, a[g][b]);
}

// weighted_values of G queries over the same float32 value rows (the same bits per query)
template <int G>
inline void weighted_values_g(const float* const* p, const float* values, int64_t L, int64_t D, float* const* acc) {
  const int64_t d8 = D / 8 * 8;
  int64_t d0 = 0;
  for (; d0 + 32 <= d8; d0 += 32) pv_g<G, 4>(p, values, L, D, d0, acc);
  for (; d0 < d8; d0 += 8) pv_g<G, 1>(p, values, L, D, d0, acc);
  for (int g = 0; g < G; ++g)
    for (int64_t d = d8; d < D; ++d) {  // the D % 8 tail
      float s = 0.f;
      for (int64_t j = 0; j < L; ++j) s = std::fma(p[g][j], values[j * D + d], s);
      acc[g][d] = s;
    }
}

// weighted_values over value rows given by pointer (a token tree's keys: the prefix, then the
// query's ancestors): the same instructions in the same order as weighted_values on rows laid
// side by side, so the same bits
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

constexpr int64_t QCHUNK = 8;  // attention: about this many query rows per work item (they share widened keys)

// RoPE of one head in float32: out = x * cos + [x2, x1] * sin_signed
inline void rope_head(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float swapped = d < h ? x[d + h] : x[d - h];
    out[d] = x[d] * cos[d] + swapped * sin[d];
  }
}

// Phase 1 (per valid token): rotate k, write k and v at the token's position of its slot.
// Phase 2 (per valid (row, head, query)): rotate q, softmax over keys [0, pos] in order,
// weighted sum of values in order, all float32; padding queries get zeros. A query's sequence
// of operations depends only on its position, never on the other queries of its work item.
template <typename T>
void rope_attention_impl(const T* qkv, int64_t B, int64_t Tq, int64_t nh, int64_t nkv, int64_t D,
                         const float* cos, const float* sin, T* kc, T* vc, int64_t P,
                         const int64_t* slots, const int64_t* starts, const int64_t* nums, T* out,
                         const int64_t* depth = nullptr, const int64_t* path = nullptr) {
  const int64_t heads = nh + 2 * nkv, groups = nh / nkv;
  at::parallel_for(0, B * Tq, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> x(D), r(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Tq, t = i % Tq;
      if (t >= nums[b]) continue;
      const int64_t pos = starts[b] + (depth ? depth[i] : t);  // a tree node: RoPE at its depth
      const T* tok = qkv + i * heads * D;
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t at = ((slots[b] * nkv + h) * P + starts[b] + t) * D;  // stored at its index
        load_f(tok + (nh + h) * D, x.data(), D);
        rope_head(x.data(), cos + pos * D, sin + pos * D, D, r.data());
        for (int64_t d = 0; d < D; ++d) store(&kc[at + d], r[d]);
        std::memcpy(&vc[at], tok + (nh + nkv + h) * D, D * sizeof(T));
      }
    }
  });
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, starts[b] + nums[b]);
  // work items: (row b, KV head, a chunk of up to TCHUNK of its tokens); an item widens its keys
  // and values to float32 once (exact) for all its queries: per token, the `groups` query heads
  // of the KV head, GQ at a time
  const int64_t TCHUNK = std::max<int64_t>(1, QCHUNK / groups), chunks = (Tq + TCHUNK - 1) / TCHUNK;
  at::parallel_for(0, B * nkv * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> pbuf(GQ * max_len), x(D), qbuf(GQ * D), abuf(GQ * D), kf, vf;
    std::vector<const float*> vrows(depth ? max_len : 0);
    float* p[GQ];
    float* q[GQ];
    float* acc[GQ];
    for (int g = 0; g < GQ; ++g) p[g] = &pbuf[g * max_len], q[g] = &qbuf[g * D], acc[g] = &abuf[g * D];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t c = item % chunks, kv = (item / chunks) % nkv, b = item / (chunks * nkv);
      const int64_t t0 = c * TCHUNK, t1 = std::min(Tq, t0 + TCHUNK);
      const int64_t Lc = std::min(t1, nums[b]) > t0 ? starts[b] + std::min(t1, nums[b]) : 0;  // keys [0, Lc)
      const int64_t base = (slots[b] * nkv + kv) * P * D;
      const float* keys;
      const float* values;
      if constexpr (sizeof(T) == 4) {
        keys = reinterpret_cast<const float*>(kc + base), values = reinterpret_cast<const float*>(vc + base);
      } else {
        kf.resize(Lc * D), vf.resize(Lc * D);
        widen(kc + base, kf.data(), Lc * D), widen(vc + base, vf.data(), Lc * D);
        keys = kf.data(), values = vf.data();
      }
      for (int64_t t = t0; t < t1; ++t) {
        if (t >= nums[b]) {
          for (int64_t g = 0; g < groups; ++g) {
            T* o = out + ((b * Tq + t) * nh + kv * groups + g) * D;
            for (int64_t d = 0; d < D; ++d) store(&o[d], 0.f);
          }
          continue;
        }
        const int64_t pos = starts[b] + (depth ? depth[b * Tq + t] : t), L = pos + 1;
        // keys in position order: [0, start) of the cache, then (a tree) the query's ancestors
        // and itself, stored at start + their node index; a chain: start + t for depth t
        const int64_t Lk = depth ? starts[b] : L;  // keys read side by side
        const int64_t* anc = depth ? path + (b * Tq + t) * Tq : nullptr;  // node indices, root first
        for (int64_t g0 = 0; g0 < groups; g0 += GQ) {
          const int G = static_cast<int>(std::min<int64_t>(GQ, groups - g0));
          for (int g = 0; g < G; ++g) {
            load_f(qkv + ((b * Tq + t) * heads + kv * groups + g0 + g) * D, x.data(), D);
            rope_head(x.data(), cos + pos * D, sin + pos * D, D, q[g]);
          }
          int64_t j = 0;
          if (D % 8 == 0)
            for (; j + 4 <= Lk; j += 4) {
              if (G == 3) dot_g4<3>(q, keys + j * D, D, p, j);
              else if (G == 2) dot_g4<2>(q, keys + j * D, D, p, j);
              else dot_g4<1>(q, keys + j * D, D, p, j);
            }
          for (int g = 0; g < G; ++g) {
            int64_t i = j;
            for (; i < Lk; ++i) p[g][i] = dot_q(q[g], keys + i * D, D);
            for (; i < L; ++i) p[g][i] = dot_q(q[g], keys + (starts[b] + anc[i - Lk]) * D, D);
          }
          float inv[GQ];
          for (int g = 0; g < G; ++g) {
            const float m = max_n(p[g], L);
            for (int64_t i = 0; i < L; ++i) p[g][i] -= m;
            exp_n(p[g], L);
            inv[g] = 1.f / sum_n(p[g], L);
          }
          if (depth) {
            for (j = 0; j < Lk; ++j) vrows[j] = values + j * D;
            for (; j < L; ++j) vrows[j] = values + (starts[b] + anc[j - Lk]) * D;
            for (int g = 0; g < G; ++g) weighted_values_rows(p[g], vrows.data(), L, D, acc[g]);
          } else if (G == 3) {
            weighted_values_g<3>(p, values, L, D, acc);
          } else if (G == 2) {
            weighted_values_g<2>(p, values, L, D, acc);
          } else {
            weighted_values_g<1>(p, values, L, D, acc);
          }
          for (int g = 0; g < G; ++g) {
            T* o = out + ((b * Tq + t) * nh + kv * groups + g0 + g) * D;
            for (int64_t d = 0; d < D; ++d) store(&o[d], acc[g][d] * inv[g]);
          }
        }
      }
    }
  });
}

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// qkv (B, T, nh + 2 nkv, D) from the qkv projection (q already scaled by 1/sqrt(D)); cos /
// sin_signed (P', D) float32 tables; k_cache / v_cache (S, nkv, P, D), written in place at each
// valid token's position; slots / starts / nums (B,) int64 -> attention output (B, T, nh, D).
// Query t of row b sits at position starts[b] + t and attends keys [0, starts[b] + t] of slot
// slots[b]; tokens t >= nums[b] are padding: not written, zero output.
at::Tensor rope_attention(const at::Tensor& qkv, int64_t num_heads, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& nums,
                          const std::optional<at::Tensor>& parents) {
  TORCH_CHECK(qkv.dim() == 4 && k_cache.dim() == 4, "qkv is (B, T, heads, D), the caches (S, nkv, P, D)");
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rope_attention: float32 or bfloat16, got ", dt);
  TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt, "caches: dtype of qkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(), "cos / sin: contiguous float32 tables");
  const int64_t B = qkv.size(0), Tq = qkv.size(1), D = qkv.size(3);
  const int64_t nkv = k_cache.size(1), P = k_cache.size(2), nh = num_heads;
  TORCH_CHECK(qkv.size(2) == nh + 2 * nkv && k_cache.size(3) == D && nh % nkv == 0 && D % 2 == 0,
              "head counts / sizes do not match (qkv ", qkv.sizes(), ", ", nh, " query heads, cache ",
              k_cache.sizes(), ")");
  TORCH_CHECK(cos.size(1) == D, "cos / sin: (positions, D)");
  auto sl = slots.to(at::kLong).contiguous(), st = starts.to(at::kLong).contiguous(),
       nu = nums.to(at::kLong).contiguous();
  TORCH_CHECK(sl.numel() == B && st.numel() == B && nu.numel() == B, "slots/starts/nums: (B,)");
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* tp = st.data_ptr<int64_t>();
  const int64_t* np = nu.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < k_cache.size(0), "slot ", sp[b], " out of range");
    TORCH_CHECK(np[b] <= Tq && tp[b] >= 0 && tp[b] + np[b] <= std::min(P, cos.size(0)),
                "row ", b, " reaches past the cache");
  }
  // a token tree: parents (B, T) int64, each valid token's parent among the row's new tokens
  // (< its own index), -1 for a child of the cached prefix. Node t sits at RoPE position
  // start + depth(t) and attends [0, start) plus its ancestors and itself in depth order: the
  // keys, positions and order of sequential decoding of its path (a chain: parents t - 1)
  std::vector<int64_t> depth, path;
  if (parents.has_value() && parents->defined()) {
    auto pa = parents->to(at::kLong).contiguous();
    TORCH_CHECK(pa.dim() == 2 && pa.size(0) == B && pa.size(1) == Tq, "parents: (B, T)");
    const int64_t* pp = pa.data_ptr<int64_t>();
    depth.assign(B * Tq, 0), path.assign(B * Tq * Tq, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < np[b]; ++t) {
        const int64_t i = b * Tq + t, par = pp[i];
        TORCH_CHECK(par >= -1 && par < t, "row ", b, " token ", t, ": parent ", par, " is not an earlier token");
        depth[i] = par < 0 ? 0 : depth[b * Tq + par] + 1;
        if (par >= 0) std::memcpy(&path[i * Tq], &path[(b * Tq + par) * Tq], depth[i] * sizeof(int64_t));
        path[i * Tq + depth[i]] = t;
      }
  }
  const int64_t* dp = depth.empty() ? nullptr : depth.data();
  const int64_t* ap = path.empty() ? nullptr : path.data();
  at::Tensor x = qkv.contiguous();
  at::Tensor out = at::empty({B, Tq, nh, D}, qkv.options());
  if (dt == at::kFloat)
    rope_attention_impl<float>(ptr<float>(x), B, Tq, nh, nkv, D, cos.data_ptr<float>(), sin.data_ptr<float>(),
                               ptr<float>(k_cache), ptr<float>(v_cache), P, sp, tp, np, ptr<float>(out), dp, ap);
  else
    rope_attention_impl<bf16>(ptr<bf16>(x), B, Tq, nh, nkv, D, cos.data_ptr<float>(), sin.data_ptr<float>(),
                              ptr<bf16>(k_cache), ptr<bf16>(v_cache), P, sp, tp, np, ptr<bf16>(out), dp, ap);
  return out;
}

// RMSNorm of each row: x * (1 / sqrt(mean(x^2) + eps)) * w, the sum of squares in float32 in a
// fixed order. float32: (x * inv) * w. bfloat16 follows transformers: x * inv rounded to
// bfloat16, then times the bfloat16 weight, rounded again.
template <typename T>
void rms_norm_impl(const T* x, const T* w, int64_t N, int64_t H, float eps, T* y) {
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    std::vector<float> xf(H);
    for (int64_t n = n0; n < n1; ++n) {
      load_f(x + n * H, xf.data(), H);
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
template <typename T>
void silu_mul_impl(const T* gu, int64_t N, int64_t I, T* y) {
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    std::vector<float> g(I);
    for (int64_t n = n0; n < n1; ++n) {
      const T* row = gu + n * 2 * I;
      const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {  // 8 at a time, the ops of the tail below
        const __m256 gate = load8(row + i);
        const __m256 e = exp8(_mm256_xor_ps(gate, sign));  // exp(-gate)
        store8(&y[n * I + i], _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(one, e)), load8(row + I + i)));
      }
      const int64_t i8 = i;
      for (; i < I; ++i) g[i - i8] = -to_f(row[i]);
      exp_n(g.data(), I - i8);  // exp(-gate) of the tail (lane-independent: the same bits)
      for (i = i8; i < I; ++i) store(&y[n * I + i], to_f(row[i]) / (1.f + g[i - i8]) * to_f(row[I + i]));
    }
  });
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

// The whole decoder stack in one call (runners/llama.py `_hidden_native` without the Python
// between the ops): per layer the ops above in the order the Python loop runs them, the same
// kernels on the same inputs, so the same bits. x (N, H): the valid tokens (all B*T of them, or
// packed: `valid` (N,) their flat indices into B*T). `params`: per layer ln1, w_qkv, b_qkv, w_o,
// b_o, ln2, w_gu, b_gu, w_down, b_down (a bias of 0 elements: none); `outs`: per layer the 4
// linears' output widths; `kernel`: 0 the AVX2 linear, 1 linear512 on FMAs, 2 on vdpbf16ps.
at::Tensor decoder_layers(const at::Tensor& x0, at::TensorList params, at::IntArrayRef outs, int64_t kernel,
                          at::TensorList k_caches, at::TensorList v_caches, int64_t B, int64_t T, int64_t nh,
                          int64_t D, double eps, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& nums,
                          const std::optional<at::Tensor>& valid, const std::optional<at::Tensor>& parents) {
  constexpr int64_t P = 10;
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == P * layers && static_cast<int64_t>(outs.size()) == 4 * layers &&
                  static_cast<int64_t>(v_caches.size()) == layers && kernel >= 0 && kernel <= 2,
              "decoder_layers: ", P, " params and 4 widths per layer, one K and one V cache per layer");
  const bool packed = valid.has_value() && valid->defined();
  auto lin = [&](const at::Tensor& in, int64_t l, int64_t i, const std::optional<at::Tensor>& res) {
    const at::Tensor& b = params[l * P + (i == 0 ? 2 : i == 1 ? 4 : i == 2 ? 7 : 9)];
    const at::Tensor& w = params[l * P + (i == 0 ? 1 : i == 1 ? 3 : i == 2 ? 6 : 8)];
    const std::optional<at::Tensor> bias = b.numel() ? std::optional<at::Tensor>(b) : std::nullopt;
    const int64_t O = outs[4 * l + i];
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

}  // namespace

TORCH_LIBRARY(specrouter_rowinv, m) {
  m.def("rope_attention(Tensor qkv, int num_heads, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor starts, Tensor nums, Tensor? parents=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor[] params, int[] outs, int kernel, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int B, int T, int num_heads, int head_dim, float eps, Tensor cos, Tensor sin, Tensor slots, Tensor starts, Tensor nums, Tensor? valid=None, Tensor? parents=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) {
  m.impl("rope_attention", &rope_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("decoder_layers", &decoder_layers);
}
