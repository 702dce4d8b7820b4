// Row-invariant bfloat16 linear on AMX tiles (`linear_amx`, the kernel path `amx`; its float32
// linears are linear512.cpp's AVX-512F FMAs). Compiled for its own instruction set (a function
// target attribute; the rest of the extension stays AVX2).
//
// The weight is packed as for linear512 (runners/linear.py `pack_tiles`, tile 32: (O/32, K/2, 32,
// 2) bfloat16), which is already AMX's B layout: for a chunk of 32 k, outputs 0-15 of a tile are
// 16 rows (k pairs) x 64 bytes at a row stride of 128 bytes, outputs 16-31 the other 64 bytes.
// A row block of M <= 16 rows of x is an A tile (M rows x 32 bfloat16, row stride K * 2 bytes).
// `tdpbf16ps` accumulates C (M rows x 16 outputs, float32) += A B: each C row depends only on its
// own A row and on B (AMX computes the rows alike, whatever M: checked bitwise at every M of
// 1-16 and every row position in the tests). So an output's sequence is fixed by K alone: the
// chunks of 32 k in order, then one chunk of the K % 32 tail (its own tile registers, configured
// by K, never by M), then linear512's finish (finish16.h: + bias, + residual, one rounding).
// The row count decides only how many rows share a B load: a row's bits do not depend on the
// other rows (1 row included) nor on the threads, which split tiles of outputs.
//
// Tile registers, K % 32 == 0 (every width of SmolLM2 and the shipped draft): two packed tiles
// side by side (`tile2`: two weight streams; C 0, 1 and 2, 3, A 4, B 5, 6, 7), a thread's odd
// last tile alone (`tile1`: C 0, 1, A 4, B 5, 6); K % 32 != 0: every tile by `tile1`, then the
// tail on A 2 (K % 32 bfloat16 wide), B 3, 7 ((K % 32) / 2 rows). Up to 16 rows make one pass over a
// thread's tiles; more go through groups of GROUP tiles (whose weights stay in cache) one
// row block at a time. Which tiles share an A load never changes an output's instructions.
// A call of at most `g_vector_rows` rows (2 by default: the 1-token step and its pair) runs the vector form of
// the same sums instead (`run_vector`, below: AVX-512 FMAs that compute what tdpbf16ps computes,
// bit for bit), streaming 4 tiles side by side: faster where the weights stream from memory for
// one or two rows. Either form gives a row the same bits, so the threshold is free to move. That
// equality is this CPU's (Sapphire Rapids; the SDM's older pseudo-code says otherwise), so a
// process checks it before its first AMX linear (`vector_check`, 4096 sums of typical, wide,
// flushed and cancelling data) and runs the vector form only where it holds
// (`amx_vector_check`; runners/linear.py `amx_vector_verdict`, in `kernels()`).
// Linux grants a process the tile data state on request (`amx_ready`:
// arch_prctl ARCH_REQ_XCOMP_PERM); without it a tile instruction is SIGILL, so every entry checks
// it first. The tile configuration is per thread: every call configures its thread's tiles and
// releases them at the end (oneDNN, which torch's bfloat16 GEMMs run on, configures the same
// registers its own way on the same threads); `decoder_layers` holds its threads' configuration
// for its whole region instead (`amx_hold`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "bf16.h"
#include "finish16.h"

#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

namespace {

using namespace specrouter_bf16;  // bf16, TILE, finish16

constexpr int MT = 16;     // rows of a tile: the rows of x an A tile holds
constexpr int64_t KC = 32;  // bfloat16 of k an A tile row holds (64 bytes)
constexpr int64_t GROUP = 4;  // more than MT rows: tiles whose weights stay in cache for all row blocks

// ldtilecfg's 64-byte operand (palette 1)
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// this thread's tiles for row blocks of M rows and a K tail of kt (even, < 32) bfloat16
TAMX void configure(int M, int kt) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  if (kt) {  // tile1's registers as below (C 0, 1, A 4, B 5, 6), the tail on A 2, B 3, 7
    for (int t : {0, 1, 4}) c.rows[t] = M, c.colsb[t] = 64;
    for (int t : {5, 6}) c.rows[t] = 16, c.colsb[t] = 64;
    c.rows[2] = M, c.colsb[2] = kt * 2;
    c.rows[3] = c.rows[7] = kt / 2, c.colsb[3] = c.colsb[7] = 64;
  } else {  // C 0, 1, 2, 3, A 4, B 5, 6, 7 (tile1 and tile2)
    for (int t : {0, 1, 2, 3, 4}) c.rows[t] = M, c.colsb[t] = 64;
    for (int t : {5, 6, 7}) c.rows[t] = 16, c.colsb[t] = 64;
  }
  // inline asm, not _tile_loadconfig: GCC 12 drops the stores to `c` before the builtin (it
  // does not see the builtin read them) and configures nothing
  asm volatile("ldtilecfg %0" ::"m"(c));
}

TAMX void release() { _tile_release(); }

// the first pass over a tile prefetches its weight stream this many bytes ahead (into L1). A
// 1-token step streams every weight once from memory; measured on a 2-core Xeon with AMX (the
// 135M target, 2 threads, in turns in one process): T(1) 11.3 ms without, 10.7 with, two tiles
// side by side (tile2); 4 and 8 KiB, a far prefetch into L2 (36-144 KiB ahead) and
// tileloaddt1 read within the noise of it (docs/kernels.md, session 14)
constexpr int64_t PREFETCH = 2048;

TAMX inline void prefetch_chunk(const bf16* w) {  // the 2 KiB of the chunk PREFETCH bytes ahead
  const char* p = reinterpret_cast<const char*>(w) + PREFETCH;
  for (int i = 0; i < KC * TILE * 2; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// M rows of x (row stride K) times one packed tile (K/2, 32, 2) -> acc (M, 32) float32, any even
// K: the chunks of 32 on C 0, 1, A 4, B 5, 6, then a K % 32 tail on A 2, B 3, 7 (configured so
// only where K has one)
TAMX void tile1(const bf16* x, int64_t K, const bf16* w, float* acc, bool pf) {
  const int64_t kf = K - K % KC, stride = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < kf; k += KC, w += KC * TILE) {
    if (pf) prefetch_chunk(w);
    _tile_loadd(4, x + k, stride);
    _tile_loadd(5, w, 2 * TILE * 2);
    _tile_loadd(6, w + 32, 2 * TILE * 2);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
  }
  if (kf < K) {  // the tail: rows (K % 32) / 2 of B, (K % 32) bfloat16 of A
    _tile_loadd(2, x + kf, stride);
    _tile_loadd(3, w, 2 * TILE * 2);
    _tile_loadd(7, w + 32, 2 * TILE * 2);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 7);
  }
  _tile_stored(0, acc, TILE * 4);
  _tile_stored(1, acc + 16, TILE * 4);
}

// K % 32 == 0: two packed tiles side by side (w and w + K * TILE), C 0, 1 and 2, 3, A 4 shared,
// B 5, 6, 7 (5 again for the second tile's upper half) -> acc, acc + MT * TILE
TAMX void tile2(const bf16* x, int64_t K, const bf16* w, float* acc, bool pf) {
  const int64_t stride = K * 2;
  const bf16* u = w + K * TILE;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += KC, w += KC * TILE, u += KC * TILE) {
    if (pf) prefetch_chunk(w), prefetch_chunk(u);
    _tile_loadd(4, x + k, stride);
    _tile_loadd(5, w, 2 * TILE * 2);
    _tile_loadd(6, w + 32, 2 * TILE * 2);
    _tile_loadd(7, u, 2 * TILE * 2);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, u + 32, 2 * TILE * 2);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, acc, TILE * 4);
  _tile_stored(1, acc + 16, TILE * 4);
  _tile_stored(2, acc + MT * TILE, TILE * 4);
  _tile_stored(3, acc + MT * TILE + 16, TILE * 4);
}

// ---- The vector form of tdpbf16ps (AVX-512F FMAs), for a few rows ----
// What one tdpbf16ps computes, established on this path's CPU (tests/test_linear.py and the
// standalone probe in docs/kernels.md: millions of random and adversarial cases, bit for bit):
// per C element, the chunk's even products summed in one float32 accumulator from +0 and its odd
// products in another, each by FMAs in k order (products exact, round to nearest even, denormal
// inputs as zero, denormal results flushed), then C + (even + odd), rounded and flushed alike. Not
// the older pseudo-code's interleaved even, odd FMAs into C (51% of typical outputs differ).
// `vtiles` does exactly that with 16-lane FMAs on the widened bfloat16 (exact) under MXCSR
// FTZ | DAZ (set around each call, then restored: the finish and the other ops keep IEEE
// denormals, as after the tiles), the same
// chunks of KC (the K % 32 tail one chunk of its own), so a row gets the tile's bits whichever
// form runs it. At one row it streams 4 tiles side by side (2 at two rows), each prefetched.
constexpr int VROWS = 4;  // the most rows of the vector form (its register tile)
// a call of at most this many rows runs the vector form. Measured on the 135M target (Sapphire
// Rapids, 2 threads, in turns in one process, load 1.8-2.1): T(1) 8.1-8.6 ms vector, 9.6-10.4
// tile; T(2) 9.5 / 10.4-10.6; T(3) 12.3 / 10.6, T(4) 14.0 / 11.2 (3 and 4 rows: one stream; more
// streams would need more than the 32 registers: 4 accumulators a row and tile)
int g_vector_rows = 2;
// the load-time self-check's verdict (`vector_check`): the vector form runs only where it gave
// the tiles' float32 sums on this CPU; g_control perturbs it (C + even + odd, left to right: a
// CPU that rounds otherwise), for the negative control of the tests
bool g_vector_ok = false, g_control = false;
// bytes ahead each weight stream is prefetched (into L1): T(1) 8.1 ms at 1.5-3 KiB (4 streams),
// 9.1-9.5 at 4 KiB, 10.2 at 8 KiB, 10.0 without (same runs)
constexpr int64_t VPREFETCH = 2048;

// R rows of x (row stride K) times G packed tiles at w, w + K * TILE, ... -> acc (G, R, TILE)
template <int R, int G>
TAMX void vtiles(const bf16* x, int64_t K, const bf16* w, float* acc) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const bool control = g_control;
  __m512 c[G][R][2];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) c[g][r][0] = c[g][r][1] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    __m512 e[G][R][2], o[G][R][2];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) e[g][r][0] = e[g][r][1] = o[g][r][0] = o[g][r][1] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 2) {
      __m512 xe[R], xo[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + k, 4);
        const __m512i xb = _mm512_set1_epi32(pair);
        xe[r] = _mm512_castsi512_ps(_mm512_slli_epi32(xb, 16));
        xo[r] = _mm512_castsi512_ps(_mm512_and_si512(xb, hi));
      }
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const bf16* wk = w + g * K * TILE + k * TILE;  // the pair's 32 outputs x 2
        _mm_prefetch(reinterpret_cast<const char*>(wk) + VPREFETCH, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wk) + VPREFETCH + 64, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_loadu_si512(wk + 32 * h);
          const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) {
            e[g][r][h] = _mm512_fmadd_ps(xe[r], we, e[g][r][h]);
            o[g][r][h] = _mm512_fmadd_ps(xo[r], wo, o[g][r][h]);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          c[g][r][h] = control ? _mm512_add_ps(_mm512_add_ps(c[g][r][h], e[g][r][h]), o[g][r][h])
                               : _mm512_add_ps(c[g][r][h], _mm512_add_ps(e[g][r][h], o[g][r][h]));
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + (g * R + r) * TILE, c[g][r][0]);
      _mm512_storeu_ps(acc + (g * R + r) * TILE + 16, c[g][r][1]);
    }
}

// tiles of G side by side per row count (registers: 6 G R accumulators, the weights, x)
constexpr int vgroup(int R) { return R == 1 ? 4 : R == 2 ? 2 : 1; }

// vtiles<R, G> under MXCSR FTZ | DAZ, as tdpbf16ps computes its sums; the finish after it runs
// under the caller's MXCSR, as the tiles' finish does (a denormal bias, residual or result kept)
template <int R, int G>
TAMX void vtiles_flushed(const bf16* x, int64_t K, const bf16* w, float* acc, unsigned csr) {
  _mm_setcsr(csr | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
  vtiles<R, G>(x, K, w, acc);
  _mm_setcsr(csr);
}

template <int R, typename T>
TAMX void run_vector_r(const bf16* x, int64_t N, int64_t K, const bf16* w, int64_t O, const T* bias,
                       const T* residual, T* y, int64_t t0, int64_t t1) {
  constexpr int G = vgroup(R);
  alignas(64) float acc[G * R * TILE];
  const unsigned csr = _mm_getcsr();
  for (int64_t n = 0; n < N; n += R) {
    int64_t t = t0;
    for (; t + G <= t1; t += G) {
      vtiles_flushed<R, G>(x + n * K, K, w + t * K * TILE, acc, csr);
      for (int g = 0; g < G; ++g) finish16(acc + g * R * TILE, R, n, (t + g) * TILE, O, bias, residual, y);
    }
    const int rest = static_cast<int>(t1 - t);  // < G: the rest side by side too (3 and 2 only where G is 4)
    if (rest == 3) vtiles_flushed<R, (G == 4 ? 3 : 1)>(x + n * K, K, w + t * K * TILE, acc, csr);
    else if (rest == 2) vtiles_flushed<R, (G == 4 ? 2 : 1)>(x + n * K, K, w + t * K * TILE, acc, csr);
    else if (rest == 1) vtiles_flushed<R, 1>(x + n * K, K, w + t * K * TILE, acc, csr);
    for (int g = 0; g < rest; ++g) finish16(acc + g * R * TILE, R, n, (t + g) * TILE, O, bias, residual, y);
  }
}

// tiles [t0, t1), N <= VROWS rows on the vector form
template <typename T>
TAMX void run_vector(const bf16* x, int64_t N, int64_t K, const bf16* w, int64_t O, const T* bias,
                     const T* residual, T* y, int64_t t0, int64_t t1) {
  switch (N) {
    case 1: run_vector_r<1>(x, N, K, w, O, bias, residual, y, t0, t1); break;
    case 2: run_vector_r<2>(x, N, K, w, O, bias, residual, y, t0, t1); break;
    case 3: run_vector_r<3>(x, N, K, w, O, bias, residual, y, t0, t1); break;
    default: run_vector_r<4>(x, N, K, w, O, bias, residual, y, t0, t1); break;
  }
}

// tiles [t0, t1) of outputs, every row: up to MT rows one block per tile; more, per GROUP
// tiles every row block (MT rows at a time, the last block the rest)
// this thread's tile configuration while `held` (amx_hold): its key (M * KC + K % KC + 1; 0 none).
// Outside a hold every call configures its tiles and releases them at the end.
thread_local bool held = false;
thread_local int held_key = 0;

template <typename T>
TAMX void run_tiles_amx(const bf16* x, int64_t N, int64_t K, const bf16* w, int64_t O, const T* bias,
                        const T* residual, T* y, int64_t t0, int64_t t1) {
  if (N <= g_vector_rows && g_vector_ok) return run_vector<T>(x, N, K, w, O, bias, residual, y, t0, t1);
  alignas(64) float acc[2 * MT * TILE];
  const int kt = static_cast<int>(K % KC);
  int configured = held ? held_key : 0;  // the key of this thread's tile configuration (0: none yet)
  for (int64_t g = t0, g1; g < t1; g = g1) {
    g1 = N <= MT ? t1 : std::min(t1, g + GROUP);
    for (int64_t n = 0; n < N; n += MT) {
      const int M = static_cast<int>(N - n < MT ? N - n : MT);
      const int key = M * static_cast<int>(KC) + kt + 1;
      if (key != configured) configure(M, kt), configured = key;
      const bool pf = n == 0;  // later passes read the group's weights from cache
      for (int64_t t = g; t < g1; ++t) {
        if (!kt && t + 1 < g1) {
          tile2(x + n * K, K, w + t * K * TILE, acc, pf);
          finish16(acc, M, n, t * TILE, O, bias, residual, y);
          ++t;
          finish16(acc + MT * TILE, M, n, t * TILE, O, bias, residual, y);
          continue;
        } else {
          tile1(x + n * K, K, w + t * K * TILE, acc, pf);
        }
        finish16(acc, M, n, t * TILE, O, bias, residual, y);
      }
    }
  }
  if (held) held_key = configured;
  else if (configured) release();
}

// the tile data permission, once per process: "" granted, else why not
const std::string& amx_state() {
  static std::string why;
  static std::once_flag once;
  std::call_once(once, [] {
    constexpr long GET_PERM = 0x1022, REQ_PERM = 0x1023, XTILEDATA = 18;
    uint64_t perm = 0;
    if (syscall(SYS_arch_prctl, REQ_PERM, XTILEDATA) != 0)
      why = std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: ") + std::strerror(errno);
    else if (syscall(SYS_arch_prctl, GET_PERM, &perm) != 0 || !(perm & (1ull << XTILEDATA)))
      why = "the kernel did not grant the AMX tile data state (ARCH_GET_XCOMP_PERM)";
  });
  return why;
}

// The vector form's self-check: its float32 sums against the tiles' on data of every kind the
// tests use (typical, wide exponents, denormal / flushed, exactly cancelling; K = 200: six chunks
// and a tail of 8; 2 tiles of outputs), 1 and 2 rows at a time against 16-row tiles: 4096 sums,
// well under a millisecond. Run once per process before the first AMX linear (outside any
// parallel region: it configures the calling thread's tiles). Returns the differing sums.
TAMX int64_t vector_check(int64_t* total) {
  constexpr int64_t K = 200, O = 64, N = 16, tiles = O / TILE;
  std::vector<bf16> w(tiles * K * TILE), x(N * K);
  std::vector<float> st(N * O), sv(N * O);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] { state ^= state << 13, state ^= state >> 7, state ^= state << 17; return state; };
  // bfloat16 bits of kind k: exponent range, a third zeros/denormals for "tiny", 2-bit mantissas for "cancel"
  auto gen = [&](int kind) -> bf16 {
    const uint64_t r = next();
    const int lo[4] = {124, 87, 62, 126}, span[4] = {7, 61, 4, 3};
    int e = lo[kind] + static_cast<int>((r >> 8) % span[kind]);
    if (kind == 2 && (r >> 20) % 3 == 0) e = 0;
    const int man = static_cast<int>((r >> 1) & (kind == 3 ? 0x3 : 0x7f));
    return static_cast<bf16>(((r & 1) << 15) | (e << 7) | man);
  };
  int64_t differ = 0;
  *total = 0;
  for (int kind = 0; kind < 4; ++kind) {
    for (auto& v : w) v = gen(kind);  // the packed layout directly: any bits are a weight
    for (auto& v : x) v = gen(kind);
    if (kind == 3)  // the odd k of a pair: x the same as the even, w its negation (even and odd sums cancel)
      for (int64_t i = 0; i < N * K; i += 2) x[i + 1] = x[i];
    if (kind == 3)
      for (int64_t i = 0; i < tiles * K * TILE; i += 2) w[i + 1] = w[i] ^ 0x8000;
    run_tiles_amx<float>(x.data(), N, K, w.data(), O, nullptr, nullptr, st.data(), 0, tiles);  // 16 rows: tiles
    std::vector<float> two(N * O);  // the rows in pairs
    for (int64_t n = 0; n < N; ++n)
      run_vector<float>(x.data() + n * K, 1, K, w.data(), O, nullptr, nullptr, sv.data() + n * O, 0, tiles);
    for (int64_t n = 0; n < N; n += 2)
      run_vector<float>(x.data() + n * K, 2, K, w.data(), O, nullptr, nullptr, two.data() + n * O, 0, tiles);
    for (int64_t i = 0; i < N * O; ++i)  // a sum differs where either vector call gave other bits
      differ += std::memcmp(&st[i], &sv[i], 4) != 0 || std::memcmp(&st[i], &two[i], 4) != 0;
    *total += N * O;
  }
  return differ;
}

std::string g_verdict;  // "" not checked yet

// (re)run the self-check; control: with the perturbed vector form (negative control)
void run_vector_check(bool control) {
  g_control = control;
  int64_t total = 0;
  const int64_t differ = vector_check(&total);
  g_control = false;
  g_vector_ok = differ == 0;
  g_verdict = differ == 0
                  ? "on: the vector form gave the tiles' bits on all " + std::to_string(total) +
                        " float32 sums of the self-check (1 and 2 rows a call)"
                  : "off: " + std::to_string(differ) + " of " + std::to_string(total) +
                        " float32 sums of the self-check differ from the tiles (tdpbf16ps rounds otherwise on this CPU); "
                        "the tiles run every row count";
}

}  // namespace

namespace specrouter {

// "" where this process may run tile instructions, else why not (the kernel path `amx` checks it)
std::string amx_ready() { return amx_state(); }

void check_amx() {
  TORCH_CHECK(amx_state().empty(), "kernel path amx: ", amx_state());
  static std::once_flag once;  // the vector form's self-check, before the first AMX linear
  std::call_once(once, [] { if (g_verdict.empty()) run_vector_check(false); });
}

// the vector form's self-check verdict ("on: ..." / "off: ..."), run first if it has not run;
// rerun: run it again (control: on the perturbed vector form, the tests' negative control)
std::string amx_vector_check(bool rerun, bool control) {
  check_amx();
  if (rerun || control) run_vector_check(control);
  return g_verdict;
}

// x (N, K) bfloat16 on the CPU and a weight packed by pack_tiles (tile 32) for it and O outputs,
// the AMX state granted (check_amx): the weight's tile count, or an error naming `op`
static int64_t check_amx_operands(const char* op, const at::Tensor& x, const at::Tensor& weight, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              op, ": x (N, K) bfloat16 on the CPU");
  check_amx();
  const int64_t N = x.size(0), K = x.size(1), tiles = (O + TILE - 1) / TILE;
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == tiles * K * TILE &&
                  weight.size(0) == tiles && K % 2 == 0,
              "weight: packed by pack_tiles (tile 32) for x (", N, ", ", K, ") and O=", O);
  return tiles;
}

// x (N, K) bfloat16; weight packed by pack_tiles (tile 32), bfloat16; bias (O,) or None; residual
// (N, O) or None -> (N, O) bfloat16
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& weight, int64_t O, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual) {
  const int64_t tiles = check_amx_operands("linear_amx", x, weight, O), N = x.size(0), K = x.size(1);
  at::Tensor b, r;
  if (bias && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == O, "bias: (", O, ",) bfloat16");
  }
  if (residual && residual->defined()) {
    r = residual->contiguous();
    TORCH_CHECK(r.scalar_type() == at::kBFloat16 && r.dim() == 2 && r.size(0) == N && r.size(1) == O,
                "residual: (N, O) bfloat16");
  }
  at::Tensor y = at::empty({N, O}, x.options());
  if (N == 0) return y;
  at::Tensor xc = x.contiguous();
  auto p = [](const at::Tensor& t) { return t.defined() ? reinterpret_cast<const bf16*>(t.data_ptr()) : nullptr; };
  const bf16 *xp = p(xc), *wp = p(weight), *bp = p(b), *rp = p(r);
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    run_tiles_amx<bf16>(xp, N, K, wp, O, bp, rp, yp, t0, t1);
  });
  return y;
}

// x (N, K) bfloat16 times a weight packed as for linear_amx -> (N, O) float32: the sums before
// the finish (no bias, no residual, no rounding to bfloat16), for tests that compare the tile
// and vector forms bit for bit where a bfloat16 output would hide a float32 ulp
at::Tensor linear_amx_sums(const at::Tensor& x, const at::Tensor& weight, int64_t O) {
  const int64_t tiles = check_amx_operands("linear_amx_sums", x, weight, O), N = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({N, O}, x.options().dtype(at::kFloat));
  if (N == 0) return y;
  at::Tensor xc = x.contiguous();
  const bf16* xp = reinterpret_cast<const bf16*>(xc.data_ptr());
  const bf16* wp = reinterpret_cast<const bf16*>(weight.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    run_tiles_amx<float>(xp, N, K, wp, O, nullptr, nullptr, yp, t0, t1);
  });
  return y;
}

// `decoder_layers`' threads, each at the start (on) and the end (off) of its region: between the
// two, linear_amx_tiles keeps this thread's tile configuration from call to call (one ldtilecfg
// a forward where every linear has the same rows and K % 32, instead of one and a release per
// call); off releases the tiles. Nothing else may use the tiles on the thread in between (oneDNN
// configures them its own way): the region runs only this extension's code.
void amx_hold(bool on) {
  if (!on && held && held_key) release();
  held = on;
  held_key = 0;
}

// calls of at most `rows` rows (0..4) run the vector form of the tile (run_vector); returns the
// setting before (tests and benchmarks: both forms at every row count, bit for bit)
int64_t set_amx_vector_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= VROWS, "set_amx_vector_rows: 0..", VROWS, " rows, got ", rows);
  const int64_t before = g_vector_rows;
  g_vector_rows = static_cast<int>(rows);
  return before;
}

// tiles [t0, t1) of linear_amx for `decoder_layers`' own threads (the caller checked the shapes
// and check_amx()); y may be the residual (each output reads its own residual element first)
void linear_amx_tiles(const void* x, int64_t N, int64_t K, const void* w, int64_t O, const void* bias,
                      const void* residual, void* y, int64_t t0, int64_t t1) {
  auto b = [](const void* p) { return static_cast<const bf16*>(p); };
  run_tiles_amx<bf16>(b(x), N, K, b(w), O, b(bias), b(residual), static_cast<bf16*>(y), t0, t1);
}

}  // namespace specrouter

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("linear_amx(Tensor x, Tensor weight, int out_features, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.def("amx_ready() -> str", [] { return specrouter::amx_ready(); });
  m.def("set_amx_vector_rows(int rows) -> int", &specrouter::set_amx_vector_rows);
  m.def("linear_amx_sums(Tensor x, Tensor weight, int out_features) -> Tensor");
  m.def("amx_vector_check(bool rerun=False, bool control=False) -> str", &specrouter::amx_vector_check);
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) {
  m.impl("linear_amx", &specrouter::linear_amx);
  m.impl("linear_amx_sums", &specrouter::linear_amx_sums);
}
