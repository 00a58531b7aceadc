"""KV caches whose rows hold different numbers of tokens: batched generation as servers run it.

A `multihead.KVCache` gives every row one length (left padding makes prompts of different
lengths fit). Here each row has its own length, as in flash-attn's ``cache_seqlens`` and
FlexDecoding's paged attention: a row's next token is written at its own column, rotated for
its own position, and sees exactly its own tokens::

    cache = multihead.RaggedKVCache(max_len=256, lengths=torch.tensor([5, 2, 7]))
    with torch.no_grad():
        y = mha(prompts, cache=cache)          # (3, 7, d): row b's first lengths[b] tokens are real
        for _ in range(steps):
            y = mha(x_next, cache=cache)       # (3, 1, d): row b's token at column lengths[b]
        cache.select(torch.tensor([0, 2]))     # row 1 finished: it leaves the batch

`RaggedKVCache` stores buffers (R, Hkv, max_len, D), one row per sequence (R rows);
`multihead.paged.PagedKVCache` stores the same rows in blocks of a shared pool, behind the same
interface.

What a call ``mha(x, cache=cache)`` with x (B, n, d) does, for the B routed rows (all rows in
order, or ``cache.use(batch_index)``, flash-attn's ``cache_batch_idx``):

1. row b's n new tokens get the positions ``len_b, ..., len_b + n - 1`` (RoPE per row);
2. they are written at those columns (a row given a prompt length P by ``lengths=``/`add` keeps
   only its first P tokens of that first write: its next token overwrites the rest);
3. query i of row b sees key j when ``j <= len_b + i`` and ``j`` is a real token of row b.
   A one-token step passes the backend a view of the held (R, max_len) table of written
   columns (no mask is built per step, and none at all when every routed row has the same
   length); a step of several tokens builds its (B, 1, n, Lk) causal keep.

Each row's output equals decoding that sequence alone (``tests/core/test_ragged_cache.py`` holds it
to 1e-12 in float64 against a reference written from flash-attn's ``flash_attn_with_kvcache``
semantics). The outputs of a prompt's padding queries (positions >= P) are not meaningful.

Legend: R rows held, B rows routed to a call, n new tokens per row, Hkv key/value heads,
D head dim, Lk the keys attended (the longest routed row after the write), S block size.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import masks as _masks
from ._checks import check_positive_int
from .cache import KVCache, KVCaches

__all__ = ["RaggedKVCache"]


def _check_lengths(lengths: object, max_len: int, name: str = "lengths") -> list[int]:
    """(R,) int prompt lengths, each 1 .. max_len, as Python ints."""
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(
            f"{name} must be a 1-D int64/int32 torch.Tensor of per-row token counts, got {type(lengths).__name__}; "
            f"use torch.tensor({name})"
        )
    if lengths.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 (or int32) tensor of per-row token counts, got {lengths.dtype}; "
                        f"convert it with {name}.long()")
    if lengths.dim() != 1 or lengths.shape[0] == 0:
        raise ValueError(f"{name} must be 1-D with one count per row (R,) and R >= 1, got shape {tuple(lengths.shape)}")
    got = [int(x) for x in lengths.tolist()]
    for r, n in enumerate(got):
        if n < 1 or n > max_len:
            raise ValueError(
                f"{name}[{r}] = {n}: every row's prompt must hold 1 .. max_len={max_len} tokens; "
                f"build the cache with max_len >= {max(got)}" if n > max_len else
                f"{name}[{r}] = {n}: every row's prompt must hold at least 1 token"
            )
    return got


class RaggedKVCache(KVCache):
    """A KV cache whose rows hold different numbers of tokens (see the module docstring).

    >>> import torch, multihead
    >>> mha = multihead.MultiHeadAttention(16, 4, causal=True, rope=True).eval()
    >>> x = torch.randn(2, 4, 16)                       # row 0: 4 real tokens, row 1: 2
    >>> cache = multihead.RaggedKVCache(max_len=8, lengths=torch.tensor([4, 2]))
    >>> with torch.no_grad():
    ...     _ = mha(x, cache=cache)                     # prefill both rows in one call
    ...     y = mha(torch.randn(2, 1, 16), cache=cache) # row 0 writes column 4, row 1 column 2
    >>> cache.lengths.tolist()
    [5, 3]

    Args:
        max_len: the most tokens one row can hold.
        lengths: optional (R,) ints, the real tokens of each row's prompt (right padding: the
            first ``lengths[b]`` tokens of row b's first write are real). Without it rows are
            added by the first write (R = its B), every token real; `add` adds rows later.

    Attributes:
        lengths: (R,) int64, the tokens each row holds (a new tensor on each read).
        length: the longest row (also ``len(cache)``).
        batch_index: the rows the next calls write, or None for all rows in order (`use`).
    """

    def __init__(self, max_len: int, *, lengths: Optional[torch.Tensor] = None):
        self._rows: list[int] = []
        self._prompt: list[Optional[int]] = []
        self.filled: Optional[torch.Tensor] = None  # (R, max_len) bool: column t of row r holds a token
        self.batch_index: Optional[torch.Tensor] = None
        super().__init__(max_len)
        if lengths is not None:
            self.add(lengths)

    @classmethod
    def layers(cls, num_layers: int, max_len: int, *, keep: Optional[torch.Tensor] = None,
               lengths: Optional[torch.Tensor] = None, **storage: int) -> KVCaches:
        """``num_layers`` caches of this kind in a `multihead.KVCaches` (one per attention layer),
        each with the same ``lengths`` (and, for `PagedKVCache`, ``block_size``/``num_blocks``:
        each layer has its own pool); ``keep`` is not taken (``lengths`` says the prompts')."""
        check_positive_int(num_layers, "num_layers")
        if keep is not None:
            raise TypeError(f"{cls.__name__}.layers takes per-row prompt lengths (lengths=), not keep")
        return KVCaches([cls(max_len, lengths=lengths, **storage) for _ in range(num_layers)])

    # ------------------------------------------------------------------ lengths and rows
    @property
    def length(self) -> int:
        return max(self._rows, default=0)

    @length.setter
    def length(self, n: int) -> None:  # the base class's reset and crop write it
        self._crop(n)

    @property
    def lengths(self) -> torch.Tensor:
        device = self.key.device if self.key is not None else None
        return torch.tensor(self._rows, dtype=torch.int64, device=device)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_len={self.max_len}, lengths={self._rows})"

    def reset(self, keep: Optional[torch.Tensor] = None, *, lengths: Optional[torch.Tensor] = None) -> None:
        """Forget every row; ``lengths``: the prompts of the next batch (as in the constructor)."""
        if keep is not None:
            raise TypeError("RaggedKVCache takes per-row prompt lengths (lengths=), not a keep mask; "
                            "lengths = keep.sum(1) for a right-padded prompt")
        self._rows, self._prompt, self.batch_index = [], [], None
        self.keep = self.positions = None
        self._fresh = True
        self._forget_storage()
        if lengths is not None:
            self.add(lengths)

    def _forget_storage(self) -> None:
        self.key = self.value = self.filled = None

    def add(self, lengths: torch.Tensor) -> torch.Tensor:
        """Add one row per entry of ``lengths`` (the real tokens of its prompt, written by the next
        write that routes it); returns their row indices (int64)."""
        got = _check_lengths(lengths, self.max_len)
        first = len(self._rows)
        self._grow(len(got))
        self._rows += [0] * len(got)
        self._prompt += got
        return torch.arange(first, first + len(got), device=self._where())

    def _grow(self, count: int) -> None:
        """Room for ``count`` more rows in the storage (once it exists)."""
        if self.key is None or self.value is None or self.filled is None:
            return
        self.key, self.value = (torch.cat([b, b.new_zeros((count,) + tuple(b.shape[1:]))]) for b in (self.key, self.value))
        self.filled = torch.cat([self.filled, self.filled.new_zeros(count, self.max_len)])

    def _where(self) -> Optional[torch.device]:
        return None if self.key is None else self.key.device

    def use(self, batch_index: Optional[torch.Tensor] = None) -> "RaggedKVCache":
        """Route the next calls' B rows to cache rows ``batch_index`` (B,) (flash-attn's
        ``cache_batch_idx``: decode some rows, prefill new ones, in any order); None: all rows
        in order. Returns the cache, so ``mha(x, cache=cache.use(rows))`` reads as one call."""
        if batch_index is not None:
            self._check_rows(batch_index, "batch_index", same_batch=False)
            if len(set(batch_index.tolist())) != batch_index.numel():
                raise ValueError(f"batch_index names a row twice ({batch_index.tolist()}); each cache row takes one "
                                 "sequence's tokens per call")
        self.batch_index = batch_index
        return self

    def _batch(self) -> Optional[int]:
        return len(self._rows) or None

    def _device(self) -> torch.device:
        return self.key.device if self.key is not None else torch.device("cpu")

    def _routed(self) -> list[int]:
        return list(range(len(self._rows))) if self.batch_index is None else [int(r) for r in self.batch_index.tolist()]

    def _after(self, rows: list[int], n: int) -> list[int]:
        """Each routed row's length after a write of n tokens."""
        return [self._prompt[r] if self._prompt[r] is not None else self._rows[r] + n for r in rows]  # type: ignore[misc]

    # ------------------------------------------------------------------ the module's hooks
    def _check_step(self, batch: int, n: int, device: torch.device) -> None:
        brought = not self._rows
        if brought:  # no lengths given: the first write brings its rows, every token real
            self._rows, self._prompt = [0] * batch, [None] * batch
        try:
            self._check_rows_fit(batch, n, device)
        except ValueError:
            if brought:  # a refused first write brings no rows
                self._rows, self._prompt = [], []
                self._forget_storage()
            raise

    def _check_rows_fit(self, batch: int, n: int, device: torch.device) -> None:
        rows = self._routed()
        if len(rows) != batch:
            what = "batch_index routes" if self.batch_index is not None else "the cache holds"
            raise ValueError(f"{what} {len(rows)} rows but the input has B={batch}; pass one input row per cache row "
                             "(cache.use(batch_index) picks the rows a call writes)")
        for r in rows:
            p = self._prompt[r]
            if p is not None and n < p:
                raise ValueError(f"row {r}'s prompt has {p} tokens (lengths[{r}]) but this write brings n={n}; "
                                 "the first write of a row brings its whole (right-padded) prompt")
            if p is None and self._rows[r] + n > self.max_len:
                raise ValueError(
                    f"{type(self).__name__} row {r} holds {self._rows[r]} of max_len={self.max_len} tokens and {n} more "
                    f"were appended; create it with a larger max_len (at least {self._rows[r] + n}), or select the "
                    "rows that go on")
        if self.key is not None and not self._fresh and self.key.device != device:
            raise ValueError(f"this cache is on {self.key.device} but the new entries are on {device}; move them")
        if self.batch_index is not None and self.batch_index.device != device:
            raise ValueError(f"batch_index is on {self.batch_index.device} but the input is on {device}; "
                             f"pass batch_index.to({str(device)!r})")
        self._check_room(rows, n)

    def _check_room(self, rows: list[int], n: int) -> None:
        """Storage for the write (the paged cache's blocks)."""

    def _key_length(self, n: int) -> int:
        return max(self._after(self._routed(), n))

    def _positions(self, n: int) -> torch.Tensor:
        start = torch.tensor([self._rows[r] for r in self._routed()], dtype=torch.int64, device=self._step_device())
        return start[:, None] + torch.arange(n, device=start.device)  # (B, n)

    def _step_device(self) -> torch.device:
        if self.batch_index is not None:
            return self.batch_index.device
        return self.key.device if self.key is not None else torch.device("cpu")

    def _check_layout(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError(f"{type(self).__name__} is for inference, but the keys/values require grad; "
                             "run decoding under torch.no_grad() or torch.inference_mode()")
        key, value = self.key, self.value
        if key is None or value is None or self._fresh:
            return
        want = (key.shape[1], key.shape[-1], value.shape[-1], key.dtype, key.device)
        got = (k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)
        if got != want:
            raise ValueError(f"this cache holds (Hkv, D, Dv, dtype, device) = {want} but the new entries have {got}; "
                             "use one cache per layer, or call cache.reset() first")

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._fresh = False
        R, Hkv = len(self._rows), k.shape[1]
        self.key = k.new_zeros(R, Hkv, self.max_len, k.shape[3])
        self.value = v.new_zeros(R, Hkv, self.max_len, v.shape[3])
        self.filled = torch.zeros(R, self.max_len, dtype=torch.bool, device=k.device)

    def _writable(self) -> None:
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return
        if self.key is not None and self.key.is_inference():
            self.key, self.value, self.filled = (None if t is None else t.clone() for t in (self.key, self.value, self.filled))

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[_masks.Mask]]:
        """Trusted write of k (B, Hkv, n, D), v (B, Hkv, n, Dv) after `_check_step`; returns
        (keys (B, Hkv, Lk, D), values, mask)."""
        self._check_layout(k, v)
        self._writable()
        if self._fresh:
            self._allocate(k, v)
        filled = self.filled
        assert filled is not None
        B, n, device = k.shape[0], k.shape[2], k.device
        rows = self._routed()
        old = [self._rows[r] for r in rows]
        new = self._after(rows, n)
        sel = torch.tensor(rows, dtype=torch.int64, device=device)
        old_t = torch.tensor(old, dtype=torch.int64, device=device)
        new_t = torch.tensor(new, dtype=torch.int64, device=device)
        cols = old_t[:, None] + torch.arange(n, device=device)  # (B, n)
        real = cols < new_t[:, None]  # a prompt's padding tokens are not written
        at_rows, at_cols = sel[:, None].expand(B, n)[real], cols[real]
        self._claim(rows, new)
        self._put(at_rows, at_cols, k.transpose(1, 2)[real], v.transpose(1, 2)[real])
        filled[at_rows, at_cols] = True
        for r, m in zip(rows, new):
            self._rows[r], self._prompt[r] = m, None
        lk = max(new)
        keys, values = self._gather(sel, lk)
        if n > 1:
            j = torch.arange(lk, device=device)
            visible = (j <= cols[:, :, None]) & (j < new_t[:, None, None])  # (B, n, Lk)
            return keys, values, _masks.keep(visible[:, None])
        if min(new) == lk:
            return keys, values, None  # every routed row sees all Lk keys
        seen = filled.narrow(1, 0, lk) if self.batch_index is None else filled.index_select(0, sel).narrow(1, 0, lk)
        return keys, values, _masks.key_padding(seen)

    def _claim(self, rows: list[int], new: list[int]) -> None:
        """Storage for rows growing to ``new`` (the paged cache takes blocks)."""

    def _put(self, rows: torch.Tensor, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (N, Hkv, D), v (N, Hkv, Dv) written at (row, column) pairs (N,)."""
        key, value = self._buffers()
        key[rows, :, cols] = k
        value[rows, :, cols] = v

    def _gather(self, sel: torch.Tensor, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed rows' first Lk columns (B, Hkv, Lk, D): views when every row is routed in order."""
        key, value = self._buffers()
        if self.batch_index is None:
            return key.narrow(2, 0, lk), value.narrow(2, 0, lk)
        return key.index_select(0, sel).narrow(2, 0, lk), value.index_select(0, sel).narrow(2, 0, lk)

    # ------------------------------------------------------------------ generation tools
    def _crop(self, n: int) -> None:
        if n == 0 and not self._rows:
            return
        self._writable()
        for r, m in enumerate(self._rows):
            self._rows[r] = min(m, n)
        if self.filled is not None:
            self.filled[:, n:] = False
        self._release_past(n)

    def _release_past(self, n: int) -> None:
        """Storage past column n is free (the paged cache's blocks)."""

    def crop(self, n: int) -> None:
        """Every row keeps at most its first ``n`` tokens."""
        n = check_positive_int(n, "n", allow_zero=True)
        if n > self.length:
            raise ValueError(f"n={n} but the longest row holds {self.length} tokens; use 0 <= n <= {self.length}")
        self._crop(n)

    def _reorder(self, index: torch.Tensor) -> None:
        self._writable()
        self._take(index, keep_storage=True)

    def _select(self, index: torch.Tensor) -> None:
        self._take(index, keep_storage=False)

    def _take(self, index: torch.Tensor, keep_storage: bool) -> None:
        rows = [int(i) for i in index.tolist()]
        if self.key is not None and not self._fresh:
            self._take_storage(index, rows)
        self._rows = [self._rows[r] for r in rows]
        self._prompt = [self._prompt[r] for r in rows]
        self.batch_index = None

    def _take_storage(self, index: torch.Tensor, rows: list[int]) -> None:
        key, value = self._buffers()
        assert self.filled is not None
        self.key, self.value, self.filled = (t.index_select(0, index) for t in (key, value, self.filled))

