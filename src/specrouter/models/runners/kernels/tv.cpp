// The router's similarity signal, native: decoding/tv.py `level_tv` (D_TV = 1/2 sum_v |p_v - q_v|
// between two levels' processed next-token distributions at the same positions) in one call.
//
// Per position: the drafter's logits x and the verifier's y (float32, V each), the row's
// temperature T (> 0: sampled rows only; a greedy row, measured at temperature 1 unfiltered until
// prune23, is an error) and its filters: min-p
// (log(min_p), -inf: none; computed by the caller with torch's log, as sampling.py's
// `_min_p_mask`), top-k, top-p. Each side keeps exactly the tokens the sampler keeps (cut.h
// `find_cut`, the candidate path's cut bit for bit, as a cut on the raw logits: x >= x0; so
// min_p = 1 keeps the top token, where a fused s - max < log(min_p) could drop it: review19 N1);
// where the torch path would find the cut by sorting (a nucleus past 4096 of 49152 tokens), the
// candidates' cut (which differs from the sort's only on a rounding boundary). p = exp(s - max) / Z over the kept tokens, s = x * (1 / T) (the
// torch path divides: the two differ in the last bit of a few scores, far below the signal's
// resolution). Three passes over the vocabulary: the two maxima (raw, then scaled once:
// x -> x / T is monotone), the exponentials (stored) and their sums, and
// sum |e_x / Z_x - e_y / Z_y|. A position with a NaN logit or an infinite maximum is NaN (the
// torch path's softmax gives NaN there too). The cuts: between passes 1 and 2.
//
// Threads: positions are split among the threads; with fewer positions than threads each
// position's vocabulary is split in chunks too, the passes then three parallel regions (the
// chunks' maxima and sums combined between them). Sums: float32 lanes over blocks of 512 tokens,
// the blocks added in float64: within ~1e-7 of a float64 reference (the torch path, float32
// softmaxes and sums: ~3e-6). exp: 2^round(t) times a degree-5 polynomial of the rest, 0 below
// 2^CUT (below).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "cut.h"

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t LANES = 8, SUM_BLOCK = 512;
constexpr float LOG2E = 1.44269504088896341f;
// exp2 is 0 below 2^CUT (a probability under 1e-30 of the top token's: a vocabulary's worth of them
// is far below float rounding), which keeps every value and product of the passes normal: a
// subnormal costs a microcode assist per instruction (measured: real logits, whose tail reaches
// 2^-126 at temperature 0.7, took 155 us a position instead of 26)
constexpr float CUT = -100.0f;
constexpr float C1 = 6.931469776e-01f, C2 = 2.402224208e-01f, C3 = 5.550733759e-02f, C4 = 9.671512969e-03f,
                C5 = 1.326472245e-03f;

// 2^t on 8 lanes, t <= 0 (the exponent in base 2): 2^round(t) times a degree-5 polynomial of the
// rest (within 2e-7 relative: a least-squares fit of 2^f on [-1/2, 1/2] weighted to minimax);
// 0 below CUT and for -inf / NaN
inline __m256 exp2_8(__m256 t) {
  const __m256 lo = _mm256_set1_ps(CUT);
  const __m256 keep = _mm256_cmp_ps(t, lo, _CMP_GE_OQ);  // false for NaN and -inf
  t = _mm256_max_ps(t, lo);
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(C5);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C4));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C1));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

inline __m256i tail_mask(int64_t n) {  // lanes < n
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// lanes [v, v + 8) of x, -inf past `end`
inline __m256 load8(const float* x, int64_t v, int64_t end) {
  if (v + LANES <= end) return _mm256_loadu_ps(x + v);
  const __m256i m = tail_mask(end - v);
  return _mm256_blendv_ps(_mm256_set1_ps(NEG_INF), _mm256_maskload_ps(x + v, m), _mm256_castsi256_ps(m));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline double hsum_d(__m256 v) {  // the 8 float lanes summed in float64
  const __m256d a = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

// pass 1 over [lo, hi): raw maxima of x and y, NaN among them
inline void span_max2(const float* x, const float* y, int64_t lo, int64_t hi, float& mx, float& my, bool& nan) {
  __m256 ax = _mm256_set1_ps(NEG_INF), ay = ax, u = _mm256_setzero_ps();
  for (int64_t v = lo; v < hi; v += LANES) {
    const __m256 a = load8(x, v, hi), b = load8(y, v, hi);
    ax = _mm256_max_ps(ax, a);
    ay = _mm256_max_ps(ay, b);
    u = _mm256_or_ps(u, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
  }
  mx = std::max(mx, hmax(ax));
  my = std::max(my, hmax(ay));
  nan |= _mm256_movemask_ps(u) != 0;
}

// pass 2 over [lo, hi): e = exp(t), t = x * inv - m, where x >= x0 (else 0; CUT: x0 is the
// side's cut), stored; returns sum e. (x * inv - m in one rounding, fused: within an ulp of the
// scaled logit minus the maximum in two)
template <bool CUT>
double span_exp(const float* x, float inv, float m, float x0, float* e, int64_t lo, int64_t hi) {
  const __m256 vi = _mm256_set1_ps(inv), vm = _mm256_set1_ps(-m), vl = _mm256_set1_ps(x0),
               l2 = _mm256_set1_ps(LOG2E);
  double total = 0.0;
  for (int64_t b = lo; b < hi; b += SUM_BLOCK) {
    const int64_t end = std::min(hi, b + SUM_BLOCK);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t v = b; v < end; v += LANES) {
      const __m256 xv = load8(x, v, end);
      const __m256 t = _mm256_fmadd_ps(xv, vi, vm);
      __m256 p = exp2_8(_mm256_mul_ps(t, l2));
      if (CUT) p = _mm256_and_ps(p, _mm256_cmp_ps(xv, vl, _CMP_GE_OQ));
      if ((v - b) & LANES)
        acc1 = _mm256_add_ps(acc1, p);
      else
        acc0 = _mm256_add_ps(acc0, p);
      if (v + LANES <= end)
        _mm256_storeu_ps(e + v, p);
      else
        _mm256_maskstore_ps(e + v, tail_mask(end - v), p);
    }
    total += hsum_d(_mm256_add_ps(acc0, acc1));
  }
  return total;
}

// pass 3 over [lo, hi): sum |ex * a - ey * b|
inline double span_absdiff(const float* ex, const float* ey, float a, float b, int64_t lo, int64_t hi) {
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  double total = 0.0;
  for (int64_t blk = lo; blk < hi; blk += SUM_BLOCK) {
    const int64_t end = std::min(hi, blk + SUM_BLOCK);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t v = blk; v < end; v += LANES) {
      __m256 p, q;
      if (v + LANES <= end) {
        p = _mm256_loadu_ps(ex + v);
        q = _mm256_loadu_ps(ey + v);
      } else {
        const __m256i m = tail_mask(end - v);
        p = _mm256_maskload_ps(ex + v, m);
        q = _mm256_maskload_ps(ey + v, m);
      }
      const __m256 d = _mm256_fmsub_ps(p, va, _mm256_mul_ps(q, vb));
      acc = _mm256_add_ps(acc, _mm256_andnot_ps(sign, d));
    }
    total += hsum_d(acc);
  }
  return total;
}

// ---- the same three passes on 16 lanes (AVX-512, where the CPU has it: twice the work per
// instruction; exp scales by 2^n with vscalefps, which flushes below -104 to 0)
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

T512 inline __m512 exp2_16(__m512 t) {  // exp2_8 on 16 lanes
  const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(CUT), _CMP_GE_OQ);  // false for NaN and -inf
  t = _mm512_max_ps(t, _mm512_set1_ps(CUT));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(C5);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

T512 inline __mmask16 lanes16(int64_t v, int64_t end) {
  return v + 16 <= end ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (end - v)) - 1u);
}

T512 inline double hsum16_d(__m512 v) {
  const __m512d a = _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)),
                                  _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  return _mm512_reduce_add_pd(a);
}

T512 void span_max2_512(const float* x, const float* y, int64_t lo, int64_t hi, float& mx, float& my, bool& nan) {
  const __m512 ninf = _mm512_set1_ps(NEG_INF);
  __m512 ax = ninf, ay = ninf, bx = ninf, by = ninf;
  __mmask16 u = 0;
  int64_t v = lo;
  for (; v + 32 <= hi; v += 32) {
    const __m512 a = _mm512_loadu_ps(x + v), b = _mm512_loadu_ps(y + v);
    const __m512 c = _mm512_loadu_ps(x + v + 16), d = _mm512_loadu_ps(y + v + 16);
    ax = _mm512_max_ps(ax, a);
    ay = _mm512_max_ps(ay, b);
    bx = _mm512_max_ps(bx, c);
    by = _mm512_max_ps(by, d);
    u |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
  }
  for (; v < hi; v += 16) {
    const __mmask16 m = lanes16(v, hi);
    const __m512 a = _mm512_mask_loadu_ps(ninf, m, x + v), b = _mm512_mask_loadu_ps(ninf, m, y + v);
    ax = _mm512_max_ps(ax, a);
    ay = _mm512_max_ps(ay, b);
    u |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  }
  mx = std::max(mx, _mm512_reduce_max_ps(_mm512_max_ps(ax, bx)));
  my = std::max(my, _mm512_reduce_max_ps(_mm512_max_ps(ay, by)));
  nan |= u != 0;
}

template <bool CUT>
T512 double span_exp_512(const float* x, float inv, float m, float x0, float* e, int64_t lo, int64_t hi) {
  const __m512 vi = _mm512_set1_ps(inv), vm = _mm512_set1_ps(-m), vl = _mm512_set1_ps(x0),
               l2 = _mm512_set1_ps(LOG2E);
  double total = 0.0;
  for (int64_t b = lo; b < hi; b += SUM_BLOCK) {
    const int64_t end = std::min(hi, b + SUM_BLOCK);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t v = b;
    for (; v + 32 <= end; v += 32) {
      const __m512 x0v = _mm512_loadu_ps(x + v), x1v = _mm512_loadu_ps(x + v + 16);
      const __m512 t0 = _mm512_fmadd_ps(x0v, vi, vm);
      const __m512 t1 = _mm512_fmadd_ps(x1v, vi, vm);
      __m512 p0 = exp2_16(_mm512_mul_ps(t0, l2)), p1 = exp2_16(_mm512_mul_ps(t1, l2));
      if (CUT) {
        p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0v, vl, _CMP_GE_OQ), p0);
        p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1v, vl, _CMP_GE_OQ), p1);
      }
      acc0 = _mm512_add_ps(acc0, p0);
      acc1 = _mm512_add_ps(acc1, p1);
      _mm512_storeu_ps(e + v, p0);
      _mm512_storeu_ps(e + v + 16, p1);
    }
    for (; v < end; v += 16) {
      const __mmask16 k = lanes16(v, end);
      const __m512 xv = _mm512_maskz_loadu_ps(k, x + v);
      const __m512 t = _mm512_fmadd_ps(xv, vi, vm);
      __mmask16 keep = k;
      if (CUT) keep &= _mm512_cmp_ps_mask(xv, vl, _CMP_GE_OQ);
      const __m512 p = _mm512_maskz_mov_ps(keep, exp2_16(_mm512_mul_ps(t, l2)));
      acc0 = _mm512_add_ps(acc0, p);
      _mm512_mask_storeu_ps(e + v, k, p);
    }
    total += hsum16_d(_mm512_add_ps(acc0, acc1));
  }
  return total;
}

T512 double span_absdiff_512(const float* ex, const float* ey, float a, float b, int64_t lo, int64_t hi) {
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
  double total = 0.0;
  for (int64_t blk = lo; blk < hi; blk += SUM_BLOCK) {
    const int64_t end = std::min(hi, blk + SUM_BLOCK);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t v = blk;
    for (; v + 32 <= end; v += 32) {
      const __m512 d0 = _mm512_fmsub_ps(_mm512_loadu_ps(ex + v), va, _mm512_mul_ps(_mm512_loadu_ps(ey + v), vb));
      const __m512 d1 = _mm512_fmsub_ps(_mm512_loadu_ps(ex + v + 16), va, _mm512_mul_ps(_mm512_loadu_ps(ey + v + 16), vb));
      acc0 = _mm512_add_ps(acc0, _mm512_abs_ps(d0));
      acc1 = _mm512_add_ps(acc1, _mm512_abs_ps(d1));
    }
    for (; v < end; v += 16) {
      const __mmask16 k = lanes16(v, end);
      const __m512 d = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, ex + v), va, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, ey + v), vb));
      acc0 = _mm512_add_ps(acc0, _mm512_abs_ps(d));
    }
    total += hsum16_d(_mm512_add_ps(acc0, acc1));
  }
  return total;
}

// the 16-lane passes where the CPU has AVX-512, unless SPECROUTER_KERNELS=avx2 forces the
// 8-lane ones (as it forces the linears' path; read when the library loads)
const bool HAS_AVX512 = [] {
  const char* forced = std::getenv("SPECROUTER_KERNELS");
  if (forced != nullptr && std::strstr(forced, "avx2") != nullptr) return false;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
         && __builtin_cpu_supports("avx512dq");
}();

struct Position {
  const float* x;  // the drafter's logits
  const float* y;  // the verifier's
  float T;         // the temperature (> 0: sampled rows only)
  float inv;       // 1 / T
  float lmp;       // log(min_p), -inf: none
  int64_t k;       // top-k, 0: none
  float p;         // top-p, 1: none
  float thx = NEG_INF, thy = NEG_INF;  // each side's cut on its raw logits: keep x >= it (cut.h)
  bool lost = false;  // no cut found (NaN scores): no signal
};

// per (position, chunk) partial results
struct Part {
  float mx = NEG_INF, my = NEG_INF;
  bool nan = false;
  double zx = 0.0, zy = 0.0, diff = 0.0;
};

// drafts: P tensors (V,) float32 contiguous, the positions in row order; verifier (B, G, V)
// float32, last dim contiguous; vrows (R) the verifier row of each row; counts (R) its positions
// (position i of row r: its next draft tensor against verifier[vrows[r], i]); temperature (S,)
// float32 (> 0 for every row measured: sampled rows only; the table's greedy rows, 0, may be
// named by no srows entry), log_min_p (S,) float32 or empty (none), srows (R) the table row of each
// row -> (R,) float64: the mean D_TV over the row's positions, NaN for a row without any
at::Tensor tv_rows(at::TensorList drafts, const at::Tensor& verifier, at::IntArrayRef vrows, at::IntArrayRef counts,
                   const at::Tensor& temperature, const at::Tensor& log_min_p, const at::Tensor& top_k,
                   const at::Tensor& top_p, at::IntArrayRef srows) {
  TORCH_CHECK(verifier.dim() == 3 && verifier.device().is_cpu() && verifier.scalar_type() == at::kFloat
              && verifier.stride(2) == 1, "verifier: (B, G, V) float32 on the CPU, the last dim contiguous");
  const int64_t R = static_cast<int64_t>(vrows.size()), B = verifier.size(0), G = verifier.size(1),
                V = verifier.size(2), S = temperature.size(0);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == R && static_cast<int64_t>(srows.size()) == R,
              "vrows, counts and srows: one per row");
  TORCH_CHECK(temperature.dim() == 1 && temperature.scalar_type() == at::kFloat && temperature.is_contiguous()
              && temperature.device().is_cpu(), "temperature: (S,) float32 on the CPU");
  const bool min_p = log_min_p.numel() > 0;
  TORCH_CHECK(!min_p || (log_min_p.dim() == 1 && log_min_p.size(0) == S && log_min_p.scalar_type() == at::kFloat
                         && log_min_p.is_contiguous()), "log_min_p: (S,) float32 or empty");
  const bool filters = top_k.numel() > 0;
  TORCH_CHECK(!filters || (top_k.dim() == 1 && top_k.size(0) == S && top_k.scalar_type() == at::kLong && top_k.is_contiguous()
                           && top_p.dim() == 1 && top_p.size(0) == S && top_p.scalar_type() == at::kFloat
                           && top_p.is_contiguous()), "top_k, top_p: (S,) int64 and float32, or both empty");
  TORCH_CHECK(!(min_p || filters) || cut::exp_ok(), "tv_rows: filters need torch's MKL exp (this torch has none)");
  const float* temp = temperature.data_ptr<float>();
  const float* lmp = min_p ? log_min_p.data_ptr<float>() : nullptr;
  const int64_t* tk = filters ? top_k.data_ptr<int64_t>() : nullptr;
  const float* tp = filters ? top_p.data_ptr<float>() : nullptr;
  std::vector<Position> pos;
  std::vector<int64_t> first(R + 1, 0);  // row r's positions: [first[r], first[r + 1])
  const float* vbase = verifier.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(vrows[r] >= 0 && vrows[r] < B, "vrows: row ", vrows[r], " out of ", B);
    TORCH_CHECK(srows[r] >= 0 && srows[r] < S, "srows: row ", srows[r], " out of the table's ", S);
    TORCH_CHECK(counts[r] >= 0 && counts[r] <= G, "counts: ", counts[r], " positions, the verifier has ", G);
    const float t = temp[srows[r]];
    TORCH_CHECK(t > 0.0f, "tv_rows: temperature ", t, " (a greedy row? D_TV is measured for sampled rows only)");
    for (int64_t i = 0; i < counts[r]; ++i) {
      const int64_t k = static_cast<int64_t>(pos.size());
      TORCH_CHECK(k < static_cast<int64_t>(drafts.size()), "drafts: fewer tensors than the counts' positions");
      const at::Tensor& d = drafts[k];
      TORCH_CHECK(d.device().is_cpu() && d.scalar_type() == at::kFloat && d.numel() == V && d.is_contiguous(),
                  "drafts: (V,) float32 contiguous on the CPU");
      pos.push_back({d.data_ptr<float>(), vbase + vrows[r] * verifier.stride(0) + i * verifier.stride(1),
                     t, 1.0f / t, min_p ? lmp[srows[r]] : NEG_INF,
                     filters && tk[srows[r]] > 0 && tk[srows[r]] < V ? tk[srows[r]] : 0, filters ? tp[srows[r]] : 1.0f});
    }
    first[r + 1] = static_cast<int64_t>(pos.size());
  }
  TORCH_CHECK(pos.size() == drafts.size(), "drafts: more tensors than the counts' positions");
  at::Tensor out = at::empty({R}, verifier.options().dtype(at::kDouble));
  double* op = out.data_ptr<double>();
  const int64_t P = static_cast<int64_t>(pos.size());
  std::vector<double> tv(P, std::numeric_limits<double>::quiet_NaN());
  if (P > 0 && V > 0) {
    // chunks per position: enough units for the threads; chunk bounds are multiples of a block
    const int64_t threads = at::get_num_threads();
    const int64_t C = P >= threads ? 1 : std::min<int64_t>((threads + P - 1) / P, (V + SUM_BLOCK - 1) / SUM_BLOCK);
    const int64_t chunk = (((V + C - 1) / C) + SUM_BLOCK - 1) / SUM_BLOCK * SUM_BLOCK;
    // the exponentials: a buffer kept per calling thread (a fresh one each call paid its pages)
    thread_local std::vector<float> ebuf;
    if (static_cast<int64_t>(ebuf.size()) < P * 2 * V) ebuf.resize(P * 2 * V);
    float* eb = ebuf.data();
    std::vector<Part> parts(P * C);
    auto kof = [&](int64_t u) { return u / C; };  // unit u: chunk u % C of position u / C
    auto bounds = [&](int64_t u, int64_t& lo, int64_t& hi) {
      lo = (u % C) * chunk;
      hi = std::min(V, lo + chunk);
    };
    auto finish = [&](int64_t k) {  // position k's D_TV from its chunks' parts, or NaN
      Part all;
      for (int64_t c = 0; c < C; ++c) {
        const Part& q = parts[k * C + c];
        all.nan |= q.nan;
        all.zx += q.zx;
        all.zy += q.zy;
        all.diff += q.diff;
      }
      return all;
    };
    auto maxima = [&](int64_t k, float& mx, float& my, bool& nan) {
      float rx = NEG_INF, ry = NEG_INF;
      for (int64_t c = 0; c < C; ++c) {
        const Part& q = parts[k * C + c];
        rx = std::max(rx, q.mx);
        ry = std::max(ry, q.my);
        nan |= q.nan;
      }
      mx = rx * pos[k].inv;  // the scaled maxima: x -> x / T is monotone
      my = ry * pos[k].inv;
      nan |= !std::isfinite(mx) || !std::isfinite(my);
    };
    auto pass1 = [&](int64_t u) {
      int64_t lo, hi;
      bounds(u, lo, hi);
      Part& q = parts[u];
      if (HAS_AVX512)
        span_max2_512(pos[kof(u)].x, pos[kof(u)].y, lo, hi, q.mx, q.my, q.nan);
      else
        span_max2(pos[kof(u)].x, pos[kof(u)].y, lo, hi, q.mx, q.my, q.nan);
    };
    // between passes 1 and 2: each side's threshold (min-p, and top-k / top-p where the row has them)
    auto thresholds = [&](int64_t k) {
      Position& p = pos[k];
      if (p.lmp == NEG_INF && p.k == 0 && !(p.p < 1.0f)) return;
      float mx, my;
      bool nan = false;
      maxima(k, mx, my, nan);
      if (nan) return;
      thread_local cut::Scratch sc;
      cut::Filter f;
      f.T = p.T;
      f.lmp = p.lmp;
      f.k = p.k;
      f.p = p.p;
      f.unbounded = true;
      const cut::Cut cx = cut::find_cut(p.x, V, f, sc), cy = cut::find_cut(p.y, V, f, sc);
      p.lost = cx.status != cut::OK || cy.status != cut::OK;
      p.thx = cut::raw_cut(cx.thr, p.T);
      p.thy = cut::raw_cut(cy.thr, p.T);
    };
    auto pass2 = [&](int64_t u) {
      const int64_t k = kof(u);
      const Position& p = pos[k];
      float mx, my;
      bool nan = false;
      maxima(k, mx, my, nan);
      if (nan) return;
      int64_t lo, hi;
      bounds(u, lo, hi);
      float* ex = eb + k * 2 * V;
      auto exps = [](float thr) {
        const bool cut = !std::isinf(thr);
        return HAS_AVX512 ? (cut ? span_exp_512<true> : span_exp_512<false>) : (cut ? span_exp<true> : span_exp<false>);
      };
      parts[u].zx = exps(p.thx)(p.x, p.inv, mx, p.thx, ex, lo, hi);
      parts[u].zy = exps(p.thy)(p.y, p.inv, my, p.thy, ex + V, lo, hi);
    };
    auto pass3 = [&](int64_t u) {
      const int64_t k = kof(u);
      float mx, my;
      bool nan = false;
      maxima(k, mx, my, nan);
      if (nan) return;
      Part all = finish(k);
      int64_t lo, hi;
      bounds(u, lo, hi);
      const float* ex = eb + k * 2 * V;
      parts[u].diff = (HAS_AVX512 ? span_absdiff_512 : span_absdiff)(ex, ex + V, static_cast<float>(1.0 / all.zx), static_cast<float>(1.0 / all.zy), lo, hi);
    };
    if (C == 1) {  // each position on one thread, the passes back to back
      at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
          pass1(u);
          thresholds(u);
          pass2(u);
          pass3(u);
        }
      });
    } else {
      at::parallel_for(0, P * C, 1, [&](int64_t begin, int64_t end) { for (int64_t u = begin; u < end; ++u) pass1(u); });
      at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) { for (int64_t k = begin; k < end; ++k) thresholds(k); });
      at::parallel_for(0, P * C, 1, [&](int64_t begin, int64_t end) { for (int64_t u = begin; u < end; ++u) pass2(u); });
      at::parallel_for(0, P * C, 1, [&](int64_t begin, int64_t end) { for (int64_t u = begin; u < end; ++u) pass3(u); });
    }
    for (int64_t k = 0; k < P; ++k) {
      float mx, my;
      bool nan = false;
      maxima(k, mx, my, nan);
      if (!nan && !pos[k].lost) tv[k] = 0.5 * finish(k).diff;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = first[r + 1] - first[r];
    double total = 0.0;
    for (int64_t k = first[r]; k < first[r + 1]; ++k) total += tv[k];
    op[r] = n > 0 ? total / static_cast<double>(n) : std::numeric_limits<double>::quiet_NaN();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("tv_rows(Tensor[] drafts, Tensor verifier, int[] vrows, int[] counts, Tensor temperature, Tensor log_min_p, "
        "Tensor top_k, Tensor top_p, int[] srows) -> Tensor");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) { m.impl("tv_rows", &tv_rows); }
