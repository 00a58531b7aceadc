// The native tile kernel: the online softmax of multihead/backends/_tiles.py in C++ against ATen.
//
// Products by at::native::cpublas::brgemm: bfloat16/float16 operands into float32 scores where
// the CPU packs them (AMX, AVX512-BF16: could_pack), float32 operands otherwise (a bfloat16 or
// float16 number is exact in float32, so the scores are the same float32 sums of exact products).
// Softmax, row sums and the accumulation of p v in float32: per row one max pass and one fused
// pass of base-2 exponentials (AVX-512 polynomial exp2; ATen's Vectorized<float> elsewhere), row
// sum and p stored as the operand type, rounded for the p v product as flash kernels do.
//
// Work: at::parallel_for over (batch, query head, query block); each output row is computed by one
// thread in a fixed key-block order, so the results are the same bits at every thread count. K and
// V are packed once per (batch, kv head, key block) into the layout brgemm reads (kᵀ and v; VNNI
// pairs for packed half operands): O(Lk·D) extra memory, no (Lq, Lk) buffer.
//
// Masks: per query row, a union of key intervals [lo, hi) (Mask.row_intervals: causal, window and
// its sinks, documents, chunked_local), an optional (B, Lk) key keep (key padding), float32 bias
// tensors read through broadcast strides, ALiBi (-slope_h |j - d_i|, d_i the row's diagonal key per
// document), softcap (cap tanh(s / cap)), in the tiles' order: scale, add, softcap, hide.
// Tiles no row of a query block sees are skipped.
//
// Legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Lq/Lk lengths, D head dim, Dv value dim.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.693147180559945309f;

struct Strides4 {
  int64_t s0, s1, s2, s3;
};

Strides4 strides4(const at::Tensor& t) {
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
    if (state == 1) {
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

// K and V of every (b, kv head, key block) in brgemm's layout: kᵀ (Dp, n) and v (n, Dv)
template <typename scalar_t, typename T>
void pack_kv(const at::Tensor& k, const at::Tensor& v, int64_t bk, int64_t ksize, int64_t vsize, T* kp, T* vp) {
  const int64_t B = k.size(0), Hkv = k.size(1), Lk = k.size(2), D = k.size(3), Dv = v.size(3);
  const int64_t nkb = (Lk + bk - 1) / bk;
  const Strides4 ks = strides4(k), vs = strides4(v);
  const scalar_t* kd = k.data_ptr<scalar_t>();
  const scalar_t* vd = v.data_ptr<scalar_t>();
  at::parallel_for(0, B * Hkv * nkb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t kb = w % nkb, hk = (w / nkb) % Hkv, b = w / nkb / Hkv;
      const int64_t k0 = kb * bk, n = std::min(bk, Lk - k0);
      const scalar_t* kbase = kd + b * ks.s0 + hk * ks.s1 + k0 * ks.s2;
      const scalar_t* vbase = vd + b * vs.s0 + hk * vs.s1 + k0 * vs.s2;
      pack_b<T>(D, n, [&](int64_t d, int64_t j) { return cast<T>(kbase[j * ks.s2 + d * ks.s3]); }, kp + w * ksize);
      pack_b<T>(n, Dv, [&](int64_t j, int64_t d) { return cast<T>(vbase[j * vs.s2 + d * vs.s3]); }, vp + w * vsize);
    }
  });
}

// -- the exponentials: 2^x with x = n + f, n = round(x), |f| <= 1/2, 2^f by a polynomial fitted
// to relative error (degree 6: 2e-8, below float32's rounding; degree 4: 3e-6, far below the
// rounding of p to a half type for the p v product); -inf gives 0, NaN stays NaN
template <int kDeg>
struct Exp2Poly;
template <>
struct Exp2Poly<4> {
  static constexpr float c[5] = {0.99999928f, 0.69312185f, 0.24024744f, 0.055917475f, 0.0095699867f};
};
template <>
struct Exp2Poly<6> {
  static constexpr float c[7] = {1.0f, 0.69314718f, 0.24022615f, 0.055503294f, 0.0096208910f,
                                 0.0013399184f, 0.00014804561f};
};

// the degree a T's p needs: float32 keeps float32 accuracy, a half type is rounded after it
template <typename T>
constexpr int exp_degree() {
  return is_half<T>() ? 4 : 6;
}

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using fReg = __m512;

template <int kDeg>
inline __m512 exp2_v(__m512 x) {
  // below 2^-126 the result is 0 by a mask: a denormal result would cost a microcode assist
  // (masked -inf scores take this path); NaN compares "not less" and goes through
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-126.f), x);  // NaN: max returns its second operand
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(Exp2Poly<kDeg>::c[kDeg]);
  for (int i = kDeg - 1; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(Exp2Poly<kDeg>::c[i]));
  return _mm512_maskz_scalef_ps(live, p, n);
}

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

// p[j] = 2^(s[j] f - m) for j < n, as T (p may be s when T is float), 0 for n <= j < ne; returns
// the sum of the float32 values
template <typename T>
float exp_row(const float* s, int64_t n, int64_t ne, float f, float m, T* p) {
  constexpr int kDeg = exp_degree<T>();
  int64_t j = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 vf = _mm512_set1_ps(f), vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; j < n; j += kLanes) {
    const int64_t count = std::min(kLanes, n - j);
    const __mmask16 k = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(k, s + j);
    // (s f rounded) - m, not one fused fmsub: m is the rounded f · max, so the row's largest
    // score gives exactly 0 and no exponent is positive however large f is
    // (the explicit rounding keeps the compiler from fusing the two into an fmsub)
    const __m512 y = _mm512_mul_round_ps(x, vf, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 e = _mm512_maskz_mov_ps(k, exp2_v<kDeg>(_mm512_sub_ps(y, vm)));
    acc = _mm512_add_ps(acc, e);
    store_v<T>(p + j, e, count);
  }
  total = _mm512_reduce_add_ps(acc);
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

template <typename scalar_t, typename T>
int64_t forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const MaskView& m,
                     int64_t bq, int64_t bk, at::Tensor& out, at::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3), G = H / Hkv;
  const int64_t Dp = is_half<T>() ? even(D) : D;
  const int64_t nqb = (Lq + bq - 1) / bq, nkb = (Lk + bk - 1) / bk, bke = even(bk);
  const int64_t ksize = Dp * chunks(bk) * kChunk, vsize = bke * chunks(Dv) * kChunk;
  // every element is written by pack_kv (padding included): no zeroing pass
  std::unique_ptr<T[]> kp(new T[B * Hkv * nkb * ksize]), vp(new T[B * Hkv * nkb * vsize]);
  if (Lk > 0) pack_kv<scalar_t, T>(k, v, bk, ksize, vsize, kp.get(), vp.get());
  const Strides4 qs = strides4(q);
  const scalar_t* qd = q.data_ptr<scalar_t>();
  float* od = out.data_ptr<float>();  // (B, H, Lq, Dv) contiguous
  float* ld = lse.data_ptr<float>();  // (B, H, Lq) contiguous
  // which (query block, key block) tiles some (batch, head) computed: the torch tiles' count
  std::unique_ptr<std::atomic<uint8_t>[]> computed(new std::atomic<uint8_t>[nqb * nkb]);
  for (int64_t t = 0; t < nqb * nkb; ++t) computed[t].store(0, std::memory_order_relaxed);
  // the exponentials are base 2: the row maxima mx are in units of log2; the scale joins log2(e)
  // where the scores wait for it
  const float factor = 1.44269504088896341f * (m.plain() ? m.scale : 1.f);
  // a row of the scores and of p: p is the scores row itself when the operands are float32
  const int64_t ldp = (is_half<T>() ? even(bk) : bk) + 16;

  // work items are taken from a shared counter (a thread slowed by the machine takes fewer), the
  // last query blocks first (under a causal mask they have the most tiles); which thread computes
  // an item never changes its result
  const int64_t items = B * H * nqb;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<T> qbuf(bq * Dp), phalf(is_half<T>() ? bq * ldp : 0);
    std::vector<float> sbuf(bq * ldp), acc(bq * Dv), mx(bq), sum(bq);
    auto pbuf = [&](int64_t r) -> T* {
      if constexpr (is_half<T>()) {
        return phalf.data() + r * ldp;
      } else {
        return sbuf.data() + r * ldp;
      }
    };
    std::vector<uint8_t> vis(bk);
    std::vector<int> state(bq);
    for (int64_t w = next.fetch_add(1); w < items; w = next.fetch_add(1)) {
      const int64_t qb = nqb - 1 - w / (B * H), h = w % H, b = (w / H) % B, hk = h / G;
      const int64_t i0 = qb * bq, nq = std::min(bq, Lq - i0);
      const scalar_t* qbase = qd + b * qs.s0 + h * qs.s1 + i0 * qs.s2;
      for (int64_t r = 0; r < nq; ++r)
        for (int64_t d = 0; d < Dp; ++d) qbuf[r * Dp + d] = d < D ? cast<T>(qbase[r * qs.s2 + d * qs.s3]) : T(0);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), kNegInf);
      std::fill(sum.begin(), sum.end(), 0.f);
      int64_t lo, hi;
      m.hull(b, i0, i0 + nq, Lk, lo, hi);
      for (int64_t kb = lo / bk; hi > lo && kb * bk < hi; ++kb) {
        const int64_t k0 = kb * bk, n = std::min(bk, Lk - k0), ne = is_half<T>() ? even(n) : n;
        bool any = false;
        for (int64_t r = 0; r < nq; ++r) {
          state[r] = m.row_state(b, i0 + r, k0, k0 + n);
          any = any || state[r] > 0;
        }
        if (!any) continue;
        computed[qb * nkb + kb].store(1, std::memory_order_relaxed);
        const int64_t blk = (b * Hkv + hk) * nkb + kb;
        gemm_packed<T>(nq, n, D, qbuf.data(), Dp, kp.get() + blk * ksize, sbuf.data(), ldp, false);
        for (int64_t r = 0; r < nq; ++r) {
          float* s = sbuf.data() + r * ldp;
          T* p = pbuf(r);
          if (state[r] == 0) {
            for (int64_t j = 0; j < ne; ++j) p[j] = T(0);
            continue;
          }
          m.finish_row(s, b, h, i0 + r, k0, n, state[r], vis.data());
          float top = row_max(s, n);
          if (top == kNegInf && std::any_of(s, s + n, [](float x) { return std::isnan(x); })) top = NAN;
          top *= factor;
          const float mnew = std::isnan(top) ? top : std::max(mx[r], top);
          if (mnew == kNegInf) {  // nothing seen yet in this row
            for (int64_t j = 0; j < ne; ++j) p[j] = T(0);
            continue;
          }
          const float alpha = mx[r] == kNegInf ? 0.f : std::exp2(mx[r] - mnew);
          // p = 2^(s · factor - mnew), summed in float32, stored rounded to the operand type
          sum[r] = sum[r] * alpha + exp_row<T>(s, n, ne, factor, mnew, p);
          mx[r] = mnew;
          if (alpha != 1.f) {
            float* a = acc.data() + r * Dv;
            const fVec va(alpha);
            int64_t d = 0;
            for (; d + fVec::size() <= Dv; d += fVec::size()) (fVec::loadu(a + d) * va).store(a + d);
            for (; d < Dv; ++d) a[d] *= alpha;
          }
        }
        gemm_packed<T>(nq, Dv, n, pbuf(0), ldp, vp.get() + blk * vsize, acc.data(), Dv, true);
      }
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t row = (b * H + h) * Lq + i0 + r;
        float* o = od + row * Dv;
        const float z = sum[r];
        const float inv = z > 0.f ? 1.f / z : 0.f;
        for (int64_t d = 0; d < Dv; ++d) o[d] = z > 0.f || std::isnan(z) ? acc[r * Dv + d] * inv : 0.f;
        if (std::isnan(z) || std::isnan(mx[r])) {
          for (int64_t d = 0; d < Dv; ++d) o[d] = std::numeric_limits<float>::quiet_NaN();
        }
        ld[row] = z > 0.f ? (mx[r] + std::log2(z)) * kLn2 : (std::isnan(z) || std::isnan(mx[r]) ? z + mx[r] : kNegInf);
      }
    }
    at::native::cpublas::brgemm_release(is_half<T>());
  });
  int64_t count = 0;
  for (int64_t t = 0; t < nqb * nkb; ++t) count += computed[t].load(std::memory_order_relaxed);
  return count;
}

MaskView make_mask(double scale, const c10::optional<at::Tensor>& intervals, const c10::optional<at::Tensor>& keep,
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

}  // namespace

// out (B, H, Lq, Dv) float32 and lse (B, H, Lq) float32 (natural log; -inf for a row with no visible key)
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                const c10::optional<at::Tensor>& intervals, const c10::optional<at::Tensor>& keep,
                                const std::vector<at::Tensor>& biases, const c10::optional<at::Tensor>& slopes,
                                const c10::optional<at::Tensor>& diag, double softcap, int64_t block_q,
                                int64_t block_k, bool half_products) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "native attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "native attention: q, k, v must share a dtype");
  TORCH_CHECK(q.device().is_cpu(), "native attention runs on the CPU");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "native attention: H must be a multiple of Hkv");
  TORCH_CHECK(block_q > 0 && block_k > 0, "native attention: blocks must be positive");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Dv = v.size(3);
  // every row of out and lse is written by the work item that owns it
  auto out = at::empty({B, H, Lq, Dv}, q.options().dtype(at::kFloat));
  auto lse = at::empty({B, H, Lq}, q.options().dtype(at::kFloat));
  int64_t tiles = 0;
  if (B * H * Lq == 0) return {out, lse, at::scalar_tensor(tiles, at::kLong)};
  MaskView m = make_mask(scale, intervals, keep, biases, slopes, diag, softcap, Lq);
  switch (q.scalar_type()) {
    case at::kFloat:
      tiles = forward_impl<float, float>(q, k, v, m, block_q, block_k, out, lse);
      break;
    case at::kBFloat16:
      if (half_products)
        tiles = forward_impl<at::BFloat16, at::BFloat16>(q, k, v, m, block_q, block_k, out, lse);
      else
        tiles = forward_impl<at::BFloat16, float>(q, k, v, m, block_q, block_k, out, lse);
      break;
    case at::kHalf:
      if (half_products)
        tiles = forward_impl<at::Half, at::Half>(q, k, v, m, block_q, block_k, out, lse);
      else
        tiles = forward_impl<at::Half, float>(q, k, v, m, block_q, block_k, out, lse);
      break;
    default:
      TORCH_CHECK(false, "native attention takes float32, bfloat16 or float16, got ", q.scalar_type());
  }
  return {out, lse, at::scalar_tensor(tiles, at::kLong)};
}

bool could_pack(const std::string& dtype) {
  return at::native::cpublas::could_pack(dtype == "bfloat16" ? at::kBFloat16 : at::kHalf);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("forward", &forward, "attention forward by tiles (out, lse)");
  mod.def("could_pack", &could_pack, "whether brgemm takes packed half operands of this dtype here");
}
