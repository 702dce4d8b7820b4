// Counter-based sampling noise, native: `coupled_argmax` of decoding/noise.py in one call.
//
// Same function as the torch path (noise.py's docstring has the derivation): per row n with
// position key key[n], token v of vocabulary block b (BLOCK tokens, the vocabulary padded with
// -inf) gets E_v = M_b + (v is the block's argmin ? 0 : -log U(key, "token", v)), with
// M_b = -log U(key, "block_min", b) / BLOCK, and the row samples argmax_v scores[v] - log E_v.
// Blocks are visited lazily by their bound max(scores in b) - log M_b (`sample_row` below), so a
// peaked distribution costs one or two blocks. The hash is the same 32-bit mixing on the same
// counters; logs are float64 (std::log here, torch's vectorized log there: they agree to the last
// bit or one ulp, so the two paths choose the same token unless two noisy scores tie to within
// ~1e-16).
//
// One implementation, two entries: `choose_tokens` (raw logits and the temperature, fused: rows
// without top-k, top-p or min_p) and `coupled_argmax` (scores the torch path scaled and filtered:
// the other rows), which is `sample_row` at temperature 1. (Until session 19 `coupled_argmax`
// had its own loop, which took every block's two logarithms: 50-190 us where it now takes 20-65,
// the same tokens.) One Python call per step instead of ~100 small torch ops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cut.h"

namespace {

constexpr int64_t BLOCK = 64;  // noise.py BLOCK
constexpr uint32_t M1 = 0x7FEB352Du, M2 = 0x846CA68Bu, GOLDEN = 0x9E3779B1u;
constexpr uint32_t STREAM_TOKEN = 0x3C6EF372u, STREAM_MIN = 0x5851F42Du, STREAM_ARG = 0x14057B7Eu;

inline uint32_t mix32(uint32_t x) {  // lowbias32
  x ^= x >> 16;
  x *= M1;
  x ^= x >> 15;
  x *= M2;
  return x ^ (x >> 16);
}

inline uint32_t uniform_bits(uint32_t key, uint32_t stream, uint64_t counter) {  // U = (x + 0.5) / 2^32
  uint32_t x = mix32(key ^ stream);
  x = mix32(x + static_cast<uint32_t>(counter * GOLDEN));
  return mix32(x ^ key);
}

inline double uniform(uint32_t key, uint32_t stream, uint64_t counter) {
  return (static_cast<double>(uniform_bits(key, stream, counter)) + 0.5) * (1.0 / 4294967296.0);
}

// std::log with the upper halves of the vector registers cleared first: libm's `log` starts with
// legacy SSE code, and with a dirty upper state every switch between it and AVX code pays a
// state transition. The compiler inserts vzeroupper after its own AVX code, yet dirties the state
// again building a closure with 256-bit moves, and torch's and the linears' AVX code runs before
// any call: measured on this Sapphire Rapids VM, a dirty state made a log cost 120 ns instead of
// 3.6 (a 64-token block ~15 us, not 1). A vzeroupper costs about a cycle.
inline double vlog(double x) {
#if defined(__AVX__)
  _mm256_zeroupper();
#endif
  return std::log(x);
}

// ---- choose_tokens: the token every position samples, from raw logits, in one call ------------
// (decoding/sampling.py `choose_at`: what `choose_tokens` does for rows without top-k, top-p or
// min_p, with `position_keys` and the temperature scaling fused.) Row b of the call is row
// rows[b] of the sampling table `temperature`; a greedy row (temperature 0) takes torch's
// `max(dim).indices` (the first maximal index; a NaN is the maximum, its first position wins);
// a sampling row takes argmax_v fl(x_v / T) - log E_v(key) with key = position_keys(seed, pos),
// the same scores, noise and hash as the torch path, so the same token. Its ties (equal noisy
// scores: +inf logits) go to the lowest index, as the materialized reference's argmax.
//
// Cheaper than the unfused path: no scaled copy of the logits (fl(x / T) is monotone in x for
// 0 < T < inf, so a block's scaled maximum is fl(its raw maximum / T), and only the tokens of the
// blocks visited are divided); block maxima with AVX2; and no logarithm for the blocks that
// cannot win. After the block with the largest maximum is evaluated (best score `best`), a block
// b is a candidate only if its bound smax_b - log M_b can reach `best`; -log M_b is bounded
// without a logarithm from the hash x_b of its uniform U_b = (x_b + 0.5) / 2^32: with
// n = 2^32 - x_b, 1 - U_b >= n / 2^33 and -log U_b >= 1 - U_b, so
// -log M_b = log(BLOCK / -log U_b) <= ln 2 * (6 + 33 - floor(log2 n)); one more ln 2 of margin
// covers the rounding of the exact bound (equality holds at n = 1). Only the candidates get the
// exact M_b and bound (the old path took two logarithms for each of a 49k vocabulary's 768
// blocks: most of its ~100 us a row).

constexpr double LN2 = 0.69314718055994530942;

// an upper bound of -log M_b from the hash of its uniform (above)
inline double noise_bound(uint32_t x) {
  const uint64_t n = (uint64_t{1} << 32) - x;  // 1..2^32
  return LN2 * static_cast<double>(40 - (63 - __builtin_clzll(n)));
}

inline uint32_t position_key(uint32_t seed_key, int64_t position) {  // noise.py position_keys
  return mix32(seed_key ^ mix32(static_cast<uint32_t>(position) * GOLDEN + 0x85EBCA6Bu));
}

// max of x[0, n) (-inf when empty) and whether a NaN is among them
inline float span_max(const float* x, int64_t n, bool& nan) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t v = 0;
#if defined(__AVX2__)
  if (n >= 16) {
    __m256 m0 = _mm256_set1_ps(mx), m1 = m0;
    __m256 u = _mm256_setzero_ps();
    for (; v + 16 <= n; v += 16) {
      const __m256 a = _mm256_loadu_ps(x + v), b = _mm256_loadu_ps(x + v + 8);
      m0 = _mm256_max_ps(m0, a);
      m1 = _mm256_max_ps(m1, b);
      u = _mm256_or_ps(u, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
    }
    nan |= _mm256_movemask_ps(u) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
    for (float l : lanes) mx = l > mx ? l : mx;
  }
#endif
  for (; v < n; ++v) {
    nan |= std::isnan(x[v]);
    mx = x[v] > mx ? x[v] : mx;
  }
  return mx;
}

inline double span_max(const double* x, int64_t n, bool& nan) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < n; ++v) {
    nan |= std::isnan(x[v]);
    mx = x[v] > mx ? x[v] : mx;
  }
  return mx;
}

// torch's max(dim).indices of x[0, V): the first maximal index, the first NaN if any; from the
// row's block maxima `bm` and NaN flags `bn` (nb blocks of BLOCK)
template <typename T>
int64_t greedy_row(const T* x, int64_t V, const T* bm, const uint8_t* bn, int64_t nb) {
  int64_t top = 0, first_nan = -1;
  for (int64_t b = 0; b < nb; ++b) {
    if (bn[b] && first_nan < 0) first_nan = b;
    if (bm[b] > bm[top]) top = b;
  }
  const int64_t b = first_nan >= 0 ? first_nan : top, lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
  for (int64_t v = lo; v < hi; ++v)
    if (first_nan >= 0 ? std::isnan(x[v]) : x[v] == bm[top]) return v;
  return lo;  // (every value -inf: the block's first)
}

struct Scratch {
  std::vector<double> smax, minima, bound;
  std::vector<int64_t> order;
  explicit Scratch(int64_t nb) : smax(nb), minima(nb), bound(nb), order(nb) {}
};

// the coupled sample of a row: argmax_v fl(x_v / temp) - log E_v(key), ties to the lowest index,
// over the tokens whose fl(x_v / temp) >= thr (the row's top-k / top-p / min-p cut, cut.h; -inf:
// every token): the others are the torch path's -inf scores, never sampled
template <typename T>
int64_t sample_row(const T* x, int64_t V, T temp, uint32_t key, const T* bm, const uint8_t* bn, Scratch& sc,
                   double thr = -std::numeric_limits<double>::infinity()) {
  constexpr double NEG_INF = -std::numeric_limits<double>::infinity();
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  // the scores x / temp are NaN where the torch path's are: a NaN temperature, or an infinite
  // one over an infinite logit (and the block maxima below need temp > 0: x / temp monotone)
  bool nan = std::isnan(temp);
  TORCH_CHECK(nan || temp > 0, "choose_tokens: a sampling row's temperature must be > 0, got ", temp);
  if (std::isinf(temp))
    for (int64_t v = 0; v < V; ++v) nan |= std::isinf(x[v]);
  int64_t top = 0;
  for (int64_t b = 0; b < nb; ++b) {
    nan |= bn[b] != 0;
    sc.smax[b] = static_cast<double>(static_cast<T>(bm[b] / temp));  // = max of fl(x / temp) over the block
    if (sc.smax[b] < thr) sc.smax[b] = NEG_INF;  // the whole block filtered
    if (sc.smax[b] > sc.smax[top]) top = b;
  }
  TORCH_CHECK(!nan, "invalid distribution: NaN scores (non-finite logits or temperature)");
  if (sc.smax[top] == NEG_INF) return 0;  // every score -inf: index 0, as argmax over the whole row
  double best = NEG_INF;
  int64_t token = -1;
  // token v of block b (log M_b = lm): its noisy score against the best so far. A token whose
  // score cannot reach `best` even with the block's smallest noise (s - log M_b, its extra
  // noise being >= 0; a margin of 1e-9 covers the logarithms' last bits) is skipped unhashed:
  // in a visited block, most tokens
  auto consider = [&](int64_t b, int64_t v, double lm, int64_t arg) {
    const double s = static_cast<double>(static_cast<T>(x[v] / temp));
    if (s == NEG_INF || s < thr || s - lm < best - 1e-9) return;  // filtered (never sampled), or cannot win
    const double extra = (v - b * BLOCK == arg) ? 0.0 : -vlog(uniform(key, STREAM_TOKEN, v));
    const double score = s - vlog(sc.minima[b] + extra);
    if (score > best || token < 0 || (score == best && v < token)) {
      best = score;
      token = v;
    }
  };
  auto visit = [&](int64_t b, int64_t first) {  // `first`: a token to score before the others (-1: none)
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
    const int64_t arg = std::min(static_cast<int64_t>(uniform(key, STREAM_ARG, b) * BLOCK), BLOCK - 1);
    const double lm = vlog(sc.minima[b]);
    if (first >= 0) consider(b, first, lm, arg);
    for (int64_t v = lo; v < hi; ++v) consider(b, v, lm, arg);
  };
  sc.minima[top] = -vlog(uniform(key, STREAM_MIN, top)) / BLOCK;
  {  // the top block's largest logit first: a good `best` early skips most of the block's tokens
    const int64_t lo = top * BLOCK, hi = std::min(V, lo + BLOCK);
    int64_t first = lo;
    for (int64_t v = lo; v < hi; ++v)
      if (x[v] > x[first]) first = v;
    visit(top, first);
  }
  // the other blocks that could hold a token scoring >= best, by their exact bound
  int64_t n = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (b == top || sc.smax[b] + noise_bound(uniform_bits(key, STREAM_MIN, b)) < best) continue;
    sc.minima[b] = -vlog(uniform(key, STREAM_MIN, b)) / BLOCK;
    sc.bound[b] = sc.smax[b] - vlog(sc.minima[b]);
    if (sc.bound[b] >= best) sc.order[n++] = b;
  }
  auto by_bound = [&](int64_t a, int64_t b) { return sc.bound[a] > sc.bound[b] || (sc.bound[a] == sc.bound[b] && a < b); };
  std::sort(sc.order.begin(), sc.order.begin() + n, by_bound);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = sc.order[i];
    if (best > sc.bound[b]) break;  // no token of this or a later block can reach it
    visit(b, -1);
  }
  return token < 0 ? 0 : token;
}

// the filters of the sampling table (cut.h), where a row has them: log(min_p) (-inf: none), top-k,
// top-p; null tables: no row filters
struct Filters {
  const float* lmp = nullptr;
  const int64_t* k = nullptr;
  const float* p = nullptr;
  bool on(int64_t r, int64_t V) const {
    return (lmp && lmp[r] != cut::NEG_INF) || (k && k[r] > 0 && k[r] < V) || (p && p[r] < 1.0f);
  }
};

template <typename T>
void choose_rows(const at::Tensor& x, const float* temp, const int64_t* rows, const int64_t* seeds,
                 const int64_t* pos, int64_t* out, int64_t B, int64_t G, int64_t V, const Filters& fl = {}) {
  const T* base = x.data_ptr<T>();
  const int64_t sb = x.stride(0), sg = x.stride(1), nb = (V + BLOCK - 1) / BLOCK, R = B * G;
  auto row_of = [&](int64_t r) { return base + (r / G) * sb + (r % G) * sg; };
  // 1. every block's maximum and NaN flag, over both threads in contiguous halves of the logits:
  // the halves that the two threads of the forward's last op (the float32 conversion of the LM
  // head's output) wrote, so each thread reads from its own core's cache (a core reading the
  // other's half paid ~40 us for a 49k row on this machine)
  std::vector<T> bmax(R * nb);
  std::vector<uint8_t> bnan(R * nb);
  at::parallel_for(0, R * nb, 128, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i % nb, lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
      bool nan = false;
      bmax[i] = span_max(row_of(i / nb) + lo, hi - lo, nan);
      bnan[i] = nan;
    }
  });
  // 2. each row's token from them: a few blocks read again (in cache now)
  // grain: a row costs about a microsecond (greedy) to ~10 (sampling), a thread's wake-up
  at::parallel_for(0, R, 4, [&](int64_t begin, int64_t end) {
    Scratch sc(nb);
    cut::Scratch cs;
    for (int64_t i = begin; i < end; ++i) {
      const T *row = row_of(i), *bm = bmax.data() + i * nb;
      const uint8_t* bn = bnan.data() + i * nb;
      const int64_t r = rows[i / G];
      const float t = temp[r];
      double thr = -std::numeric_limits<double>::infinity();
      if (t != 0.0f && fl.on(r, V)) {  // (float32 only: `choose_tokens` checks)
        cut::Filter f;
        f.T = t;
        f.lmp = fl.lmp ? fl.lmp[r] : cut::NEG_INF;
        f.k = fl.k ? fl.k[r] : 0;
        f.p = fl.p ? fl.p[r] : 1.0f;
        TORCH_CHECK(!std::isnan(t) && t > 0, "choose_tokens: a sampling row's temperature must be > 0, got ", t);
        const cut::Cut c = cut::find_cut(reinterpret_cast<const float*>(row), V, f, cs);
        TORCH_CHECK(c.status != cut::NAN_SCORES, "invalid distribution: NaN scores (non-finite logits or temperature)");
        if (c.status == cut::SORT) {  // the torch path sorts this row: the caller does
          out[i] = -2;
          continue;
        }
        thr = c.thr;
      }
      out[i] = t == 0.0f ? greedy_row(row, V, bm, bn, nb)
                         : sample_row(row, V, static_cast<T>(t), position_key(static_cast<uint32_t>(seeds[i / G]), pos[i]),
                                      bm, bn, sc, thr);
    }
  });
}

// logits (B, G, V) float32 / float64 (last dim contiguous), temperature (R,) float32 (the
// sampling table: 0 = greedy), rows (B) indices into it, seed_keys (B) 32-bit seed keys,
// positions (B*G) each token's position ([] when every row is greedy) -> (B, G) int64 tokens
// With filters (log_min_p, top_k, top_p: (R,) float32, int64, float32 tables beside temperature,
// as sampling.py's SamplingTensors; log_min_p torch's log of min_p): each sampling row's tokens
// under its cut (cut.h) are never sampled, the torch path's `choose_tokens` on `scaled_logits`;
// float32 logits only. A row whose cut the torch path finds by sorting gets -2 (the caller
// decides it).
at::Tensor choose_tokens(const at::Tensor& logits, const at::Tensor& temperature, at::IntArrayRef rows,
                         at::IntArrayRef seed_keys, at::IntArrayRef positions, const std::optional<at::Tensor>& log_min_p,
                         const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p) {
  TORCH_CHECK(logits.dim() == 3 && logits.device().is_cpu() && logits.stride(2) == 1,
              "logits: (B, G, V) on the CPU, the last dim contiguous");
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "choose_tokens: float32 or float64 logits, got ", dt);
  TORCH_CHECK(temperature.dim() == 1 && temperature.scalar_type() == at::kFloat && temperature.is_contiguous()
              && temperature.device().is_cpu(), "temperature: (R,) float32 on the CPU");
  const int64_t B = logits.size(0), G = logits.size(1), V = logits.size(2), R = temperature.size(0);
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == B && static_cast<int64_t>(seed_keys.size()) == B, "rows and seed_keys: one per row");
  const float* temp = temperature.data_ptr<float>();
  bool sampled = false;
  for (int64_t r : rows) {
    TORCH_CHECK(r >= 0 && r < R, "rows: index ", r, " out of the sampling table's ", R);
    sampled |= temp[r] != 0.0f;
  }
  TORCH_CHECK(!sampled || static_cast<int64_t>(positions.size()) == B * G, "positions: B*G positions for sampling rows");
  at::Tensor out = at::empty({B, G}, logits.options().dtype(at::kLong));
  if (B * G == 0) return out;
  TORCH_CHECK(V > 0, "logits: empty vocabulary");
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t* pos = sampled ? positions.data() : nullptr;
  Filters fl;
  auto table = [&](const std::optional<at::Tensor>& t, at::ScalarType type, const char* name) -> const void* {
    if (!t.has_value() || t->numel() == 0) return nullptr;
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R && t->scalar_type() == type && t->is_contiguous() && t->device().is_cpu(),
                name, ": (R,) on the CPU, contiguous, beside temperature");
    return t->data_ptr();
  };
  fl.lmp = static_cast<const float*>(table(log_min_p, at::kFloat, "log_min_p"));
  fl.k = static_cast<const int64_t*>(table(top_k, at::kLong, "top_k"));
  fl.p = static_cast<const float*>(table(top_p, at::kFloat, "top_p"));
  if (fl.lmp || fl.k || fl.p) {
    TORCH_CHECK(dt == at::kFloat, "choose_tokens: filters need float32 logits");
    TORCH_CHECK(cut::exp_ok(), "choose_tokens: filters need torch's MKL exp (this torch has none)");
  }
  if (dt == at::kFloat)
    choose_rows<float>(logits, temp, rows.data(), seed_keys.data(), pos, op, B, G, V, fl);
  else
    choose_rows<double>(logits, temp, rows.data(), seed_keys.data(), pos, op, B, G, V);
  return out;
}

template <typename T>
void argmax_rows(const T* scores, const int64_t* keys, int64_t* out, int64_t N, int64_t V) {
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(nb);
    std::vector<T> bm(nb);
    std::vector<uint8_t> bn(nb);
    for (int64_t n = begin; n < end; ++n) {
      const T* row = scores + n * V;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
        bool nan = false;
        bm[b] = span_max(row + lo, hi - lo, nan);
        bn[b] = nan;
      }
      out[n] = sample_row(row, V, T(1), static_cast<uint32_t>(keys[n]), bm.data(), bn.data(), sc);
    }
  });
}

// ---- coupled_argmax: the same sample from scores already scaled and filtered ------------------
// (sampling.py `choose_tokens` for rows with top-k, top-p or min_p: their scores are the torch
// path's `scaled_logits`.) A row is `sample_row` at temperature 1 (fl(x / 1) = x), from its
// blocks' maxima: the same lazy bounds, the same noise, ties to the lowest index.
//
// scores (N, V) float32 or float64 (scaled logits, -inf = filtered), keys (N,) int64 position
// keys (32-bit values) -> (N,) int64 tokens
at::Tensor coupled_argmax(const at::Tensor& scores, const at::Tensor& keys) {
  TORCH_CHECK(scores.dim() == 2 && scores.device().is_cpu(), "scores: (N, V) on the CPU");
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == scores.size(0) && keys.scalar_type() == at::kLong,
              "keys: (N,) int64");
  const auto dt = scores.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "coupled_argmax: float32 or float64 scores, got ", dt);
  at::Tensor s = scores.contiguous();
  at::Tensor k = keys.contiguous();
  const int64_t N = s.size(0), V = s.size(1);
  at::Tensor out = at::empty({N}, keys.options());
  if (N == 0) return out;
  TORCH_CHECK(V > 0, "scores: empty vocabulary");
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  if (dt == at::kFloat)
    argmax_rows<float>(s.data_ptr<float>(), kp, op, N, V);
  else
    argmax_rows<double>(s.data_ptr<double>(), kp, op, N, V);
  return out;
}

// ---- top_k_top_p_mask: sampling.py `_top_k_top_p_mask` on the CPU (cut.h) ---------------------
// x (N, V) float32 scaled logits (min-p applied), top_k (N,) int64, top_p (N,) float32 ->
// (x with the values under each row's cut set to -inf, (N,) int8 status: 0 done, 1 the row's cut
// lies past the candidates (the torch path sorts it; its output row is x's), 2 NaN scores)
std::tuple<at::Tensor, at::Tensor> top_k_top_p_mask(const at::Tensor& x, const at::Tensor& top_k, const at::Tensor& top_p) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat, "x: (N, V) float32 on the CPU");
  TORCH_CHECK(cut::exp_ok(), "top_k_top_p_mask: needs torch's MKL exp (this torch has none)");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == N && top_k.scalar_type() == at::kLong, "top_k: (N,) int64");
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == N && top_p.scalar_type() == at::kFloat, "top_p: (N,) float32");
  const at::Tensor xs = x.contiguous(), ks = top_k.contiguous(), ps = top_p.contiguous();
  at::Tensor out = at::empty({N, V}, x.options());
  at::Tensor status = at::zeros({N}, x.options().dtype(at::kChar));
  const float* xp = xs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int8_t* st = status.data_ptr<int8_t>();
  const int64_t* kp = ks.data_ptr<int64_t>();
  const float* pp = ps.data_ptr<float>();
  auto one = [&](int64_t n, cut::Scratch& sc) {
    cut::Filter f;
    f.k = kp[n];
    f.p = pp[n];
    const float* row = xp + n * V;
    float* o = op + n * V;
    const cut::Cut c = cut::find_cut(row, V, f, sc);
    st[n] = c.status;
    const float thr = c.status == cut::OK ? c.thr : cut::NEG_INF;
    if (thr == cut::NEG_INF) {
      std::memcpy(o, row, V * sizeof(float));
      return;
    }
    const __m256 vt = _mm256_set1_ps(thr), ninf = _mm256_set1_ps(cut::NEG_INF);
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
      const __m256 a = _mm256_loadu_ps(row + v);
      _mm256_storeu_ps(o + v, _mm256_blendv_ps(ninf, a, _mm256_cmp_ps(a, vt, _CMP_GE_OQ)));
    }
    for (; v < V; ++v) o[v] = row[v] >= thr ? row[v] : cut::NEG_INF;
  };
  if (N == 1) {  // one row: outside a parallel region (torch's exp may use the threads)
    cut::Scratch sc;
    one(0, sc);
  } else {
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      cut::Scratch sc;
      for (int64_t n = begin; n < end; ++n) one(n, sc);
    });
  }
  return {out, status};
}

// torch's float32 exp as cut.h computes it (a self-check against torch.exp: sampling.py)
at::Tensor torch_exp(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x: (n,) float32 contiguous on the CPU");
  TORCH_CHECK(cut::exp_ok(), "torch_exp: this torch has no MKL exp");
  at::Tensor out = at::empty_like(x);
  cut::torch_exp(x.data_ptr<float>(), out.data_ptr<float>(), x.numel());
  return out;
}

bool has_torch_exp() { return cut::exp_ok(); }

// noise.py `token_noise`'s three uniforms of (keys (N,) int64 position keys, tokens (N, M) int64):
// (3, N, M) float64: U(key, "token", v), U(key, "block_arg", v / BLOCK), U(key, "block_min",
// v / BLOCK) (integer hashing: the bits of the torch path's; the logarithms stay torch's)
at::Tensor token_uniforms(const at::Tensor& keys, const at::Tensor& tokens) {
  TORCH_CHECK(keys.dim() == 1 && tokens.dim() == 2 && keys.size(0) == tokens.size(0) && keys.scalar_type() == at::kLong
              && tokens.scalar_type() == at::kLong && keys.device().is_cpu() && tokens.device().is_cpu(),
              "token_uniforms: keys (N,) and tokens (N, M) int64 on the CPU");
  const at::Tensor k = keys.contiguous(), t = tokens.contiguous();
  const int64_t N = t.size(0), M = t.size(1);
  at::Tensor out = at::empty({3, N, M}, t.options().dtype(at::kDouble));
  const int64_t* pk = k.data_ptr<int64_t>();
  const int64_t* pt = t.data_ptr<int64_t>();
  double* po = out.data_ptr<double>();
  for (int64_t n = 0; n < N; ++n) {
    const uint32_t key = static_cast<uint32_t>(pk[n]);
    for (int64_t m = 0; m < M; ++m) {
      const int64_t v = pt[n * M + m];
      TORCH_CHECK(v >= 0, "token_uniforms: tokens must be >= 0");
      const int64_t i = n * M + m;
      po[i] = uniform(key, STREAM_TOKEN, static_cast<uint64_t>(v));
      po[N * M + i] = uniform(key, STREAM_ARG, static_cast<uint64_t>(v / BLOCK));
      po[2 * N * M + i] = uniform(key, STREAM_MIN, static_cast<uint64_t>(v / BLOCK));
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("coupled_argmax(Tensor scores, Tensor keys) -> Tensor");
  m.def("choose_tokens(Tensor logits, Tensor temperature, int[] rows, int[] seed_keys, int[] positions, "
        "Tensor? log_min_p=None, Tensor? top_k=None, Tensor? top_p=None) -> Tensor");
  m.def("top_k_top_p_mask(Tensor x, Tensor top_k, Tensor top_p) -> (Tensor, Tensor)");
  m.def("torch_exp(Tensor x) -> Tensor");
  m.def("has_torch_exp() -> bool", &has_torch_exp);
  m.def("token_uniforms(Tensor keys, Tensor tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) {
  m.impl("coupled_argmax", &coupled_argmax);
  m.impl("choose_tokens", &choose_tokens);
  m.impl("top_k_top_p_mask", &top_k_top_p_mask);
  m.impl("torch_exp", &torch_exp);
  m.impl("token_uniforms", &token_uniforms);
}
