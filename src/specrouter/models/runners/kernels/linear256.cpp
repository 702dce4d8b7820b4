// Row-invariant linear on AVX2 + FMA (kernel path `avx2`, and the float32 / bfloat16 linear of
// CPUs without AVX-512): linear512.cpp's design on 256-bit registers, llama.cpp tinyBLAS's tile.
//
// Layout: a weight is packed once (runners/linear.py `pack_tiles`, tile 16) into tiles of TILE =
// 16 outputs, (O/16, K, 16) float32 or (O/16, K/2, 16, 2) bfloat16 (the pair k, k+1 of an output
// side by side), so a tile streams one contiguous block. The 8 lanes of an accumulator are 8
// outputs of one row; each output of each row has its own accumulator, fed by one fixed sequence
// of FMAs over k = 0, 1, ... (a broadcast float32 activation times the weight; bfloat16 weights
// widened exactly with a shift or a mask, k then k + 1), and is finished by one add of the bias,
// one of the residual and one rounding. A register tile is R <= ROWS rows x G tiles (R x 2G
// accumulators): the weights of a k step are loaded once for the R rows, and G tiles side by
// side give few rows enough independent FMA chains to hide the FMA latency. R and G decide only
// how many outputs and rows share the loads, never the sequence of an output: a row's bits do
// not depend on the other rows (1 row included) nor on the threads, which split tiles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>

#include "bf16.h"

namespace {

using namespace specrouter_bf16;  // bf16, to_f, store, load8, store8 (bf16.h)

constexpr int64_t TILE = 16;  // 2 x 8 output lanes
constexpr int ROWS = 6;       // <= 12 accumulators + 2 weights + a broadcast: the 16 ymm registers
// bfloat16: prefetch each tile's stream this many bytes ahead. With several rows the bfloat16
// tile is FMA-bound (the widening, 4 R FMAs per 64 bytes), the hardware prefetchers fall behind
// and the loads stall the FMAs: on Zen 4 (forced avx2, 2 threads) the 120 layer linears of the
// 135M target at 5 rows took 10.0 ms without, 6.8-6.9 ms at 2-4 KiB ahead (1 row unchanged).
constexpr int64_t PREFETCH_BF16 = 4096;
// float32, from PREFETCH_F32_ROWS rows: the same, 4 KiB ahead. On Zen 1 (half-rate FMAs) the
// several-row float32 tile is FMA-bound too: the 135M target's 5-token step took 31-32 ms
// without, 25-27 ms with (2 threads). A lone row is memory-bound and does not prefetch (on Zen 4
// prefetching lost up to 10% at 1-3 rows).
constexpr int64_t PREFETCH_F32 = 4096;
constexpr int PREFETCH_F32_ROWS = 2;

// tiles side by side per row count: R x 2G <= 12 accumulators, >= 8 chains where it fits
constexpr int tiles_for(int R) { return R == 1 ? 4 : R <= 3 ? 2 : 1; }

// acc (R rows, G tiles, 2 x 8 lanes) of rows n0.. and tiles t0.. -> y: + bias, then residual +,
// one rounding; 8 outputs at a time (store8 = the scalar store lane by lane), the last tile's
// padding outputs dropped (a partial 8 through the scalar ops, the same bits)
template <int R, int G, typename T>
inline void finish(const __m256 (&a)[R][2 * G], int64_t n0, int64_t t0, int64_t O, const T* bias,
                   const T* residual, T* y) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r;
#pragma GCC unroll 8
    for (int j = 0; j < 2 * G; ++j) {
      const int64_t o = t0 * TILE + 8 * j;
      const int64_t w = O - o;
      if (w <= 0) break;
      if (w >= 8) {
        __m256 v = a[r][j];
        if (bias) v = _mm256_add_ps(v, load8(bias + o));
        if (residual) v = _mm256_add_ps(load8(residual + n * O + o), v);
        store8(y + n * O + o, v);
      } else {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, a[r][j]);
        for (int64_t i = 0; i < w; ++i) {
          float v = lanes[i];
          if (bias) v += to_f(bias[o + i]);
          if (residual) v = to_f(residual[n * O + o + i]) + v;
          store(&y[n * O + o + i], v);
        }
      }
    }
  }
}

// float32 x (R rows of K, row stride K) times G float32 tiles (K, 16) at w, w + tile, ...
template <int R, int G>
inline void tile_f32(const float* x, int64_t K, const float* w, int64_t tile, __m256 (&a)[R][2 * G]) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * G; ++j) a[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += TILE) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      if constexpr (R >= PREFETCH_F32_ROWS)  // one 64-byte line a k
        _mm_prefetch(reinterpret_cast<const char*>(w + g * tile) + PREFETCH_F32, _MM_HINT_T0);
      const __m256 w0 = _mm256_loadu_ps(w + g * tile), w1 = _mm256_loadu_ps(w + g * tile + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
        a[r][2 * g] = _mm256_fmadd_ps(xb, w0, a[r][2 * g]);
        a[r][2 * g + 1] = _mm256_fmadd_ps(xb, w1, a[r][2 * g + 1]);
      }
    }
  }
}

// float32 x (R rows of K) times G bfloat16 tiles (K/2, 16, 2), widened: k then k + 1. With
// several tiles side by side (G > 1: 1-3 rows) the k + 1 halves are masked from memory again
// (an and with a memory operand) rather than kept in registers across the k FMAs: the 2G raw
// vectors live otherwise beside 2RG accumulators spilled to the stack every k pair
template <int R, int G>
inline void tile_bf16(const float* x, int64_t K, const bf16* w, int64_t tile, __m256 (&a)[R][2 * G]) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256 hi_ps = _mm256_castsi256_ps(hi);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * G; ++j) a[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 2, w += 2 * TILE) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const bf16* wg = w + g * tile;
      _mm_prefetch(reinterpret_cast<const char*>(wg) + PREFETCH_BF16, _MM_HINT_T0);  // one 64-byte line a k pair
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 16));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 xe = _mm256_broadcast_ss(x + r * K + k);
        a[r][2 * g] = _mm256_fmadd_ps(xe, e0, a[r][2 * g]);
        a[r][2 * g + 1] = _mm256_fmadd_ps(xe, e1, a[r][2 * g + 1]);
      }
      __m256 o0, o1;
      if constexpr (G > 1) {
        o0 = _mm256_and_ps(hi_ps, _mm256_loadu_ps(reinterpret_cast<const float*>(wg)));
        o1 = _mm256_and_ps(hi_ps, _mm256_loadu_ps(reinterpret_cast<const float*>(wg + 16)));
      } else {
        o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
        o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 xo = _mm256_broadcast_ss(x + r * K + k + 1);
        a[r][2 * g] = _mm256_fmadd_ps(xo, o0, a[r][2 * g]);
        a[r][2 * g + 1] = _mm256_fmadd_ps(xo, o1, a[r][2 * g + 1]);
      }
    }
  }
}

// rows [n0, n0 + R) x tiles [t0, t0 + G): one register tile, then its outputs
template <int R, int G, typename T, typename W>
inline void block(const float* x, int64_t n0, int64_t K, const W* w, int64_t t0, int64_t O, const T* bias,
                  const T* residual, T* y) {
  __m256 a[R][2 * G];
  const int64_t tile = K * TILE;  // elements of one packed tile
  if constexpr (sizeof(W) == 4)
    tile_f32<R, G>(x + n0 * K, K, w + t0 * tile, tile, a);
  else
    tile_bf16<R, G>(x + n0 * K, K, w + t0 * tile, tile, a);
  finish<R, G, T>(a, n0, t0, O, bias, residual, y);
}

// rows [n0, n0 + R) over tiles [t0, t1): G tiles at a time, then 2 (a lone row's remainder keeps
// 4 FMA chains), then the rest one by one
template <int R, typename T, typename W>
inline void rows(const float* x, int64_t n0, int64_t K, const W* w, int64_t t0, int64_t t1, int64_t O,
                 const T* bias, const T* residual, T* y) {
  constexpr int G = tiles_for(R);
  int64_t t = t0;
  for (; t + G <= t1; t += G) block<R, G, T, W>(x, n0, K, w, t, O, bias, residual, y);
  if constexpr (G > 2)
    for (; t + 2 <= t1; t += 2) block<R, 2, T, W>(x, n0, K, w, t, O, bias, residual, y);
  for (; t < t1; ++t) block<R, 1, T, W>(x, n0, K, w, t, O, bias, residual, y);
}

// tiles [t0, t1) of outputs, every row: up to ROWS rows in one pass over the tiles; more in
// groups of 8 tiles (a group's weights stay in cache for all its row blocks)
template <typename T, typename W>
void tiles_range(const float* x, int64_t N, int64_t K, const W* w, int64_t O, const T* bias, const T* residual,
                 T* y, int64_t t0, int64_t t1) {
  const int64_t group = N <= ROWS ? t1 - t0 : 8;
  for (int64_t g0 = t0; g0 < t1; g0 += group) {
    const int64_t g1 = g0 + group < t1 ? g0 + group : t1;
    for (int64_t n = 0; n < N; n += ROWS) {
      switch (N - n < ROWS ? N - n : ROWS) {
        case 1: rows<1, T, W>(x, n, K, w, g0, g1, O, bias, residual, y); break;
        case 2: rows<2, T, W>(x, n, K, w, g0, g1, O, bias, residual, y); break;
        case 3: rows<3, T, W>(x, n, K, w, g0, g1, O, bias, residual, y); break;
        case 4: rows<4, T, W>(x, n, K, w, g0, g1, O, bias, residual, y); break;
        case 5: rows<5, T, W>(x, n, K, w, g0, g1, O, bias, residual, y); break;
        default: rows<6, T, W>(x, n, K, w, g0, g1, O, bias, residual, y); break;
      }
    }
  }
}

template <typename T, typename W>
void linear_impl(const float* x, int64_t N, int64_t K, const W* w, int64_t O, const T* bias,
                 const T* residual, T* y) {
  const int64_t tiles = (O + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    tiles_range<T, W>(x, N, K, w, O, bias, residual, y, t0, t1);
  });
}

}  // namespace

namespace specrouter {

// x (N, K); weight packed by pack_tiles with tile 16 ((ceil(O/16), K, 16) float32 or
// (ceil(O/16), K/2, 16, 2) bfloat16, dtype of x); bias (O,) or None; residual (N, O) or None
// -> (N, O), dtype of x
at::Tensor linear256(const at::Tensor& x, const at::Tensor& weight, int64_t O, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x: (N, K) on the CPU");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rowinv.linear: float32 or bfloat16, got ", dt);
  const int64_t N = x.size(0), K = x.size(1), tiles = (O + TILE - 1) / TILE;
  TORCH_CHECK(weight.scalar_type() == dt && weight.is_contiguous() && weight.numel() == tiles * K * TILE &&
                  weight.size(0) == tiles && (dt == at::kFloat || K % 2 == 0),
              "weight: packed by pack_tiles (tile 16) for x (", N, ", ", K, ") and O=", O);
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
  at::Tensor xf = x.to(at::kFloat).contiguous();  // exact
  const float* xp = xf.data_ptr<float>();
  if (dt == at::kFloat) {
    linear_impl<float, float>(xp, N, K, weight.data_ptr<float>(), O, b.defined() ? b.data_ptr<float>() : nullptr,
                              r.defined() ? r.data_ptr<float>() : nullptr, y.data_ptr<float>());
    return y;
  }
  auto p = [](const at::Tensor& t) { return t.defined() ? reinterpret_cast<const bf16*>(t.data_ptr()) : nullptr; };
  linear_impl<bf16, bf16>(xp, N, K, p(weight), O, p(b), p(r), reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

// tiles [t0, t1) of linear256 for `decoder_layers`' own threads (the caller checked the shapes):
// x (N, K) float32 (bfloat16 activations widened, exactly); w, bias, residual, y float32 or,
// with bf, bfloat16; y may be the residual (each output reads its own residual element first)
void linear256_tiles(bool bf, const float* x, int64_t N, int64_t K, const void* w, int64_t O, const void* bias,
                     const void* residual, void* y, int64_t t0, int64_t t1) {
  if (bf)
    tiles_range<bf16, bf16>(x, N, K, static_cast<const bf16*>(w), O, static_cast<const bf16*>(bias),
                            static_cast<const bf16*>(residual), static_cast<bf16*>(y), t0, t1);
  else
    tiles_range<float, float>(x, N, K, static_cast<const float*>(w), O, static_cast<const float*>(bias),
                              static_cast<const float*>(residual), static_cast<float*>(y), t0, t1);
}

}  // namespace specrouter

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("linear(Tensor x, Tensor weight, int out_features, Tensor? bias=None, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) { m.impl("linear", &specrouter::linear256); }
