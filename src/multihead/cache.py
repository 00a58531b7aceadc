"""``KVCache``: the keys and values of the tokens seen so far, for step-by-step generation.

Without a cache, generating token n recomputes the keys and values of all n tokens. With one,
each step projects only the new token(s), writes their keys/values after the cached ones and
attends over everything written so far::

    cache = multihead.KVCache(max_len=1024)      # one per attention layer
    y = mha(prompt, cache=cache)                 # prefill: L tokens, causal
    for _ in range(steps):
        y = mha(x_next, cache=cache)             # decode: 1 token attends to all cached ones

The buffers are allocated once, on the first ``append``, at their full size
(B, Hkv, max_len, D); each ``append`` copies the new entries into place and returns views of the
filled part, so a step costs O(new tokens) writes (no O(n²) re-concatenation).

With grouped-query attention (``num_kv_heads`` = Hkv < H) the cache holds only the Hkv key/value
heads: its memory is Hkv/H of a cache of all H heads (multi-query attention, Hkv = 1: 1/H).
Memory = 2 · B · Hkv · max_len · D · bytes per element (see :attr:`KVCache.nbytes`).

The cache is for inference: run decoding under ``torch.no_grad()`` or ``torch.inference_mode()``.
Appending tensors that require grad raises, because the in-place writes of later steps would
invalidate the graph of earlier ones.

Grad modes may change from one call to the next. Buffers allocated under ``inference_mode``
are inference tensors, which torch lets no one write outside inference mode; the first append
outside it copies them, once, into ordinary tensors (O(max_len) copy, then writes in place as
before), so a cache filled under ``inference_mode`` keeps working under ``no_grad`` or with
frozen weights in grad mode. Buffers allocated outside ``inference_mode`` are written in place
under any mode.

Legend: B batch, Hkv key/value heads, L tokens, D head dim, Dv value head dim.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._checks import check_positive_int, check_rank, check_same_dtype_device, check_tensor

__all__ = ["KVCache"]


class KVCache:
    """A preallocated key/value store for one attention layer.

    Args:
        max_len: the most tokens it can hold (prompt plus generated).

    Attributes:
        max_len: capacity in tokens.
        length: tokens written so far (also ``len(cache)``).
        key, value: the whole buffers (B, Hkv, max_len, D) and (B, Hkv, max_len, Dv), or None
            before the first append; :attr:`keys` / :attr:`values` are the filled part.

    Any mix of grad mode, ``no_grad`` and ``inference_mode`` across appends works: buffers
    made under ``inference_mode`` are copied once into ordinary tensors by the first append
    outside it (so ``key``/``value`` may then be new tensors). Inside ``torch.compile`` that
    copy is not made (dynamo cannot ask ``is_inference()``): there, use one mode per cache.
    """

    def __init__(self, max_len: int):
        self.max_len = check_positive_int(max_len, "max_len")
        self.length = 0
        self.key: Optional[torch.Tensor] = None
        self.value: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        if self.key is None:
            return f"KVCache(max_len={self.max_len}, empty, not allocated)"
        B, Hkv, _, D = self.key.shape
        return (
            f"KVCache(max_len={self.max_len}, length={self.length}, B={B}, Hkv={Hkv}, D={D}, "
            f"dtype={self.key.dtype}, device={self.key.device})"
        )

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """The cached keys (B, Hkv, length, D), a view of the buffer; None before the first append."""
        return None if self.key is None else self.key[:, :, : self.length]

    @property
    def values(self) -> Optional[torch.Tensor]:
        """The cached values (B, Hkv, length, Dv), a view of the buffer; None before the first append."""
        return None if self.value is None else self.value[:, :, : self.length]

    @property
    def nbytes(self) -> int:
        """Bytes held by the two buffers (0 before the first append)."""
        if self.key is None:
            return 0
        return self.key.nbytes + self.value.nbytes

    def reset(self) -> None:
        """Forget every token. The buffers are kept and reused; the next append may bring a
        different batch, head count, head dim, dtype or device (the buffers are then reallocated)."""
        self.length = 0

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        check_tensor(k, "k")
        check_tensor(v, "v")
        check_rank(k, "k", 4, "(B, Hkv, L, D)")
        check_rank(v, "v", 4, "(B, Hkv, L, Dv)")
        check_same_dtype_device(k, "k", v=v)
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"k has (B, Hkv, L) = {tuple(k.shape[:3])} but v has {tuple(v.shape[:3])}; they must match"
            )
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError(
                "KVCache is for inference, but the keys/values require grad; "
                "run decoding under torch.no_grad() or torch.inference_mode()"
            )
        if self.key is None or self.length == 0:
            return
        want = (self.key.shape[0], self.key.shape[1], self.key.shape[3], self.value.shape[3])
        got = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if got != want:
            raise ValueError(
                f"this cache holds (B, Hkv, D, Dv) = {want} but the new entries have {got}; "
                "use one KVCache per layer and per batch, or call cache.reset() first"
            )
        if k.dtype != self.key.dtype or k.device != self.key.device:
            raise ValueError(
                f"this cache holds {self.key.dtype} on {self.key.device} but the new entries are "
                f"{k.dtype} on {k.device}; convert them, or call cache.reset() first"
            )

    def _writable(self) -> None:
        """Inference-tensor buffers (allocated under inference_mode) copied into ordinary tensors
        when the current call is outside inference mode, where torch refuses to write them."""
        if torch.compiler.is_compiling():
            return  # dynamo cannot ask is_inference(); under torch.compile keep one grad mode per cache
        if self.key is not None and self.key.is_inference() and not torch.is_inference_mode_enabled():
            if self.length == 0:
                self.key = self.value = None  # nothing to keep: _allocate makes new ones
            else:
                self.key, self.value = self.key.clone(), self.value.clone()

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        B, Hkv, _, D = k.shape
        layout = (B, Hkv, self.max_len, D)
        if (
            self.key is not None
            and tuple(self.key.shape) == layout
            and self.value.shape[3] == v.shape[3]
            and self.key.dtype == k.dtype
            and self.key.device == k.device
        ):
            return  # the buffers of before the reset fit: reuse them
        self.key = torch.empty(layout, dtype=k.dtype, device=k.device)
        self.value = torch.empty((B, Hkv, self.max_len, v.shape[3]), dtype=v.dtype, device=v.device)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k (B, Hkv, L, D) and v (B, Hkv, L, Dv) after the cached tokens.

        Returns:
            the keys (B, Hkv, length, D) and values (B, Hkv, length, Dv) of every token so far,
            as views of the buffers (valid until the next append or reset).

        Raises:
            ValueError: when the cache would exceed ``max_len``, when the batch, head count,
                head dims, dtype or device differ from the cached entries', or when k/v require grad.
        """
        self._check(k, v)
        start, n = self.length, k.shape[2]
        end = start + n
        if end > self.max_len:
            raise ValueError(
                f"KVCache is full: it holds {start} of max_len={self.max_len} tokens and {n} more "
                f"were appended; create it with a larger max_len (at least {end})"
            )
        self._writable()
        if self.length == 0:
            self._allocate(k, v)
        self.key[:, :, start:end].copy_(k)
        self.value[:, :, start:end].copy_(v)
        self.length = end
        return self.key[:, :, :end], self.value[:, :, :end]
