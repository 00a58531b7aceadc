// What the native kernel's forward (attention.cpp) and backward (backward.cpp) share: the mask
// as read per row of a tile (MaskView, make_mask), and brgemm's operand layout (pack_b, gemm_packed).
//
// Legend: B batch, H query heads, Lq/Lk lengths, D head dim.

#pragma once

// ATen alone (not torch/extension.h, which only attention.cpp needs for its bindings): each
// translation unit parses a third of the headers
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <cstring>
#include <limits>
#include <vector>

namespace multihead_native {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.693147180559945309f;

struct Strides4 {
  int64_t s0, s1, s2, s3;
};

inline Strides4 strides4(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// What the mask adds and hides, read per row of a tile.
struct MaskView {
  const int64_t* iv = nullptr;  // (I, Bm, Lq, 2) contiguous
  int64_t I = 0, ivB = 1;
  const bool* keep = nullptr;  // (B, Lk)
  int64_t keep_s0 = 0, keep_s1 = 0;
  std::vector<const float*> bias;  // each broadcast to (B, H, Lq, Lk) by strides
  std::vector<Strides4> bias_st;
  const float* slopes = nullptr;  // (H,)
  const int64_t* diag = nullptr;  // (diagB, Lq)
  int64_t diagB = 1;
  float softcap = 0.f;
  float scale = 1.f;
  int64_t Lq = 0;

  // 0: the row sees no key of [k0, k1), 2: every key (by the intervals), 1: some
  int row_state(int64_t b, int64_t i, int64_t k0, int64_t k1) const {
    if (I == 0) return 2;
    bool seen = false;
    for (int64_t t = 0; t < I; ++t) {
      const int64_t* e = iv + ((t * ivB + (ivB == 1 ? 0 : b)) * Lq + i) * 2;
      int64_t lo = e[0], hi = e[1];
      if (lo <= k0 && hi >= k1) return 2;
      if (std::min(hi, k1) > std::max(lo, k0)) seen = true;
    }
    return seen ? 1 : 0;
  }

  // the hull [lo, hi) of the keys rows i0..i1-1 may see, clamped to [0, Lk)
  void hull(int64_t b, int64_t i0, int64_t i1, int64_t Lk, int64_t& lo_all, int64_t& hi_all) const {
    if (I == 0) {
      lo_all = 0;
      hi_all = Lk;
      return;
    }
    lo_all = Lk;
    hi_all = 0;
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t t = 0; t < I; ++t) {
        const int64_t* e = iv + ((t * ivB + (ivB == 1 ? 0 : b)) * Lq + i) * 2;
        int64_t lo = std::max<int64_t>(e[0], 0), hi = std::min<int64_t>(e[1], Lk);
        if (hi > lo) {
          lo_all = std::min(lo_all, lo);
          hi_all = std::max(hi_all, hi);
        }
      }
  }

  // [lo, hi): the keys every row of i0..i1-1 sees by the intervals (all keys without intervals; an
  // empty range where a row has more than one interval, which the caller then reads row by row)
  void common(int64_t b, int64_t i0, int64_t i1, int64_t& lo_all, int64_t& hi_all) const {
    lo_all = std::numeric_limits<int64_t>::min();
    hi_all = std::numeric_limits<int64_t>::max();
    if (I == 0) return;
    if (I > 1) {
      lo_all = hi_all = 0;
      return;
    }
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t* e = iv + ((ivB == 1 ? 0 : b) * Lq + i) * 2;
      lo_all = std::max(lo_all, e[0]);
      hi_all = std::min(hi_all, e[1]);
    }
    if (hi_all <= lo_all) lo_all = hi_all = 0;
  }

  // nothing is added to or changes the scaled products: the scale can wait for the exponential
  bool plain() const { return bias.empty() && slopes == nullptr && softcap == 0.f && scale > 0.f; }

  // scores of row (b, h, i) x keys k0..k0+n-1 from q·k: scale, biases, ALiBi, softcap, hidden
  // -inf; for a plain() mask the scores stay unscaled (the caller scales them in the exponential)
  void finish_row(float* s, int64_t b, int64_t h, int64_t i, int64_t k0, int64_t n, int state,
                  uint8_t* vis) const {
    int64_t j = 0;
    if (!plain()) {
      const fVec vscale(scale);
      for (; j + fVec::size() <= n; j += fVec::size()) (fVec::loadu(s + j) * vscale).store(s + j);
      for (; j < n; ++j) s[j] *= scale;
    }
    for (size_t t = 0; t < bias.size(); ++t) {
      const Strides4& st = bias_st[t];
      const float* row = bias[t] + b * st.s0 + h * st.s1 + i * st.s2 + k0 * st.s3;
      if (st.s3 == 1) {
        for (j = 0; j < n; ++j) s[j] += row[j];
      } else {
        for (j = 0; j < n; ++j) s[j] += row[j * st.s3];
      }
    }
    if (slopes != nullptr) {
      const float slope = slopes[h];
      const int64_t d = diag[(diagB == 1 ? 0 : b) * Lq + i];
      for (j = 0; j < n; ++j) s[j] -= slope * static_cast<float>(std::llabs(k0 + j - d));
    }
    if (softcap > 0.f) {
      const fVec cap(softcap), inv(1.f / softcap);
      for (j = 0; j + fVec::size() <= n; j += fVec::size())
        ((fVec::loadu(s + j) * inv).tanh() * cap).store(s + j);
      for (; j < n; ++j) s[j] = std::tanh(s[j] / softcap) * softcap;
    }
    if (state == 1 && I == 1) {  // one interval: hide the keys before and after it
      const int64_t* e = iv + ((ivB == 1 ? 0 : b) * Lq + i) * 2;
      const int64_t lo = std::min(std::max<int64_t>(e[0] - k0, 0), n), hi = std::max(std::min<int64_t>(e[1] - k0, n), lo);
      for (j = 0; j < lo; ++j) s[j] = kNegInf;
      for (j = hi; j < n; ++j) s[j] = kNegInf;
    } else if (state == 1) {
      std::memset(vis, 0, n);
      for (int64_t t = 0; t < I; ++t) {
        const int64_t* e = iv + ((t * ivB + (ivB == 1 ? 0 : b)) * Lq + i) * 2;
        int64_t lo = std::max<int64_t>(e[0], k0), hi = std::min<int64_t>(e[1], k0 + n);
        if (hi > lo) std::memset(vis + (lo - k0), 1, hi - lo);
      }
      for (j = 0; j < n; ++j)
        if (!vis[j]) s[j] = kNegInf;
    }
    if (keep != nullptr) {
      const bool* kr = keep + b * keep_s0 + k0 * keep_s1;
      for (j = 0; j < n; ++j)
        if (!kr[j * keep_s1]) s[j] = kNegInf;
    }
  }
};

template <typename T>
constexpr bool is_half() {
  return !std::is_same<T, float>::value;
}

template <typename T>
constexpr at::ScalarType scalar_of() {
  return std::is_same<T, float>::value ? at::kFloat
         : std::is_same<T, at::BFloat16>::value ? at::kBFloat16 : at::kHalf;
}

// x as a T: a copy when the types agree, else through float (exact: T is float or x's own type)
template <typename T, typename S>
inline T cast(S x) {
  if constexpr (std::is_same<S, T>::value) {
    return x;
  } else {
    return static_cast<T>(static_cast<float>(x));
  }
}

inline int64_t even(int64_t n) { return (n + 1) / 2 * 2; }
inline int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

// brgemm's packed B is made of column chunks of at most kChunk columns, each with a leading
// dimension of a multiple of 16 up to kChunk (oneDNN's packing takes 16, 32, 48 or 64)
constexpr int64_t kChunk = 64;
inline int64_t chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

// B (rows, cols) in brgemm's layout, from src(r, c): column chunks of kChunk, chunk c at
// out + c * rows_e * kChunk with leading dimension ld = up16(its columns), zero padded; half
// operands in VNNI pairs (element (r, j) of a chunk at ((r / 2) * ld + j) * 2 + r % 2, the layout
// cpublas::pack makes)
template <typename T, typename F>
void pack_b(int64_t rows, int64_t cols, F src, T* out) {
  const int64_t re = is_half<T>() ? even(rows) : rows;
  for (int64_t c = 0; c < chunks(cols); ++c) {
    const int64_t c0 = c * kChunk, nc = std::min(kChunk, cols - c0), ld = up16(nc);
    T* dst = out + c * re * kChunk;
    for (int64_t r = 0; r < re; ++r) {
      T* row = is_half<T>() ? dst + (r / 2) * ld * 2 + (r % 2) : dst + r * ld;
      const int64_t step = is_half<T>() ? 2 : 1;
      for (int64_t j = 0; j < ld; ++j) row[j * step] = (r < rows && j < nc) ? src(r, c0 + j) : T(0);
    }
  }
}

// C (m, cols) (+)= A (m, K) B with B from pack_b, chunk by chunk
template <typename T>
void gemm_packed(int64_t m, int64_t cols, int64_t K, const T* a, int64_t lda, const T* b, float* c, int64_t ldc,
                 bool add) {
  const int64_t Ke = is_half<T>() ? even(K) : K;
  for (int64_t ch = 0; ch < chunks(cols); ++ch) {
    const int64_t c0 = ch * kChunk, nc = std::min(kChunk, cols - c0), ld = up16(nc);
    at::native::cpublas::brgemm(m, nc, Ke, lda, ld, ldc, add, a, b + ch * Ke * kChunk, c + c0, is_half<T>());
  }
}


inline MaskView make_mask(double scale, const c10::optional<at::Tensor>& intervals, const c10::optional<at::Tensor>& keep,
                   const std::vector<at::Tensor>& biases, const c10::optional<at::Tensor>& slopes,
                   const c10::optional<at::Tensor>& diag, double softcap, int64_t Lq) {
  MaskView m;
  m.scale = static_cast<float>(scale);
  m.softcap = static_cast<float>(softcap);
  m.Lq = Lq;
  if (intervals.has_value()) {
    const at::Tensor& t = *intervals;
    TORCH_CHECK(t.dtype() == at::kLong && t.is_contiguous() && t.dim() == 4 && t.size(2) == Lq && t.size(3) == 2,
                "native attention: intervals must be contiguous int64 (I, B|1, Lq, 2)");
    m.iv = t.data_ptr<int64_t>();
    m.I = t.size(0);
    m.ivB = t.size(1);
  }
  if (keep.has_value()) {
    TORCH_CHECK(keep->dtype() == at::kBool && keep->dim() == 2, "native attention: key keep must be bool (B, Lk)");
    m.keep = keep->data_ptr<bool>();
    m.keep_s0 = keep->stride(0);
    m.keep_s1 = keep->stride(1);
  }
  for (const auto& b : biases) {
    TORCH_CHECK(b.dtype() == at::kFloat && b.dim() == 4, "native attention: biases must be float32 (B, H, Lq, Lk) views");
    m.bias.push_back(b.data_ptr<float>());
    m.bias_st.push_back(strides4(b));
  }
  if (slopes.has_value()) {
    TORCH_CHECK(diag.has_value() && slopes->dtype() == at::kFloat && slopes->is_contiguous() &&
                    diag->dtype() == at::kLong && diag->is_contiguous() && diag->dim() == 2,
                "native attention: ALiBi needs float32 slopes (H,) and int64 diagonals (B|1, Lq)");
    m.slopes = slopes->data_ptr<float>();
    m.diag = diag->data_ptr<int64_t>();
    m.diagB = diag->size(0);
  }
  return m;
}

}  // namespace multihead_native

// dq, dk, dv (float32) from the forward's out and lse: see backward.cpp
std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                 const at::Tensor& lse, const at::Tensor& g_out, const c10::optional<at::Tensor>& g_lse,
                                 double scale, const c10::optional<at::Tensor>& intervals,
                                 const c10::optional<at::Tensor>& keep, const std::vector<at::Tensor>& biases,
                                 const std::vector<at::Tensor>& dbiases, const c10::optional<at::Tensor>& slopes,
                                 const c10::optional<at::Tensor>& diag, double softcap, int64_t block_q,
                                 int64_t block_k, bool half_products);

// -- float32 rows rounded to T, and 2^x by a polynomial (the forward's and the backward's one
// exponential).
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace multihead_native {

// dst[0..n) = src[0..n) rounded to T (to nearest even; bfloat16 by the CPU's own instruction where
// it has one)
template <typename T>
inline void round_to(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    if (src != dst) std::memcpy(dst, src, n * sizeof(float));
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  } else if constexpr (std::is_same<T, at::BFloat16>::value) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
    if (j < n) {
      const __mmask16 k = __mmask16((1u << (n - j)) - 1);
      _mm256_mask_storeu_epi16(dst + j, k, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, src + j)));
    }
#endif
  } else {
    at::vec::convert(src, dst, n);
  }
}

// the exponential's polynomial degree for p of type T: float32 keeps float32 accuracy, a half type
// is rounded after it
template <typename T>
constexpr int exp_degree() {
  return is_half<T>() ? 4 : 6;
}

#if defined(__AVX512F__)
// 2^x, x = n + f, n = round(x), |f| <= 1/2, 2^f by a polynomial of degree kDeg fitted to relative
// error (6: 2e-8, float32's rounding; 4: 3e-6, far below a half type's); below 2^-126 gives 0, NaN
// stays NaN
template <int kDeg>
inline __m512 exp2_poly(__m512 x) {
  static constexpr float c4[5] = {0.99999928f, 0.69312185f, 0.24024744f, 0.055917475f, 0.0095699867f};
  static constexpr float c6[7] = {1.0f, 0.69314718f, 0.24022615f, 0.055503294f, 0.0096208910f,
                                  0.0013399184f, 0.00014804561f};
  const float* c = kDeg == 4 ? c4 : c6;
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-126.f), x);
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(c[kDeg]);
  for (int i = kDeg - 1; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_maskz_scalef_ps(live, p, n);
}
#endif

}  // namespace multihead_native
