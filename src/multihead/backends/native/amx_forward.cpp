// The bfloat16 forward on AMX tiles: the online softmax of forward_impl (attention.cpp), with the
// products written against the tile registers instead of called through brgemm, so that the
// scores never leave L1 and the tiles work while the vector units take the exponentials.
//
// Per (batch, query head, query block) work item, per key block, the (step of 64 keys, group of 16
// query rows) pairs some row sees are taken step by step (a step's K and V tiles stay in L1 while
// every group of the block takes them). For each pair:
//   S (16 x 64 float32) = Q rows (16 x D) Kᵀ in four accumulator tiles, stored to a 4 KiB buffer;
//   the softmax of its rows on the vector units -> P (16 x 64 bfloat16);
//   O (16 x Dv float32, rows in memory, where a rescale reads them) += P V.
// The tiles run the previous pair's P V and the next pair's Q Kᵀ while this pair's softmax runs.
//
// A row under a plain mask (nothing added, no key padding) that sees one run of a step's keys (all
// 64, a tail, the diagonal's) takes a short path: the keys it does not see masked to -inf in
// registers, its reference maximum moved only when a score passes it by 2^kLazy (a lazy rescale:
// between moves p may reach 2^kLazy, and the row's sum and O are rescaled only when it moves), and
// 2^x taken by VREDUCEPS and VSCALEFPS with a degree-3 polynomial (relative error 8.6e-5, a
// twentieth of bfloat16's rounding of p). Every other row (masks that add or hide by more than one
// interval) takes forward_impl's row path: finish_row, the exact maximum, exp_row.
//
// Same bits at every thread count: a work item is computed by one thread in a fixed order.
//
// Legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Lq/Lk lengths, D head dim, Dv value dim.

#include "amx_forward.h"
#include "rows.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512DQ__) && \
    defined(__linux__)
#define MULTIHEAD_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace multihead_native {

bool amx_forward_fits(int64_t D, int64_t Dv, int64_t block_q, int64_t block_k) {
  return D > 0 && Dv > 0 && D % 32 == 0 && Dv % 16 == 0 && block_q % 16 == 0 && block_k % 64 == 0;
}

#if !defined(MULTIHEAD_AMX)

bool amx_forward_available() { return false; }

int64_t forward_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, const MaskView&, int64_t, int64_t,
                    at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "native attention: this build has no AMX forward");
}

#else

bool amx_forward_available() {
  // Linux grants the tile data state on request, once per process
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

namespace {

using T = at::BFloat16;
constexpr int64_t kStep = 64;   // keys per step
constexpr int64_t kRows = 16;   // query rows per group
constexpr int64_t kTile = 512;  // bfloat16 elements per tile (16 rows of 64 bytes)
constexpr float kLazy = 8.f;    // a row's reference maximum moves when a score passes it by 2^8
constexpr float kFused = 4194304.f;  // 2^22: below it s f - m by one fused multiply-subtract is exact enough

// n elements of X on a 64-byte boundary (a tile row or a vector never straddles two cache lines)
template <typename X>
struct Aligned {
  struct Free {
    void operator()(X* p) const { std::free(p); }
  };
  std::unique_ptr<X[], Free> ptr;
  explicit Aligned(int64_t n)
      : ptr(static_cast<X*>(std::aligned_alloc(64, std::max<int64_t>((n * sizeof(X) + 63) / 64 * 64, 64)))) {
    TORCH_CHECK(ptr != nullptr, "native attention: out of memory for ", n * sizeof(X), " bytes");
  }
  X* data() const { return ptr.get(); }
  X& operator[](int64_t i) const { return ptr[i]; }
};

// every tile 16 rows of 64 bytes: a 16 x 16 float32 block, a 16 x 32 bfloat16 block, or the VNNI
// pairs of a 32 x 16 bfloat16 block
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// this thread's tiles configured for the forward while it lives; on leaving (an exception
// included) the tiles are released and ATen's brgemm told that its configuration is gone, so that
// its next call on this thread loads its own again
struct TileScope {
  TileScope() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
  }
  ~TileScope() {
    _tile_release();
    at::native::cpublas::brgemm_release(true);
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// the 16 x 16 transpose of 32-bit words: row d of the result = word d of each of the 16 rows
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: a0 b0 a1 b1 | a2 b2 a3 b3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + m], lane L: word 4L + m of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // a 4 x 4 transpose of the lanes of u[m], u[4 + m], u[8 + m], u[12 + m]
    const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), x1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + m] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

// K and V of every (b, kv head, key block of bk) as tiles, zero past Lk: the Kᵀ tile (step, key
// group g < 4, d chunk c) holds d in [32c, 32c + 32) x the step's keys [16g, 16g + 16) as VNNI pairs
// of d (element (d, j) at ((d / 2) * 16 + j) * 2 + d % 2: a 16 x 16 transpose of the pairs); the V
// tile (step, key half kc < 2, dv group g) holds the step's keys [32kc, 32kc + 32) x dv [16g, 16g +
// 16) as VNNI pairs of keys (element (j, d) at ((j / 2) * 16 + d) * 2 + j % 2: two key rows
// interleaved)
void pack_kv_tiles(const at::Tensor& k, const at::Tensor& v, int64_t bk, int64_t ksize, int64_t vsize, T* kp,
                   T* vp) {
  const int64_t B = k.size(0), Hkv = k.size(1), Lk = k.size(2), D = k.size(3), Dv = v.size(3);
  const int64_t nkb = (Lk + bk - 1) / bk, Dc = D / 32, Dg = Dv / 16;
  const Strides4 ks = strides4(k), vs = strides4(v);
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  // out word 2d = a[d], 2d + 1 = b[d] (a, b: 16 bfloat16 each)
  alignas(64) static const uint16_t kInterleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  at::parallel_for(0, B * Hkv * nkb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t kb = w % nkb, hk = (w / nkb) % Hkv, b = w / nkb / Hkv;
      const int64_t k0 = kb * bk, n = std::min(bk, Lk - k0), steps = (n + kStep - 1) / kStep;
      const T* kbase = kd + b * ks.s0 + hk * ks.s1 + k0 * ks.s2;
      const T* vbase = vd + b * vs.s0 + hk * vs.s1 + k0 * vs.s2;
      uint16_t* kt = reinterpret_cast<uint16_t*>(kp + w * ksize);
      uint16_t* vt = reinterpret_cast<uint16_t*>(vp + w * vsize);
      // 16 elements from element d of the key's row (zeros past Lk), as 16 bfloat16 in a ymm
      auto krow32 = [&](int64_t key, int64_t d) -> __m512i {  // 32 elements
        if (key >= n) return _mm512_setzero_si512();
        const T* src = kbase + key * ks.s2 + d * ks.s3;
        if (ks.s3 == 1) return _mm512_loadu_si512(src);
        alignas(64) uint16_t tmp[32];
        for (int e = 0; e < 32; ++e) tmp[e] = src[e * ks.s3].x;
        return _mm512_load_si512(tmp);
      };
      auto vrow16 = [&](int64_t key, int64_t d) -> __m512i {  // 16 elements in the low half
        if (key >= n) return _mm512_setzero_si512();
        const T* src = vbase + key * vs.s2 + d * vs.s3;
        if (vs.s3 == 1) return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        alignas(32) uint16_t tmp[16];
        for (int e = 0; e < 16; ++e) tmp[e] = src[e * vs.s3].x;
        return _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(tmp)));
      };
      for (int64_t s = 0; s < steps; ++s) {
        for (int64_t g = 0; g < 4; ++g)
          for (int64_t c = 0; c < Dc; ++c) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j) r[j] = krow32(s * kStep + g * 16 + j, c * 32);
            transpose16(r);
            uint16_t* t = kt + ((s * 4 + g) * Dc + c) * kTile;
            for (int d2 = 0; d2 < 16; ++d2) _mm512_store_si512(t + d2 * 32, r[d2]);
          }
        for (int64_t kc = 0; kc < 2; ++kc)
          for (int64_t g = 0; g < Dg; ++g) {
            uint16_t* t = vt + ((s * 2 + kc) * Dg + g) * kTile;
            for (int64_t j = 0; j < 32; j += 2) {
              const int64_t key = s * kStep + kc * 32 + j;
              _mm512_store_si512(t + (j / 2) * 32, _mm512_permutex2var_epi16(vrow16(key, g * 16), interleave,
                                                                            vrow16(key + 1, g * 16)));
            }
          }
      }
    }
  });
}

// S (16 x 64) = Q rows (16 x D, leading dimension D) Kᵀ of one step, into tiles 0..3 (4: a chunk of
// Q; 5, 6, 7: chunks of Kᵀ)
inline void issue_qk(const T* qrows, int64_t D, const T* kst) {
  const int64_t Dc = D / 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < Dc; ++c) {
    _tile_loadd(4, qrows + c * 32, D * sizeof(T));
    _tile_loadd(5, kst + (0 * Dc + c) * kTile, 64);
    _tile_loadd(6, kst + (1 * Dc + c) * kTile, 64);
    _tile_loadd(7, kst + (2 * Dc + c) * kTile, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, kst + (3 * Dc + c) * kTile, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// tiles 0..3 (S) into s (16 x 64 float32)
inline void store_s(float* s) {
  _tile_stored(0, s, kStep * sizeof(float));
  _tile_stored(1, s + 16, kStep * sizeof(float));
  _tile_stored(2, s + 32, kStep * sizeof(float));
  _tile_stored(3, s + 48, kStep * sizeof(float));
}

// O (16 x Dv float32, leading dimension Dv) += P (16 x 64) V of one step: four O tiles at a time
// (0..3) with the two halves of P (4, 5) and V by 6 and 7 in turn, so that consecutive products
// go to different accumulators
inline void issue_pv(const T* p, const T* vst, float* o, int64_t Dv) {
  const int64_t Dg = Dv / 16;
  const int ldo = Dv * sizeof(float);
  _tile_loadd(4, p, kStep * sizeof(T));
  _tile_loadd(5, p + 32, kStep * sizeof(T));
  int64_t g = 0;
  for (; g + 4 <= Dg; g += 4) {
    _tile_loadd(0, o + g * 16, ldo);
    _tile_loadd(1, o + g * 16 + 16, ldo);
    _tile_loadd(2, o + g * 16 + 32, ldo);
    _tile_loadd(3, o + g * 16 + 48, ldo);
    _tile_loadd(6, vst + (0 * Dg + g) * kTile, 64);
    _tile_loadd(7, vst + (0 * Dg + g + 1) * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, vst + (0 * Dg + g + 2) * kTile, 64);
    _tile_loadd(7, vst + (0 * Dg + g + 3) * kTile, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 7);
    _tile_loadd(6, vst + (1 * Dg + g) * kTile, 64);
    _tile_loadd(7, vst + (1 * Dg + g + 1) * kTile, 64);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, vst + (1 * Dg + g + 2) * kTile, 64);
    _tile_loadd(7, vst + (1 * Dg + g + 3) * kTile, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, o + g * 16, ldo);
    _tile_stored(1, o + g * 16 + 16, ldo);
    _tile_stored(2, o + g * 16 + 32, ldo);
    _tile_stored(3, o + g * 16 + 48, ldo);
  }
  for (; g < Dg; ++g) {
    _tile_loadd(0, o + g * 16, ldo);
    _tile_loadd(6, vst + (0 * Dg + g) * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, vst + (1 * Dg + g) * kTile, 64);
    _tile_dpbf16ps(0, 5, 7);
    _tile_stored(0, o + g * 16, ldo);
  }
}

// 2^x: p(x - floor x) by a degree-3 polynomial on [0, 1) fitted to relative error with p(0) = 1
// (8.6e-5; p >= 1, so a result is never subnormal) times 2^floor(x) by VSCALEFPS; x below -126
// (and -inf) gives 0 by the mask, NaN stays NaN
inline __m512 exp2_short(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.706717402e-02f), r, _mm512_set1_ps(2.276448458e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.951168180e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, p, x);
}

// The per-row state of the online softmax: the reference maximum mx (log2 units, of s f), thr the
// raw score past which mx moves, the float32 sum of the row path and the 16 lanes of the short path
struct RowState {
  float mx = kNegInf, thr = kNegInf, sum = 0.f;
  alignas(64) float lanes[16] = {};

  void rescale(float alpha, float* o, int64_t Dv) {
    sum *= alpha;
    _mm512_store_ps(lanes, _mm512_mul_ps(_mm512_load_ps(lanes), _mm512_set1_ps(alpha)));
    const __m512 va = _mm512_set1_ps(alpha);
    int64_t d = 0;
    for (; d + 16 <= Dv; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), va));
    for (; d < Dv; ++d) o[d] *= alpha;
  }

  void set_max(float m, float factor) {
    mx = m;
    thr = std::fabs(m) < kFused ? (m + kLazy) / factor : kNegInf;  // past 2^22 every step checks again
  }
};

// the short path: a row of 64 scores under a plain mask that sees those of `seen` (bit j: key j;
// every key unless kMasked), p = 2^(s f - mx) and 0 for the others; false (nothing written) for the
// row path where the row's largest score is not finite or past 2^22, or where nothing has set mx
// yet and the largest is -inf
template <bool kMasked>
inline bool short_row(const float* s, T* p, RowState& st, float* o, int64_t Dv, float factor, uint64_t seen) {
  __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + 16);
  __m512 s2 = _mm512_load_ps(s + 32), s3 = _mm512_load_ps(s + 48);
  if constexpr (kMasked) {  // the keys the row does not see: -inf
    const __m512 hidden = _mm512_set1_ps(kNegInf);
    s0 = _mm512_mask_blend_ps(__mmask16(seen), hidden, s0);
    s1 = _mm512_mask_blend_ps(__mmask16(seen >> 16), hidden, s1);
    s2 = _mm512_mask_blend_ps(__mmask16(seen >> 32), hidden, s2);
    s3 = _mm512_mask_blend_ps(__mmask16(seen >> 48), hidden, s3);
  }
  const __m512 top4 = _mm512_max_ps(_mm512_max_ps(s0, s1), _mm512_max_ps(s2, s3));
  if (st.mx == kNegInf || _mm512_cmp_ps_mask(top4, _mm512_set1_ps(st.thr), _CMP_GT_OQ)) {
    // s f rounded, as the row path rounds it (top4 may miss a NaN: the exponentials carry it)
    const float top = _mm512_cvtss_f32(_mm512_mul_round_ps(_mm512_set1_ps(_mm512_reduce_max_ps(top4)),
                                                           _mm512_set1_ps(factor),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (!(std::fabs(top) < kFused)) return false;
    if (st.mx != kNegInf) st.rescale(exp2_one(st.mx - top), o, Dv);
    st.set_max(top, factor);
  }
  // s f - mx in one rounding: within 2^-2 of the twice-rounded value below 2^22, and mx is at
  // least the largest s f less kLazy, so no exponent passes kLazy by more than that
  const __m512 vf = _mm512_set1_ps(factor), vm = _mm512_set1_ps(st.mx);
  const __m512 e0 = exp2_short(_mm512_fmsub_ps(s0, vf, vm)), e1 = exp2_short(_mm512_fmsub_ps(s1, vf, vm));
  const __m512 e2 = exp2_short(_mm512_fmsub_ps(s2, vf, vm)), e3 = exp2_short(_mm512_fmsub_ps(s3, vf, vm));
  _mm512_store_ps(st.lanes, _mm512_add_ps(_mm512_load_ps(st.lanes),
                                          _mm512_add_ps(_mm512_add_ps(e0, e1), _mm512_add_ps(e2, e3))));
  _mm512_store_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  _mm512_store_si512(p + 32, (__m512i)_mm512_cvtne2ps_pbh(e3, e2));
  return true;
}

// the row path, forward_impl's: finish_row, the exact maximum, exp_row
inline void long_row(float* s, T* p, RowState& st, float* o, int64_t Dv, float factor, const MaskView& m,
                     int64_t b, int64_t h, int64_t i, int64_t ks0, int64_t ns, int state, uint8_t* vis) {
  m.finish_row(s, b, h, i, ks0, ns, state, vis);
  float top = row_max(s, ns);
  if (top == kNegInf && std::any_of(s, s + ns, [](float x) { return std::isnan(x); })) top = NAN;
  top *= factor;
  const float mnew = std::isnan(top) ? top : std::max(st.mx, top);
  if (mnew == kNegInf) {  // nothing seen yet in this row
    std::memset(p, 0, kStep * sizeof(T));
    return;
  }
  if (mnew != st.mx && st.mx != kNegInf) st.rescale(exp2_one(st.mx - mnew), o, Dv);
  st.sum += exp_row<T>(s, ns, kStep, factor, mnew, p);
  st.set_max(mnew, factor);
}

}  // namespace

int64_t forward_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const MaskView& m,
                    int64_t bq, int64_t bk, at::Tensor& out, at::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3), G = H / Hkv;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && amx_forward_fits(D, Dv, bq, bk),
              "native attention: the AMX forward takes bfloat16 with D % 32 == 0, Dv % 16 == 0 and blocks of 16 x 64");
  const int64_t nqb = (Lq + bq - 1) / bq, nkb = (Lk + bk - 1) / bk, nks = bk / kStep, ngr = bq / kRows;
  const int64_t Dc = D / 32, Dg = Dv / 16, ksize = nks * 4 * Dc * kTile, vsize = nks * 2 * Dg * kTile;
  Aligned<T> kp(B * Hkv * nkb * ksize), vp(B * Hkv * nkb * vsize);
  if (Lk > 0) pack_kv_tiles(k, v, bk, ksize, vsize, kp.data(), vp.data());
  const Strides4 qs = strides4(q);
  const T* qd = q.data_ptr<T>();
  // out (B, H, Lq, Dv) contiguous, float32 or bfloat16
  float* od = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  T* oh = out.scalar_type() == at::kBFloat16 ? out.data_ptr<T>() : nullptr;
  float* ld = lse.data_ptr<float>();  // (B, H, Lq) contiguous
  std::unique_ptr<std::atomic<uint8_t>[]> computed(new std::atomic<uint8_t>[nqb * nkb]);
  for (int64_t t = 0; t < nqb * nkb; ++t) computed[t].store(0, std::memory_order_relaxed);
  // plain: the scores need nothing but the scale, which waits for the exponential
  const bool plain = m.plain() && m.keep == nullptr;
  const float factor = 1.44269504088896341f * (m.plain() ? m.scale : 1.f);
  const int64_t items = B * H * nqb;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const TileScope tiles;
    Aligned<T> qbuf(bq * D);
    Aligned<float> obuf(bq * Dv);
    std::vector<RowState> rows(bq);
    alignas(64) float sbuf[kRows * kStep];
    alignas(64) T pbuf[2][kRows * kStep];
    struct Pair {
      int64_t s, g0;
    };
    std::vector<Pair> work(nks * ngr);
    std::vector<int> states(nks * bq);
    std::vector<int64_t> spans(ngr * 4);  // per group: the hull of its keys, and the keys all its rows see
    std::vector<uint8_t> vis(kStep);
    // work items from a shared counter, the last query blocks first (under a causal mask they have
    // the most tiles); which thread computes an item never changes its result
    for (int64_t w = next.fetch_add(1); w < items; w = next.fetch_add(1)) {
      const int64_t qb = nqb - 1 - w / (B * H), h = w % H, b = (w / H) % B, hk = h / G;
      const int64_t i0 = qb * bq, nq = std::min(bq, Lq - i0);
      const T* qbase = qd + b * qs.s0 + h * qs.s1 + i0 * qs.s2;
      load_rows(qbase, qs.s2, qs.s3, nq, bq, D, D, qbuf.data());  // rows past nq zero: S of 0, never read
      std::fill(obuf.data(), obuf.data() + bq * Dv, 0.f);
      std::fill(rows.begin(), rows.end(), RowState());
      for (int64_t gi = 0; gi * kRows < nq; ++gi) {
        const int64_t g0 = gi * kRows, g1 = std::min(nq, g0 + kRows);
        m.hull(b, i0 + g0, i0 + g1, Lk, spans[gi * 4], spans[gi * 4 + 1]);
        m.common(b, i0 + g0, i0 + g1, spans[gi * 4 + 2], spans[gi * 4 + 3]);
      }
      int64_t lo, hi;
      m.hull(b, i0, i0 + nq, Lk, lo, hi);
      for (int64_t kb = lo / bk; hi > lo && kb * bk < hi; ++kb) {
        const int64_t k0 = kb * bk, n = std::min(bk, Lk - k0);
        const T* kt = kp.data() + ((b * Hkv + hk) * nkb + kb) * ksize;
        const T* vt = vp.data() + ((b * Hkv + hk) * nkb + kb) * vsize;
        // the (step, group) pairs some row sees, step by step, with each row's state
        int64_t count = 0;
        for (int64_t s = 0; s * kStep < n; ++s) {
          const int64_t ks0 = k0 + s * kStep, ns = std::min(kStep, n - s * kStep);
          for (int64_t g0 = 0; g0 < nq; g0 += kRows) {
            const int64_t nr = std::min(kRows, nq - g0), gi = g0 / kRows;
            if (spans[gi * 4 + 1] <= ks0 || spans[gi * 4] >= ks0 + ns) continue;  // no row sees the step
            int* st = states.data() + count * kRows;
            bool any = false;
            if (spans[gi * 4 + 2] <= ks0 && spans[gi * 4 + 3] >= ks0 + ns) {  // every row sees all of it
              for (int64_t r = 0; r < kRows; ++r) st[r] = r < nr ? 2 : 0;
              any = true;
            } else {
              for (int64_t r = 0; r < kRows; ++r) {
                st[r] = r < nr ? m.row_state(b, i0 + g0 + r, ks0, ks0 + ns) : 0;
                any = any || st[r] > 0;
              }
            }
            if (any) work[count++] = {s, g0};
          }
        }
        if (count == 0) continue;
        computed[qb * nkb + kb].store(1, std::memory_order_relaxed);
        issue_qk(qbuf.data() + work[0].g0 * D, D, kt + work[0].s * 4 * Dc * kTile);
        for (int64_t x = 0; x < count; ++x) {
          const int64_t s = work[x].s, g0 = work[x].g0, ks0 = k0 + s * kStep, ns = std::min(kStep, n - s * kStep);
          // the tiles take the previous pair's P V and the next pair's Q Kᵀ while this pair's
          // softmax runs on the vector units
          store_s(sbuf);
          if (x > 0) {
            const Pair& prev = work[x - 1];
            issue_pv(pbuf[(x - 1) % 2], vt + prev.s * 2 * Dg * kTile, obuf.data() + prev.g0 * Dv, Dv);
          }
          if (x + 1 < count) issue_qk(qbuf.data() + work[x + 1].g0 * D, D, kt + work[x + 1].s * 4 * Dc * kTile);
          const int* st = states.data() + x * kRows;
          for (int64_t r = 0; r < kRows; ++r) {
            float* srow = sbuf + r * kStep;
            T* p = pbuf[x % 2] + r * kStep;
            float* o = obuf.data() + (g0 + r) * Dv;
            // the row of O this pair's P V loads on the next pass, into L1 meanwhile
            for (int64_t d = 0; d < Dv; d += 16) _mm_prefetch(reinterpret_cast<const char*>(o + d), _MM_HINT_T0);
            if (st[r] == 0) {
              std::memset(p, 0, kStep * sizeof(T));
              continue;
            }
            bool done = false;
            if (plain && st[r] == 2 && ns == kStep) {
              done = short_row<false>(srow, p, rows[g0 + r], o, Dv, factor, ~uint64_t(0));
            } else if (plain && (m.I == 1 || st[r] == 2)) {  // a tail, or one interval of the step seen
              int64_t lo = 0, hi = ns;
              if (st[r] == 1) {
                const int64_t* e = m.iv + ((m.ivB == 1 ? 0 : b) * m.Lq + i0 + g0 + r) * 2;
                lo = std::min(std::max<int64_t>(e[0] - ks0, 0), ns);
                hi = std::max(std::min<int64_t>(e[1] - ks0, ns), lo);
              }
              const uint64_t upto = hi >= 64 ? ~uint64_t(0) : (uint64_t(1) << hi) - 1;
              done = short_row<true>(srow, p, rows[g0 + r], o, Dv, factor, upto & ~((uint64_t(1) << lo) - 1));
            }
            if (!done) long_row(srow, p, rows[g0 + r], o, Dv, factor, m, b, h, i0 + g0 + r, ks0, ns, st[r], vis.data());
          }
        }
        const Pair& last = work[count - 1];
        issue_pv(pbuf[(count - 1) % 2], vt + last.s * 2 * Dg * kTile, obuf.data() + last.g0 * Dv, Dv);
      }
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t row = (b * H + h) * Lq + i0 + r;
        const RowState& rs = rows[r];
        float* o = obuf.data() + r * Dv;  // normalised in place, then written out
        float z = rs.sum;
        for (int t = 0; t < 16; ++t) z += rs.lanes[t];
        ld[row] = finish_output_row(o, Dv, z, rs.mx);
        if (oh != nullptr) {
          round_to<T>(o, oh + row * Dv, Dv);
        } else {
          std::memcpy(od + row * Dv, o, Dv * sizeof(float));
        }
      }
    }
  });
  int64_t count = 0;
  for (int64_t t = 0; t < nqb * nkb; ++t) count += computed[t].load(std::memory_order_relaxed);
  return count;
}

#endif

}  // namespace multihead_native
