// Row-invariant linear on AVX-512: `linear512`, two paths chosen by the caller (runners/linear.py)
// from the CPU's flags, each compiled for its own instruction set (function target attributes;
// the rest of the extension stays AVX2):
//
//   avx512     float32: one FMA per (row, 16 outputs, k); bfloat16 weights widened exactly to
//              float32 (shift / mask), activations widened exactly, the same FMAs.
//   avx512bf16 bfloat16 only: `vdpbf16ps`, 32 bfloat16 products per instruction (exact
//              products, float32 accumulation, the pair (k, k+1) summed into the accumulator in
//              the instruction's fixed order), activations in bfloat16 as the model computes them.
//
// Layout: a weight is packed once (runners/linear.py `pack_tiles`, tile 32) into tiles of TILE = 32
// outputs, (O/32, K, 32) float32 or (O/32, K/2, 32, 2) bfloat16, so a tile streams one
// contiguous block. The 16 lanes of an accumulator are 16 outputs of one row; each output of
// each row has its own accumulator, fed by one fixed sequence of instructions over k = 0, 1, ...
// (a broadcast activation times the weights), and is finished by one add of the bias, one of the
// residual and one rounding. A register tile is up to ROWS rows x 32 outputs (N rows in balanced
// blocks, `block_rows`): the weights of a k step are loaded once for all its rows. The row count decides only how many rows share those
// loads, never the sequence of an output: a row's bits do not depend on the other rows (1 row
// included) nor on the threads, which split tiles of outputs. Float32 at 1-3 rows off AMD runs
// 4 tiles side by side (`tile_f32_group`: 4 weight streams, the same FMAs per output).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cpuid.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "bf16.h"
#include "finish16.h"

namespace {

using namespace specrouter_bf16;  // bf16, load16, store16 (bf16.h), TILE, finish16 (finish16.h)

constexpr int64_t ROWS = 12;  // rows of a register tile: <= 24 accumulators (2 x 16 output lanes)

// The rows of a register tile for N rows: the fewest blocks of <= ROWS rows, balanced (17 rows:
// 9 + 8, not 12 + 5; 13: 7 + 6). A block of few rows is latency-bound (2 R accumulator chains,
// vdpbf16ps ~6 cycles): on a Zen 5 a 5-row remainder ran at ~250 GMAC/s where 9 rows ran at
// ~360 (docs/kernels.md, session 21). How rows are blocked changes no output's sequence.
inline int64_t block_rows(int64_t N) {
  if (N <= 0) return ROWS;  // no rows: the row loops run zero times (and no division by zero blocks)
  const int64_t blocks = (N + ROWS - 1) / ROWS;
  return (N + blocks - 1) / blocks;
}

// How far ahead (bytes) the float32 and the vdpbf16ps tiles prefetch their weight stream, and
// with which hint: two cache lines per k step (a tile streams one contiguous block and the tiles
// of a thread follow each other, so the prefetch runs into the next tile). Two policies, chosen
// per CPU vendor at load (`vendor_prefetch`; `set_linear512_prefetch` for tests and A/Bs): the
// prefetches change no value, so no bits (tests/test_linear.py).
//
// AMD (`Pf::nta`): 8 KiB ahead, non-temporal. On a Zen 5 (AMD EPYC, session 21, in-process
// A/B) bf16 135M T(17) 10.0 -> 8.2 ms, T(33) 16.1 -> 13.8, fp32 T(17) 17.1 -> 15.1, T(1)
// unchanged (4 KiB: 8.9 ms at 17 rows; 16 KiB as 8, 32-64 KiB 0.3-0.5 ms slower there); on Zen 4
// it gained nothing (docs/kernels.md). The hint: each weight line is read once per forward (a
// 135M target's forward streams ~269 MB); on a Zen 5 (session 22, in-process A/B, the hint
// switched every other step) with co-tenants on the cores (load ~2) the target's bf16 forward
// 2.3-4.6% faster at 1-5 tokens and the sampling call after it 26-43 us faster; on a quiet
// machine (load 0.5) both within 1%; the draft's forward unchanged.
//
// Every other vendor (`Pf::t0`): 2 KiB ahead into L1 (`_MM_HINT_T0`). On an Intel Xeon with
// AMX (Sapphire/Granite Rapids class, session 29, 2 threads, the 135M linears streamed from huge
// pages, min ms at 1 / 5 / 9 / 17 / 33 rows) the non-temporal prefetch throttled the stream to
// a third: fp32 54.2 / 50.6 / 43.3 / 90.4 / 133.6 ms with it (8 KiB; 2 KiB: 40.5 / 50.4 / 39.5
// / 93.2 / 131.1), 20.7 / 29.7 / 34.3 / 41.1 / 55.0 without any prefetch, 16.8 / 21.6 / 23.2 /
// 32.4 / 45.1 with T0 2 KiB ahead (T0 at 1-8 KiB, T1 at 2-8 KiB: no consistent difference
// beyond the noise in two runs); bf16 vdpbf16ps
// 27.3 / 22.5 / 25.2 / 52.8 / 84.8 -> 9.3 / 11.5 / 16.0 / 26.7 / 47.0 (docs/kernels.md).
enum class Pf { t0 = 0, nta = 1 };
template <Pf P> constexpr int64_t PREFETCH = P == Pf::nta ? 8192 : 2048;

template <Pf P>
T512 inline void prefetch_k(const void* w) {  // the two lines of the k step PREFETCH<P> bytes ahead
  const char* p = static_cast<const char*>(w) + PREFETCH<P>;
  if constexpr (P == Pf::nta) {
    _mm_prefetch(p, _MM_HINT_NTA);
    _mm_prefetch(p + 64, _MM_HINT_NTA);
  } else {
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
  }
}

inline Pf vendor_prefetch() {  // AMD: nta; Intel and the rest: t0
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return Pf::t0;
  char v[13];
  std::memcpy(v, &b, 4), std::memcpy(v + 4, &d, 4), std::memcpy(v + 8, &c, 4), v[12] = 0;
  return std::strcmp(v, "AuthenticAMD") == 0 ? Pf::nta : Pf::t0;
}

Pf g_prefetch = vendor_prefetch();  // set_linear512_prefetch

// float32 x (R rows of K, row stride K) times one tile (K, 32) float32 -> acc (R, 32)
template <int R, Pf P>
T512 void tile_f32(const float* x, int64_t K, const float* w, float* acc) {
  __m512 a[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += TILE) {
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    prefetch_k<P>(w);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      a[r][0] = _mm512_fmadd_ps(xb, w0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xb, w1, a[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * TILE, a[r][0]);
    _mm512_storeu_ps(acc + r * TILE + 16, a[r][1]);
  }
}

// float32, few rows, Pf::t0 only: GROUP tiles side by side (GROUP weight streams, each
// prefetched), up to GROUP_ROWS rows, acc (GROUP, GROUP_ROWS, 32). Each output's FMAs are
// tile_f32's, in the same order: only how many tiles share a pass changes. On the Intel Xeon
// of session 29 (the 135M linears streamed, min ms, 5 rounds) 1 / 2 / 3 rows 17.1 / 18.5 / 20.0
// ms one tile at a time, 17.1 / 16.6 / 16.4 four side by side (two: 16.2 / 17.6 / 17.2); 5 rows
// no gain (21.1 / 21.4), so from 4 rows one tile a pass. AMD (Pf::nta) keeps one tile a pass.
constexpr int GROUP = 4, GROUP_ROWS = 3;
static_assert(GROUP * GROUP_ROWS <= ROWS, "the group's accumulators fit a register tile's acc");

template <int R>
T512 void tile_f32_group(const float* x, int64_t K, const float* w, float* acc) {
  __m512 a[R][2 * GROUP];
  const int64_t stride = K * TILE;  // floats from a tile to the next
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * GROUP; ++j) a[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += TILE) {
#pragma GCC unroll 4
    for (int g = 0; g < GROUP; ++g) {
      const float* wg = w + g * stride;
      const __m512 w0 = _mm512_loadu_ps(wg), w1 = _mm512_loadu_ps(wg + 16);
      prefetch_k<Pf::t0>(wg);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * K + k]);
        a[r][2 * g] = _mm512_fmadd_ps(xb, w0, a[r][2 * g]);
        a[r][2 * g + 1] = _mm512_fmadd_ps(xb, w1, a[r][2 * g + 1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GROUP; ++g)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + (g * GROUP_ROWS + r) * TILE, a[r][2 * g]);
      _mm512_storeu_ps(acc + (g * GROUP_ROWS + r) * TILE + 16, a[r][2 * g + 1]);
    }
}

// float32 x (R rows of K) times one bfloat16 tile (K/2, 32, 2), widened: k then k + 1 (no
// prefetch: P unused, one instantiation, Pf::t0)
template <int R, Pf P>
T512 void tile_bf16_fma(const float* x, int64_t K, const bf16* w, float* acc) {
  __m512 a[R][2];
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2, w += 2 * TILE) {
    const __m512i v0 = _mm512_loadu_si512(w), v1 = _mm512_loadu_si512(w + 32);
    const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, hi));
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, hi));
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(x[r * K + k]), xo = _mm512_set1_ps(x[r * K + k + 1]);
      a[r][0] = _mm512_fmadd_ps(xo, o0, _mm512_fmadd_ps(xe, e0, a[r][0]));
      a[r][1] = _mm512_fmadd_ps(xo, o1, _mm512_fmadd_ps(xe, e1, a[r][1]));
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * TILE, a[r][0]);
    _mm512_storeu_ps(acc + r * TILE + 16, a[r][1]);
  }
}

// bfloat16 x (R rows of K) times one bfloat16 tile (K/2, 32, 2) with vdpbf16ps
template <int R, Pf P>
T512BF void tile_bf16_dp(const bf16* x, int64_t K, const bf16* w, float* acc) {
  __m512 a[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2, w += 2 * TILE) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    prefetch_k<P>(w);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + k, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      a[r][0] = _mm512_dpbf16_ps(a[r][0], xb, w0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], xb, w1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * TILE, a[r][0]);
    _mm512_storeu_ps(acc + r * TILE + 16, a[r][1]);
  }
}

// one tile for R = 1..ROWS rows (instantiated per R so the accumulators stay in registers) and
// the prefetch policy P
#define DISPATCH_ROWS(fn, P, R, ...)                               \
  switch (R) {                                                     \
    case 1: fn<1, P>(__VA_ARGS__); break;                          \
    case 2: fn<2, P>(__VA_ARGS__); break;                          \
    case 3: fn<3, P>(__VA_ARGS__); break;                          \
    case 4: fn<4, P>(__VA_ARGS__); break;                          \
    case 5: fn<5, P>(__VA_ARGS__); break;                          \
    case 6: fn<6, P>(__VA_ARGS__); break;                          \
    case 7: fn<7, P>(__VA_ARGS__); break;                          \
    case 8: fn<8, P>(__VA_ARGS__); break;                          \
    case 9: fn<9, P>(__VA_ARGS__); break;                          \
    case 10: fn<10, P>(__VA_ARGS__); break;                        \
    case 11: fn<11, P>(__VA_ARGS__); break;                        \
    default: fn<12, P>(__VA_ARGS__); break;                        \
  }

// tiles [t0, t1) of outputs, every row: for each tile, rows in blocks of block_rows(N)
template <typename T, Pf P>
T512BF void run_tiles_dp(const bf16* x, int64_t N, int64_t K, const bf16* w, int64_t O, const T* bias,
                         const T* residual, T* y, int64_t t0, int64_t t1) {
  alignas(64) float acc[ROWS * TILE];
  const int64_t B = block_rows(N);
  for (int64_t t = t0; t < t1; ++t) {
    const bf16* wt = w + t * K * TILE;
    for (int64_t n = 0; n < N; n += B) {
      const int R = static_cast<int>(N - n < B ? N - n : B);
      DISPATCH_ROWS(tile_bf16_dp, P, R, x + n * K, K, wt, acc)
      finish16(acc, R, n, t * TILE, O, bias, residual, y);
    }
  }
}

template <typename T, typename W, Pf P>
T512 void run_tiles_fma(const float* x, int64_t N, int64_t K, const W* w, int64_t O, const T* bias,
                        const T* residual, T* y, int64_t t0, int64_t t1) {
  alignas(64) float acc[ROWS * TILE];
  const int64_t B = block_rows(N);
  int64_t t = t0;
  if constexpr (sizeof(W) == 4 && P == Pf::t0) {
    if (N >= 1 && N <= GROUP_ROWS) {  // GROUP tiles a pass, then the rest one at a time (no rows: nothing)
      for (; t + GROUP <= t1; t += GROUP) {
        const W* wt = w + t * K * TILE;
        if (N == 1) tile_f32_group<1>(x, K, wt, acc);
        else if (N == 2) tile_f32_group<2>(x, K, wt, acc);
        else tile_f32_group<3>(x, K, wt, acc);
        for (int g = 0; g < GROUP; ++g)
          finish16(acc + g * GROUP_ROWS * TILE, static_cast<int>(N), 0, (t + g) * TILE, O, bias, residual, y);
      }
    }
  }
  for (; t < t1; ++t) {
    const W* wt = w + t * K * TILE;
    for (int64_t n = 0; n < N; n += B) {
      const int R = static_cast<int>(N - n < B ? N - n : B);
      if constexpr (sizeof(W) == 4) {
        DISPATCH_ROWS(tile_f32, P, R, x + n * K, K, wt, acc)
      } else {
        DISPATCH_ROWS(tile_bf16_fma, P, R, x + n * K, K, wt, acc)
      }
      finish16(acc, R, n, t * TILE, O, bias, residual, y);
    }
  }
}

}  // namespace

namespace specrouter {

// x (N, K); weight packed by pack_tiles ((ceil(O/32), K, 32) float32 or (ceil(O/32), K/2, 32, 2)
// bfloat16, dtype of x); bias (O,) or None; residual (N, O) or None; dp: bfloat16 on
// vdpbf16ps (else widened FMAs) -> (N, O), dtype of x
at::Tensor linear512(const at::Tensor& x, const at::Tensor& weight, int64_t O, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual, bool dp) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x: (N, K) on the CPU");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "linear512: float32 or bfloat16, got ", dt);
  TORCH_CHECK(!dp || dt == at::kBFloat16, "linear512: vdpbf16ps takes bfloat16");
  const int64_t N = x.size(0), K = x.size(1), tiles = (O + TILE - 1) / TILE;
  TORCH_CHECK(weight.scalar_type() == dt && weight.is_contiguous() && weight.numel() == tiles * K * TILE &&
                  weight.size(0) == tiles && (dt == at::kFloat || K % 2 == 0),
              "weight: packed by pack_tiles (tile 32) for x (", N, ", ", K, ") and O=", O);
  at::Tensor b, r;
  if (bias && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == dt && b.numel() == O, "bias: (", O, ",) of the dtype of x");
  }
  if (residual && residual->defined()) {
    r = residual->contiguous();
    TORCH_CHECK(r.scalar_type() == dt && r.dim() == 2 && r.size(0) == N && r.size(1) == O,
                "residual: (N, O), dtype of x");
  }
  at::Tensor y = at::empty({N, O}, x.options());
  if (N == 0) return y;
  at::Tensor xc = x.contiguous();
  if (dt == at::kFloat) {
    const float* xp = xc.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    const float* rp = r.defined() ? r.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const Pf pf = g_prefetch;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      if (pf == Pf::nta) run_tiles_fma<float, float, Pf::nta>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
      else run_tiles_fma<float, float, Pf::t0>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
    });
    return y;
  }
  auto p = [](const at::Tensor& t) { return t.defined() ? reinterpret_cast<const bf16*>(t.data_ptr()) : nullptr; };
  const bf16* wp = p(weight);
  const bf16* bp = p(b);
  const bf16* rp = p(r);
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  if (dp) {
    const bf16* xp = p(xc);
    const Pf pf = g_prefetch;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      if (pf == Pf::nta) run_tiles_dp<bf16, Pf::nta>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
      else run_tiles_dp<bf16, Pf::t0>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
    });
  } else {
    at::Tensor xf = xc.to(at::kFloat);  // exact
    const float* xp = xf.data_ptr<float>();
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      run_tiles_fma<bf16, bf16, Pf::t0>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
    });
  }
  return y;
}

// tiles [t0, t1) of linear512 for `decoder_layers`' own threads (the caller checked the shapes):
// mode 0 float32 (x float32), 1 bfloat16 widened (x float32: the activations widened, exactly),
// 2 bfloat16 on vdpbf16ps (x bfloat16); y may be the residual (each output reads its own
// residual element first)
void linear512_tiles(int mode, const void* x, int64_t N, int64_t K, const void* w, int64_t O, const void* bias,
                     const void* residual, void* y, int64_t t0, int64_t t1) {
  auto b = [](const void* p) { return static_cast<const bf16*>(p); };
  auto f = [](const void* p) { return static_cast<const float*>(p); };
  const bool nta = g_prefetch == Pf::nta;
  if (mode == 0 && nta)
    run_tiles_fma<float, float, Pf::nta>(f(x), N, K, f(w), O, f(bias), f(residual), static_cast<float*>(y), t0, t1);
  else if (mode == 0)
    run_tiles_fma<float, float, Pf::t0>(f(x), N, K, f(w), O, f(bias), f(residual), static_cast<float*>(y), t0, t1);
  else if (mode == 1)
    run_tiles_fma<bf16, bf16, Pf::t0>(f(x), N, K, b(w), O, b(bias), b(residual), static_cast<bf16*>(y), t0, t1);
  else if (nta)
    run_tiles_dp<bf16, Pf::nta>(b(x), N, K, b(w), O, b(bias), b(residual), static_cast<bf16*>(y), t0, t1);
  else
    run_tiles_dp<bf16, Pf::t0>(b(x), N, K, b(w), O, b(bias), b(residual), static_cast<bf16*>(y), t0, t1);
}

// the prefetch policy of the float32 and vdpbf16ps tiles: "nta" (8 KiB ahead, non-temporal: the
// AMD default), "t0" (2 KiB ahead into L1: every other vendor's) or "auto" (this CPU vendor's);
// returns the policy before (tests and benchmarks: both policies on one machine, bit for bit)
std::string set_linear512_prefetch(const std::string& kind) {
  const std::string before = g_prefetch == Pf::nta ? "nta" : "t0";
  if (kind == "nta") g_prefetch = Pf::nta;
  else if (kind == "t0") g_prefetch = Pf::t0;
  else if (kind == "auto") g_prefetch = vendor_prefetch();
  else TORCH_CHECK(false, "set_linear512_prefetch: nta, t0 or auto, got ", kind);
  return before;
}

}  // namespace specrouter

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("linear512(Tensor x, Tensor weight, int out_features, Tensor? bias=None, Tensor? residual=None, bool dp=False) -> Tensor");
  m.def("set_linear512_prefetch(str kind) -> str", &specrouter::set_linear512_prefetch);
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) { m.impl("linear512", &specrouter::linear512); }
