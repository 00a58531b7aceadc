// One row of scores into its softmax numerators, as both forward paths take it (attention.cpp's
// brgemm tiles, amx_forward.cpp's AMX tiles): the row's maximum, and p = 2^(s f - m) stored as the
// operand type with the float32 sum of the p before rounding. Base-2 exponentials: the row maxima
// are in units of log2, f = log2(e) (times the scale where the scores wait for it).

#pragma once

#include "common.h"

#include <algorithm>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace multihead_native {

#if defined(__AVX512F__)
constexpr int64_t kFloatLanes = 16;  // float32 lanes of a zmm register

// store 16 floats (the first `count`) as T
template <typename T>
inline void store_v(T* dst, __m512 x, int64_t count) {
  const __mmask16 k = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  if constexpr (std::is_same<T, float>::value) {
    _mm512_mask_storeu_ps(dst, k, x);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  } else if constexpr (std::is_same<T, at::BFloat16>::value) {
    _mm256_mask_storeu_epi16(dst, k, (__m256i)_mm512_cvtneps_pbh(x));
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  } else if constexpr (std::is_same<T, at::Half>::value) {
    _mm256_mask_storeu_epi16(dst, k, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, x);
    for (int64_t j = 0; j < std::min<int64_t>(count, 16); ++j) dst[j] = static_cast<T>(tmp[j]);
  }
}
#endif

// the largest of s[0..n) (a NaN may be missed: the exponentials carry it into the row sum)
inline float row_max(const float* s, int64_t n) {
  int64_t j = 0;
  float top = kNegInf;
#if defined(__AVX512F__)
  __m512 a = _mm512_set1_ps(kNegInf), b = a;
  for (; j + 32 <= n; j += 32) {
    a = _mm512_max_ps(a, _mm512_loadu_ps(s + j));
    b = _mm512_max_ps(b, _mm512_loadu_ps(s + j + 16));
  }
  for (; j + 16 <= n; j += 16) a = _mm512_max_ps(a, _mm512_loadu_ps(s + j));
  top = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
#endif
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

#if defined(__AVX512F__)
// 2^(x f rounded - m) of 16 scores (the lanes of k; the others 0): (s f rounded) - m, not one
// fused fmsub: m is the rounded f · max, so the row's largest score gives exactly 0 and no exponent
// is positive however large f is (the explicit rounding keeps the compiler from fusing the two)
template <int kDeg>
inline __m512 exp_scores(const float* s, __mmask16 k, __m512 vf, __m512 vm) {
  const __m512 x = _mm512_maskz_loadu_ps(k, s);
  const __m512 y = _mm512_mul_round_ps(x, vf, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_maskz_mov_ps(k, exp2_poly<kDeg>(_mm512_sub_ps(y, vm)));
}
#endif

// p[j] = 2^(s[j] f - m) for j < n, as T (p may be s when T is float), 0 for n <= j < ne; returns
// the sum of the float32 values
template <typename T>
float exp_row(const float* s, int64_t n, int64_t ne, float f, float m, T* p) {
  constexpr int kDeg = exp_degree<T>();
  int64_t j = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 vf = _mm512_set1_ps(f), vm = _mm512_set1_ps(m);
  // two vectors a step, two sums (independent chains); bfloat16 converted and stored 32 at a time
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; j + 2 * kFloatLanes <= n; j += 2 * kFloatLanes) {
    const __m512 e0 = exp_scores<kDeg>(s + j, __mmask16(0xFFFF), vf, vm);
    const __m512 e1 = exp_scores<kDeg>(s + j + kFloatLanes, __mmask16(0xFFFF), vf, vm);
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      continue;
    }
#endif
    store_v<T>(p + j, e0, kFloatLanes);
    store_v<T>(p + j + kFloatLanes, e1, kFloatLanes);
  }
  for (; j < n; j += kFloatLanes) {
    const int64_t count = std::min(kFloatLanes, n - j);
    const __mmask16 k = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
    const __m512 e = exp_scores<kDeg>(s + j, k, vf, vm);
    acc0 = _mm512_add_ps(acc0, e);
    store_v<T>(p + j, e, count);
  }
  total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  j = n;
#else
  const fVec vf(f), vm(m), ln2(kLn2);
  fVec acc(0.f);
  alignas(64) float tmp[fVec::size()];
  for (; j + fVec::size() <= n; j += fVec::size()) {
    (fVec::loadu(s + j) * vf).store(tmp);
    __asm__ volatile("" ::: "memory");  // s f rounded, then - m (no fused fmsub)
    const fVec e = ((fVec::loadu(tmp) - vm) * ln2).exp_u20();
    acc = acc + e;
    e.store(tmp);
    for (int64_t t = 0; t < fVec::size(); ++t) p[j + t] = static_cast<T>(tmp[t]);
  }
  total = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, acc);
#endif
  for (; j < n; ++j) {
    volatile float y = s[j] * f;  // s f rounded, then - m (no fused fmsub)
    const float e = std::exp2(y - m);
    total += e;
    p[j] = static_cast<T>(e);
  }
  for (j = n; j < ne; ++j) p[j] = T(0);
  return total;
}

// 2^x for one x <= 0 (a row's rescale): the float32-accurate polynomial where there is AVX-512
inline float exp2_one(float x) {
#if defined(__AVX512F__)
  return _mm512_cvtss_f32(exp2_poly<6>(_mm512_set1_ps(x)));
#else
  return std::exp2(x);
#endif
}

// a finished row: o[0..Dv) = acc / z (0 where no key was seen, NaN where z or the maximum is NaN,
// as SDPA propagates it), written in place; returns the row's lse in natural log (-inf for a row
// with no visible key); m is the row maximum in log2 units, z the sum of 2^(s f - m)
inline float finish_output_row(float* o, int64_t Dv, float z, float m) {
  const bool nan = std::isnan(z) || std::isnan(m);
  const float inv = z > 0.f ? 1.f / z : 0.f;
  for (int64_t d = 0; d < Dv; ++d) o[d] = nan ? std::numeric_limits<float>::quiet_NaN() : z > 0.f ? o[d] * inv : 0.f;
  return z > 0.f ? (m + std::log2(z)) * kLn2 : (nan ? z + m : kNegInf);
}

// rows [0, n) of q (row stride rs, element stride es) into dst as T, each dst row ld elements with
// the last ld - D zero; rows [n, total) zero (a block's tail)
template <typename T, typename S>
void load_rows(const S* q, int64_t rs, int64_t es, int64_t n, int64_t total, int64_t D, int64_t ld, T* dst) {
  for (int64_t r = 0; r < total; ++r) {
    T* row = dst + r * ld;
    if (r >= n) {
      std::fill(row, row + ld, T(0));
      continue;
    }
    if (std::is_same<T, S>::value && es == 1) {  // a contiguous row: copied as is
      std::memcpy(row, q + r * rs, D * sizeof(T));
    } else {
      for (int64_t d = 0; d < D; ++d) row[d] = cast<T>(q[r * rs + d * es]);
    }
    std::fill(row + D, row + ld, T(0));
  }
}

}  // namespace multihead_native
