"""A ragged KV cache stored in blocks of a shared pool, as paged attention (vLLM, FlexDecoding) keeps it.

`PagedKVCache` is a `multihead.ragged.RaggedKVCache` (each row its own length, the same calls
and results) whose storage is a pool of ``num_blocks`` blocks of ``block_size`` tokens shared by
all rows (num_blocks, Hkv, block_size, D), and a block table per row: row b's token t lives in
block ``block_table[b, t // block_size]`` at offset ``t % block_size``. A row takes a free block
when it crosses a block boundary; rows that leave (`select`) give theirs back, and later rows
reuse them. Memory follows the tokens held, not R · max_len.

Legend: R rows held, B rows routed to a call, n new tokens per row, Hkv key/value heads,
D head dim, Lk the keys attended (the longest routed row after the write), S block size.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._checks import check_positive_int
from .ragged import RaggedKVCache

__all__ = ["PagedKVCache"]


class PagedKVCache(RaggedKVCache):
    """A ragged KV cache stored in fixed-size blocks of a shared pool (see the module docstring).

    >>> import torch, multihead
    >>> mha = multihead.MultiHeadAttention(16, 4, causal=True).eval()
    >>> cache = multihead.PagedKVCache(max_len=32, block_size=4, num_blocks=6, lengths=torch.tensor([5, 3]))
    >>> with torch.no_grad():
    ...     _ = mha(torch.randn(2, 5, 16), cache=cache)
    >>> cache.block_table.tolist(), cache.free_blocks
    ([[0, 1, -1, -1, -1, -1, -1, -1], [2, -1, -1, -1, -1, -1, -1, -1]], 3)

    Args:
        max_len: the most tokens one row can hold (a multiple of ``block_size`` is natural).
        block_size: tokens per block (S).
        num_blocks: blocks in the pool.
        lengths: as in `RaggedKVCache`.

    Attributes:
        block_table: (R, ceil(max_len / S)) int64, row r's blocks in order, -1 past its last.
        free_blocks: how many blocks no row holds.
    """

    def __init__(self, max_len: int, *, block_size: int, num_blocks: int, lengths: Optional[torch.Tensor] = None):
        self.block_size = check_positive_int(block_size, "block_size")
        self.num_blocks = check_positive_int(num_blocks, "num_blocks")
        self._table: list[list[int]] = []
        self._free: list[int] = list(range(self.num_blocks))
        super().__init__(max_len, lengths=lengths)

    @property
    def blocks_per_row(self) -> int:
        return math.ceil(self.max_len / self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def block_table(self) -> torch.Tensor:
        out = torch.full((len(self._table), self.blocks_per_row), -1, dtype=torch.int64)
        for r, row in enumerate(self._table):
            out[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
        return out

    def set_block_table(self, block_table: torch.Tensor) -> None:
        """Give the rows other blocks of the pool (e.g. after moving blocks to defragment it):
        ``block_table`` (R, ceil(max_len / S)) int, row r's blocks in order then -1. Every block a
        row's tokens need must be one that some row holds now (not a free one, whose tokens were
        released), in range, and used by one row only; the blocks no row names become free."""
        t = block_table
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"block_table must be an int64/int32 torch.Tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        want = (len(self._rows), self.blocks_per_row)
        if tuple(t.shape) != want:
            raise ValueError(f"block_table must have shape (R, ceil(max_len / block_size)) = {want}, got {tuple(t.shape)}")
        held = {b for row in self._table for b in row}
        table: list[list[int]] = []
        seen: set[int] = set()
        for r, row in enumerate(t.tolist()):
            need = math.ceil(self._rows[r] / self.block_size)
            blocks = row[:need]
            for i, b in enumerate(row):
                if i < need and not 0 <= b < self.num_blocks:
                    raise ValueError(f"block_table[{r}, {i}] = {b} is out of range: row {r} holds {self._rows[r]} "
                                     f"tokens in its first {need} blocks, each in 0 .. num_blocks-1 = {self.num_blocks - 1}")
                if i >= need and b != -1:
                    raise ValueError(f"block_table[{r}, {i}] = {b}: row {r} needs only {need} blocks for its "
                                     f"{self._rows[r]} tokens; mark the rest -1 (the cache takes blocks as rows grow)")
            for i, b in enumerate(blocks):
                if b not in held:
                    raise ValueError(f"block_table[{r}, {i}] = {b} names a free block (its tokens were released); "
                                     "point rows only at blocks some row holds now")
                if b in seen:
                    raise ValueError(f"block_table[{r}, {i}] = {b} is named by two rows; each block belongs to one row")
                seen.add(b)
            table.append(blocks)
        self._table = table
        self._free = sorted(set(range(self.num_blocks)) - seen)

    def __repr__(self) -> str:
        return (f"PagedKVCache(max_len={self.max_len}, block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"lengths={self._rows}, free_blocks={self.free_blocks})")

    def _forget_storage(self) -> None:
        super()._forget_storage()
        self._table = []
        self._free = list(range(getattr(self, "num_blocks", 0)))

    def add(self, lengths: torch.Tensor) -> torch.Tensor:
        got = super().add(lengths)
        self._table += [[] for _ in range(got.numel())]
        return got


    def _grow(self, count: int) -> None:
        if self.filled is not None:
            self.filled = torch.cat([self.filled, self.filled.new_zeros(count, self.max_len)])

    def _needed(self, rows: list[int], new: list[int]) -> int:
        return sum(max(0, math.ceil(m / self.block_size) - len(self._table[r])) for r, m in zip(rows, new))

    def _check_room(self, rows: list[int], n: int) -> None:
        self._table += [[] for _ in range(len(self._rows) - len(self._table))]  # rows the first write brought
        need = self._needed(rows, self._after(rows, n))
        if need > len(self._free):
            raise ValueError(f"the paged cache needs {need} more blocks for this write but {len(self._free)} are free "
                             f"(num_blocks={self.num_blocks}); build it with more blocks, or select the rows that go on")

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._fresh = False
        Hkv, S = k.shape[1], self.block_size
        self.key = k.new_zeros(self.num_blocks, Hkv, S, k.shape[3])
        self.value = v.new_zeros(self.num_blocks, Hkv, S, v.shape[3])
        self.filled = torch.zeros(len(self._rows), self.max_len, dtype=torch.bool, device=k.device)

    def _claim(self, rows: list[int], new: list[int]) -> None:
        for r, m in zip(rows, new):
            while len(self._table[r]) * self.block_size < m:
                self._table[r].append(self._free.pop(0))

    def _table_tensor(self, device: torch.device) -> torch.Tensor:
        return self.block_table.to(device)

    def _put(self, rows: torch.Tensor, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        key, value = self._buffers()
        blocks = self._table_tensor(rows.device)[rows, cols // self.block_size]
        key[blocks, :, cols % self.block_size] = k
        value[blocks, :, cols % self.block_size] = v

    def _gather(self, sel: torch.Tensor, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed rows' blocks laid end to end (B, Hkv, Lk, D): a copy of Lk tokens per row."""
        key, value = self._buffers()
        nb = math.ceil(lk / self.block_size)
        blocks = self._table_tensor(sel.device)[sel, :nb].clamp_min(0)  # (B, nb): past a row's end, masked
        out = []
        for pool in (key, value):
            g = pool[blocks]  # (B, nb, Hkv, S, D)
            B, _, Hkv, S, D = g.shape
            out.append(g.transpose(1, 2).reshape(B, Hkv, nb * S, D).narrow(2, 0, lk))
        return out[0], out[1]

    def _release_past(self, n: int) -> None:
        keep = math.ceil(n / self.block_size)
        for row in self._table:
            self._free += row[keep:]
            del row[keep:]
        self._free.sort()

    def _check_rows(self, index: torch.Tensor, name: str, *, same_batch: bool) -> None:
        super()._check_rows(index, name, same_batch=same_batch)
        if name == "batch_index" or not self._table:
            return
        rows = [int(r) for r in index.tolist()]
        need = sum(len(self._table[r]) for i, r in enumerate(rows) if r in rows[:i])
        spare = len(self._free) + sum(len(self._table[r]) for r in set(range(len(self._table))) - set(rows))
        if need > spare:
            raise ValueError(f"{name} repeats rows whose blocks must be copied ({need} blocks) but only {spare} "
                             "would be free; build the cache with more blocks")

    def _take_storage(self, index: torch.Tensor, rows: list[int]) -> None:
        assert self.filled is not None
        self.filled = self.filled.index_select(0, index)
        key, value = self._buffers()
        kept = set(rows)
        for r, row in enumerate(self._table):  # the rows that leave give their blocks back first
            if r not in kept:
                self._free += row
        self._free.sort()
        table: list[list[int]] = []
        used: set[int] = set()
        for r in rows:  # a row taken twice (a beam duplicated) gets a copy in blocks of its own
            src = self._table[r]
            if not (set(src) & used):
                table.append(list(src))
                used.update(src)
                continue
            copy = [self._free.pop(0) for _ in src]
            idx_src, idx_dst = torch.tensor(src, device=key.device), torch.tensor(copy, device=key.device)
            key[idx_dst], value[idx_dst] = key[idx_src], value[idx_src]
            table.append(copy)
            used.update(copy)
        self._table = table
