// The bfloat16 forward on AMX tiles (amx_forward.cpp): where it runs, and its entry.
//
// Legend: B batch, H query heads, Hkv kv heads, Lq/Lk lengths, D head dim, Dv value dim.

#pragma once

#include "common.h"

namespace multihead_native {

// whether this build has the AMX forward and the OS lets this process use the tiles
bool amx_forward_available();

// whether the AMX forward takes these head dims and blocks: D % 32 == 0, Dv % 16 == 0, block_q a
// multiple of 16 rows and block_k of 64 keys (else the brgemm forward runs)
bool amx_forward_fits(int64_t D, int64_t Dv, int64_t block_q, int64_t block_k);

// out (B, H, Lq, Dv; float32 or bfloat16) and lse (B, H, Lq) float32 from bfloat16 q (B, H, Lq, D), k (B, Hkv, Lk, D),
// v (B, Hkv, Lk, Dv) read through their strides; returns the (query block, key block) tiles some
// (batch, head) computed, as forward_impl counts them
int64_t forward_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const MaskView& m,
                    int64_t block_q, int64_t block_k, at::Tensor& out, at::Tensor& lse);

}  // namespace multihead_native
