// The sampler's top-k / top-p / min-p cut of a row, natively: the threshold that
// decoding/sampling.py's candidate path (`_top_k_top_p_mask_candidates`, after `_min_p_mask`)
// finds, bit for bit, from the same float operations in the same order. One implementation, three
// users: the mask (noise.cpp `top_k_top_p_mask`: process_logits, scaled_logits), the sampler
// (noise.cpp `choose_tokens` with filters: a token under the cut is never sampled) and the
// router's D_TV (tv.cpp: each side filtered exactly as the sampler filters it).
//
// A row's scaled logits are s = fl(x / T) (T = 1: already scaled; x / 1 = x); min-p sets
// s < fl(max s + log(min_p)) to -inf; call the result ms(x): a non-decreasing function of x, so
// the k-th largest of ms is ms(the k-th largest x) and every cut on ms is a cut on x. Then, as the
// torch path (module docstring of sampling.py), with e = exp(s - max) in torch's float32 exp (MKL's
// vsExp in high accuracy, which torch's CPU exp calls: elementwise, the same bits whatever the
// length or the threads; `torch_exp`):
// - top-k (0 < k < V): thr_k = the k-th largest ms; survivors = ms >= thr_k, finite.
// - top-p (p < 1): in descending order, probs_i = fl(e_i / z), cs_i = (float) of the running
//   float64 sum of probs (torch's cumsum: a double accumulator), before_i = fl(cs_i - probs_i); the
//   nucleus is the prefix with before_i < p (at least one); thr_p = its smallest value. z: with
//   top-k, (float) of the float64 sum of the survivors' e in descending order (cumsum gathered at
//   the last survivor); without, the whole row's mass in fixed point: sum of round(e * 2^S) as
//   int64 (exact, so in any order), times 2^-S (`row_mass`, S = 62 - bit length of V).
// - thr = max(min-p's, thr_k, thr_p); the row keeps ms >= thr.
// A cut past K_MAX(V) candidates (sampling.py: top 64 widened x4 while 16 x the set fits in V;
// 4096 of 49152) is not found here (status SORT): the torch path sorts such a row, and so must
// its caller (or, `Filter::unbounded`, found from more candidates). A NaN logit: status NAN (the
// torch path then sorts the whole call; the sampler raises).

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

// MKL's vsExp (Fortran entry, LP64: n a 32-bit int), which torch's CPU exp calls for float32
// (aten/src/ATen/cpu/vml.h); weak: null where this torch has no MKL (then `exp_ok` is false and
// the callers keep the torch path)
extern "C" void VMSEXP_(const int* n, const float* a, float* r, const int64_t* mode) __attribute__((weak));

namespace cut {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float POS_INF = std::numeric_limits<float>::infinity();
enum Status : int8_t { OK = 0, SORT = 1, NAN_SCORES = 2 };

inline bool exp_ok() { return VMSEXP_ != nullptr; }

// out[i] = exp(in[i]) as torch.exp computes float32 on the CPU (VML_HA | VML_ERRMODE_IGNORE | VML_FTZDAZ_OFF)
inline void torch_exp(const float* in, float* out, int64_t n) {
  static const int64_t mode = 0x2 | 0x100 | 0x140000;
  for (int64_t i = 0; i < n; i += INT_MAX) {
    const int m = static_cast<int>(std::min<int64_t>(n - i, INT_MAX));
    VMSEXP_(&m, in + i, out + i, &mode);
  }
}

// the largest candidate set the torch path widens to: min(64, V), x4 (capped at V) while
// 4 x min(4K, V) <= V and K < V
inline int64_t k_max(int64_t V) {
  int64_t K = std::min<int64_t>(64, V);
  while (4 * std::min(4 * K, V) <= V && K < V) K = std::min(4 * K, V);
  return K;
}

// the fixed-point scale of `row_mass`: e * 2^S <= 2^S, V of them < 2^62
inline int mass_shift(int64_t V) {
  int bits = 0;
  for (int64_t v = V; v; v >>= 1) ++bits;
  return 62 - bits;
}

struct Filter {
  float T = 1.0f;         // divide by it (> 0; 1: the logits are already scaled)
  float lmp = NEG_INF;    // log(min_p) as torch computes it; -inf: no min-p
  int64_t k = 0;          // top-k, 0 (or >= V): none
  float p = 1.0f;         // top-p, >= 1: none
  bool unbounded = false; // find a cut past K_MAX candidates too (the D_TV: where the torch path
                          // sorts, the candidates' cut, which differs only on a rounding boundary)
};

struct Cut {
  Status status = OK;
  float thr = NEG_INF;  // keep ms >= thr (-inf: keep every value)
};

// per thread: the row's exponentials and the candidates
struct Scratch {
  std::vector<float> t, e;
  std::vector<std::pair<float, float>> cand;  // (s, e)
  std::vector<float> xs;
};

// max of x[0, V) and whether a NaN is among them
inline float row_max(const float* x, int64_t V, bool& nan) {
  __m256 m0 = _mm256_set1_ps(NEG_INF), m1 = m0, u = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) {
    const __m256 a = _mm256_loadu_ps(x + v), b = _mm256_loadu_ps(x + v + 8);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    u = _mm256_or_ps(u, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  float mx = NEG_INF;
  for (float l : lanes) mx = l > mx ? l : mx;
  nan = _mm256_movemask_ps(u) != 0;
  for (; v < V; ++v) {
    nan |= std::isnan(x[v]);
    mx = x[v] > mx ? x[v] : mx;
  }
  return mx;
}

// how many x[v] >= c
inline int64_t count_at_least(const float* x, int64_t V, float c) {
  const __m256 vc = _mm256_set1_ps(c);
  int64_t n = 0, v = 0;
  for (; v + 8 <= V; v += 8)
    n += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + v), vc, _CMP_GE_OQ))));
  for (; v < V; ++v) n += x[v] >= c;
  return n;
}

// f(v) for every v with x[v] >= c, in order
template <typename F>
inline void each_at_least(const float* x, int64_t V, float c, F f) {
  const __m256 vc = _mm256_set1_ps(c);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + v), vc, _CMP_GE_OQ)));
    for (; bits; bits &= bits - 1) f(v + __builtin_ctz(bits));
  }
  for (; v < V; ++v)
    if (x[v] >= c) f(v);
}

// the smallest float x with fl(x / T) >= thr (a cut on ms as a cut on x); -inf for thr = -inf
inline float raw_cut(float thr, float T) {
  if (thr == NEG_INF) return NEG_INF;
  float x = thr * T;
  if (std::isnan(x)) x = thr;
  while (!(x / T >= thr) && x < POS_INF) x = std::nextafter(x, POS_INF);
  while (true) {
    const float below = std::nextafter(x, NEG_INF);
    if (below == NEG_INF || !(below / T >= thr)) break;
    x = below;
  }
  return x;
}

// the nucleus of descending (s, e) pairs with the mass' denominator z: the length of the prefix
// whose mass before each is < p (sampling.py's formula, its float32 and float64 steps)
inline int64_t nucleus(const std::vector<std::pair<float, float>>& c, float z, float p) {
  double run = 0.0;
  int64_t i = 0, n = static_cast<int64_t>(c.size());
  for (; i < n; ++i) {
    const float prob = c[i].second / z;
    run += static_cast<double>(prob);
    const float before = static_cast<float>(run) - prob;
    if (!(before < p)) break;
  }
  return i;
}

// z of a row without top-k: sum of round(e * 2^S) over the row as int64, times 2^-S, as float.
// The integers (< 2^S each) are summed in float64 in blocks of 2^(53 - S) (exact: no sum
// passes 2^53), the blocks as int64.
inline float row_mass(const float* e, int64_t V) {
  const int S = mass_shift(V);
  const float scale = std::ldexp(1.0f, S);
  int64_t total = 0, v = 0;
  if (S <= 50) {
    const int64_t block = int64_t{1} << (53 - S);  // >= 8
    const __m256 vs = _mm256_set1_ps(scale);
    for (; v + block <= V; v += block) {
      __m256d a = _mm256_setzero_pd(), b = a;
      for (int64_t i = v; i < v + block; i += 8) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(e + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(r)));
        b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)));
      }
      alignas(32) double la[4], lb[4];
      _mm256_store_pd(la, a);
      _mm256_store_pd(lb, b);
      for (int j = 0; j < 4; ++j) total += static_cast<int64_t>(la[j]) + static_cast<int64_t>(lb[j]);
    }
  }
  for (; v < V; ++v) total += static_cast<int64_t>(std::nearbyint(e[v] * scale));
  return static_cast<float>(static_cast<double>(total) * std::ldexp(1.0, -S));
}

// the cut of one row: x its logits (V, unscaled unless f.T = 1)
inline Cut find_cut(const float* x, int64_t V, const Filter& f, Scratch& sc) {
  Cut out;
  bool nan = false;
  const float mxr = row_max(x, V, nan);
  if (nan) return {NAN_SCORES, NEG_INF};
  const float T = f.T;
  const float mx = mxr / T;  // max fl(x / T): x -> fl(x / T) is non-decreasing
  float thr_m = NEG_INF;
  if (f.lmp != NEG_INF) {
    thr_m = mx + f.lmp;
    if (std::isnan(thr_m)) thr_m = NEG_INF;  // (+inf + -inf: torch's compare with NaN masks nothing)
  }
  auto ms = [&](float xv) {
    const float s = xv / T;
    return s < thr_m ? NEG_INF : s;
  };
  const bool k_on = f.k > 0 && f.k < V, p_on = f.p < 1.0f;
  out.thr = thr_m;
  if ((!k_on && !p_on) || mx == NEG_INF) return out;
  const int64_t KM = f.unbounded ? V : k_max(V);
  const bool all = KM == V;  // every value a candidate: every cut resolves
  const float x_m = raw_cut(thr_m, T);  // x >= x_m: not masked by min-p
  float thr_k = NEG_INF, thr_p = NEG_INF;
  if (k_on) {
    if (f.k > KM) return {SORT, NEG_INF};
    // raw values at or above a cut lowered until it holds k, the k-th largest among them
    float d = 2.0f;
    float c = mxr - d * T;
    while (count_at_least(x, V, c) < f.k) {
      d *= 4.0f;
      c = d > 512.0f ? NEG_INF : mxr - d * T;
      if (std::isnan(c)) c = NEG_INF;
      if (c == NEG_INF) break;
    }
    sc.xs.clear();
    each_at_least(x, V, c, [&](int64_t v) { sc.xs.push_back(x[v]); });
    std::nth_element(sc.xs.begin(), sc.xs.begin() + (f.k - 1), sc.xs.end(), std::greater<float>());
    thr_k = ms(sc.xs[f.k - 1]);
    // the survivors: ms >= thr_k, finite; fewer than K_MAX (the torch path's `covered`)
    const float x_k = thr_k == NEG_INF ? std::max(x_m, std::nextafter(NEG_INF, 0.0f)) : raw_cut(thr_k, T);
    sc.cand.clear();
    int64_t n = 0;
    bool over = false;
    each_at_least(x, V, x_k, [&](int64_t v) {
      const float s = ms(x[v]);
      if (s == NEG_INF) return;
      if (++n >= KM && !all) over = true;
      if (p_on && !over) sc.cand.emplace_back(s, 0.0f);
    });
    if (over) return {SORT, NEG_INF};
  }
  if (p_on) {
    if (mx == POS_INF) {
      thr_p = POS_INF;  // the torch path's NaN masses keep its first candidate: the +inf values
    } else if (k_on) {
      std::sort(sc.cand.begin(), sc.cand.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      const int64_t n = static_cast<int64_t>(sc.cand.size());
      sc.t.resize(n);
      sc.e.resize(n);
      for (int64_t i = 0; i < n; ++i) sc.t[i] = sc.cand[i].first - mx;
      torch_exp(sc.t.data(), sc.e.data(), n);
      double z = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        sc.cand[i].second = sc.e[i];
        z += static_cast<double>(sc.e[i]);
      }
      const int64_t kept = std::max<int64_t>(nucleus(sc.cand, static_cast<float>(z), f.p), 1);
      thr_p = sc.cand[std::min(kept, n) - 1].first;
    } else {
      // the whole row's exponentials (masked values: exp(-inf) = 0) and mass
      sc.t.resize(V);
      sc.e.resize(V);
      float* t = sc.t.data();
      for (int64_t v = 0; v < V; ++v) t[v] = ms(x[v]) - mx;
      torch_exp(t, sc.e.data(), V);
      const float* e = sc.e.data();
      const float z = row_mass(e, V);
      const int64_t finite = count_at_least(t, V, std::nextafter(NEG_INF, 0.0f));
      // candidates: t >= a cut lowered until their mass reaches the nucleus' (then checked exactly)
      for (float c = -2.0f;; c *= 2.0f) {
        if (c < -160.0f) c = NEG_INF;
        sc.cand.clear();
        double mass = 0.0;
        each_at_least(t, V, c == NEG_INF ? std::nextafter(NEG_INF, 0.0f) : c, [&](int64_t v) {
          sc.cand.emplace_back(ms(x[v]), e[v]);
          mass += e[v];
        });
        const bool every = static_cast<int64_t>(sc.cand.size()) == finite;
        if (!every && mass < static_cast<double>(f.p) * z * (1.0 + 1e-4)) continue;
        std::sort(sc.cand.begin(), sc.cand.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
        const int64_t n = static_cast<int64_t>(sc.cand.size());
        const int64_t kept = nucleus(sc.cand, z, f.p);
        if (kept == n && !every) continue;  // the prefix may go on past the candidates
        if (!all && kept >= KM && finite >= KM) return {SORT, NEG_INF};
        thr_p = sc.cand[std::max<int64_t>(std::min(kept, n), 1) - 1].first;
        break;
      }
    }
  }
  out.thr = std::max(thr_m, std::max(thr_k, thr_p));
  return out;
}

}  // namespace cut
