"""``multihead explain --ring P``: which rank computes which score blocks at each ring step.

    >>> from multihead import masks
    >>> from multihead.explain.ring_view import RingView
    >>> view = RingView(2, 8, mask=masks.causal())
    >>> view.visible                          # [step][rank]: visible (query, key) score pairs
    [[10, 10], [8, 8]]
    >>> print(view.grid(1))                   # step 1: rank r's queries meet rank r-1's keys
    | .. |
    |1  .|
    |1  .|
    | 00 |

The plan is the ring's own (:func:`multihead.distributed.ring_plan`, the rule `ring_attention`
follows): at step s rank r holds rank (r - s) mod P's key/value block and attends the
(query segment, key segment) pairs the plan lists; a pair wholly above the causal diagonal is
never computed. The grid has one character per block of tokens (the largest block size that
cuts every rank's segments whole): the rank's digit where it computes scores the mask keeps,
``.`` where this step's block holds no visible score (skipped, or empty under the mask), a blank
where another step computes. The counts come from the mask's definition (its dense keep,
summed over each rank's query rows and the key columns it holds at that step); ``work`` is what
the plan computes (the causal triangle of a diagonal pair, every score of the others).

Legend: P ranks, L tokens, s step, r rank, b block size (tokens per grid character).
"""

from __future__ import annotations

import json
import math
from typing import Optional

import torch

from .. import masks as _masks
from ..distributed import DocumentLayout, ring_plan, shard_positions

__all__ = ["RingView", "MAX_RANKS", "MAX_TOKENS", "MAX_CELLS"]

#: one digit per rank in the drawing
MAX_RANKS = 10
#: tokens of the sequence (its (L, L) keep is built densely)
MAX_TOKENS = 4096
#: grid characters per side (the drawing's width)
MAX_CELLS = 96

_WORDS = {
    "title": ("ring attention over P={P} ranks, L={L} tokens, layout {layout}, mask {mask}",
              "环形注意力：P={P} 个进程，L={L} 个词元，切分方式 {layout}，掩码 {mask}"),
    "legend": ("one character = {b} query token(s) x {b} key token(s); rows: queries, columns: keys; "
               "digit: the rank that computes visible scores there; '.': nothing visible at this step "
               "(skipped or masked); blank: another step",
               "每个字符 = {b} 个查询词元 x {b} 个键词元；行：查询，列：键；数字：在此计算可见注意力分数的进程；"
               "'.'：本步此处没有可见分数（跳过或被掩码）；空白：其他步骤"),
    "shards": ("rank {r} holds tokens {tokens}", "进程 {r} 持有词元 {tokens}"),
    "step": ("step {s}: rank r attends to the key/value block of rank (r - {s}) mod {P}",
             "第 {s} 步：进程 r 与进程 (r - {s}) mod {P} 的键/值块计算注意力"),
    "rank_line": ("rank {r}: {total} visible score pairs (per step: {steps}); the ring's blocks span {work}",
                  "进程 {r}：{total} 个可见分数对（每步：{steps}）；环形计算的块共含 {work} 个分数"),
    "imbalance": ("imbalance (max / mean - 1): {pct}%", "负载不均衡（最大值 / 平均值 - 1）：{pct}%"),
}


def _word(key: str, lang: str, **fmt: object) -> str:
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    return _WORDS[key][0 if lang == "en" else 1].format(**fmt)


def _ranges(tokens: list[int]) -> str:
    out, i = [], 0
    while i < len(tokens):
        j = i
        while j + 1 < len(tokens) and tokens[j + 1] == tokens[j] + 1:
            j += 1
        out.append(f"{tokens[i]}-{tokens[j]}" if j > i else str(tokens[i]))
        i = j + 1
    return ", ".join(out)


class RingView:
    """The ring's plan for P ranks over L tokens, with the mask's visible scores per step and rank.

    ``mask``: a `multihead.masks` mask over the whole sequence (causal, documents, window, ...);
    ``layout``: "contiguous", "zigzag", "documents" (the balanced
    `multihead.distributed.DocumentLayout` of the mask's documents) or a DocumentLayout; None =
    the ring's default. A P or L the ring cannot take raises ValueError.
    """

    def __init__(self, world_size: int, seq_len: int, *, mask: Optional[_masks.Mask] = None,
                 layout: "str | DocumentLayout | None" = None, heads: int = 1):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"the ring's ranks P must be an integer in [1, {MAX_RANKS}] (one digit per rank in the "
                             f"drawing), got {world_size!r}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= MAX_TOKENS:
            raise ValueError(f"the ring view's tokens L must be an integer in [1, {MAX_TOKENS}] (its mask is built "
                             f"densely), got {seq_len!r}")
        m = _masks.as_mask(mask)
        if layout == "documents":
            docs = [p for p in (m.parts if m is not None else ()) if isinstance(p, _masks.Documents)]
            if not docs:
                raise ValueError("layout 'documents' balances packed documents: give them with a documents mask "
                                 "(--mask documents:8,4,12)")
            ids = docs[0].q_ids.reshape(-1, docs[0].q_ids.shape[-1])[0]
            layout = DocumentLayout(torch.unique_consecutive(ids, return_counts=True)[1].tolist())
        self.plan = ring_plan(world_size, seq_len, layout=layout, mask=m, heads=heads)
        self.P, self.L, self.mask = world_size, seq_len, m
        self.layout = layout if layout is not None else ("zigzag" if self._causal() else "contiguous")
        keep = None if m is None else m.materialize((1, heads, seq_len, seq_len), device=torch.device("cpu"),
                                                   dtype=torch.float32).keep
        full = torch.ones(seq_len, seq_len, dtype=torch.bool)
        #: (L, L): a query sees a key under some head
        self.keep = full if keep is None else (keep & full).reshape(-1, seq_len, seq_len).any(0)
        #: (L,): the rank holding each token (the shards of shard_sequence)
        self.rank_of = torch.empty(seq_len, dtype=torch.long)
        for r in range(world_size):
            self.rank_of[shard_positions(r, world_size, seq_len, self.layout)] = r
        changes = [0, seq_len] + (torch.nonzero(self.rank_of[1:] != self.rank_of[:-1]).flatten() + 1).tolist()
        #: tokens per grid character: every block lies in one rank's shard
        self.block = math.gcd(*changes)
        #: [step][rank] visible score pairs, from the mask's dense keep
        self.visible = [[self._count(r, s) for r in range(world_size)] for s in range(world_size)]
        #: [step][rank] scores the plan computes
        self.work = [[sum(qn * kn if not diag else qn * (qn + 1) // 2 for (_, _, qn), (_, _, kn), diag in self.plan[s][r])
                      for r in range(world_size)] for s in range(world_size)]
        if seq_len // self.block > MAX_CELLS:
            raise ValueError(f"the drawing would be {seq_len // self.block} characters wide (blocks of {self.block} "
                             f"token(s)), more than {MAX_CELLS}; use fewer tokens or a P that cuts them in larger blocks")

    def _causal(self) -> bool:
        return self.mask is not None and any(isinstance(p, _masks.Causal) for p in self.mask.parts)

    def _owner_mask(self, step: int, rank: int) -> torch.Tensor:
        """(L, L): the scores rank ``rank`` computes at ``step`` under the plan."""
        out = torch.zeros(self.L, self.L, dtype=torch.bool)
        for (_, qg, qn), (_, kg, kn), diag in self.plan[step][rank]:
            blk = torch.ones(qn, kn, dtype=torch.bool)
            out[qg:qg + qn, kg:kg + kn] = blk.tril(kg - qg) if diag else blk
        return out

    def _count(self, rank: int, step: int) -> int:
        owner = (rank - step) % self.P
        rows, cols = self.rank_of == rank, self.rank_of == owner
        return int(self.keep[rows][:, cols].sum())

    def imbalance_percent(self) -> int:
        """max / mean - 1 of each rank's visible scores, in whole percent (0 without any)."""
        totals = [sum(self.visible[s][r] for s in range(self.P)) for r in range(self.P)]
        mean = sum(totals) / self.P
        return 0 if mean == 0 else round(100 * (max(totals) / mean - 1))

    def cells(self, step: int) -> list[list[str]]:
        """The grid of ``step``: one character per (query block, key block)."""
        b, n = self.block, self.L // self.block
        grid = [[" "] * n for _ in range(n)]
        for r in range(self.P):
            owner = (r - step) % self.P
            computed = self._owner_mask(step, r) & self.keep
            for i in range(n):
                if int(self.rank_of[i * b]) != r:
                    continue
                for j in range(n):
                    if int(self.rank_of[j * b]) == owner:
                        grid[i][j] = str(r) if bool(computed[i * b:(i + 1) * b, j * b:(j + 1) * b].any()) else "."
        return grid

    def grid(self, step: int) -> str:
        return "\n".join("|" + "".join(row) + "|" for row in self.cells(step))

    def _mask_text(self) -> str:
        return "none" if self.mask is None else " & ".join(p.kind for p in self.mask.parts)

    def text(self, lang: str = "en") -> str:
        lines = [_word("title", lang, P=self.P, L=self.L, layout=self.layout, mask=self._mask_text()),
                 _word("legend", lang, b=self.block)]
        for r in range(self.P):
            lines.append("  " + _word("shards", lang, r=r, tokens=_ranges(torch.nonzero(self.rank_of == r).flatten().tolist())))
        for s in range(self.P):
            lines += ["", _word("step", lang, s=s, P=self.P), self.grid(s)]
        lines.append("")
        for r in range(self.P):
            steps = ", ".join(str(self.visible[s][r]) for s in range(self.P))
            lines.append(_word("rank_line", lang, r=r, total=sum(self.visible[s][r] for s in range(self.P)), steps=steps,
                               work=sum(self.work[s][r] for s in range(self.P))))
        lines.append(_word("imbalance", lang, pct=self.imbalance_percent()))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {"ranks": self.P, "tokens": self.L, "layout": str(self.layout), "mask": self._mask_text(),
                "block": self.block, "visible": self.visible, "work": self.work,
                "steps": [["".join(row) for row in self.cells(s)] for s in range(self.P)],
                "imbalance_percent": self.imbalance_percent()}

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)
