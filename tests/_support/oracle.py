"""An independent float64 oracle for attention, and the tolerance rule every path is held to.

Nothing here imports multihead's backends: masks are built from a plain description
(:class:`MaskPart`) straight into dense tensors, and attention is written out op by op, so a
bug in ``multihead.masks`` or in a backend cannot hide by being copied into the oracle.

The tolerance rule (flash-attn's): a path computed from inputs in ``dtype`` may differ from the
float64 oracle by at most twice the error of a naive same-precision reference, plus a tiny floor::

    path_error <= 2 * naive_error + floor
    floor = size * (FLOOR_ULPS + (sqrt(D) + 2) * S) * eps(score dtype)
            + [half inputs] (eps(dtype) * |result| + eps(dtype) / 2 * size)

The naive reference (:func:`naive_attention`) is attention written out op by op from ``dtype``
inputs. For float32/float64 every step is in ``dtype``. For float16/bfloat16 (issue 22 item 5)
the inputs are the same ``dtype`` tensors, but the scores q kᵀ, the scale, the bias, the
softmax and the accumulation of p v are in float32 (the *score dtype*), and only the output is
rounded to ``dtype``, once: flash-attn's ``attention_ref(upcast=True)``, the references of
PyTorch's and xFormers' attention tests. A bias enters at its own precision: a float32 bias
beside bfloat16 inputs is never rounded to bfloat16.

Why float32 scores. A path whose q kᵀ comes back rounded to bfloat16 (torch's bfloat16 ``mm`` on
the CPU returns bfloat16) moves a score s by up to |s| 2⁻⁹ before the softmax; at scores of a few
units that is a different distribution (an error of 1.04 against float64 at L=2048, inputs x3,
where SDPA's fused kernel, bfloat16 operands into float32 products, makes 0.032). The earlier
naive reference rounded its own scores and probabilities to ``dtype`` as well, so its error was
of the same size and "2 x the naive error" accepted the rounded path;
``test_numerics.py::test_bf16_rounded_products_fail_the_rule`` emulates such products and holds
them to this rule (they fail it) beside emulated AMX/AVX512-BF16 products (bfloat16 operands,
float32 accumulation), which pass.

Why these and no other roundings. The rule should allow the errors that ``dtype`` inputs force on
any computation in that precision (the products of ``dtype`` numbers and the ``dtype`` result), and
no error that only a careless path makes. Rounding the bias to ``dtype``, or summing the softmax's
exponentials in ``dtype``, is of the second kind, and it is not small next to the first: a bias b rounded to bfloat16 moves
its score by up to |b| 2⁻⁹ whatever q·kᵀ is, so a BLOOM-style ALiBi bias (slope × key position,
hundreds at a few hundred keys) moves scores by 0.5 or more and turns the softmax into another
distribution. A reference that rounded the bias too made its own error as large as the careless
path's, so "2 × the naive error" accepted it (issue 11, defect 6: the sdpa backend rounded a float32
bias to the inputs' dtype). With the bias and the softmax in float32 the naive error is what the
half-precision products and results cost, and a path that rounds the bias exceeds twice that:
in ``test_numerics.py::test_float32_bias_is_not_rounded_to_half_inputs`` the old sdpa backend's
error was 1.9 (bfloat16) and 0.41 (float16) against bounds of 0.079 and 0.012.

The floor covers what "2 x the naive error" may miss: a correct path may make a rounding that the
naive code makes elsewhere, or whose twin in the naive code happened to cancel the naive code's
other errors. Let c = float32 for float16/bfloat16 inputs (the paths compute in it) and c = dtype
otherwise, u(dt) = eps(dt) / 2 the cost of one rounding relative to the rounded value, and::

    floor = size * (FLOOR_ULPS * eps(c) + (sqrt(D) + 2) * S * eps(c))          every dtype
          + CAST_ULPS * eps(dtype) * |result| + INNER_ULPS * u(dtype) * size    only where c != dtype

``size`` is the size of the terms that are summed: for the output ``sum_j p_j v_j`` (p_j >= 0,
sum p_j = 1) it is max|v|; in general (gradients, the module's projections) it is measured by
running the float64 oracle on absolute values with a backward that adds magnitudes
(:class:`_TermSizes`), so no sum cancels: a gradient entry that is a sum of 31 terms of size 1 may
cancel to 0.04, but its rounding error is still that of terms of size 1. ``|result|`` is the
result's own magnitude, max|oracle|.

Accumulation (FLOOR_ULPS = 4 roundings in c of ``size``): a correct path sums the same terms in
another order, rescales a running sum (online softmax) and divides at another point; each costs
at most u(c) of the terms summed. For float32 and float64 the path and the naive code round at the
same precision, c = dtype, so this part also holds their roundings to dtype: it is the floor as it
always was.

Scores ((sqrt(D) + 2) roundings in c of S): every probability is exp(score - max). A path that
forms a score in another order rounds it differently, by up to about (sqrt(D) + 2) * S * eps(c)
(D products summed, then the scale and the bias; S = scale * sum_d |q_d k_d| + |bias| is the size
of the score's terms), and exp turns that absolute error into the same relative error of every
probability, hence of every term. The paths form their scores in c.

Roundings to dtype, where a path computes in float32 from float16/bfloat16 inputs. Rounding is
relative: a value x rounded to dtype moves by at most u(dtype) |x|, so a rounding costs the size
of what is rounded, not of the terms that made it. Those a path makes exactly as the naive code
does (the module's projections: the same F.linear on the same dtype inputs) are inside the naive
error already. Two kinds are not:

* the final cast, at most u |result|. The naive code rounds its result too, and its other errors
  may have cancelled against that rounding; then its error understates the shared error by up to
  u |result|. Together: CAST_ULPS = 1 ulp of the result's own magnitude, eps(dtype) * |result|.
* an intermediate that the path rounds to dtype at another point than the naive code.
  Flash-style kernels (torch's CPU flash kernel for bfloat16/float16, the CUDA kernels) round the
  unnormalized probabilities exp(s - running max) to dtype for the p v product and normalize in
  float32, where the naive code rounds the normalized ones; their backward rounds dS and dP for
  the products with k, q and v. Rounding every p_j by a relative u moves ``sum_j p_j v_j`` by at
  most u sum_j p_j |v_j|, which the terms' size bounds, and likewise for each gradient, whose
  terms are those products: INNER_ULPS = 1 rounding of ``size``. In the module, the attention
  output o (rounded to dtype by both, from inputs that now differ) propagates through out_proj
  as u |W_o| |o|, also below ``size``.

So for float16/bfloat16 the floor is about one ulp of the result plus half an ulp of the terms,
where it used to be FLOOR_ULPS = 4 ulps of the terms: for the module (whose terms, summed through
the projections, reach 8 to 10 where the output stays near 1) the bfloat16 floor fell from 0.24
to 0.04, and a RoPE shifted by one position in cached decoding (error 0.059) fails it; before,
only the float32 tests caught it.

The floor matters where the naive error is small by luck: one key (the weight is exactly 1), a
tiny tensor whose few rounding errors happen to cancel, or float32 and float64, where the path
and the naive code round at the same precision and either may be the luckier.

float64 is the oracle's own precision, so the naive float64 error cannot be measured against
it. To first order a rounding error is proportional to the unit roundoff, so for float64 the
naive error is estimated as ``naive_error(float32) * eps(float64) / eps(float32)``: the same
problem's sensitivity to rounding, scaled to float64.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim, Dv value dim.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

import multihead
import multihead.masks as mmasks
from multihead import backends


@pytest.fixture(scope="module")
def one_thread():
    """torch on one intra-op thread for a test module, restored afterwards. The tensors in these
    tests are tiny: extra threads only add synchronisation, which on a busy 2-core machine made
    the suite four times slower in wall time. A test module imports it and
    sets ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def tile_kernel_as(which: str):
    """The chunked backend's tile kernel inside the block: "native" (the C++ kernel) or "torch
    tiles" (the readable torch one, the native kernel's oracle)."""
    from multihead.backends import native

    before = native.ENABLED
    native.ENABLED = which == "native"
    try:
        yield which
    finally:
        native.ENABLED = before


#: the chunked backend's two implementations of one algorithm (issue 22: every test that runs
#: chunked runs both); "native" only where the kernel builds here
TILE_KERNELS = ("native", "torch tiles")


@pytest.fixture
def tile_kernel(request):
    """The tile kernel a test runs chunked with (see :func:`parametrize_tile_kernels`)."""
    from multihead.backends import native

    which = getattr(request, "param", TILE_KERNELS[0])
    if which == "native" and native.module() is None:
        pytest.skip(f"the native kernel cannot be built here: {native.status()}")
    with tile_kernel_as(which):
        yield which


@pytest.fixture
def torch_tiles():
    """Marks a test of the torch tiles' own mechanics (redone panels, Python threads, base 2):
    :func:`parametrize_tile_kernels` runs it on the torch tiles alone."""
    yield


def parametrize_tile_kernels(metafunc) -> None:
    """A test module's ``pytest_generate_tests`` (the module also sets ``pytestmark =
    pytest.mark.usefixtures("tile_kernel")``): every test runs once per tile kernel
    (:data:`TILE_KERNELS`), those that take the ``torch_tiles`` fixture on the torch tiles alone."""
    kernels = ["torch tiles"] if "torch_tiles" in metafunc.fixturenames else list(TILE_KERNELS)
    metafunc.parametrize("tile_kernel", kernels, indirect=True)


#: roundings in the compute dtype of the terms' size (accumulation order, rescaling)
@contextlib.contextmanager
def torch_threads(n: int):
    """torch on ``n`` intra-op threads inside the block, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside the block, restored afterwards."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


FLOOR_ULPS = 4
#: half inputs: ulps of the result's own magnitude for the final cast (the path's and the naive code's)
CAST_ULPS = 1
#: half inputs: roundings to dtype (u = eps / 2) of the terms' size, for an intermediate rounded elsewhere
INNER_ULPS = 1
LOW_PRECISION = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


# --------------------------------------------------------------------------- declared refusals
def declined(backend: str, q, k, v, mask=None, dropout_p: float = 0.0) -> Optional[str]:
    """Why ``backend`` declines this call, or None. By the registry's contract a backend may
    decline a call (the chunked backend declines dropout); asked for by name, it must then raise
    a ValueError saying so -- see :func:`attention_or_refusal`."""
    if backend == "auto":
        return None
    call = backends.Call(q=q, k=k, v=v, mask=mmasks.as_mask(mask), dropout_p=dropout_p)
    return backends.get(backend).refuses(call)


def attention_or_refusal(backend: str, q, k, v, mask=None, **kwargs):
    """``multihead.attention(...)``, or None after checking that a backend which declines the
    call says so by name."""
    if declined(backend, q, k, v, mask, kwargs.get("dropout_p", 0.0)):
        with pytest.raises(ValueError, match=f"backend '{backend}' cannot run this call"):
            multihead.attention(q, k, v, mask, backend=backend, **kwargs)
        return None
    return multihead.attention(q, k, v, mask, backend=backend, **kwargs)


def module_or_refusal(backend: str, module, *args, **kwargs):
    """``module(*args, **kwargs)``, or None when its backend declines the call by name."""
    try:
        return module(*args, **kwargs)
    except ValueError as e:
        if backend == "auto" or f"backend '{backend}' cannot run this call" not in str(e):
            raise
        return None


# --------------------------------------------------------------------------- masks
@dataclass
class MaskPart:
    """One mask in plain words: ``kind`` and its parameters.

    kinds: "causal" (align), "window" (left, right, align, sinks), "key_padding" (tensor (B, Lk),
    True = real token), "keep" (bool tensor, True = may attend), "bias" (float tensor),
    "torch" (nn.MultiheadAttention masks, True = blocked: attn_mask and/or key_padding_mask),
    each tensor broadcastable to (B, H, Lq, Lk) as the kind allows; "documents" (``ids`` =
    (q_ids (B|1, Lq), kv_ids (B|1, Lk)) integer document ids, < 0 padding), "chunked_local"
    (chunk, align), "alibi" (tensor = slopes (H,), align), "mask_mod" (fn(b, h, q, kv) -> bool).
    ``raw`` passes a keep/bias tensor as a plain tensor instead of through the constructor.
    """

    kind: str
    align: str = "bottom_right"
    left: Optional[int] = None
    right: Optional[int] = None
    tensor: Optional[torch.Tensor] = None
    padding: Optional[torch.Tensor] = None
    raw: bool = False
    sinks: int = 0
    chunk: int = 1
    ids: Optional[tuple] = None
    fn: Optional[Callable] = None

    def to_multihead(self):
        """The multihead mask object (or plain tensor) for this part."""
        if self.kind == "causal":
            return mmasks.causal(self.align)
        if self.kind == "window":
            return mmasks.window(self.left, self.right, align=self.align, sinks=self.sinks)
        if self.kind == "documents":
            q_ids, kv_ids = self.ids
            return mmasks.documents(q_ids) if kv_ids is q_ids else mmasks.documents(q_ids, kv_ids)
        if self.kind == "chunked_local":
            return mmasks.chunked_local(self.chunk, align=self.align)
        if self.kind == "alibi":
            return mmasks.alibi(self.tensor, align=self.align)
        if self.kind == "mask_mod":
            return mmasks.mask_mod(self.fn)
        if self.kind == "key_padding":
            return mmasks.key_padding(self.tensor)
        if self.kind == "keep":
            return self.tensor if self.raw else mmasks.keep(self.tensor)
        if self.kind == "bias":
            return self.tensor if self.raw else mmasks.bias(self.tensor)
        if self.kind == "torch":
            return mmasks.from_torch(attn_mask=self.tensor, key_padding_mask=self.padding)
        raise AssertionError(self.kind)


def combine(parts: list) -> object:
    """multihead's mask for ``parts`` joined with ``&`` (None for no parts).

    A raw tensor meets ``&`` only with a mask object on its other side (two raw tensors would be
    torch's own ``&``): ``Mask & tensor`` and ``tensor & Mask`` are both exercised.
    """
    mask = None
    for part in parts:
        m = part.to_multihead()
        if isinstance(mask, torch.Tensor) and isinstance(m, torch.Tensor):
            mask = mmasks.as_mask(mask)
        mask = m if mask is None else mask & m
    return mask


def dense(parts: list, B: int, H: int, Lq: int, Lk: int, *, dtype=torch.float64):
    """keep (B, H, Lq, Lk) bool and bias (B, H, Lq, Lk) for ``parts``, from the spec; the bias is
    summed in ``score_dtype(dtype)`` (float32 for float16/bfloat16 inputs: never rounded to them).

    Query i sees key j when j <= i + offset (causal), and i + offset - left <= j <= i + offset + right
    (window), offset = Lk - Lq for bottom-right alignment and 0 for top-left. With a documents
    part the same holds inside each document (its queries and keys numbered from 0, as if run
    alone; flash-attn varlen), keys of other documents are hidden, and so are padding ids (< 0).
    A window's sink tokens are the first ``sinks`` keys (of the document) up to i + offset + right;
    chunked_local keeps key j when j // chunk == (i + offset) // chunk; alibi adds
    -slope_h * |j - (i + offset)|; a mask_mod is evaluated on the full index grids.
    """
    dtype = score_dtype(dtype)
    keep = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    bias = torch.zeros(B, H, Lq, Lk, dtype=dtype)
    cols = torch.arange(Lk).view(1, 1, Lk)
    docs = [p for p in parts if p.kind == "documents"]
    # per (row b, query i): the first key of its document, and its diagonal key for each alignment
    start, diags, same = _document_geometry(docs[0].ids if docs else None, B, Lq, Lk)
    for p in parts:
        diag = diags[p.align]  # (B, Lq, 1): the key each query's diagonal sits on
        if p.kind == "causal":
            keep = keep & (cols <= diag).unsqueeze(1)
        elif p.kind == "window":
            ok = torch.ones(B, Lq, Lk, dtype=torch.bool)
            if p.left is not None:
                ok = ok & (cols >= diag - p.left)
            sink_token = cols - start < p.sinks
            if p.right is not None:
                ok = ok & (cols <= diag + p.right)
                sink_token = sink_token & (cols <= diag + p.right)
            keep = keep & (ok | sink_token).unsqueeze(1)
        elif p.kind == "documents":
            keep = keep & same.unsqueeze(1)
        elif p.kind == "chunked_local":
            keep = keep & (torch.div(cols - start, p.chunk, rounding_mode="floor")
                           == torch.div(diag - start, p.chunk, rounding_mode="floor")).unsqueeze(1)
        elif p.kind == "alibi":
            bias = bias + (-p.tensor.to(dtype).view(1, H, 1, 1) * (cols - diag).abs().unsqueeze(1).to(dtype))
        elif p.kind == "mask_mod":
            grid = (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
                    torch.arange(Lq).view(1, 1, Lq, 1), torch.arange(Lk).view(1, 1, 1, Lk))
            keep = keep & p.fn(*grid)
        elif p.kind == "key_padding":
            keep = keep & p.tensor.view(B, 1, 1, Lk)
        elif p.kind == "keep":
            keep = keep & p.tensor
        elif p.kind == "bias":
            bias = bias + p.tensor.to(dtype)
        elif p.kind == "torch":
            if p.tensor is not None:
                t = p.tensor.reshape(B, H, Lq, Lk) if p.tensor.dim() == 3 else p.tensor
                if t.dtype == torch.bool:
                    keep = keep & ~t  # nn.MultiheadAttention: True = blocked
                else:
                    bias = bias + t.to(dtype)
            if p.padding is not None:
                if p.padding.dtype == torch.bool:
                    keep = keep & ~p.padding.view(B, 1, 1, Lk)
                else:
                    bias = bias + p.padding.view(B, 1, 1, Lk).to(dtype)
        else:
            raise AssertionError(p.kind)
    return keep, bias


def _document_geometry(ids, B: int, Lq: int, Lk: int):
    """(start, {align: diagonal}, same) by loops over the documents: start (B, Lq, 1) the first
    key of each query's document (0 without documents), each diagonal (B, Lq, 1), ``same``
    (B, Lq, Lk) whether query and key share a document (all True without documents)."""
    rows = torch.arange(Lq).view(1, Lq, 1)
    if ids is None:
        zero = torch.zeros(B, Lq, 1, dtype=torch.long)
        return zero, {"bottom_right": rows + (Lk - Lq) + zero, "top_left": rows + zero}, torch.ones(B, Lq, Lk, dtype=torch.bool)
    q_ids, kv_ids = ids
    start = torch.zeros(B, Lq, 1, dtype=torch.long)
    br = torch.zeros(B, Lq, 1, dtype=torch.long)
    tl = torch.zeros(B, Lq, 1, dtype=torch.long)
    same = torch.zeros(B, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        qrow = q_ids[b % q_ids.shape[0]].tolist()
        krow = kv_ids[b % kv_ids.shape[0]].tolist()
        for i, d in enumerate(qrow):
            if d < 0:
                continue
            qpos = [x for x in range(Lq) if qrow[x] == d]
            kpos = [x for x in range(Lk) if krow[x] == d]
            first = kpos[0] if kpos else 0
            a = qpos.index(i)
            start[b, i, 0] = first
            br[b, i, 0] = first + a + len(kpos) - len(qpos)
            tl[b, i, 0] = first + a
            for j in kpos:
                same[b, i, j] = True
    return start, {"bottom_right": br, "top_left": tl}, same


# --------------------------------------------------------------------------- attention
def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the naive reference scales, biases and softmaxes the scores of ``dtype`` inputs:
    float32 for float16/bfloat16, ``dtype`` itself otherwise (see the module docstring)."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def _probabilities(q, k, keep, bias, scale):
    """softmax(q kᵀ · scale + bias, -inf where not keep) in q's dtype, a row with no visible key all 0."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    top = s.detach().amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_zeros(s.shape[:-1] + (1,))
    top = top.masked_fill(top == -math.inf, 0)
    e = torch.exp(s - top)
    z = e.sum(dim=-1, keepdim=True)
    return e / z.masked_fill(z == 0, 1)


def naive_attention(q, k, v, keep, bias, scale: float, dtype: torch.dtype, *, term_sizes: Optional[dict] = None):
    """softmax(q kᵀ · scale + bias, -inf where not keep) v from ``dtype`` inputs, the naive
    same-precision reference of the module docstring: the inputs rounded to ``dtype``; for
    float16/bfloat16 the products, the scale, the bias (never rounded to ``dtype``), the softmax
    and the accumulation in :func:`score_dtype` (float32), the output rounded to ``dtype`` once;
    every step in ``dtype`` otherwise.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), keep/bias (B, H, Lq, Lk) -> (B, H, Lq, Dv).
    Query head i reads key/value head i // (H // Hkv). A row with no visible key gives 0.

    ``term_sizes`` (a dict; with non-negative q, k, v and upstream gradient) gives the size of
    the terms summed in every output and gradient entry instead, see :class:`_TermSizes`, and
    records in ``term_sizes["score"]`` the largest size of a visible score's terms,
    ``scale * sum_d |q_d k_d| + |bias|``.
    """
    H, Hkv = q.shape[1], k.shape[1]
    kv_head = torch.arange(H) // (H // Hkv)
    sdt = score_dtype(dtype)
    q, k, v = q.to(dtype), k.to(dtype)[:, kv_head], v.to(dtype)[:, kv_head]
    bias = None if bias is None else bias.to(sdt)
    if term_sizes is not None:
        term_sizes["score"] = max(term_sizes.get("score", 0.0), score_size(q, k, keep, bias, scale))
        return _TermSizes.apply(q, k, v, keep, bias, scale)
    q, k, v = q.to(sdt), k.to(sdt), v.to(sdt)
    return torch.matmul(_probabilities(q, k, keep, bias, scale), v).to(dtype)


def score_size(q, k, keep, bias, scale: float) -> float:
    """The largest size of a visible score's terms, ``scale * sum_d |q_d k_d| + |bias|``.

    q (B, H, Lq, D), k (B, H or Hkv, Lk, D); keep/bias (B, H, Lq, Lk) or None."""
    with torch.no_grad():
        kv_head = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
        size = scale * torch.matmul(q.double().abs(), k.double()[:, kv_head].abs().transpose(-1, -2))
        if bias is not None:
            size = size + bias.double().abs().nan_to_num(posinf=0.0)
            size = size.masked_fill(bias == -math.inf, 0)
        if keep is not None:
            size = size.masked_fill(~keep, 0)
    return size.max().item() if size.numel() else 0.0


class _TermSizes(torch.autograd.Function):
    """Attention whose backward adds magnitudes instead of cancelling them (a running error bound).

    The softmax gradient ``dS = P * (dP - rowsum(P * dP))`` subtracts; its rounding error is
    that of its terms, ``P * (|dP| + rowsum(P * |dP|))``, not that of the (possibly tiny) difference.
    Every product here is of non-negative tensors, so nothing cancels.
    """

    @staticmethod
    def forward(ctx, q, k, v, keep, bias, scale):
        p = _probabilities(q, k, keep, bias, scale)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return torch.matmul(p, v)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, p = ctx.saved_tensors
        d_p = torch.matmul(grad_out.abs(), v.abs().transpose(-1, -2))
        d_s = p * (d_p + (p * d_p).sum(-1, keepdim=True))
        d_q = ctx.scale * torch.matmul(d_s, k.abs())
        d_k = ctx.scale * torch.matmul(d_s.transpose(-1, -2), q.abs())
        d_v = torch.matmul(p.transpose(-1, -2), grad_out.abs())
        return d_q, d_k, d_v, None, d_s if ctx.needs_input_grad[4] else None, None


def naive_weights(q, k, keep, bias, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The softmax probabilities (B, H, Lq, Lk) of :func:`naive_attention`, in ``dtype``."""
    Lk = k.shape[2]
    eye = torch.eye(Lk, dtype=dtype).expand(k.shape[0], k.shape[1], Lk, Lk)
    return naive_attention(q, k, eye, keep, bias, scale, dtype)


# --------------------------------------------------------------------------- tolerance
def row_sum_bound(dtype: torch.dtype, lk: int) -> float:
    """How far from 1 a row of probabilities over ``lk`` keys may sum, for ``dtype`` inputs.

    The probabilities are computed in float32 (float64 for float64 inputs): each p_j = e_j / z
    with z summed over lk terms, so |sum p - 1| <= (lk + 2) u_compute; rounding each p_j to
    dtype adds at most u_dtype * sum p = u_dtype (u = eps / 2).
    """
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (lk + 2) * eps(compute) / 2 + eps(dtype) / 2


@dataclass
class Verdict:
    what: str
    error: float
    naive_error: float
    floor: float
    details: dict = field(default_factory=dict)

    @property
    def bound(self) -> float:
        return 2 * self.naive_error + self.floor

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    def __str__(self) -> str:
        return (f"{self.what}: error {self.error:.3e} > bound {self.bound:.3e} "
                f"(2 x naive {self.naive_error:.3e} + floor {self.floor:.3e}) {self.details}")


def max_abs_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    return (got.double() - ref.double()).abs().max().item()


def judge(what: str, got: torch.Tensor, oracle: torch.Tensor, naive: Callable[[torch.dtype], torch.Tensor],
          dtype: torch.dtype, *, terms: Optional[torch.Tensor] = None, score_size: float = 0.0,
          head_dim: int = 1, **details) -> Verdict:
    """Hold ``got`` (computed from ``dtype`` inputs) to the rule in the module docstring.

    ``naive(dt)`` returns the naive result computed entirely in ``dt``; ``terms`` is the oracle
    run on absolute values (the size of the summed terms; default: the oracle itself);
    ``score_size`` the largest size of a score's terms and ``head_dim`` the length of its sum.
    The floor's parts (accumulation, scores, and for half inputs the cast and one inner rounding
    to ``dtype``) are derived in the module docstring.
    """
    assert got.shape == oracle.shape, f"{what}: shape {tuple(got.shape)} != {tuple(oracle.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values where the oracle is finite"
    if dtype == torch.float64:
        naive_error = max_abs_error(naive(torch.float32), oracle) * eps(torch.float64) / eps(torch.float32)
    else:
        naive_error = max_abs_error(naive(dtype), oracle)
    result = oracle.abs().max().item() if oracle.numel() else 0.0
    size = max((t.abs().max().item() for t in (oracle, terms) if t is not None and t.numel()), default=0.0)
    compute = score_dtype(dtype)
    floor = size * (FLOOR_ULPS * eps(compute) + (math.sqrt(head_dim) + 2) * score_size * eps(compute))
    if compute != dtype:  # computed in float32 from half inputs: the roundings to dtype of the docstring
        floor += CAST_ULPS * eps(dtype) * result + INNER_ULPS * eps(dtype) / 2 * size
    return Verdict(what, max_abs_error(got, oracle), naive_error, floor, details)
