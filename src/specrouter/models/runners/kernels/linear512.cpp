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
// included) nor on the threads, which split tiles of outputs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

// How far ahead (bytes) the float32 and the vdpbf16ps tiles prefetch their weight stream: two
// cache lines per k step (a tile streams one contiguous block and the tiles of a thread follow
// each other, so 8 KiB ahead runs into the next tile). On a Zen 5 (AMD EPYC, session 21,
// in-process A/B) bf16 135M T(17) 10.0 -> 8.2 ms, T(33) 16.1 -> 13.8, fp32 T(17) 17.1 -> 15.1,
// T(1) unchanged (4 KiB: 8.9 ms at 17 rows; 16 KiB as 8, 32-64 KiB 0.3-0.5 ms slower there); on
// Zen 4 it gained nothing (docs/kernels.md). Prefetches change no bits.
//
// Non-temporal (`PREFETCH_HINT`): each weight line is read once per forward, and a forward of the
// 135M target streams ~269 MB through the caches, evicting the host's working set (the
// interpreter, torch's dispatcher, the router's tables): the host work between two forwards then
// ran 3-5x slower than warm (a sampling call 45-80 us after a forward, 11-16 us warm; 70 us after
// a 300 MB sweep). With the NTA hint on a Zen 5 (session 22, in-process A/B, every other step,
// two runs): the target's bf16 forward 2.3-4.6% faster at 1, 2 and 5 tokens, the sampling call
// after it 26-43 us faster; the draft's forward (weights cache-resident) unchanged.
constexpr int64_t PREFETCH = 8192;
constexpr auto PREFETCH_HINT = _MM_HINT_NTA;  // (GCC: an enum _mm_hint, clang: an int)

// float32 x (R rows of K, row stride K) times one tile (K, 32) float32 -> acc (R, 32)
template <int R>
T512 void tile_f32(const float* x, int64_t K, const float* w, float* acc) {
  __m512 a[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += TILE) {
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    _mm_prefetch(reinterpret_cast<const char*>(w) + PREFETCH, PREFETCH_HINT);
    _mm_prefetch(reinterpret_cast<const char*>(w) + PREFETCH + 64, PREFETCH_HINT);
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

// float32 x (R rows of K) times one bfloat16 tile (K/2, 32, 2), widened: k then k + 1
template <int R>
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
template <int R>
T512BF void tile_bf16_dp(const bf16* x, int64_t K, const bf16* w, float* acc) {
  __m512 a[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2, w += 2 * TILE) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    _mm_prefetch(reinterpret_cast<const char*>(w) + PREFETCH, PREFETCH_HINT);
    _mm_prefetch(reinterpret_cast<const char*>(w) + PREFETCH + 64, PREFETCH_HINT);
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

// one tile for R = 1..ROWS rows (instantiated per R so the accumulators stay in registers)
#define DISPATCH_ROWS(fn, R, ...)                                  \
  switch (R) {                                                     \
    case 1: fn<1>(__VA_ARGS__); break;                             \
    case 2: fn<2>(__VA_ARGS__); break;                             \
    case 3: fn<3>(__VA_ARGS__); break;                             \
    case 4: fn<4>(__VA_ARGS__); break;                             \
    case 5: fn<5>(__VA_ARGS__); break;                             \
    case 6: fn<6>(__VA_ARGS__); break;                             \
    case 7: fn<7>(__VA_ARGS__); break;                             \
    case 8: fn<8>(__VA_ARGS__); break;                             \
    case 9: fn<9>(__VA_ARGS__); break;                             \
    case 10: fn<10>(__VA_ARGS__); break;                           \
    case 11: fn<11>(__VA_ARGS__); break;                           \
    default: fn<12>(__VA_ARGS__); break;                           \
  }

// tiles [t0, t1) of outputs, every row: for each tile, rows in blocks of block_rows(N)
template <typename T>
T512BF void run_tiles_dp(const bf16* x, int64_t N, int64_t K, const bf16* w, int64_t O, const T* bias,
                         const T* residual, T* y, int64_t t0, int64_t t1) {
  alignas(64) float acc[ROWS * TILE];
  const int64_t B = block_rows(N);
  for (int64_t t = t0; t < t1; ++t) {
    const bf16* wt = w + t * K * TILE;
    for (int64_t n = 0; n < N; n += B) {
      const int R = static_cast<int>(N - n < B ? N - n : B);
      DISPATCH_ROWS(tile_bf16_dp, R, x + n * K, K, wt, acc)
      finish16(acc, R, n, t * TILE, O, bias, residual, y);
    }
  }
}

template <typename T, typename W>
T512 void run_tiles_fma(const float* x, int64_t N, int64_t K, const W* w, int64_t O, const T* bias,
                        const T* residual, T* y, int64_t t0, int64_t t1) {
  alignas(64) float acc[ROWS * TILE];
  const int64_t B = block_rows(N);
  for (int64_t t = t0; t < t1; ++t) {
    const W* wt = w + t * K * TILE;
    for (int64_t n = 0; n < N; n += B) {
      const int R = static_cast<int>(N - n < B ? N - n : B);
      if constexpr (sizeof(W) == 4) {
        DISPATCH_ROWS(tile_f32, R, x + n * K, K, wt, acc)
      } else {
        DISPATCH_ROWS(tile_bf16_fma, R, x + n * K, K, wt, acc)
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
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      run_tiles_fma<float, float>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
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
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      run_tiles_dp<bf16>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
    });
  } else {
    at::Tensor xf = xc.to(at::kFloat);  // exact
    const float* xp = xf.data_ptr<float>();
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      run_tiles_fma<bf16, bf16>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
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
  if (mode == 0)
    run_tiles_fma<float, float>(static_cast<const float*>(x), N, K, static_cast<const float*>(w), O,
                                static_cast<const float*>(bias), static_cast<const float*>(residual),
                                static_cast<float*>(y), t0, t1);
  else if (mode == 1)
    run_tiles_fma<bf16, bf16>(static_cast<const float*>(x), N, K, b(w), O, b(bias), b(residual),
                              static_cast<bf16*>(y), t0, t1);
  else
    run_tiles_dp<bf16>(b(x), N, K, b(w), O, b(bias), b(residual), static_cast<bf16*>(y), t0, t1);
}

}  // namespace specrouter

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("linear512(Tensor x, Tensor weight, int out_features, Tensor? bias=None, Tensor? residual=None, bool dp=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) { m.impl("linear512", &specrouter::linear512); }
