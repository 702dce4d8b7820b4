// The finish of the 32-output tiles (linear512.cpp's register tiles, linearamx.cpp's AMX tiles):
// float32 accumulators -> + bias, then residual +, one rounding, 16 outputs at a time. One
// definition, so the AVX-512 and AMX paths finish an output with the same instructions.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "bf16.h"

namespace specrouter_bf16 {

constexpr int64_t TILE = 32;  // outputs of a packed tile (runners/linear.py pack_tiles): 2 x 16 lanes

// acc (R, TILE) float32 of rows n0.. and outputs o0.. -> y: + bias, then residual +, one rounding
// (bf16.h's store16, lane by lane the scalar store()), 16 outputs at a time
template <typename T>
T512 void finish16(const float* acc, int R, int64_t n0, int64_t o0, int64_t O, const T* bias,
                   const T* residual, T* y) {
  const int64_t width = O - o0 < TILE ? O - o0 : TILE;  // the last tile's padding outputs
  for (int64_t h = 0; h < TILE; h += 16) {
    const int64_t w = width - h;
    if (w <= 0) break;
    const __mmask16 m = w >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << w) - 1);
    const __m512 b = bias ? load16(bias + o0 + h, m) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      __m512 v = _mm512_loadu_ps(acc + r * TILE + h);
      if (bias) v = _mm512_add_ps(v, b);
      if (residual) v = _mm512_add_ps(load16(residual + n * O + o0 + h, m), v);
      store16(y + n * O + o0 + h, v, m);
    }
  }
}

}  // namespace specrouter_bf16
