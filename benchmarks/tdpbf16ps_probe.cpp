// What does AMX's tdpbf16ps compute? (issue 26, session 15; docs/kernels.md)
//
// Runs tdpbf16ps on random and adversarial 16 x 32 bfloat16 tiles (and a random float32 C) and
// compares every output, bit for bit, with candidate emulations in float32 FMAs under MXCSR
// FTZ | DAZ (round to nearest even). Not a test of the package: a standalone program for a CPU
// with AMX-BF16 under Linux (it asks the OS for the tile state).
//
//     g++ -O2 -mavx2 -mfma -o tdpbf16ps_probe benchmarks/tdpbf16ps_probe.cpp && ./tdpbf16ps_probe 5000
//
// Candidates, per output (m, n), over the 16 k pairs of one instruction:
//   0 the SDM's older pseudo-code: C += even product, C += odd product, k by k (FMAs)
//   1 the same, odd first
//   2 each pair summed exactly (double), then added to C (one rounding)
//   3 each pair summed in float32, then added to C
//   4 the even products in one float32 sum from +0 and the odd in another (FMAs in k order),
//     then C + (even + odd): what runners/kernels/linearamx.cpp's vector form computes
// On the Sapphire Rapids-class Xeon of session 15 only candidate 4 matched (0 of 9.2M outputs
// differ; 0-3 differ in a quarter to a half of typical outputs, by an ulp or a few).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

struct alignas(64) Cfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static float f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static float bf(uint16_t h) { return f32(uint32_t(h) << 16); }

alignas(64) static uint16_t A[16][32], B[16][32];  // A: 16 rows x 16 pairs; B: 16 pair rows x 16 outputs x 2
alignas(64) static float C0[16][16], C[16][16];
static std::mt19937_64 rng(12345);

static const char* MODES[] = {"typical (2^-3..2^3)", "any exponent", "denormals and tiny", "wide (2^-20..2^20)",
                              "2-bit mantissas, cancelling", "wide, no overflow (2^-60..2^60)",
                              "products near FLT_MIN (flushed)", "zeros, denormals, ones"};
constexpr int NMODES = 8;

static uint16_t gen(int mode) {
  const uint64_t r = rng();
  uint16_t sign = uint16_t((r & 1) << 15), man = uint16_t((r >> 1) & 0x7f);
  int e;
  switch (mode) {
    case 0: e = 127 + int((r >> 8) % 7) - 3; break;
    case 1: e = int((r >> 8) % 254) + 1; break;
    case 2: e = ((r >> 8) % 4 == 0) ? 0 : 1 + int((r >> 10) % 40); break;
    case 3: e = 127 + int((r >> 8) % 40) - 20; break;
    case 4: e = 127 + int((r >> 8) % 3) - 1; man &= 0x3; break;
    case 5: e = 127 + int((r >> 8) % 121) - 60; break;
    case 6: e = 127 - 63 + int((r >> 8) % 5) - 2; break;
    default: e = ((r >> 8) % 3 == 0) ? 0 : 127 + int((r >> 10) % 3) - 1; man = ((r >> 12) % 2) ? 0 : man; break;
  }
  return uint16_t(sign | uint16_t(e << 7) | man);
}
static float genc(int mode) {
  const uint64_t r = rng();
  const uint32_t sign = uint32_t(r & 1) << 31, man = uint32_t((r >> 1) & 0x7fffff);
  int e;
  switch (mode) {
    case 1: e = 1 + int((r >> 40) % 253); break;
    case 2: e = int((r >> 40) % 60); break;
    case 4: return f32(sign | (uint32_t(127 + int((r >> 40) % 5) - 2) << 23) | ((man & 0x7ff) << 12));
    case 5: e = 127 + int((r >> 40) % 121) - 60; break;
    case 6: e = int((r >> 40) % 4); break;  // denormal C included
    case 7: return (r >> 40) % 2 ? ((r & 1) ? -0.f : 0.f) : f32(sign | (127u << 23));
    default: e = 127 + int((r >> 40) % 9) - 4; break;
  }
  return f32(sign | (uint32_t(e) << 23) | man);
}

__attribute__((target("amx-tile,amx-bf16"))) static void amx() {
  Cfg c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 3; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  asm volatile("ldtilecfg %0" ::"m"(c));  // not _tile_loadconfig: GCC 12 drops the stores to c
  _tile_loadd(0, C, 64);
  _tile_loadd(1, A, 64);
  _tile_loadd(2, B, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, C, 64);
  _tile_release();
}

static float daz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x; }

// MXCSR has FTZ | DAZ set: fmaf and + flush denormal inputs and results
static float candidate(int which, float c, int m, int n) {
  float a = c;
  for (int k = 0; k < 16 && which < 4; ++k) {
    const float xe = bf(A[m][2 * k]), we = bf(B[k][2 * n]), xo = bf(A[m][2 * k + 1]), wo = bf(B[k][2 * n + 1]);
    if (which == 0) a = std::fmaf(xo, wo, std::fmaf(xe, we, a));
    if (which == 1) a = std::fmaf(xe, we, std::fmaf(xo, wo, a));
    if (which == 2) a = daz(float(double(daz(a)) + (double(daz(xe)) * daz(we) + double(daz(xo)) * daz(wo))));
    if (which == 3) a = a + std::fmaf(xo, wo, xe * we);
  }
  if (which == 4) {
    float e = 0.f, o = 0.f;
    for (int k = 0; k < 16; ++k) {
      e = std::fmaf(bf(A[m][2 * k]), bf(B[k][2 * n]), e);
      o = std::fmaf(bf(A[m][2 * k + 1]), bf(B[k][2 * n + 1]), o);
    }
    a = a + (e + o);
  }
  return a;
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
    std::puts("the OS refused the AMX tile state");
    return 1;
  }
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ
  const long iters = argc > 1 ? std::atol(argv[1]) : 2000;
  for (int mode = 0; mode < NMODES; ++mode) {
    long mism[5] = {}, total = 0, skipped = 0;
    bool shown = false;
    for (long it = 0; it < iters; ++it) {
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 32; ++j) A[i][j] = gen(mode), B[i][j] = gen(mode);
      if (mode == 4 && it % 2)  // exact cancellation: odd = even on A, odd = -even on B
        for (int i = 0; i < 16; ++i)
          for (int j = 0; j < 16; ++j) A[i][2 * j + 1] = A[i][2 * j], B[i][2 * j + 1] = B[i][2 * j] ^ 0x8000;
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) C0[i][j] = C[i][j] = (it % 3 == 0) ? 0.f : genc(mode);
      amx();
      for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
          const float got = C[m][n];
          if (!std::isfinite(got)) { ++skipped; continue; }
          ++total;
          for (int w = 0; w < 5; ++w) {
            const float want = candidate(w, C0[m][n], m, n);
            if (bits(want) == bits(got)) continue;
            ++mism[w];
            if (w == 4 && !shown) {
              shown = true;
              std::printf("  candidate 4 counterexample: C %a, tdpbf16ps %a, candidate %a\n", C0[m][n], got, want);
            }
          }
        }
    }
    std::printf("%-34s %9ld outputs (%ld non-finite skipped); differing: ", MODES[mode], total, skipped);
    for (int w = 0; w < 5; ++w) std::printf(" [%d] %ld", w, mism[w]);
    std::printf("\n");
  }
}
