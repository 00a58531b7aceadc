"""The step catalogue: every kind of step a traced forward pass can record, in one table.

    >>> import torch, multihead
    >>> from multihead import steps
    >>> with multihead.trace() as tr:
    ...     _ = multihead.MultiHeadAttention(8, 2, backend="reference")(torch.randn(1, 3, 8))
    >>> s = tr.step(steps.SCALE)
    >>> s.kind.id, s.params["head_dim"], s.title("zh")
    ('scale', 4, '缩放')

One concept, long on purpose: the table holds every step kind with its English and Chinese
words, and the small functions that fill a text from a step's params sit beside the kinds
that use them, so a kind and everything it says are read in one place.

A :class:`StepKind` says what a step is: its id, the English name its label is built from, its
einops pattern and axis names, its title and one-line meaning in English and Chinese, the note
it carries (written from the step's structured ``params``), how :mod:`multihead.explain.cost`
counts it (:data:`COST_RULES`) and which checks (:data:`CHECKS`) may be recorded on it.
Producers (heads, module, backends) record ``tr.record(steps.X, tensor, params={...})``;
consumers (the trace's checks, cost, text/Markdown/JSON, HTML, PNG) read ``step.kind`` and
``step.params``. Nobody matches names or note text.

Meanings are format strings over the sizes of the traced example (B, Lq, Lk, d_in, kdim,
d_out, kv_dim, H, Hkv, D, g, F, h, scale, p; see :func:`multihead.explain.i18n.trace_sizes`)
merged with the step's params.

Legend: b batch, t tokens, h heads (hkv key/value heads, g query heads per kv head), d head
dim, q query tokens, k key tokens, d_in/d_out/d_kv feature widths.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ._numerics import default_scale

__all__ = [
    "LANGS",
    "StepKind",
    "KINDS",
    "CHECKS",
    "COST_RULES",
    "MASK_KINDS",
    "selecting_kinds",
    "part_params",
    "ROLES",
    "get",
    "mask_words",
    "check_text",
    "INPUT",
    "PROJECT",
    "SPLIT_HEADS",
    "MOVE_HEADS_FORWARD",
    "ROPE",
    "CACHE_APPEND",
    "REPEAT_KV",
    "SCORES",
    "SCALE",
    "ADD_BIAS",
    "SCORE_MOD",
    "MASK",
    "SINK",
    "QK_NORM",
    "SCALE_Q",
    "SOFTMAX",
    "DROPOUT",
    "WEIGHTED_SUM",
    "FUSED_ATTENTION",
    "MOVE_HEADS_BACK",
    "MERGE_HEADS",
    "OUTPUT_PROJECTION",
]

LANGS = ("en", "zh")

#: a text in both languages: an (en, zh) pair of format strings, or a function of
#: (params merged with sizes, lang) for texts whose wording depends on the params
Text = Union[tuple[str, str], Callable[[Mapping[str, Any], str], str]]

#: the roles a per-tensor step is recorded with, in each language
ROLES = {"Q": ("Q", "查询 Q"), "K": ("K", "键 K"), "V": ("V", "值 V")}

#: the kinds of mask part (``Mask.kind``), as the mask step's title and meaning name them
MASK_KINDS: dict[str, tuple[str, str]] = {
    "causal": ("causal", "因果"),
    "window": ("window", "窗口"),
    "padding": ("padding", "填充"),
    "keep": ("keep", "布尔"),
    "bias": ("bias", "偏置"),
    "torch": ("nn.MultiheadAttention", "nn.MultiheadAttention"),
    "documents": ("documents", "文档"),
    "chunked_local": ("chunked local", "分块局部"),
    "mask_mod": ("mask_mod", "自定义 mask_mod"),
    "score_mod": ("score_mod", "自定义 score_mod"),
    "alibi": ("ALiBi", "ALiBi 线性偏置"),
    "softcap": ("softcap", "软上限 softcap"),
    "sink": ("sink", "注意力汇聚 sink"),
    "all": ("combined", "组合"),
}

#: every check a trace or ``multihead explain`` records, by its English name (the key a step's
#: ``checks`` uses): its Chinese name
CHECKS: dict[str, str] = {
    "equals its own separate product": "与单独计算的矩阵乘积相同",
    "same data after view": "view 前后数据相同",
    "same data after transpose": "转置前后数据相同",
    "blocked scores are -inf": "被遮蔽的分数为 -inf",
    "rows sum to 1": "每行的和为 1",
    "rows sum to at most 1 (a sink takes the rest)": "每行的和至多为 1（其余归注意力汇聚 sink）",
    "masked weights are exactly 0": "被遮蔽的权重恰好为 0",
    "rows with no visible key are all 0": "没有可见键的行全为 0",
    "heads concatenated back to d_out": "各头拼接回 d_out 维",
    "equals Q·Kᵀ in float64": "等于 float64 计算的 Q·Kᵀ",
    "is exactly scores × 1/√D": "恰好等于 注意力分数 × 1/√D",
    "visible scores unchanged": "未遮蔽的分数不变",
    "equals cap·tanh(s / cap) in float64": "等于 float64 计算的 cap·tanh(s / cap)",
    "mask is triu(ones, diagonal=1 + Lk - Lq) flipped": "掩码与 triu(ones, diagonal=1 + Lk - Lq) 取反一致",
    "equals softmax in float64": "等于 float64 计算的 softmax",
    "is exactly scores × the scale": "恰好等于 注意力分数 × 缩放因子",
    "is exactly q_proj × the folded scale": "恰好等于 q_proj × 并入的缩放因子",
    "equals the rotary formula in float64": "等于 float64 计算的旋转公式",
    "each row's weights and its sink sum to 1": "每行的权重加上 sink 所占之和为 1",
    "each weight is 0 or weight / (1 - p)": "每个权重为 0 或 原权重 / (1 - p)",
    "equals weights × V in float64": "等于 float64 计算的 权重 × 值",
    "equals merged × W_Oᵀ in float64": "等于 float64 计算的 拼接结果 × W_Oᵀ",
    "output equals the tutorial's plain code in float64": "输出与教程的朴素代码（float64）一致",
    "per-head reference equals the fused module": "逐头参考实现与融合实现一致",
    "the fused backend's output equals the reference backend's within tolerance": "融合后端的输出与 reference 后端的输出在容差内一致",
}

#: how :func:`multihead.explain.cost.trace_cost` counts each kind (n: the output's elements,
#: s: its element size in bytes). A multiply-add is 2 FLOPs.
COST_RULES: dict[str, str] = {
    "none": "nothing: the input is given",
    "linear": "2·n·f_in FLOPs (+ n with a bias); reads the input and the weights, writes n",
    "view": "nothing: a view moves no data",
    "copy": "0 FLOPs; reads and writes n elements",
    "cache": "0 FLOPs; reads and writes the new tokens' keys or values",
    "rope": "3 FLOPs per element (x·cos + rotate_half(x)·sin); reads x and the cos/sin rows, writes n",
    "scores": "2·n·D FLOPs; reads q and k, writes n",
    "scale": "1 FLOP per score; reads and writes n",
    "norm": "4 FLOPs per element (square, sum, divide by the root, times the weight); reads and writes n",
    "sink": "2 FLOPs per row (exp of the sink logit, added to the row's sum by the softmax); moves no data",
    "add": "1 FLOP per score; reads the scores and the bias, writes n",
    "score_mod": "1 FLOP per score and part at least (the function's own ops are not counted); reads and writes n",
    "select": "0 FLOPs (a select); reads the scores and one bool per score, writes n",
    "softmax": "5 FLOPs per score (max, subtract, exp, sum, divide); reads and writes n",
    "dropout": "1 FLOP per weight; reads the weights and the random mask, writes n",
    "weighted_sum": "2·B·H·Lq·Lk·Dv FLOPs; reads the weights and v, writes n",
    "fused": "the scores, scale, softmax and weights × V of the reference without the (B, H, Lq, Lk) "
             "round trips: reads q, k, v, writes n",
}


@dataclass(frozen=True)
class StepKind:
    """One kind of step.

    id: the catalogue key (``steps.get(id)``). name: the English name the step's label is built
    from ("{role}" is replaced by the role; otherwise a role is appended: "split heads K");
    the mask step's name is built from its mask kinds. pattern / axes: the einops pattern (or
    None) and the output's axis names, unless the producer gives others. title / meaning / note:
    :data:`Text`; a note of ("", "") means the step carries none. cost: a key of
    :data:`COST_RULES`. checks: the :data:`CHECKS` that may be recorded on this step.
    """

    id: str
    name: str
    pattern: Optional[str]
    axes: tuple[str, ...]
    title: Text
    meaning: Text
    cost: str
    checks: tuple[str, ...] = ()
    note: Text = ("", "")
    roles: tuple[str, ...] = ()
    #: the params the producer must record (consumers read them without guessing)
    params: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.cost not in COST_RULES:
            raise ValueError(f"step kind {self.id!r}: cost rule {self.cost!r} is not one of {sorted(COST_RULES)}")
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown:
            raise ValueError(f"step kind {self.id!r}: checks {unknown} are not in steps.CHECKS")


class _Unknown:
    """A size the trace does not tell (a trace of ``functional.attention`` has no module config):
    written "?" whatever the format spec."""

    def __format__(self, spec: str) -> str:
        return "?"


class _Values(dict[str, Any]):
    def __missing__(self, key: str) -> _Unknown:
        return _Unknown()


#: the counted nouns of the English texts, whose plural "s" goes after a count of 1
_ONE = re.compile(r"(?<![\d.])\b1 ((?:key |query |new |key/value |cached )?(?:sequence|token|head|layer|number|key|"
                  r"value|panel|tile|feature|call|step)s|(?:key |new )?queries)\b")


def singular_ones(text: str) -> str:
    """English ``text`` with "1 tokens", "1 sequences", "1 key tokens", "1 queries" in the
    singular; the texts are written with plurals and counts filled in."""
    return _ONE.sub(lambda m: "1 " + (m.group(1)[:-3] + "y" if m.group(1).endswith("queries") else m.group(1)[:-1]), text)


def fill_text(text: Text, values: Mapping[str, Any], lang: str) -> str:
    if lang not in LANGS:
        raise ValueError(f"lang must be one of {LANGS}, got {lang!r}")
    if callable(text):
        out = text(_Values(values), lang)
    else:
        out = text[LANGS.index(lang)].format_map(_Values(values))
    return singular_ones(out) if lang == "en" else out


def mask_words(kinds: Sequence[str], lang: str, sep: str = " & ") -> str:
    """The mask kinds ("causal", "padding") in ``lang``: "causal & padding" / "因果 & 填充"."""
    unknown = [k for k in kinds if k not in MASK_KINDS]
    if unknown:
        raise KeyError(f"no words for the mask kinds {unknown}; add them to multihead.steps.MASK_KINDS")
    return sep.join(MASK_KINDS[k][LANGS.index(lang)] for k in kinds)


def selecting_kinds(parts: Sequence[Any]) -> tuple[str, ...]:
    """The kinds of the selecting parts among a mask's ``parts`` (those whose ``role`` is
    "select": a -inf where they say False; what the mask step is made of), in order. The others
    add to the scores, rewrite them or join the softmax's denominator (`multihead.masks.ROLES`)."""
    return tuple(p.kind for p in parts if p.role == "select")


#: the attributes of a mask part that the mask step records (besides its kind), by kind
_PART_FIELDS: dict[str, tuple[str, ...]] = {
    "causal": ("align",),
    "window": ("left", "right", "sinks", "align"),
    "chunked_local": ("chunk", "align"),
    "documents": ("lengths",),
    "softcap": ("cap",),
}


def part_params(parts: Sequence[Any]) -> tuple[dict[str, Any], ...]:
    """Every part of a mask as plain data, in written order: ``{"kind": ..., **its numbers}``
    (a window's left/right/sinks, a chunk, a softcap's cap, documents' lengths when given by
    lengths, the heads of an alibi or a sink), for the mask step's ``parts`` parameter."""
    out = []
    for p in parts:
        d: dict[str, Any] = {"kind": p.kind}
        for name in _PART_FIELDS.get(p.kind, ()):
            value = getattr(p, name, None)
            if value is not None:
                d[name] = value
        if p.kind == "documents" and "lengths" in d:
            d["lengths"] = list(d["lengths"][0])
        for name in ("slopes", "logits"):  # alibi, sink: one value per head
            value = getattr(p, name, None)
            if value is not None and hasattr(value, "tolist"):
                d[name] = [float(x) for x in value.detach().flatten().tolist()]
        out.append(d)
    return tuple(out)


def check_text(name: str, lang: str) -> str:
    """The check ``name`` (its English name, a key of :data:`CHECKS`) in ``lang``."""
    if name not in CHECKS:
        raise KeyError(f"no Chinese name for the check {name!r}; add it to multihead.steps.CHECKS")
    return name if lang == "en" else CHECKS[name]


# ------------------------------------------------------------------------------- texts with params
def _scale_note(v: Mapping[str, Any], lang: str) -> str:
    s, d = v["scale"], v["head_dim"]
    if v.get("default", True):
        return f"× {s:.6g} (1/√D when D = {d})" if lang == "en" else f"× {s:.6g}（D = {d} 时即 1/√D）"
    default = default_scale(d)
    return (f"× {s:.6g} (given; 1/√D would be {default:.6g})" if lang == "en"
            else f"× {s:.6g}（给定的值；1/√D 为 {default:.6g}）")


def _rope_note(v: Mapping[str, Any], lang: str) -> str:
    en = lang == "en"
    where = v["positions"]
    if where == "offset":
        at = f"positions {v['start']}..{v['stop']}" if en else f"位置 {v['start']}..{v['stop']}"
    elif where == "cache":
        rows = v.get("per_row", False)
        at = ("positions from the cache" + (" (per row)" if rows else "")) if en else ("位置取自缓存" + ("（每行各自）" if rows else ""))
    else:
        at = f"global positions of this shard ({v['count']} tokens)" if en else f"本分片的全局位置（{v['count']} 个 token）"
    r, d = v.get("rotary_dim"), v.get("head_dim")
    if r is not None and d is not None and r < d:
        part = f"; the first {r} of {d} dims (partial rotary)" if en else f"；只旋转 {d} 维中的前 {r} 维（部分旋转）"
    else:
        part = ""
    base = v["base"]
    at_base = (f", base {base:g}" if en else f"，base {base:g}") if base else ""
    if en:
        return f"{at}{at_base}, rotate-half layout{part}"
    return f"{at}{at_base}，rotate_half 布局{part}"


def _project_note(v: Mapping[str, Any], lang: str) -> str:
    fused = v.get("fused")
    if fused == "qkv":
        return ("one product with the concatenated weights [W_q; W_k; W_v]" if lang == "en"
                else "Q、K、V 由一次矩阵乘法（拼接的权重 [W_q; W_k; W_v]）得到，再切开")
    if fused == "kv":
        return ("K and V: one product with [W_k; W_v]" if lang == "en"
                else "K 和 V 由一次矩阵乘法（拼接的权重 [W_k; W_v]）得到，再切开")
    return ""


def _project_meaning(v: Mapping[str, Any], lang: str) -> str:
    role = v["role"]
    table = {
        "Q": ("Queries: each token's vector times W_q ({d_in} -> {d_out}): what this token is looking for.",
              "查询 Q：每个 token 的向量乘以 W_q（{d_in} → {d_out}）：这个 token 想找什么。"),
        "K": ("Keys: each key token times W_k ({kdim} -> {kv_dim}): what a token offers to be matched on.",
              "键 K：每个键 token 乘以 W_k（{kdim} → {kv_dim}）：token 用来被匹配的特征。"),
        "V": ("Values: each key token times W_v ({kdim} -> {kv_dim}): what a token hands over when attended.",
              "值 V：每个键 token 乘以 W_v（{kdim} → {kv_dim}）：被关注时交出去的内容。"),
    }
    return table[role][LANGS.index(lang)].format(**v)


def _mask_meaning(v: Mapping[str, Any], lang: str) -> str:
    kinds = tuple(v["kinds"])
    if kinds == ("causal",):
        text = ("Query i may only look at keys up to its own position (no future): blocked scores become "
                "-inf, so their weights will be exactly 0." if lang == "en" else
                "因果掩码：查询 i 只能看到它自己及之前位置的键（不能看未来）；被遮蔽的分数设为 -inf，其权重将恰好为 0。")
        if "Lq" in v and "Lk" in v and v["Lq"] != v["Lk"]:
            off = v["Lk"] - v["Lq"]
            shift = f"i {'+' if off > 0 else '-'} {abs(off)}"
            if lang == "en":
                text += (f" With {v['Lq']} queries and {v['Lk']} keys the mask is aligned bottom-right: the "
                         f"last query sees every key, query i sees keys 0 to {shift}.")
            else:
                text += (f"查询 {v['Lq']} 个、键 {v['Lk']} 个时，掩码右下对齐：最后一个查询能看到所有键，"
                         f"查询 i 能看到键 0 到 {shift}。")
        return text
    words = mask_words(kinds, lang)
    text = (f"Mask ({words}): the query/key pairs it blocks become -inf, so their weights will be exactly 0."
            if lang == "en" else f"掩码（{words}）：被遮蔽的查询/键位置设为 -inf，其权重将恰好为 0。")
    for part in v.get("parts", ()):
        if part["kind"] == "documents" and "lengths" in part:
            lengths = ", ".join(str(n) for n in part["lengths"])
            text += (f" Documents of {lengths} tokens are packed in one row: a query sees only keys of its own "
                     "document, and causal and window masks align within each document." if lang == "en" else
                     f"长度为 {lengths} 的文档打包在同一行：查询只能看到本文档内的键，因果和窗口掩码在每个文档内各自对齐。")
    if v.get("sink"):
        text += (" A sink logit joins each row's softmax denominator, so a row's weights sum to less than 1."
                 if lang == "en" else "每行 softmax 的分母还加上注意力汇聚 sink 的一项，所以每行权重之和小于 1。")
    return text


def _mask_title(v: Mapping[str, Any], lang: str) -> str:
    kinds = tuple(v["kinds"])
    return f"{mask_words(kinds, lang)} mask" if lang == "en" else f"{mask_words(kinds, lang)}掩码"


def _score_mod_title(v: Mapping[str, Any], lang: str) -> str:
    return f"{mask_words(v['kinds'], lang, ', ')} on the scores" if lang == "en" else f"作用于分数：{mask_words(v['kinds'], lang, '、')}"


def _score_mod_meaning(v: Mapping[str, Any], lang: str) -> str:
    words = mask_words(v["kinds"], lang, ", " if lang == "en" else "、")
    text = (f"Each score goes through {words} (in the order written), before the mask selects."
            if lang == "en" else f"每个分数依次经过 {words}（按书写顺序），然后才由掩码选择。")
    for part in v.get("parts", ()):
        if part["kind"] == "softcap":
            cap = f"{part['cap']:g}"
            text += (f" softcap: s -> {cap}·tanh(s / {cap}), so every score lies in (-{cap}, {cap}); small "
                     "scores barely change, large ones are squashed." if lang == "en" else
                     f"软上限：s → {cap}·tanh(s / {cap})，每个分数都落在 (-{cap}, {cap}) 内；小的分数几乎不变，大的被压扁。")
    return text


def _cache_meaning(v: Mapping[str, Any], lang: str) -> str:
    if lang == "en":
        what = "keys" if v["role"] == "K" else "values"
        return (f"The {v['new']} new tokens' {what} are written to the cache; attention then reads all "
                f"{v['length']} cached tokens (max_len {v['max_len']}).")
    what = "键" if v["role"] == "K" else "值"
    return f"把 {v['new']} 个新 token 的{what}写入缓存；注意力随后读取缓存中全部 {v['length']} 个 token（max_len {v['max_len']}）。"


def _merge_meaning(v: Mapping[str, Any], lang: str) -> str:
    en = lang == "en"
    text = ("Concatenate the heads: {H} x {D} = {d_out} features per token. " if en
            else "拼接：把各头拼回去，{H} × {D} = {d_out} 维。").format_map(v)
    if v.get("view"):  # one token: the heads are contiguous after all
        return text + ("A view here: with one token the heads already sit side by side in memory." if en
                       else "这里是 view：只有一个 token 时，各头在内存中本来就相邻。")
    return text + ("A copy: after the transpose the heads are not contiguous, so reshape must move data." if en
                   else "这是复制：转置后各头在内存中不连续，reshape 必须移动数据。")


def _fused_note(v: Mapping[str, Any], lang: str) -> str:
    en = lang == "en"
    backend = v["backend"]
    if backend == "sdpa":
        how = {"is_causal": "is_causal=True", "none": "no mask" if en else "无掩码"}.get(
            v["mask"], (f"{v['mask_dtype']} mask tensor" if en else f"{v['mask_dtype']} 掩码张量"))
        return (f"torch scaled_dot_product_attention, {v['kernel']} kernel, {how}" if en
                else f"PyTorch 的 scaled_dot_product_attention，{v['kernel']} 内核，{how}")
    if backend == "chunked":
        redone = v.get("redone") or 0
        if en:
            again = (f"; scores far above a row's first tiles: the forward ran a second, checked pass, "
                     f"{redone} panels redone with the exact row max") if redone else ""
            backward = f"; backward by the {v['backward_kernel']} kernel" if v.get("backward_kernel") else ""
            return (f"multihead chunked online softmax, tiles of {v['block_q']} queries × {v['block_k']} keys: "
                    f"{v['tiles_computed']} computed of about {v['tiles_total']} "
                    f"(tiles a causal/window mask hides are skipped){again}{backward}")
        again = f"；某行后面的分数远高于它最初几块：前向又做了一遍带检查的计算，{redone} 个块按精确的行最大值重算" if redone else ""
        backward = f"；反向由 {v['backward_kernel']} 内核计算" if v.get("backward_kernel") else ""
        return (f"multihead 分块在线 softmax，每块 {v['block_q']} 个查询 × {v['block_k']} 个键：计算了 "
                f"{v['tiles_computed']} 块，共约 {v['tiles_total']} 块（因果/窗口掩码遮住的块被跳过）{again}{backward}")
    kernel = v.get("kernel")
    if en:
        return f"the {backend} backend" + (f", {kernel}" if kernel else "")
    return f"{backend} 后端" + (f"，{kernel}" if kernel else "")


# ------------------------------------------------------------------------------- the catalogue
_SCORE_AXES = ("b", "h", "q", "k")
_HEAD_AXES = ("b", "h", "t", "d")

INPUT = StepKind(
    "input", "input", None, ("b", "t", "d_in"),
    ("input x", "输入 x"),
    ("The input: {B} sequences of {Lq} tokens, each token a vector of {d_in} numbers.",
     "输入：{B} 个序列，每个序列 {Lq} 个 token，每个 token 是 {d_in} 维向量。"),
    "none",
)
PROJECT = StepKind(
    "project", "project {role}", None, ("b", "t", "d_out"),
    ("project {role}", "线性投影 → {role}"),
    _project_meaning, "linear",
    checks=("equals its own separate product",),
    note=_project_note, roles=("Q", "K", "V"), params=("f_in", "bias", "fused"),
)
SPLIT_HEADS = StepKind(
    "split_heads", "split heads", "b t (h d) -> b t h d", ("b", "t", "h", "d"),
    ("split heads", "分头"),
    ("Cut each token's {F} features into {h} heads of {D}: a view, the numbers stay where they "
     "are, only the way they are indexed changes.",
     "分头：把每个 token 的 {F} 维切成 {h} 个头、每头 {D} 维；这是 view，数据没有移动，只是看待数据的方式变了。"),
    "view", checks=("same data after view",), roles=("Q", "K", "V"),
)
MOVE_HEADS_FORWARD = StepKind(
    "move_heads_forward", "move heads forward", "b t h d -> b h t d", _HEAD_AXES,
    ("move heads forward", "转置：头轴提前"),
    ("transpose(1, 2): swap the token and head axes, so each head is its own (tokens x {D}) "
     "matrix and all heads multiply in one batched matmul; still a view.",
     "转置 transpose(1, 2)：交换 token 轴和头轴，每个头成为独立的 (token × {D}) 矩阵，所有头用一次批量矩阵乘法计算；仍是 view。"),
    "view", checks=("same data after transpose",), roles=("Q", "K", "V"),
)
ROPE = StepKind(
    "rope", "rotary position embedding", None, _HEAD_AXES,
    ("rotary position embedding", "旋转位置编码 RoPE"),
    ("Rotate each pair of features by an angle that grows with the token's position (base {base:g}): "
     "a query and a key then score by their relative distance.",
     "旋转位置编码：按 token 的位置把每对特征旋转一个角度（base {base:g}）；这样查询与键的分数只取决于它们的相对距离。"),
    "rope", checks=("equals the rotary formula in float64",), note=_rope_note, roles=("Q", "K"),
    params=("positions", "base"),
)
CACHE_APPEND = StepKind(
    "cache_append", "append to the cache", None, _HEAD_AXES,
    ("append to the cache", "写入键值缓存"),
    _cache_meaning, "cache",
    note=("{length} of max_len={max_len} tokens cached; {kv_heads} kv heads",
          "已缓存 {length} 个 token（max_len={max_len}）；{kv_heads} 个键/值头"),
    roles=("K", "V"), params=("length", "max_len", "kv_heads", "new"),
)
REPEAT_KV = StepKind(
    "repeat_kv", "repeat kv heads", "b hkv t d -> b (hkv g) t d", _HEAD_AXES,
    ("repeat kv heads", "复制键/值头"),
    ("Grouped-query attention: each of the {Hkv} key/value heads serves {g} query heads; "
     "copy it so that every query head has one.",
     "分组查询注意力（GQA）：{Hkv} 个键/值头各服务 {g} 个查询头；复制后每个查询头都有自己的键/值。"),
    "copy",
    note=("each key/value head serves {groups} query heads", "每个键/值头服务 {groups} 个查询头"),
    roles=("K", "V"), params=("groups",),
)
SCORES = StepKind(
    "scores", "scores QKᵀ", "b h q d, b h k d -> b h q k", _SCORE_AXES,
    ("scores QKᵀ", "注意力分数 QKᵀ"),
    ("Every query dotted with every key: row i, column j says how well token i's query matches "
     "key j ({Lq} x {Lk} per head).",
     "注意力分数：每个查询与每个键做点积；第 i 行第 j 列表示 token i 的查询与键 j 的匹配程度（每个头 {Lq} × {Lk}）。"),
    "scores", checks=("equals Q·Kᵀ in float64",), params=("head_dim",),
)
def _scale_meaning(v: Mapping[str, Any], lang: str) -> str:
    s, d = v["scale"], v["head_dim"]
    if v.get("default", True):
        return (f"Multiply by 1/sqrt({d}) = {s:.4g}: the scores' spread then does not grow with the head size, "
                "and softmax stays soft." if lang == "en" else
                f"缩放：乘以 1/√{d} = {s:.4g}，分数的幅度不再随头维度增大，softmax 不会过于尖锐。")
    return (f"Multiply by the given scale {s:.4g} (not 1/sqrt({d}) = {default_scale(d):.4g}): it sets how sharp "
            "the softmax is." if lang == "en" else
            f"缩放：乘以给定的缩放因子 {s:.4g}（不是 1/√{d} = {default_scale(d):.4g}）：它决定 softmax 有多尖锐。")


SCALE = StepKind(
    "scale", "scale", None, _SCORE_AXES,
    ("scale", "缩放"),
    _scale_meaning,
    "scale", checks=("is exactly scores × 1/√D", "is exactly scores × the scale"), note=_scale_note,
    params=("scale", "head_dim", "default"),
)
ADD_BIAS = StepKind(
    "add_bias", "add bias", None, _SCORE_AXES,
    ("add bias", "加偏置（浮点掩码）"),
    ("Add the float mask (a bias) to the scaled scores.", "把浮点掩码（偏置）加到缩放后的注意力分数上。"),
    "add",
)
SCORE_MOD = StepKind(
    "score_mod", "score mods", None, _SCORE_AXES,
    _score_mod_title, _score_mod_meaning, "score_mod",
    checks=("equals cap·tanh(s / cap) in float64",), params=("kinds", "parts"),
)
MASK = StepKind(
    "mask", "{kinds} mask", None, _SCORE_AXES,
    _mask_title, _mask_meaning, "select",
    checks=("blocked scores are -inf", "visible scores unchanged", "mask is triu(ones, diagonal=1 + Lk - Lq) flipped"),
    note=("{code}", "{code}"), params=("kinds", "parts", "sink", "code"),
)
def _sink_meaning(v: Mapping[str, Any], lang: str) -> str:
    logits = ", ".join(f"{x:.3g}" for x in v["logits"])
    return (f"Attention sinks: head h's sink logit ({logits}) joins each row's softmax denominator as one more "
            "score that belongs to no key, so it takes part of every row's weight and the weights of the keys sum "
            "to less than 1." if lang == "en" else
            f"注意力汇聚 sink：第 h 个头的 sink 的 logit（{logits}）作为不属于任何键的一项加入每行 softmax 的分母，"
            "它分走每行的一部分权重，各键的权重之和小于 1。")


def _softmax_meaning(v: Mapping[str, Any], lang: str) -> str:
    if v.get("sink"):
        return ("Turn each row of scores into weights: all >= 0, -inf gives 0, and each row sums to less than 1: "
                "the sink's term in the denominator takes the rest." if lang == "en" else
                "Softmax 归一化：每一行分数变成权重，全部非负，-inf 变成 0；每行之和小于 1：其余归分母中 sink 的那一项。")
    return ("Turn each row of scores into weights: all >= 0, each row sums to 1, and -inf gives 0." if lang == "en"
            else "Softmax 归一化：每一行分数变成权重，全部非负、每行和为 1，-inf 变成 0。")


SINK = StepKind(
    "sink", "sink", None, _SCORE_AXES,
    ("attention sink", "注意力汇聚 sink"),
    _sink_meaning, "sink",
    note=("softmax over [scores, sink_h]; the sink's column is dropped after it",
          "对 [分数, sink_h] 做 softmax，之后丢掉 sink 那一列"),
    params=("logits",),
)


def _qk_norm_meaning(v: Mapping[str, Any], lang: str) -> str:
    return ("Normalise each head's vector (the layer's own RMSNorm over D, with its learned weights) before the "
            "rotary embedding: the scores' size then does not grow with the projections'." if lang == "en" else
            "在旋转位置编码之前，把每个头的向量归一化（该层自己的 RMSNorm，作用于 D 维，带学到的权重）："
            "分数的大小不再随投影变大。")


QK_NORM = StepKind(
    "qk_norm", "q/k norm {role}", None, _HEAD_AXES,
    ("q/k norm {role}", "q/k 归一化 {role}"),
    _qk_norm_meaning, "norm", roles=("Q", "K"),
)


def _scale_q_meaning(v: Mapping[str, Any], lang: str) -> str:
    s = v["scale"]
    return (f"The scale folded into q: q = q_proj × {s:.6g} right after the projection, so the scores q·k are "
            "already scaled and are not multiplied again." if lang == "en" else
            f"缩放并入 q：投影之后立即 q = q_proj × {s:.6g}，所以分数 q·k 已经缩放过，不再相乘。")


SCALE_Q = StepKind(
    "scale_q", "scale folded into q", None, ("b", "t", "d_out"),
    ("scale folded into q", "缩放并入 q"),
    _scale_q_meaning, "scale", checks=("is exactly q_proj × the folded scale",), roles=("Q",),
    params=("scale", "head_dim"),
)


SOFTMAX = StepKind(
    "softmax", "softmax", None, _SCORE_AXES,
    ("softmax", "Softmax 归一化"),
    _softmax_meaning,
    "softmax",
    checks=("rows sum to 1", "rows sum to at most 1 (a sink takes the rest)", "masked weights are exactly 0",
            "rows with no visible key are all 0", "equals softmax in float64"),
)
DROPOUT = StepKind(
    "dropout", "dropout", None, _SCORE_AXES,
    ("dropout", "随机失活 Dropout"),
    ("Training only: each weight is zeroed with probability {p}, the others are scaled by 1/(1 - {p}).",
     "仅在训练时：每个权重以概率 {p} 置 0，其余乘以 1/(1 - {p})。"),
    "dropout", checks=("each weight is 0 or weight / (1 - p)",),
    note=("p = {p}; kept weights scaled by 1/(1-p)", "p = {p}；保留的权重乘以 1/(1-p)"), params=("p",),
)
WEIGHTED_SUM = StepKind(
    "weighted_sum", "weights × V", "b h q k, b h k d -> b h q d", _HEAD_AXES,
    ("weights × V", "加权求和：权重 × 值"),
    ("Each query's output is the average of the value vectors, weighted by its row of weights.",
     "加权求和：每个查询的输出是值向量按它那一行权重的加权平均。"),
    "weighted_sum", checks=("equals weights × V in float64",), params=("lk",),
)
FUSED_ATTENTION = StepKind(
    "fused_attention", "fused attention (scores, scale, mask, softmax, weights × V)",
    "b h q d, b h k d, b h k d -> b h q d", _HEAD_AXES,
    ("fused attention (scores, scale, mask, softmax, weights × V)", "融合注意力（分数、缩放、掩码、softmax、加权求和）"),
    ("One call of the {backend} backend computes the scores, the scale, the mask, the softmax and "
     "weights × V without writing the ({Lq} x {Lk}) scores out; run the module with "
     "backend=\"reference\" to see each of them.",
     "{backend} 后端用一次调用完成分数、缩放、掩码、softmax 和加权求和，不把 ({Lq} × {Lk}) 的分数写出来；"
     "用 backend=\"reference\" 运行模块可看到其中每一步。"),
    "fused", note=_fused_note, params=("backend", "lk", "head_dim"),
)
MOVE_HEADS_BACK = StepKind(
    "move_heads_back", "move heads back", "b h t d -> b t h d", ("b", "t", "h", "d"),
    ("move heads back", "转置回去：头轴放回"),
    ("transpose(1, 2) again: (b, h, t, d) -> (b, t, h, d), heads next to each other per token; a view.",
     "再次转置 transpose(1, 2)：(b, h, t, d) → (b, t, h, d)，每个 token 的各头相邻；仍是 view。"),
    "view", checks=("same data after transpose",),
)
MERGE_HEADS = StepKind(
    "merge_heads", "merge heads", "b t h d -> b t (h d)", ("b", "t", "d_out"),
    ("merge heads", "拼接各头"),
    _merge_meaning, "copy", checks=("heads concatenated back to d_out",),
)
OUTPUT_PROJECTION = StepKind(
    "output_projection", "output projection", None, ("b", "t", "d_out"),
    ("output projection", "输出投影 W_O"),
    ("W_O ({d_out} -> {d_out}) mixes what the heads found into one vector per token.",
     "输出投影：W_O（{d_out} → {d_out}）把各头得到的信息融合成每个 token 的一个向量。"),
    "linear",
    checks=("equals merged × W_Oᵀ in float64", "output equals the tutorial's plain code in float64",
            "per-head reference equals the fused module",
            "the fused backend's output equals the reference backend's within tolerance"),
    note=("W_O mixes the heads", "W_O 融合各头的结果"), params=("f_in", "bias"),
)

#: every kind, in the order the data flows through a forward pass
KINDS: dict[str, StepKind] = {k.id: k for k in (
    INPUT, PROJECT, SCALE_Q, SPLIT_HEADS, MOVE_HEADS_FORWARD, QK_NORM, ROPE, CACHE_APPEND, REPEAT_KV, SCORES, SCALE,
    ADD_BIAS, SCORE_MOD, MASK, SINK, SOFTMAX, DROPOUT, WEIGHTED_SUM, FUSED_ATTENTION, MOVE_HEADS_BACK,
    MERGE_HEADS, OUTPUT_PROJECTION,
)}


def get(kind: Union[str, StepKind]) -> StepKind:
    """The :class:`StepKind` of ``kind`` (a kind, or its id)."""
    if isinstance(kind, StepKind):
        return kind
    if isinstance(kind, str) and kind in KINDS:
        return KINDS[kind]
    raise ValueError(f"unknown step kind {kind!r}; the kinds are {sorted(KINDS)} (multihead.steps)")
