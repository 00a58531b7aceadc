// The native tile kernel's backward: dq, dk, dv (and the gradients of bias tensors) from the
// forward's out and lse, recomputing each tile (nothing (Lq, Lk) is kept), as the torch tiles'
// Tiles.backward does:
//
//   p = exp(s - lse), dV += pᵀ dO, dP = dO vᵀ, dS = p ⊙ (dP - delta) · softcap'(s),
//   dQ += dS k · scale, dK += dSᵀ q · scale, d(bias) += dS,   delta = rowsum(dO ⊙ out) - g_lse.
//
// One concept past 500 lines: the passes of one backward (the key pass; with bias gradients the key
// and query passes) and the per-row gradient they share.
//
// Deterministic at every thread count, without atomics: every output element is owned by one work
// item that adds its terms in a fixed order. The key pass: an item per (batch, kv head, lane of key
// blocks) forms each of its key blocks' dK and dV over the G query heads and the query blocks in
// order, and adds the tiles' dQ terms into the lane's own dQ (the lanes' dQ added in lane order at
// the end; a fixed number of lanes, kLanes, whatever the thread count). With bias gradients the
// key pass takes one key block per item and dQ has a pass of its own (the query pass: one item
// per (batch, query head, query block), over the key blocks in order; s and dP computed again),
// which owns the bias rows. A
// gradient is formed where its rows are owned: one with the query axis in the query pass, one
// broadcast over the queries in the key pass; where it is also broadcast over the batch or the
// heads, an item takes one block of every (batch, head) in order, so one item still owns each
// element. Which thread runs an item never changes its result.
//
// Products by at::native::cpublas::brgemm into float32 (bfloat16/float16 operands where the CPU
// packs them, float32 operands otherwise), p and dS rounded to the operand type for the products
// as the forward rounds p; everything else in float32. q, k, v are read through their strides.
//
// Legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Lq/Lk lengths, D head dim, Dv value dim.

#include "common.h"

#include <atomic>
#include <memory>

using namespace multihead_native;

namespace {

// the lanes of key blocks whose dQ terms are summed apart (see backward_impl): at most kLanes, and
// no more than it takes to make kItems work items of the (batch, kv head) pairs
constexpr int64_t kLanes = 4, kItems = 16;

// a bias gradient to form: float32 (Bb, Hb, Lqb, Lkb), each axis 1 or full
struct BiasGrad {
  float* d;
  Strides4 st;
  int64_t Bb, Hb, Lqb, Lkb;
};

// an operand per (b, head, block): at base + b s0 + head s1 + block sblk, rows ld apart (A operands)
template <typename T>
struct View {
  const T* base = nullptr;
  int64_t s0 = 0, s1 = 0, sblk = 0, ld = 0;
  const T* at(int64_t b, int64_t h, int64_t blk) const { return base + b * s0 + h * s1 + blk * sblk; }
};

// what the two passes read, packed once: per (b, kv head, key block) kᵀ (D, n), vᵀ (Dv, n) and
// k (n, D) as brgemm's B operands; per (b, head, query block) q (nq, D) and dO (nq, Dv) as
// row-major A operands and as packed B operands; per row delta and lse. An operand whose layout
// the input already has is read in place (its View points into the input, its buffer stays empty):
// a row-major A of the operand type with unit column stride; in float32, a B of at most kChunk
// columns, a multiple of 16, rows that many apart (pack_b's layout)
template <typename T>
struct Packed {
  int64_t ktsize, vtsize, ksize, qasize, qpsize, dasize, dpsize;
  std::vector<T> kt, vt, k, qa, qp, da, dp;  // empty where read in place
  View<T> vk, vqa, vqp, vda, vdp;
  std::vector<float> delta, lse;
};

// the View of buffer `buf` of n0 x n1 x n2 blocks of `size` (A rows ld apart), or of the input
// `t` (B, H, L, X) in blocks of `rows` rows where `direct`
template <typename T>
View<T> view_of(bool direct, const at::Tensor& t, int64_t rows, std::vector<T>& buf, int64_t n1, int64_t n2,
                int64_t size, int64_t ld) {
  View<T> v;
  if (direct) {
    v.base = reinterpret_cast<const T*>(t.data_ptr());
    v.s0 = t.stride(0);
    v.s1 = t.stride(1);
    v.sblk = rows * t.stride(2);
    v.ld = t.stride(2);
  } else {
    v.base = buf.data();
    v.s1 = n2 * size;
    v.s0 = n1 * v.s1;
    v.sblk = size;
    v.ld = ld;
  }
  return v;
}

template <typename scalar_t, typename T>
void pack_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse, const at::Tensor& g_out, const float* g_lse, int64_t bq, int64_t bk,
              Packed<T>& P) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3);
  const int64_t Dp = is_half<T>() ? even(D) : D, Dvp = is_half<T>() ? even(Dv) : Dv;
  const int64_t nqb = (Lq + bq - 1) / bq, nkb = (Lk + bk - 1) / bk, bke = even(bk), bqe = even(bq);
  P.ktsize = Dp * chunks(bk) * kChunk;
  P.vtsize = Dvp * chunks(bk) * kChunk;
  P.ksize = bke * chunks(D) * kChunk;
  P.qasize = bq * Dp;
  P.qpsize = bqe * chunks(D) * kChunk;
  P.dasize = bq * Dvp;
  P.dpsize = bqe * chunks(Dv) * kChunk;
  // which operands are read in place (see Packed)
  constexpr bool same = std::is_same<scalar_t, T>::value, flt = std::is_same<T, float>::value;
  auto b_direct = [&](const at::Tensor& t, int64_t cols) {
    return flt && cols <= kChunk && cols % 16 == 0 && t.stride(3) == 1 && t.stride(2) == cols;
  };
  const bool qa_in = same && q.stride(3) == 1 && q.stride(2) >= D && D == Dp;
  const bool da_in = flt && g_out.stride(3) == 1 && g_out.stride(2) >= Dv;
  const bool qp_in = same && b_direct(q, D), dp_in = b_direct(g_out, Dv), k_in = same && b_direct(k, D);
  P.kt.resize(B * Hkv * nkb * P.ktsize);
  P.vt.resize(B * Hkv * nkb * P.vtsize);
  if (!k_in) P.k.resize(B * Hkv * nkb * P.ksize);
  if (!qa_in) P.qa.resize(B * H * nqb * P.qasize);
  if (!qp_in) P.qp.resize(B * H * nqb * P.qpsize);
  if (!da_in) P.da.resize(B * H * nqb * P.dasize);
  if (!dp_in) P.dp.resize(B * H * nqb * P.dpsize);
  P.vk = view_of<T>(k_in, k, bk, P.k, Hkv, nkb, P.ksize, 0);
  P.vqa = view_of<T>(qa_in, q, bq, P.qa, H, nqb, P.qasize, Dp);
  P.vqp = view_of<T>(qp_in, q, bq, P.qp, H, nqb, P.qpsize, 0);
  P.vda = view_of<T>(da_in, g_out, bq, P.da, H, nqb, P.dasize, Dvp);
  P.vdp = view_of<T>(dp_in, g_out, bq, P.dp, H, nqb, P.dpsize, 0);
  P.delta.resize(B * H * Lq);
  P.lse.resize(B * H * Lq);
  const Strides4 ks = strides4(k), vs = strides4(v), qs = strides4(q), os = strides4(out), gs = strides4(g_out);
  const scalar_t* kd = k.data_ptr<scalar_t>();
  const scalar_t* vd = v.data_ptr<scalar_t>();
  const scalar_t* qd = q.data_ptr<scalar_t>();
  const float* od = out.data_ptr<float>();
  const float* gd = g_out.data_ptr<float>();
  const float* ld = lse.data_ptr<float>();  // (B, H, Lq) contiguous
  const int64_t kitems = B * Hkv * nkb;
  at::parallel_for(0, kitems + B * H * nqb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      if (w < kitems) {
        const int64_t kb = w % nkb, hk = (w / nkb) % Hkv, b = w / nkb / Hkv;
        const int64_t k0 = kb * bk, n = std::min(bk, Lk - k0);
        const scalar_t* kb0 = kd + b * ks.s0 + hk * ks.s1 + k0 * ks.s2;
        const scalar_t* vb0 = vd + b * vs.s0 + hk * vs.s1 + k0 * vs.s2;
        auto kv = [&](int64_t j, int64_t d) { return static_cast<T>(static_cast<float>(kb0[j * ks.s2 + d * ks.s3])); };
        auto vv = [&](int64_t j, int64_t d) { return static_cast<T>(static_cast<float>(vb0[j * vs.s2 + d * vs.s3])); };
        pack_b<T>(D, n, [&](int64_t d, int64_t j) { return kv(j, d); }, P.kt.data() + w * P.ktsize);
        pack_b<T>(Dv, n, [&](int64_t d, int64_t j) { return vv(j, d); }, P.vt.data() + w * P.vtsize);
        if (!k_in) pack_b<T>(n, D, kv, P.k.data() + w * P.ksize);
        continue;
      }
      const int64_t x = w - kitems, qb = x % nqb, h = (x / nqb) % H, b = x / nqb / H;
      const int64_t i0 = qb * bq, nq = std::min(bq, Lq - i0);
      const scalar_t* qb0 = qd + b * qs.s0 + h * qs.s1 + i0 * qs.s2;
      const float* gb0 = gd + b * gs.s0 + h * gs.s1 + i0 * gs.s2;
      const float* ob0 = od + b * os.s0 + h * os.s1 + i0 * os.s2;
      auto qv = [&](int64_t r, int64_t d) { return static_cast<T>(static_cast<float>(qb0[r * qs.s2 + d * qs.s3])); };
      auto gv = [&](int64_t r, int64_t d) { return static_cast<T>(gb0[r * gs.s2 + d * gs.s3]); };
      T* qa = qa_in ? nullptr : P.qa.data() + x * P.qasize;
      T* da = da_in ? nullptr : P.da.data() + x * P.dasize;
      for (int64_t r = 0; r < nq; ++r) {
        if (!qa_in)
          for (int64_t d = 0; d < Dp; ++d) qa[r * Dp + d] = d < D ? qv(r, d) : T(0);
        if (!da_in)
          for (int64_t d = 0; d < Dvp; ++d) da[r * Dvp + d] = d < Dv ? gv(r, d) : T(0);
        const int64_t row = (b * H + h) * Lq + i0 + r;
        float dot = 0.f;  // in a fixed order
        for (int64_t d = 0; d < Dv; ++d) dot += gb0[r * gs.s2 + d * gs.s3] * ob0[r * os.s2 + d * os.s3];
        P.delta[row] = dot - (g_lse != nullptr ? g_lse[row] : 0.f);
        P.lse[row] = ld[row] == kNegInf ? 0.f : ld[row];  // a row that sees no key: p = exp(-inf) = 0
      }
      if (!qp_in) pack_b<T>(nq, D, qv, P.qp.data() + x * P.qpsize);
      if (!dp_in) pack_b<T>(nq, Dv, gv, P.dp.data() + x * P.dpsize);
    }
  });
}

// One row of a tile: s (q·kᵀ) becomes p = exp(score - lse), dp (dO·vᵀ) becomes dS of the score
// before the softcap, p (dp - delta) softcap'; a row that sees no key of the tile gets zeros.
template <int Deg>
inline void row_grad(const MaskView& m, float* s, float* dp, int64_t b, int64_t h, int64_t i, int64_t k0,
                     int64_t n, int state, uint8_t* vis, float lse, float delta, float factor) {
  if (state == 0) {
    std::fill(s, s + n, 0.f);
    std::fill(dp, dp + n, 0.f);
    return;
  }
  m.finish_row(s, b, h, i, k0, n, state, vis);
  int64_t j = 0;
#if defined(__AVX512F__)
  if (m.softcap == 0.f) {  // p = 2^(s factor log2(e) - lse log2(e))
    constexpr float kLog2e = 1.44269504088896341f;
    const __m512 vf = _mm512_set1_ps(factor * kLog2e), vl = _mm512_set1_ps(lse * kLog2e),
                 vd = _mm512_set1_ps(delta);
    for (; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 p = exp2_poly<Deg>(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), vf, vl));
      _mm512_mask_storeu_ps(dp + j, k, _mm512_mul_ps(p, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dp + j), vd)));
      _mm512_mask_storeu_ps(s + j, k, p);
    }
  }
#else
  if (m.softcap == 0.f) {
    const fVec vf(factor), vl(lse), vd(delta);
    for (; j + fVec::size() <= n; j += fVec::size()) {
      const fVec p = at::vec::fmsub(fVec::loadu(s + j), vf, vl).exp_u20();
      (p * (fVec::loadu(dp + j) - vd)).store(dp + j);
      p.store(s + j);
    }
  }
#endif
  for (; j < n; ++j) {
    const float x = s[j];
    const float p = std::exp(x * factor - lse);
    float d = p * (dp[j] - delta);
    if (m.softcap > 0.f && x != kNegInf) {  // d(cap tanh(u / cap)) / du = 1 - tanh²
      const float t = x / m.softcap;
      d *= 1.f - t * t;
    }
    dp[j] = d;
    s[j] = p;
  }
}

// the rows' visibility of keys k0..k0+n-1 (MaskView::row_state); whether any row sees one
inline bool states(const MaskView& m, int64_t b, int64_t i0, int64_t nq, int64_t k0, int64_t n, int* state) {
  bool any = false;
  for (int64_t r = 0; r < nq; ++r) {
    state[r] = m.row_state(b, i0 + r, k0, k0 + n);
    any = any || state[r] > 0;
  }
  return any;
}

// x (nq, n) with leading dimension ldx, as T: out (n, nqe) = xᵀ with leading dimension ldo >= nqe,
// columns nq..nqe-1 zero (nqe: nq rounded up to even for half T); tmp: 16 x 16 floats of scratch
template <typename T>
inline void transpose_to(const float* x, int64_t ldx, int64_t nq, int64_t n, int64_t ldo, float* tmp, T* out) {
  if constexpr (is_half<T>()) {  // 16 x 16 blocks through a scratch block, each row rounded to T
    for (int64_t i0 = 0; i0 < nq; i0 += 16) {
      const int64_t mi = std::min<int64_t>(16, nq - i0);
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t mj = std::min<int64_t>(16, n - j0);
        at::vec::transpose_mxn<float>(x + i0 * ldx + j0, ldx, tmp, 16, static_cast<int>(mi), static_cast<int>(mj));
        for (int64_t j = 0; j < mj; ++j) round_to(tmp + j * 16, out + (j0 + j) * ldo + i0, mi);
      }
    }
    if (nq % 2 != 0)
      for (int64_t j = 0; j < n; ++j) out[j * ldo + nq] = T(0);
  } else {
    at::vec::transpose_mxn<float>(x, ldx, reinterpret_cast<float*>(out), ldo, static_cast<int>(nq), static_cast<int>(n));
  }
}

// work items taken from a shared counter by at::get_num_threads() threads; each item's result
// does not depend on which thread runs it
template <typename F>
void share(bool half, F body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    body(next);
    at::native::cpublas::brgemm_release(half);
  });
}

template <typename scalar_t, typename T>
int64_t backward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                      const at::Tensor& lse, const at::Tensor& g_out, const float* g_lse, const MaskView& m,
                      const std::vector<BiasGrad>& dbias, int64_t bq, int64_t bk, at::Tensor& dq, at::Tensor& dk,
                      at::Tensor& dv) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3), G = H / Hkv;
  const int64_t Dp = is_half<T>() ? even(D) : D, Dvp = is_half<T>() ? even(Dv) : Dv;
  const int64_t nqb = (Lq + bq - 1) / bq, nkb = (Lk + bk - 1) / bk, bke = even(bk), bqe = even(bq);
  Packed<T> P;
  pack_all<scalar_t, T>(q, k, v, out, lse, g_out, g_lse, bq, bk, P);
  const float factor = m.plain() ? m.scale : 1.f;  // the scale, where finish_row leaves it out
  const float scale = m.scale;
  // the keys each (b, query block) may see
  std::vector<int64_t> hull(B * nqb * 2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t qb = 0; qb < nqb; ++qb)
      m.hull(b, qb * bq, std::min(Lq, (qb + 1) * bq), Lk, hull[(b * nqb + qb) * 2], hull[(b * nqb + qb) * 2 + 1]);
  // bias gradients by pass: with the query axis (query pass), broadcast over it (key pass)
  std::vector<const BiasGrad*> by_rows, by_keys;
  bool rows_coarse = false, keys_coarse = false;
  for (const auto& g : dbias) {
    const bool over_bh = (g.Bb == 1 && B > 1) || (g.Hb == 1 && H > 1);
    if (g.Lqb == Lq) {
      by_rows.push_back(&g);
      rows_coarse = rows_coarse || over_bh;
    } else {
      by_keys.push_back(&g);
      keys_coarse = keys_coarse || over_bh;
    }
  }
  std::unique_ptr<std::atomic<uint8_t>[]> computed(new std::atomic<uint8_t>[nqb * nkb]);
  for (int64_t t = 0; t < nqb * nkb; ++t) computed[t].store(0, std::memory_order_relaxed);
  float* dqd = dq.data_ptr<float>();  // (B, H, Lq, D)
  float* dkd = dk.data_ptr<float>();  // (B, Hkv, Lk, D)
  float* dvd = dv.data_ptr<float>();  // (B, Hkv, Lk, Dv)

  // without bias gradients the key pass forms dQ too (no query pass, whose s and dP are the key
  // pass's again): each item takes the key blocks of one of `lanes` lanes (dealt back and forth)
  // and adds its dQ terms, key block after key block, into that lane's dQ; the lanes are added in
  // order at the end. The number of lanes follows the shape alone, never the thread count.
  const bool fused = dbias.empty();
  const int64_t lanes = fused ? std::min({kLanes, nkb, (kItems + B * Hkv - 1) / (B * Hkv)}) : 1;
  const int64_t dqsize = B * H * Lq * D;
  std::vector<float> dqlanes(fused ? (lanes - 1) * dqsize : 0, 0.f);
  auto lane_of = [&](int64_t kb) {
    const int64_t turn = kb / lanes, place = kb % lanes;
    return turn % 2 == 0 ? place : lanes - 1 - place;
  };

  // the key pass: dK and dV of one key block of (b, kv head), or of every (b, kv head) (coarse),
  // or (fused) of one lane's key blocks of (b, kv head), with their dQ terms
  const int64_t kitems = fused ? B * Hkv * lanes : keys_coarse ? nkb : B * Hkv * nkb;
  share(is_half<T>(), [&](std::atomic<int64_t>& next) {
    std::vector<float> sbuf(bq * bk), dpbuf(bq * bk), kacc(bk * D), vacc(bk * Dv);
    std::vector<T> pt(bk * bqe), dst(bk * bqe), ds(fused && is_half<T>() ? bq * bke : 0);
    std::vector<float> tbuf(is_half<T>() ? 16 * 16 : 0);
    std::vector<uint8_t> vis(bk);
    std::vector<int> state(bq);
    for (int64_t w = next.fetch_add(1); w < kitems; w = next.fetch_add(1)) {
      const int64_t lane = fused ? w % lanes : 0;
      const int64_t kb0 = fused ? 0 : keys_coarse ? w : w / (B * Hkv), kb1 = fused ? nkb : kb0 + 1;
      const int64_t pairs0 = fused ? w / lanes : keys_coarse ? 0 : w % (B * Hkv);
      const int64_t pairs1 = keys_coarse && !fused ? B * Hkv : pairs0 + 1;
      float* dqbase = lane == 0 ? dqd : dqlanes.data() + (lane - 1) * dqsize;
      for (int64_t kb = kb0; kb < kb1; ++kb) {
      if (fused && lane_of(kb) != lane) continue;
      const int64_t k0 = kb * bk, n = std::min(bk, Lk - k0), ne = is_half<T>() ? even(n) : n;
      for (int64_t pair = pairs0; pair < pairs1; ++pair) {
        const int64_t b = pair / Hkv, hk = pair % Hkv, blk = pair * nkb + kb;
        std::fill(kacc.begin(), kacc.end(), 0.f);
        std::fill(vacc.begin(), vacc.end(), 0.f);
        for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
          for (int64_t qb = 0; qb < nqb; ++qb) {
            const int64_t lo = hull[(b * nqb + qb) * 2], hi = hull[(b * nqb + qb) * 2 + 1];
            const int64_t i0 = qb * bq, nq = std::min(bq, Lq - i0), nqe = is_half<T>() ? even(nq) : nq;
            if (std::min(hi, k0 + n) <= std::max(lo, k0) || !states(m, b, i0, nq, k0, n, state.data())) continue;
            const int64_t row0 = (b * H + h) * Lq + i0;
            gemm_packed<T>(nq, n, D, P.vqa.at(b, h, qb), P.vqa.ld, P.kt.data() + blk * P.ktsize, sbuf.data(), bk,
                           false);
            gemm_packed<T>(nq, n, Dv, P.vda.at(b, h, qb), P.vda.ld, P.vt.data() + blk * P.vtsize, dpbuf.data(),
                           bk, false);
            for (int64_t r = 0; r < nq; ++r)
              row_grad<exp_degree<T>()>(m, sbuf.data() + r * bk, dpbuf.data() + r * bk, b, h, i0 + r, k0, n, state[r], vis.data(),
                       P.lse[row0 + r], P.delta[row0 + r], factor);
            transpose_to(sbuf.data(), bk, nq, n, bqe, tbuf.data(), pt.data());  // pᵀ, dSᵀ (n, nqe)
            transpose_to(dpbuf.data(), bk, nq, n, bqe, tbuf.data(), dst.data());
            gemm_packed<T>(n, Dv, nq, pt.data(), bqe, P.vdp.at(b, h, qb), vacc.data(), Dv, true);
            gemm_packed<T>(n, D, nq, dst.data(), bqe, P.vqp.at(b, h, qb), kacc.data(), D, true);
            if (fused) {  // this lane's dQ terms of the tile
              computed[qb * nkb + kb].store(1, std::memory_order_relaxed);
              if constexpr (is_half<T>()) {
                for (int64_t r = 0; r < nq; ++r) {
                  T* dr = ds.data() + r * bke;
                  round_to(dpbuf.data() + r * bk, dr, n);
                  for (int64_t j = n; j < ne; ++j) dr[j] = T(0);
                }
                gemm_packed<T>(nq, D, n, ds.data(), bke, P.vk.at(b, hk, kb), dqbase + row0 * D, D, true);
              } else {  // float operands: dS is read where it is
                gemm_packed<T>(nq, D, n, reinterpret_cast<const T*>(dpbuf.data()), bk, P.vk.at(b, hk, kb),
                               dqbase + row0 * D, D, true);
              }
            }
            for (const BiasGrad* g : by_keys) {  // (Bb, Hb, 1, Lk|1): the rows summed in order
              float* d = g->d + (g->Bb == 1 ? 0 : b) * g->st.s0 + (g->Hb == 1 ? 0 : h) * g->st.s1;
              for (int64_t r = 0; r < nq; ++r)
                for (int64_t j = 0; j < n; ++j) d[g->Lkb == 1 ? 0 : (k0 + j) * g->st.s3] += dpbuf[r * bk + j];
            }
          }
        float* kout = dkd + (pair * Lk + k0) * D;
        float* vout = dvd + (pair * Lk + k0) * Dv;
        for (int64_t t = 0; t < n * D; ++t) kout[t] = kacc[t] * scale;
        std::copy(vacc.begin(), vacc.begin() + n * Dv, vout);
      }
      }
    }
  });
  if (fused) {  // dQ = scale · (lane 0 + lane 1 + ...), in lane order
    at::parallel_for(0, dqsize, 4096, [&](int64_t begin, int64_t end) {
      const fVec vs(scale);
      int64_t t = begin;
      for (; t + fVec::size() <= end; t += fVec::size()) {
        fVec x = fVec::loadu(dqd + t);
        for (int64_t l = 1; l < lanes; ++l) x = x + fVec::loadu(dqlanes.data() + (l - 1) * dqsize + t);
        (x * vs).store(dqd + t);
      }
      for (; t < end; ++t) {
        float x = dqd[t];
        for (int64_t l = 1; l < lanes; ++l) x += dqlanes[(l - 1) * dqsize + t];
        dqd[t] = x * scale;
      }
    });
    int64_t count = 0;
    for (int64_t t = 0; t < nqb * nkb; ++t) count += computed[t].load(std::memory_order_relaxed);
    return count;
  }

  // the query pass: dQ of one query block of (b, head), or of every (b, head) (coarse)
  const int64_t qitems = rows_coarse ? nqb : B * H * nqb;
  share(is_half<T>(), [&](std::atomic<int64_t>& next) {
    std::vector<float> sbuf(bq * bk), dpbuf(bq * bk), qacc(bq * D);
    std::vector<T> ds(bq * bke);
    std::vector<uint8_t> vis(bk);
    std::vector<int> state(bq);
    for (int64_t w = next.fetch_add(1); w < qitems; w = next.fetch_add(1)) {
      const int64_t qb = nqb - 1 - (rows_coarse ? w : w / (B * H));  // the longest rows first (causal)
      const int64_t pairs0 = rows_coarse ? 0 : w % (B * H), pairs1 = rows_coarse ? B * H : pairs0 + 1;
      const int64_t i0 = qb * bq, nq = std::min(bq, Lq - i0);
      for (int64_t pair = pairs0; pair < pairs1; ++pair) {
        const int64_t b = pair / H, h = pair % H, hk = h / G;
        const int64_t row0 = pair * Lq + i0;
        const int64_t lo = hull[(b * nqb + qb) * 2], hi = hull[(b * nqb + qb) * 2 + 1];
        std::fill(qacc.begin(), qacc.end(), 0.f);
        for (int64_t kb = lo / bk; hi > lo && kb * bk < hi; ++kb) {
          const int64_t k0 = kb * bk, n = std::min(bk, Lk - k0), ne = is_half<T>() ? even(n) : n;
          if (!states(m, b, i0, nq, k0, n, state.data())) continue;
          computed[qb * nkb + kb].store(1, std::memory_order_relaxed);
          const int64_t blk = (b * Hkv + hk) * nkb + kb;
          gemm_packed<T>(nq, n, D, P.vqa.at(b, h, qb), P.vqa.ld, P.kt.data() + blk * P.ktsize, sbuf.data(), bk,
                         false);
          gemm_packed<T>(nq, n, Dv, P.vda.at(b, h, qb), P.vda.ld, P.vt.data() + blk * P.vtsize, dpbuf.data(), bk,
                         false);
          for (int64_t r = 0; r < nq; ++r) {
            float* d = dpbuf.data() + r * bk;
            row_grad<exp_degree<T>()>(m, sbuf.data() + r * bk, d, b, h, i0 + r, k0, n, state[r], vis.data(), P.lse[row0 + r],
                     P.delta[row0 + r], factor);
            T* dr = ds.data() + r * bke;
            at::vec::convert(d, dr, n);
            for (int64_t j = n; j < ne; ++j) dr[j] = T(0);
            for (const BiasGrad* g : by_rows) {  // (Bb, Hb, Lq, Lk|1)
              float* o = g->d + (g->Bb == 1 ? 0 : b) * g->st.s0 + (g->Hb == 1 ? 0 : h) * g->st.s1 + (i0 + r) * g->st.s2;
              if (g->Lkb == 1) {
                float t = 0.f;
                for (int64_t j = 0; j < n; ++j) t += d[j];
                o[0] += t;
              } else {
                for (int64_t j = 0; j < n; ++j) o[(k0 + j) * g->st.s3] += d[j];
              }
            }
          }
          gemm_packed<T>(nq, D, n, ds.data(), bke, P.vk.at(b, hk, kb), qacc.data(), D, true);
        }
        float* qout = dqd + row0 * D;
        for (int64_t t = 0; t < nq * D; ++t) qout[t] = qacc[t] * scale;
      }
    }
  });
  int64_t count = 0;
  for (int64_t t = 0; t < nqb * nkb; ++t) count += computed[t].load(std::memory_order_relaxed);
  return count;
}

}  // namespace

// dq (B, H, Lq, D), dk (B, Hkv, Lk, D), dv (B, Hkv, Lk, Dv) in float32, and the number of tiles;
// out (B, H, Lq, Dv), lse (B, H, Lq) float32 from the forward (lse contiguous), g_out like out,
// g_lse (B, H, Lq) contiguous or none; dbiases: per bias, a float32 (Bb, Hb, Lqb, Lkb) tensor to
// add its gradient to (each axis 1 or full; Lqb = Lq or Lkb = Lk), or an empty one for none
std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                 const at::Tensor& lse, const at::Tensor& g_out, const c10::optional<at::Tensor>& g_lse,
                                 double scale, const c10::optional<at::Tensor>& intervals,
                                 const c10::optional<at::Tensor>& keep, const std::vector<at::Tensor>& biases,
                                 const std::vector<at::Tensor>& dbiases, const c10::optional<at::Tensor>& slopes,
                                 const c10::optional<at::Tensor>& diag, double softcap, int64_t block_q,
                                 int64_t block_k, bool half_products) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "native attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "native attention: q, k, v must share a dtype");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "native attention: H must be a multiple of Hkv");
  TORCH_CHECK(block_q > 0 && block_k > 0, "native attention: blocks must be positive");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(out.scalar_type() == at::kFloat && g_out.scalar_type() == at::kFloat && out.dim() == 4 &&
                  g_out.dim() == 4 && out.size(2) == Lq && g_out.size(3) == Dv,
              "native attention backward: out and its gradient must be float32 (B, H, Lq, Dv)");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == B * H * Lq,
              "native attention backward: lse must be contiguous float32 (B, H, Lq)");
  const float* gl = nullptr;
  if (g_lse.has_value()) {
    TORCH_CHECK(g_lse->scalar_type() == at::kFloat && g_lse->is_contiguous() && g_lse->numel() == B * H * Lq,
                "native attention backward: the lse gradient must be contiguous float32 (B, H, Lq)");
    gl = g_lse->data_ptr<float>();
  }
  auto opts = q.options().dtype(at::kFloat);
  auto dq = at::zeros({B, H, Lq, D}, opts);
  auto dk = at::empty({B, Hkv, Lk, D}, opts);  // every element written by its owner
  auto dv = at::empty({B, Hkv, Lk, Dv}, opts);
  int64_t tiles = 0;
  if (B * H * Lq == 0 || Lk == 0) return {dq, dk.zero_(), dv.zero_(), at::scalar_tensor(tiles, at::kLong)};
  MaskView m = make_mask(scale, intervals, keep, biases, slopes, diag, softcap, Lq);
  std::vector<BiasGrad> grads;
  for (const auto& d : dbiases) {
    if (d.numel() == 0) continue;
    TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 4 && (d.size(0) == 1 || d.size(0) == B) &&
                    (d.size(1) == 1 || d.size(1) == H) && (d.size(2) == Lq || (d.size(2) == 1 && d.size(3) == Lk)) &&
                    (d.size(3) == 1 || d.size(3) == Lk),
                "native attention backward: a bias gradient must be float32 (B|1, H|1, Lq, Lk|1) or (B|1, H|1, 1, Lk)");
    grads.push_back({d.data_ptr<float>(), strides4(d), d.size(0), d.size(1), d.size(2), d.size(3)});
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      tiles = backward_impl<float, float>(q, k, v, out, lse, g_out, gl, m, grads, block_q, block_k, dq, dk, dv);
      break;
    case at::kBFloat16:
      if (half_products)
        tiles = backward_impl<at::BFloat16, at::BFloat16>(q, k, v, out, lse, g_out, gl, m, grads, block_q, block_k, dq,
                                                          dk, dv);
      else
        tiles = backward_impl<at::BFloat16, float>(q, k, v, out, lse, g_out, gl, m, grads, block_q, block_k, dq, dk, dv);
      break;
    case at::kHalf:
      if (half_products)
        tiles = backward_impl<at::Half, at::Half>(q, k, v, out, lse, g_out, gl, m, grads, block_q, block_k, dq, dk, dv);
      else
        tiles = backward_impl<at::Half, float>(q, k, v, out, lse, g_out, gl, m, grads, block_q, block_k, dq, dk, dv);
      break;
    default:
      TORCH_CHECK(false, "native attention takes float32, bfloat16 or float16, got ", q.scalar_type());
  }
  return {dq, dk, dv, at::scalar_tensor(tiles, at::kLong)};
}
