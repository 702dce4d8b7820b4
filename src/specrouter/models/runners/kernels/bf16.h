// bfloat16 <-> float32 for the native kernels (rowinv.cpp, linear512.cpp): one definition of the
// widening (exact: the 16 bits become the high half of a float32) and of the rounding (to
// nearest even, NaN kept quiet), scalar, 8 lanes (AVX2) and 16 lanes (AVX-512). The vector forms
// round lane by lane exactly as the scalar `store` does, so a value's bits never depend on which
// form wrote it (tests/test_rowinv_kernels.py compares the paths bit for bit).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// AVX-512 functions carry their instruction set as a target attribute; the rest stays AVX2
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define T512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace specrouter_bf16 {

using bf16 = uint16_t;

// scalar: the reference every vector form equals
inline float to_f(float v) { return v; }
inline float to_f(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<bf16>((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<bf16>(u >> 16);
}

// 8 lanes (AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// 8 float32 -> their bfloat16 bits in the low half of each 32-bit lane, rounded as `store`
// rounds (nearest even, NaN kept quiet), lane by lane
inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rne, quiet, nan);
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
  const __m256i b = bf16_bits8(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// 16 lanes (AVX-512), masked
T512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
T512 inline __m512 load16(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
T512 inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
T512 inline void store16(bf16* p, __m512 v, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(v);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rne = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rne, quiet)));
}

}  // namespace specrouter_bf16
