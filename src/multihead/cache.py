"""KV caches: the keys and values of the tokens seen so far, for step-by-step generation.

Without a cache, generating token n recomputes the keys and values of all n tokens. With one,
each step projects only the new token(s), writes their keys/values after the cached ones and
attends over everything written so far::

    cache = multihead.KVCache(max_len=1024)      # one per attention layer
    y = mha(prompt, cache=cache)                 # prefill: L tokens, causal
    for _ in range(steps):
        y = mha(x_next, cache=cache)             # decode: 1 token attends to all cached ones

Two kinds, one interface (``len``, ``crop``, ``reorder``, ``select``, ``reset``):

* `KVCache` (eager decoding): its length is a Python int and a step attends over the
  filled part only (``key[:, :, :length]``), the cheapest step in eager mode.
* `StaticKVCache` (``torch.compile``): its length is a 0-d tensor; a step writes with
  ``index_copy_`` at that position and attends over the whole buffer, keys after the position
  masked, so every decode step has the same shapes and a compiled model does not recompile as
  the cache grows.

**Batches of different lengths** (left padding). Build the cache with ``keep``, the prompt's
(B, P) padding mask (True for real tokens, as Hugging Face's ``attention_mask``); from then on
the padding keys are masked in the prefill and every later step, and rotary positions count
each row's real tokens only (row b's first real token is position 0, as ``generate`` does with
``position_ids`` from the attention mask). No mask is passed to the module at any step.

**Generation tools.** ``crop(n)`` keeps the first n tokens (speculative decoding rejects drafted
ones), ``reorder(index)`` permutes or duplicates the batch rows (beam search), ``select(rows)``
keeps some rows (finished sequences leave the batch). `KVCache.layers` builds one cache per
layer in a `KVCaches`, which applies these to every layer at once.

One concept past 500 lines: the cache interface and its two kinds, which share it method for
method, and `KVCaches`, the same interface over a model's layers (ragged batches are
:mod:`multihead.ragged`, pages :mod:`multihead.paged`).

The buffers are allocated once, on the first write, at their full size (B, Hkv, max_len, D);
a write copies the new entries into place, so a step costs O(new tokens) writes (no O(n²)
re-concatenation). With grouped-query attention (``num_kv_heads`` = Hkv < H) the cache holds
only the Hkv key/value heads: its memory is Hkv/H of a cache of all H heads (multi-query
attention, Hkv = 1: 1/H). Memory = 2 · B · Hkv · max_len · D · bytes per element
(see `KVCache.nbytes`).

The caches are for inference: run decoding under ``torch.no_grad()`` or ``torch.inference_mode()``.
Appending tensors that require grad raises, because the in-place writes of later steps would
invalidate the graph of earlier ones. Grad modes may change from one call to the next: buffers
allocated under ``inference_mode`` are inference tensors, which torch lets no one write outside
inference mode, so the first write outside it copies them, once, into ordinary tensors.

Legend: B batch, Hkv key/value heads, L tokens, P prompt tokens, D head dim, Dv value head dim.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

import torch

from . import masks as _masks
from ._checks import check_positive_int, check_rank, check_same_dtype_device, check_tensor

__all__ = ["KVCache", "StaticKVCache", "KVCaches"]

_CAUSAL = _masks.causal()  # bottom-right: the new tokens come after the cached ones


def _check_keep(keep, max_len: int) -> Optional[torch.Tensor]:
    if keep is None:
        return None
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise TypeError(
            f"keep must be a bool torch.Tensor (B, P), True for the prompt's real tokens, got {got}; "
            "for a 0/1 attention_mask pass attention_mask.bool()"
        )
    if keep.dim() != 2 or keep.shape[0] == 0:
        raise ValueError(f"keep must have shape (B, P) with B >= 1, got {tuple(keep.shape)}")
    if keep.shape[1] > max_len:
        raise ValueError(
            f"keep covers P={keep.shape[1]} prompt tokens but max_len={max_len}; "
            f"build the cache with max_len >= {keep.shape[1]}"
        )
    return keep


class KVCache:
    """A preallocated key/value store for one attention layer (eager decoding).

    >>> import torch, multihead
    >>> mha = multihead.MultiHeadAttention(16, 4, causal=True).eval()
    >>> x = torch.randn(1, 6, 16)                      # a prompt of 5 tokens, then 1 more
    >>> cache = multihead.KVCache(max_len=8)
    >>> with torch.no_grad():                          # decoding is inference
    ...     prompt = mha(x[:, :5], cache=cache)        # prefill: 5 tokens written
    ...     step = mha(x[:, 5:], cache=cache)          # decode: the 6th attends to all 6
    ...     full = mha(x)
    >>> len(cache), torch.allclose(step, full[:, 5:], atol=1e-5)
    (6, True)

    Args:
        max_len: the most tokens it can hold (prompt plus generated).
        keep: optional (B, P) bool, True for the real tokens of the prompt, False for its
            padding (left padding: the Falses come first in each row). The first P tokens
            written take it; every later token is real.

    Attributes:
        max_len: capacity in tokens.
        length: tokens written so far (also ``len(cache)``), the same for every row.
        key, value: the whole buffers (B, Hkv, max_len, D) and (B, Hkv, max_len, Dv), or None
            before the first append; `keys` / `values` are the filled part.
        keep: (B, max_len) bool, True where a column holds a real token (None without ``keep``).
        positions: (B, max_len) int64, the rotary position of each column of each row: the
            number of real tokens before it (None without ``keep``: column t is position t).

    Any mix of grad mode, ``no_grad`` and ``inference_mode`` across appends works: buffers
    made under ``inference_mode`` are copied once into ordinary tensors by the first append
    outside it (so ``key``/``value`` may then be new tensors). Inside ``torch.compile`` that
    copy is not made (dynamo cannot ask ``is_inference()``): there, use one mode per cache.
    """

    def __init__(self, max_len: int, *, keep: Optional[torch.Tensor] = None):
        self.max_len = check_positive_int(max_len, "max_len")
        self.key: Optional[torch.Tensor] = None
        self.value: Optional[torch.Tensor] = None
        self.reset(keep)

    @classmethod
    def layers(cls, num_layers: int, max_len: int, *, keep: Optional[torch.Tensor] = None) -> "KVCaches":
        """``num_layers`` caches of this kind, one per attention layer, in a `KVCaches`."""
        check_positive_int(num_layers, "num_layers")
        return KVCaches([cls(max_len, keep=keep) for _ in range(num_layers)])

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        name = type(self).__name__
        padded = "" if self.keep is None else ", padded"
        if self.key is None:
            return f"{name}(max_len={self.max_len}, empty, not allocated{padded})"
        B, Hkv, _, D = self.key.shape
        return (
            f"{name}(max_len={self.max_len}, length={self.length}, B={B}, Hkv={Hkv}, D={D}, "
            f"dtype={self.key.dtype}, device={self.key.device}{padded})"
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
        key, value = self._buffers()
        return key.nbytes + value.nbytes

    # ------------------------------------------------------------------ generation tools
    def reset(self, keep: Optional[torch.Tensor] = None) -> None:
        """Forget every token (and the padding). The buffers are kept and reused; the next write
        may bring a different batch, head count, head dim, dtype or device (the buffers are then
        reallocated). ``keep``: the padding of the next prompt, as in the constructor."""
        keep = _check_keep(keep, self.max_len)
        self.length = 0
        self._fresh = True  # no write since the reset: the next one may change the layout
        self.keep: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None
        if keep is not None:
            B, P = keep.shape
            full = torch.ones(B, self.max_len, dtype=torch.bool, device=keep.device)
            full[:, :P] = keep
            self.keep = full
            # row b's real tokens are positions 0, 1, ...; a padding column gets a harmless 0
            self.positions = (full.cumsum(1) - 1).clamp_min_(0)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens, forget the rest (speculative decoding: the rejected
        draft tokens). The next token is written at column ``n``; the padding given by ``keep``
        stays with its columns."""
        n = check_positive_int(n, "n", allow_zero=True)
        if n > self.length:
            raise ValueError(
                f"n={n} but the cache holds {self.length} tokens; crop keeps a prefix: use 0 <= n <= {self.length}"
            )
        self.length = n

    def reorder(self, index: torch.Tensor) -> None:
        """Row b becomes old row ``index[b]``, in place (beam search: beams are permuted and
        duplicated). ``index``: a 1-D int64/int32 tensor of length B on the cache's device."""
        self._check_rows(index, "index", same_batch=True)
        self._reorder(index)

    def select(self, batch_index: torch.Tensor) -> None:
        """Keep the rows ``batch_index`` (in that order); the batch shrinks to ``len(batch_index)``
        (finished sequences leave the batch). ``batch_index``: a 1-D int64/int32 tensor of row
        indices on the cache's device."""
        self._check_rows(batch_index, "batch_index", same_batch=False)
        self._select(batch_index)

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value), once allocated: the two are set together (both None before the first write)."""
        key, value = self.key, self.value
        if key is None or value is None:
            raise RuntimeError("the cache's buffers are read before the first write allocated them")
        return key, value

    def _padding(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep, positions), with ``keep``: the two are set together (both None without it)."""
        keep, positions = self.keep, self.positions
        if keep is None or positions is None:
            raise RuntimeError("the cache's padding is read but it was built without keep")
        return keep, positions

    def _batch(self) -> Optional[int]:
        if self.key is not None and not self._fresh:
            return self.key.shape[0]
        return None if self.keep is None else self.keep.shape[0]

    def _device(self) -> torch.device:
        # after _check_rows found a batch: the buffers' rows, or before the first write the padding's
        return self.key.device if self.key is not None and not self._fresh else self._padding()[0].device

    def _check_rows(self, index, name: str, *, same_batch: bool) -> None:
        fix = f"e.g. {name}=torch.tensor([1, 0], device=...)"
        if not isinstance(index, torch.Tensor):
            raise TypeError(f"{name} must be a 1-D torch.LongTensor of batch rows, got {type(index).__name__}; {fix}")
        if index.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"{name} must be an int64 (or int32) tensor of batch rows, got {index.dtype}; "
                + (f"for a bool mask of rows pass {name}.nonzero().squeeze(1)" if index.dtype == torch.bool
                   else f"convert it with {name}.long()")
            )
        if index.dim() != 1:
            raise ValueError(f"{name} must be 1-D (one batch row each), got shape {tuple(index.shape)}")
        B = self._batch()
        if B is None:
            raise ValueError(f"this cache holds no batch yet; {name} applies after the first write (the prefill)")
        n = index.shape[0]
        if same_batch and n != B:
            raise ValueError(
                f"{name} has {n} entries but the cache holds B={B} rows; reorder takes one source row per row "
                "(length B); to change the batch size use select()"
            )
        if n == 0:
            raise ValueError(f"{name} is empty; select at least one row, or call reset() to start over")
        device = self._device()
        if index.device != device:
            raise ValueError(f"{name} is on {index.device} but the cache is on {device}; pass {name}.to({str(device)!r})")
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= B:
            raise ValueError(f"{name} has {lo if lo < 0 else hi}, but the cache holds B={B} rows: use row indices 0 .. {B - 1}")

    def _reorder(self, index: torch.Tensor) -> None:
        """Trusted: ``index`` checked by `_check_rows`."""
        self._writable()
        if self.key is not None and not self._fresh:
            for buf in self._buffers():
                filled = buf[:, :, : self.length]
                filled.copy_(filled.index_select(0, index))
        if self.keep is not None:
            for pad in self._padding():
                pad.copy_(pad.index_select(0, index))

    def _select(self, index: torch.Tensor) -> None:
        """Trusted: ``index`` checked by `_check_rows`."""
        if self.key is not None and not self._fresh:
            self.key, self.value = (self._take_rows(buf, index) for buf in self._buffers())
        if self.keep is not None:
            self.keep, self.positions = (pad.index_select(0, index) for pad in self._padding())

    def _take_rows(self, buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """New buffer of rows ``index`` of ``buf``; the filled part copied."""
        new = torch.zeros((index.shape[0],) + tuple(buf.shape[1:]), dtype=buf.dtype, device=buf.device)
        new[:, :, : self.length] = buf[:, :, : self.length].index_select(0, index)
        return new

    # ------------------------------------------------------------------ checked append, for users
    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k (B, Hkv, L, D) and v (B, Hkv, L, Dv) after the cached tokens.

        Returns:
            the keys and values to attend over, views of the buffers (valid until the next
            write or reset): the filled part (B, Hkv, length, D) for `KVCache`, the whole
            buffers (B, Hkv, max_len, D) for `StaticKVCache`.

        Raises:
            ValueError: when the cache would exceed ``max_len``, when the batch, head count,
                head dims, dtype or device differ from the cached entries', or when k/v require grad.
        """
        check_tensor(k, "k")
        check_tensor(v, "v")
        check_rank(k, "k", 4, "(B, Hkv, L, D)")
        check_rank(v, "v", 4, "(B, Hkv, L, Dv)")
        check_same_dtype_device(k, "k", v=v)
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"k has (B, Hkv, L) = {tuple(k.shape[:3])} but v has {tuple(v.shape[:3])}; they must match"
            )
        self._check_step(k.shape[0], k.shape[2], k.device)
        k, v, _ = self._write(k, v)
        return k, v

    # ------------------------------------------------------------------ trusted steps, for the module
    def _check_step(self, batch: int, n: int, device) -> None:
        """Refuse (before anything is computed) a write of ``n`` tokens that would overflow, or a
        batch that does not match the padding given at construction."""
        start, end = self.length, self.length + n
        if end > self.max_len:
            raise ValueError(
                f"{type(self).__name__} is full: it holds {start} of max_len={self.max_len} tokens and {n} more "
                f"were appended; create it with a larger max_len (at least {end})"
            )
        self._check_keep_fits(batch, device)

    def _check_keep_fits(self, batch: int, device) -> None:
        if self.keep is None:
            return
        if self.keep.shape[0] != batch:
            raise ValueError(
                f"this cache was built with keep for B={self.keep.shape[0]} rows but the new entries have B={batch}; "
                "build it (or reset it) with the keep of this batch"
            )
        if self.keep.device != device:
            raise ValueError(
                f"keep is on {self.keep.device} but the new entries are on {device}; "
                f"build the cache with keep.to({str(device)!r})"
            )

    def _key_length(self, n: int) -> int:
        """Lk of the keys a write of ``n`` tokens returns (for checking a mask at the edge)."""
        return self.length + n

    def _positions(self, n: int) -> Union[int, torch.Tensor]:
        """Rotary positions of the next ``n`` tokens: an int offset (tokens at offset, offset + 1,
        ...) or, with padding, a (B, n) tensor."""
        if self.positions is None:
            return self.length
        return self.positions[:, self.length: self.length + n]

    def _check_layout(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError(
                f"{type(self).__name__} is for inference, but the keys/values require grad; "
                "run decoding under torch.no_grad() or torch.inference_mode()"
            )
        key, value = self.key, self.value
        if key is None or value is None or self._fresh:
            return
        ks, vs, bs = k.shape, v.shape, key.shape
        if ks[0] == bs[0] and ks[1] == bs[1] and ks[3] == bs[3] and vs[3] == value.shape[3] \
                and k.dtype == key.dtype and k.device == key.device:
            return  # the usual step: the layout of every write before it
        want = (key.shape[0], key.shape[1], key.shape[3], value.shape[3])
        got = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if got != want:
            raise ValueError(
                f"this cache holds (B, Hkv, D, Dv) = {want} but the new entries have {got}; "
                "use one cache per layer and per batch, or call cache.reset() first"
            )
        if k.dtype != key.dtype or k.device != key.device:
            raise ValueError(
                f"this cache holds {key.dtype} on {key.device} but the new entries are "
                f"{k.dtype} on {k.device}; convert them, or call cache.reset() first"
            )

    def _writable(self) -> None:
        """Inference-tensor buffers (allocated under inference_mode) copied into ordinary tensors
        when the current call is outside inference mode, where torch refuses to write them."""
        if torch.compiler.is_compiling():
            return  # dynamo cannot ask is_inference(); under torch.compile keep one grad mode per cache
        if torch.is_inference_mode_enabled():
            return
        if self.key is not None and self.key.is_inference():
            if self._fresh:
                self.key = self.value = None  # nothing to keep: _allocate makes new ones
            else:
                self.key, self.value = (buf.clone() for buf in self._buffers())
        if self.keep is not None and self.keep.is_inference():
            self.keep, self.positions = (pad.clone() for pad in self._padding())

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Buffers for the layout of k, v (the old ones when they fit)."""
        self._fresh = False
        B, Hkv, _, D = k.shape
        layout = (B, Hkv, self.max_len, D)
        if (
            self.key is not None
            and tuple(self.key.shape) == layout
            and self._buffers()[1].shape[3] == v.shape[3]
            and self.key.dtype == k.dtype
            and self.key.device == k.device
        ):
            return  # the buffers of before the reset fit: reuse them
        # zeros, not empty: a static cache attends over (masked) unwritten columns too
        self.key = torch.zeros(layout, dtype=k.dtype, device=k.device)
        self.value = torch.zeros((B, Hkv, self.max_len, v.shape[3]), dtype=v.dtype, device=v.device)

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """Trusted write of k (B, Hkv, n, D), v (B, Hkv, n, Dv), after `_check_step`.

        Returns (keys, values, mask): what the n new tokens attend over, and the
        `multihead.masks` mask of which keys each of them may see (None: all of them).
        """
        self._check_layout(k, v)
        self._writable()
        if self._fresh:
            self._allocate(k, v)
        n = k.shape[2]
        keys, values = self.store(k, v)
        mask = None if self.keep is None else _masks.key_padding(self.keep[:, :self.length])
        if n > 1:  # a single new token sees every key: no causal mask needed
            mask = _CAUSAL if mask is None else _CAUSAL & mask
        return keys, values, mask

    # ------------------------------------------------------------------ hooks for multihead.decoding
    @property
    def settled(self) -> bool:
        """Whether the buffers hold the layout of the last write (allocated, and no `reset`
        since, after which the next write may bring another batch, head count, dtype or device).

            >>> cache = KVCache(max_len=4)
            >>> cache.settled, cache.append(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))[0].shape, cache.settled
            (False, torch.Size([1, 2, 1, 8]), True)

        A hook for `multihead.decoding`, which writes with `store` while the buffers it checked
        once (``key``, ``value``: the same tensors) stay settled."""
        return not self._fresh and self.key is not None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (B, Hkv, n, D), v (B, Hkv, n, Dv) copied in after the cached tokens, without checks;
        returns the filled part of the buffers, (B, Hkv, length, D) and (B, Hkv, length, Dv).

            >>> cache = KVCache(max_len=4)
            >>> _ = cache.append(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))  # checks, allocates
            >>> [t.shape[2] for t in cache.store(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))]
            [2, 2]

        The trusted write under `append` and the module's cached step, and a hook for
        `multihead.decoding`: the caller has made sure the buffers fit (``settled``, the same
        layout, dtype and device, ``length + n <= max_len``, no padding to extend). Use `append`
        otherwise: it checks all of that and raises naming the fix."""
        start, n = self.length, k.shape[2]
        end = start + n
        key, value = self.key, self.value
        if key is None or value is None:
            key, value = self._buffers()  # raises: an invariant (allocated before any store)
        key.narrow(2, start, n).copy_(k)
        value.narrow(2, start, n).copy_(v)
        self.length = end
        return key.narrow(2, 0, end), value.narrow(2, 0, end)


class StaticKVCache(KVCache):
    """A KV cache whose steps all have the same shapes, for ``torch.compile``.

    Same constructor, attributes and tools as `KVCache`; the difference is how a step
    runs. The length lives in a 0-d int64 tensor, the new entries are written with
    ``index_copy_`` at the columns ``length + arange(n)``, and every step attends over the whole
    buffers (B, Hkv, max_len, D) with a mask built from that tensor (query at column c sees the
    keys of columns <= c, and only the real ones when the cache was built with ``keep``).
    Nothing in a step depends on a Python int that changes from step to step, so a model
    compiled with ``fullgraph=True`` compiles the prefill and the decode step once each and
    then runs every step on those graphs::

        mha = torch.compile(mha, fullgraph=True)
        cache = multihead.StaticKVCache(max_len=256)
        with torch.no_grad():
            y = mha(prompt, cache=cache)          # compiles the prefill
            for _ in range(steps):
                y = mha(x_next, cache=cache)      # compiles once, then reuses the graph

    Each step costs attention over ``max_len`` keys (eagerly, prefer `KVCache`). Reading
    ``len(cache)`` copies the length to the host; under compile, writing past ``max_len`` is
    caught by ``index_copy_`` itself (a RuntimeError), not by the ValueError of eager mode.
    """

    def __init__(self, max_len: int, *, keep: Optional[torch.Tensor] = None):
        self._end = torch.zeros((), dtype=torch.long)
        super().__init__(max_len, keep=keep)

    @property
    def length(self) -> int:
        return int(self._end)

    @length.setter
    def length(self, n: int) -> None:
        self._writable_end()
        self._end.fill_(n)

    def _writable_end(self) -> None:
        """The length tensor, like the buffers, copied out of inference mode when written outside it."""
        if not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled() and self._end.is_inference():
            self._end = self._end.clone()

    def _check_step(self, batch: int, n: int, device) -> None:
        if self._end.device != device:
            self._end = self._end.to(device)
        if torch.compiler.is_compiling():
            self._check_keep_fits(batch, device)  # the length is data: index_copy_ checks the bound
        else:
            super()._check_step(batch, n, device)

    def _key_length(self, n: int) -> int:
        return self.max_len

    def _writable(self) -> None:
        super()._writable()
        self._writable_end()

    def _columns(self, n: int) -> torch.Tensor:
        return self._end + torch.arange(n, device=self._end.device)

    def _positions(self, n: int) -> torch.Tensor:
        """(n,) tensor of the next columns, or (B, n) positions with padding; never a Python int."""
        cols = self._columns(n)
        return cols if self.positions is None else self.positions.index_select(1, cols)

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        self._check_layout(k, v)
        self._writable()
        if self._fresh:
            self._allocate(k, v)
        cols = self._columns(k.shape[2])
        key, value = self._buffers()
        key.index_copy_(2, cols, k)
        value.index_copy_(2, cols, v)
        self._end.add_(k.shape[2])
        visible = torch.arange(self.max_len, device=cols.device) <= cols[:, None]  # (n, max_len)
        if self.keep is not None:
            visible = visible & self.keep[:, None, None, :]  # (B, 1, n, max_len)
        return key, value, _masks.keep(visible)


class KVCaches:
    """One cache per attention layer, with one length: the tools apply to every layer.

    ``caches[i]`` is layer i's cache (pass it as ``cache=`` to that layer), ``len(caches)`` the
    tokens they hold, ``caches.num_layers`` how many there are. Build it with
    `KVCache.layers` (or ``StaticKVCache.layers``)::

        caches = multihead.KVCache.layers(len(blocks), max_len=512, keep=attention_mask.bool())
        for block, cache in zip(blocks, caches):
            x = block(x, cache=cache)
        caches.reorder(beam_index)
    """

    def __init__(self, caches: Sequence[KVCache]):
        caches = list(caches)
        if not caches or not all(isinstance(c, KVCache) for c in caches):
            raise TypeError("KVCaches takes a non-empty list of KVCache / StaticKVCache, one per layer")
        self.caches = caches

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    def __getitem__(self, i: int) -> KVCache:
        return self.caches[i]

    def __iter__(self) -> Iterator[KVCache]:
        return iter(self.caches)

    def __repr__(self) -> str:
        return f"KVCaches({self.num_layers} x {self.caches[0]!r})"

    def __len__(self) -> int:
        lengths = [c.length for c in self.caches]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"the layers' caches hold different lengths {lengths}: a forward pass stopped midway, or a layer "
                "was written alone; crop them to a common length (caches.crop(n)) or reset them"
            )
        return lengths[0]

    def crop(self, n: int) -> None:
        """Every layer keeps its first ``n`` tokens (see `KVCache.crop`)."""
        n = check_positive_int(n, "n", allow_zero=True)
        shortest = min(c.length for c in self.caches)
        if n > shortest:
            raise ValueError(f"n={n} but the caches hold {shortest} tokens; use 0 <= n <= {shortest}")
        for c in self.caches:
            c.length = n

    def reorder(self, index: torch.Tensor) -> None:
        """Every layer's rows reordered by ``index`` (see `KVCache.reorder`)."""
        for c in self.caches:
            c._check_rows(index, "index", same_batch=True)
        for c in self.caches:
            c._reorder(index)

    def select(self, batch_index: torch.Tensor) -> None:
        """Every layer keeps the rows ``batch_index`` (see `KVCache.select`)."""
        for c in self.caches:
            c._check_rows(batch_index, "batch_index", same_batch=False)
        for c in self.caches:
            c._select(batch_index)

    def reset(self, keep: Optional[torch.Tensor] = None) -> None:
        """Every layer forgets its tokens; ``keep``: the padding of the next prompt."""
        _check_keep(keep, self.caches[0].max_len)
        for c in self.caches:
            c.reset(keep)
