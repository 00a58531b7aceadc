// The native tile kernel: the online softmax of multihead/backends/tiles.py in C++ against ATen.
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
// Tiles no row of a query block sees are skipped; a tile its rows see in part (the diagonal's)
// goes by panels of 64 rows, each over the key columns its rows see.
//
// Where the CPU has AMX and the inputs are bfloat16, forward() runs amx_forward.cpp instead: the
// same algorithm with the products on the tile registers and the scores kept in L1 (rows.h holds
// the row pieces both take).
//
// Legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Lq/Lk lengths, D head dim, Dv value dim.

#include <torch/extension.h>

#include "common.h"
#include "rows.h"
#include "amx_forward.h"

#include <algorithm>
#include <atomic>
#include <memory>

using namespace multihead_native;

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

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

// rows of a diagonal tile computed together (by panels), see forward_impl
constexpr int64_t kPanel = 64;

// C (m, cols) += A (m, K) B with B the first K of the Kp rows pack_b packed (K <= Kp)
template <typename T>
void gemm_rows(int64_t m, int64_t cols, int64_t K, int64_t Kp, const T* a, int64_t lda, const T* b, float* c,
               int64_t ldc) {
  const int64_t Ke = is_half<T>() ? even(K) : K, Kpe = is_half<T>() ? even(Kp) : Kp;
  for (int64_t ch = 0; ch < chunks(cols); ++ch) {
    const int64_t c0 = ch * kChunk, nc = std::min(kChunk, cols - c0), ld = up16(nc);
    at::native::cpublas::brgemm(m, nc, Ke, lda, ld, ldc, true, a, b + ch * Kpe * kChunk, c + c0, is_half<T>());
  }
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
      load_rows(qbase, qs.s2, qs.s3, nq, nq, D, Dp, qbuf.data());
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
        // a tile every row sees whole is one panel; a partly seen one (a diagonal tile) goes by
        // panels of kPanel rows, each over the key columns up to its rows' last visible key
        // (whole chunks of kChunk), so the keys no row of a panel sees are not computed
        bool whole = true;
        for (int64_t r = 0; r < nq && whole; ++r) whole = state[r] == 2;
        const int64_t panel = whole ? nq : kPanel;
        for (int64_t r0 = 0; r0 < nq; r0 += panel) {
          const int64_t nr = std::min(panel, nq - r0);
          int64_t nn = n;
          if (!whole) {
            int64_t plo, phi;
            m.hull(b, i0 + r0, i0 + r0 + nr, Lk, plo, phi);
            if (phi <= k0 || plo >= k0 + n || phi <= plo) continue;  // no row of the panel sees this block
            nn = std::min(n, (phi - k0 + kChunk - 1) / kChunk * kChunk);
          }
          const int64_t nee = is_half<T>() ? even(nn) : nn;
          gemm_packed<T>(nr, nn, D, qbuf.data() + r0 * Dp, Dp, kp.get() + blk * ksize, sbuf.data() + r0 * ldp, ldp, false);
          for (int64_t r = r0; r < r0 + nr; ++r) {
            float* s = sbuf.data() + r * ldp;
            T* p = pbuf(r);
            if (state[r] == 0) {
              for (int64_t j = 0; j < nee; ++j) p[j] = T(0);
              continue;
            }
            m.finish_row(s, b, h, i0 + r, k0, nn, state[r], vis.data());
            float top = row_max(s, nn);
            if (top == kNegInf && std::any_of(s, s + nn, [](float x) { return std::isnan(x); })) top = NAN;
            top *= factor;
            const float mnew = std::isnan(top) ? top : std::max(mx[r], top);
            if (mnew == kNegInf) {  // nothing seen yet in this row
              for (int64_t j = 0; j < nee; ++j) p[j] = T(0);
              continue;
            }
            const float alpha = mx[r] == kNegInf ? 0.f : exp2_one(mx[r] - mnew);
            // p = 2^(s · factor - mnew), summed in float32, stored rounded to the operand type
            sum[r] = sum[r] * alpha + exp_row<T>(s, nn, nee, factor, mnew, p);
            mx[r] = mnew;
            if (alpha != 1.f) {
              float* a = acc.data() + r * Dv;
              const fVec va(alpha);
              int64_t d = 0;
              for (; d + fVec::size() <= Dv; d += fVec::size()) (fVec::loadu(a + d) * va).store(a + d);
              for (; d < Dv; ++d) a[d] *= alpha;
            }
          }
          gemm_rows<T>(nr, Dv, nn, n, pbuf(r0), ldp, vp.get() + blk * vsize, acc.data() + r0 * Dv, Dv);
        }
      }
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t row = (b * H + h) * Lq + i0 + r;
        float* o = acc.data() + r * Dv;
        ld[row] = finish_output_row(o, Dv, sum[r], mx[r]);
        std::memcpy(od + row * Dv, o, Dv * sizeof(float));
      }
    }
    at::native::cpublas::brgemm_release(is_half<T>());
  });
  int64_t count = 0;
  for (int64_t t = 0; t < nqb * nkb; ++t) count += computed[t].load(std::memory_order_relaxed);
  return count;
}


}  // namespace

// out (B, H, Lq, Dv) float32 and lse (B, H, Lq) float32 (natural log; -inf for a row with no visible
// key), the tiles computed, and which forward ran (0 these brgemm tiles, 1 amx_forward.cpp's AMX
// tiles: bfloat16 with half products where amx_tiles allows it and the shapes fit; then out is
// bfloat16 where half_out asks for it)
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                const c10::optional<at::Tensor>& intervals, const c10::optional<at::Tensor>& keep,
                                const std::vector<at::Tensor>& biases, const c10::optional<at::Tensor>& slopes,
                                const c10::optional<at::Tensor>& diag, double softcap, int64_t block_q,
                                int64_t block_k, bool half_products, bool amx_tiles, bool half_out) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "native attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "native attention: q, k, v must share a dtype");
  TORCH_CHECK(q.device().is_cpu(), "native attention runs on the CPU");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "native attention: H must be a multiple of Hkv");
  TORCH_CHECK(block_q > 0 && block_k > 0, "native attention: blocks must be positive");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Dv = v.size(3);
  const bool amx = q.scalar_type() == at::kBFloat16 && half_products && amx_tiles && amx_forward_available() &&
                   amx_forward_fits(q.size(3), Dv, block_q, block_k);
  // every row of out and lse is written by the work item that owns it; the AMX forward writes out
  // in bfloat16 where the caller asks (half_out: nothing reads the float32 out, a backward included)
  auto out = at::empty({B, H, Lq, Dv}, q.options().dtype(amx && half_out ? at::kBFloat16 : at::kFloat));
  auto lse = at::empty({B, H, Lq}, q.options().dtype(at::kFloat));
  int64_t tiles = 0, path = 0;  // path 1: the AMX forward ran
  if (B * H * Lq == 0) return {out, lse, at::scalar_tensor(tiles, at::kLong), at::scalar_tensor(path, at::kLong)};
  MaskView m = make_mask(scale, intervals, keep, biases, slopes, diag, softcap, Lq);
  switch (q.scalar_type()) {
    case at::kFloat:
      tiles = forward_impl<float, float>(q, k, v, m, block_q, block_k, out, lse);
      break;
    case at::kBFloat16:
      if (amx) {
        tiles = forward_amx(q, k, v, m, block_q, block_k, out, lse);
        path = 1;
      } else if (half_products)
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
  return {out, lse, at::scalar_tensor(tiles, at::kLong), at::scalar_tensor(path, at::kLong)};
}

bool could_pack(const std::string& dtype) {
  return at::native::cpublas::could_pack(dtype == "bfloat16" ? at::kBFloat16 : at::kHalf);
}

// how many threads at::parallel_for ran a body on, over n items of grain 1 (at most n; 1 where the
// kernel was built without OpenMP, whose at::parallel_for is serial)
int64_t parallel_threads(int64_t n) {
  std::vector<std::atomic<uint8_t>> seen(std::max<int64_t>(at::get_num_threads(), 1));
  for (auto& s : seen) s.store(0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int64_t t = at::get_thread_num();
    if (t >= 0 && t < static_cast<int64_t>(seen.size())) seen[t].store(1);
  });
  int64_t count = 0;
  for (auto& s : seen) count += s.load();
  return count;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("parallel_threads", &parallel_threads, "threads at::parallel_for ran a body on over n items");
  mod.def("forward", &forward, "attention forward by tiles (out, lse)");
  mod.def("backward", &backward, "attention backward by tiles (dq, dk, dv, bias grads) from out and lse");
  mod.def("could_pack", &could_pack, "whether brgemm takes packed half operands of this dtype here");
  mod.def("amx_forward_available", &amx_forward_available, "whether the bfloat16 forward runs on AMX tiles here");
}
