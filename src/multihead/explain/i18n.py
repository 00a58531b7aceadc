"""Every word of the walkthrough, in English and Chinese.

Step titles and one-line meanings are keyed by the trace's step names (``Step.name``; the role
"Q"/"K"/"V" is added by :func:`step_title`). The Chinese follows the tutorials' vocabulary:
查询/键/值, 分头, 转置, 注意力分数, 缩放, 因果掩码, 拼接, 输出投影.

Meanings are format strings over the example's sizes: B, Lq, Lk, d_in, d_out, kv_dim, H, Hkv,
D, g (query heads per key/value head), F (features being split), scale, p (dropout).
"""

from __future__ import annotations

import re

LANGS = ("en", "zh")

_ROLE = {
    "en": {"Q": "Q", "K": "K", "V": "V"},
    "zh": {"Q": "查询 Q", "K": "键 K", "V": "值 V"},
}

# name -> (English title, Chinese title). Titles with a role get it appended.
_TITLES = {
    "input": ("input x", "输入 x"),
    "project Q": ("project Q", "线性投影 → 查询 Q"),
    "project K": ("project K", "线性投影 → 键 K"),
    "project V": ("project V", "线性投影 → 值 V"),
    "split heads": ("split heads", "分头"),
    "move heads forward": ("move heads forward", "转置：头轴提前"),
    "repeat kv heads": ("repeat kv heads", "复制键/值头"),
    "scores QKᵀ": ("scores QKᵀ", "注意力分数 QKᵀ"),
    "scale": ("scale", "缩放 × 1/√d"),
    "add bias": ("add bias", "加偏置（浮点掩码）"),
    "softmax": ("softmax", "Softmax 归一化"),
    "dropout": ("dropout", "随机失活 Dropout"),
    "weights × V": ("weights × V", "加权求和：权重 × 值"),
    "move heads back": ("move heads back", "转置回去：头轴放回"),
    "merge heads": ("merge heads", "拼接各头"),
    "output projection": ("output projection", "输出投影 W_O"),
}

# mask kinds, for steps named "<kind> & <kind> mask"
_MASK_KINDS = {
    "causal": ("causal", "因果"),
    "window": ("window", "窗口"),
    "padding": ("padding", "填充"),
    "keep": ("keep", "布尔"),
    "torch": ("nn.MultiheadAttention", "nn.MultiheadAttention"),
}

_MEANINGS = {
    "input": (
        "The input: {B} sequences of {Lq} tokens, each token a vector of {d_in} numbers.",
        "输入：{B} 个序列，每个序列 {Lq} 个 token，每个 token 是 {d_in} 维向量。",
    ),
    "project Q": (
        "Queries: each token's vector times W_q ({d_in} -> {d_out}): what this token is looking for.",
        "查询 Q：每个 token 的向量乘以 W_q（{d_in} → {d_out}）：这个 token 想找什么。",
    ),
    "project K": (
        "Keys: each key token times W_k ({kdim} -> {kv_dim}): what a token offers to be matched on.",
        "键 K：每个键 token 乘以 W_k（{kdim} → {kv_dim}）：token 用来被匹配的特征。",
    ),
    "project V": (
        "Values: each key token times W_v ({kdim} -> {kv_dim}): what a token hands over when attended.",
        "值 V：每个键 token 乘以 W_v（{kdim} → {kv_dim}）：被关注时交出去的内容。",
    ),
    "split heads": (
        "Cut each token's {F} features into {h} heads of {D}: a view, the numbers stay where they "
        "are, only the way they are indexed changes.",
        "分头：把每个 token 的 {F} 维切成 {h} 个头、每头 {D} 维；这是 view，数据没有移动，"
        "只是看待数据的方式变了。",
    ),
    "move heads forward": (
        "transpose(1, 2): swap the token and head axes, so each head is its own (tokens x {D}) "
        "matrix and all heads multiply in one batched matmul; still a view.",
        "转置 transpose(1, 2)：交换 token 轴和头轴，每个头成为独立的 (token × {D}) 矩阵，"
        "所有头用一次批量矩阵乘法计算；仍是 view。",
    ),
    "repeat kv heads": (
        "Grouped-query attention: each of the {Hkv} key/value heads serves {g} query heads; "
        "copy it so that every query head has one.",
        "分组查询注意力（GQA）：{Hkv} 个键/值头各服务 {g} 个查询头；复制后每个查询头都有自己的键/值。",
    ),
    "scores QKᵀ": (
        "Every query dotted with every key: row i, column j says how well token i's query matches "
        "key j ({Lq} x {Lk} per head).",
        "注意力分数：每个查询与每个键做点积；第 i 行第 j 列表示 token i 的查询与键 j 的匹配程度"
        "（每个头 {Lq} × {Lk}）。",
    ),
    "scale": (
        "Multiply by 1/sqrt({D}) = {scale}: the scores' spread then does not grow with the head "
        "size, and softmax stays soft.",
        "缩放：乘以 1/√{D} = {scale}，分数的幅度不再随头维度增大，softmax 不会过于尖锐。",
    ),
    "causal mask": (
        "Query i may only look at keys up to its own position (no future): blocked scores become "
        "-inf, so their weights will be exactly 0.",
        "因果掩码：查询 i 只能看到它自己及之前位置的键（不能看未来）；被遮蔽的分数设为 -inf，"
        "其权重将恰好为 0。",
    ),
    "mask": (
        "Mask ({kinds}): the query/key pairs it blocks become -inf, so their weights will be exactly 0.",
        "掩码（{kinds}）：被遮蔽的查询/键位置设为 -inf，其权重将恰好为 0。",
    ),
    "add bias": (
        "Add the float mask (a bias) to the scaled scores.",
        "把浮点掩码（偏置）加到缩放后的注意力分数上。",
    ),
    "softmax": (
        "Turn each row of scores into weights: all >= 0, each row sums to 1, and -inf gives 0.",
        "Softmax 归一化：每一行分数变成权重，全部非负、每行和为 1，-inf 变成 0。",
    ),
    "dropout": (
        "Training only: each weight is zeroed with probability {p}, the others are scaled by "
        "1/(1 - {p}).",
        "仅在训练时：每个权重以概率 {p} 置 0，其余乘以 1/(1 - {p})。",
    ),
    "weights × V": (
        "Each query's output is the average of the value vectors, weighted by its row of weights.",
        "加权求和：每个查询的输出是值向量按它那一行权重的加权平均。",
    ),
    "move heads back": (
        "transpose(1, 2) again: (b, h, t, d) -> (b, t, h, d), heads next to each other per token; a view.",
        "再次转置 transpose(1, 2)：(b, h, t, d) → (b, t, h, d)，每个 token 的各头相邻；仍是 view。",
    ),
    "merge heads": (
        "Concatenate the heads: {H} x {D} = {d_out} features per token. A copy: after the transpose "
        "the heads are not contiguous, so reshape must move data.",
        "拼接：把各头拼回去，{H} × {D} = {d_out} 维。这是复制：转置后各头在内存中不连续，reshape 必须移动数据。",
    ),
    "output projection": (
        "W_O ({d_out} -> {d_out}) mixes what the heads found into one vector per token.",
        "输出投影：W_O（{d_out} → {d_out}）把各头得到的信息融合成每个 token 的一个向量。",
    ),
}

_NOTES = {
    "one product with the concatenated weights [W_q; W_k; W_v]": (
        "Q, K and V come from one product with the stacked weights [W_q; W_k; W_v], then a split.",
        "Q、K、V 由一次矩阵乘法（拼接的权重 [W_q; W_k; W_v]）得到，再切开。",
    ),
    "K and V: one product with [W_k; W_v]": (
        "K and V come from one product with the stacked weights [W_k; W_v], then a split.",
        "K 和 V 由一次矩阵乘法（拼接的权重 [W_k; W_v]）得到，再切开。",
    ),
}

# notes recorded with numbers in them: (pattern over the English note, Chinese template)
_NOTE_TEMPLATES = (
    (re.compile(r"× (?P<s>\S+) \(1/√D when D = (?P<D>\d+)\)"), "× {s}（D = {D} 时即 1/√D）"),
    (re.compile(r"p = (?P<p>\S+); kept weights scaled by 1/\(1-p\)"), "p = {p}；保留的权重乘以 1/(1-p)"),
    (re.compile(r"each key/value head serves (?P<g>\d+) query heads"), "每个键/值头服务 {g} 个查询头"),
    (re.compile(r"W_O mixes the heads"), "W_O 融合各头的结果"),
)

_CHECKS = {
    "equals its own separate product": "与单独计算的矩阵乘积相同",
    "same data after view": "view 前后数据相同",
    "same data after transpose": "转置前后数据相同",
    "blocked scores are -inf": "被遮蔽的分数为 -inf",
    "rows sum to 1": "每行的和为 1",
    "masked weights are exactly 0": "被遮蔽的权重恰好为 0",
    "rows with no visible key are all 0": "没有可见键的行全为 0",
    "heads concatenated back to d_out": "各头拼接回 d_out 维",
    "equals Q·Kᵀ in float64": "等于 float64 计算的 Q·Kᵀ",
    "is exactly scores × 1/√D": "恰好等于 注意力分数 × 1/√D",
    "visible scores unchanged": "未遮蔽的分数不变",
    "mask is triu(ones, diagonal=1 + Lk - Lq) flipped": "掩码与 triu(ones, diagonal=1 + Lk - Lq) 取反一致",
    "equals softmax in float64": "等于 float64 计算的 softmax",
    "each weight is 0 or weight / (1 - p)": "每个权重为 0 或 原权重 / (1 - p)",
    "equals weights × V in float64": "等于 float64 计算的 权重 × 值",
    "equals merged × W_Oᵀ in float64": "等于 float64 计算的 拼接结果 × W_Oᵀ",
    "output equals the tutorial's plain code in float64": "输出与教程的朴素代码（float64）一致",
    "per-head reference equals the fused module": "逐头参考实现与融合实现一致",
}

_WORDS = {
    "title": (
        "multihead explain: every step of one real forward pass of MultiHeadAttention",
        "multihead explain：MultiHeadAttention 一次真实前向计算的每一步",
    ),
    "example": ("example", "示例"),
    "code": ("code", "代码"),
    "backend": ("backend", "后端"),
    "backend_line": (
        "reference: one plain tensor op per step, so every step is visible "
        '(backend="auto" would fuse the steps from the scores to weights × V into one SDPA call)',
        "reference：每一步都是一个普通的张量运算，因此每一步都可见"
        '（backend="auto" 会把从注意力分数到加权求和的步骤融合成一次 SDPA 调用）',
    ),
    "axes": ("axes", "轴"),
    "axes_line": (
        "b batch, t tokens, h heads, d head dim, q query tokens, k key tokens",
        "b 批次, t token, h 头, d 每头维度, q 查询 token, k 键 token",
    ),
    "values": ("values", "数值"),
    "values_line": ("batch 0, head 0", "batch 0，head 0"),
    "sizes": (
        "batch {B}, {Lq} tokens, d_in {d_in}, d_out {d_out}, {H} heads x head_dim {D}",
        "batch {B}，{Lq} 个 token，d_in {d_in}，d_out {d_out}，{H} 个头 × 每头 {D} 维",
    ),
    "kv_heads": ("{Hkv} key/value heads (GQA)", "{Hkv} 个键/值头（GQA）"),
    "cross": ("cross-attention to {Lk} key tokens", "交叉注意力，{Lk} 个键 token"),
    "causal": ("causal", "因果"),
    "dropout": ("dropout {p} (training mode)", "dropout {p}（训练模式）"),
    "seed": ("seed {seed}", "随机种子 {seed}"),
    "view": ("view (no data moved)", "view（数据未移动）"),
    "copy": ("copy (new tensor)", "复制（新张量）"),
    "pattern": ("pattern", "模式"),
    "shape": ("shape", "形状"),
    "checks": ("checks", "检查"),
    "hold": ("{held}/{total} hold", "{held}/{total} 通过"),
    "all_hold": ("every check holds", "所有检查均通过"),
    "some_failed": ("{n} check(s) FAILED", "{n} 项检查失败"),
    "ok": ("ok", "通过"),
    "fail": ("FAIL", "失败"),
    "mask01": ("mask, 1 = may attend:", "掩码，1 = 可以关注："),
    "masked_scores": ("masked scores:", "掩码后的分数："),
    "token0": ("batch 0, token 0, cut into heads:", "batch 0，token 0，切成各头："),
    "head": ("head", "头"),
    "token": ("token", "token"),
    "rows_tokens": ("batch 0, head 0 (rows = tokens):", "batch 0，head 0（行 = token）："),
    "rows_queries": ("batch 0, head 0 (rows = queries, columns = keys):",
                     "batch 0，head 0（行 = 查询，列 = 键）："),
    "rows_out": ("batch 0, head 0 (rows = queries):", "batch 0，head 0（行 = 查询）："),
    "rows_weights": ("batch 0, head 0 (rows = queries, columns = keys; after | the row's sum):",
                     "batch 0，head 0（行 = 查询，列 = 键；| 后为该行之和）："),
    "causal_offset": (
        "With {Lq} queries and {Lk} keys the mask is aligned bottom-right: the last query sees every "
        "key, query i sees keys 0 to {shift}.",
        "查询 {Lq} 个、键 {Lk} 个时，掩码右下对齐：最后一个查询能看到所有键，查询 i 能看到键 0 到 {shift}。",
    ),
    "batch0": ("batch 0 (rows = tokens):", "batch 0（行 = token）："),
    "merged_cols": ("batch 0: head i fills columns {ranges}", "batch 0：头 i 占据列 {ranges}"),
    "per_head": ("per-head reference", "逐头参考实现"),
    "per_head_line": (
        "mha.to_per_head(): {H} separate heads, each its own W_q, W_k, W_v, concatenated, then W_O",
        "mha.to_per_head()：{H} 个独立的头，各有自己的 W_q、W_k、W_v，拼接后乘 W_O",
    ),
    "per_head_eval": ("(both run in eval mode, without dropout)", "（两者都在 eval 模式下运行，无 dropout）"),
    "max_diff": ("max |fused - per-head| = {diff:.3g}  (tolerance {tol:.3g})",
                 "max |融合 - 逐头| = {diff:.3g}（容差 {tol:.3g}）"),
    "cost": ("cost", "计算量"),
    "cost_step": ("step", "步骤"),
    "flops": ("FLOPs", "FLOPs"),
    "bytes": ("bytes", "字节"),
    "total": ("total", "合计"),
    "cost_note": (
        "FLOPs count a multiply-add as 2; bytes are what the step reads and writes ({dtype}); "
        "a view moves nothing.",
        "FLOPs 把一次乘加记为 2；字节数是这一步读写的数据量（{dtype}）；view 不移动数据。",
    ),
    "heads_table": (
        "same sizes, other head counts (Lq = {Lq}, Lk = {Lk}, d_model = {d_out}):",
        "同样的尺寸、不同的头数（Lq = {Lq}，Lk = {Lk}，d_model = {d_out}）：",
    ),
    "heads_col": ("heads", "头数"),
    "hd_col": ("head_dim", "每头维度"),
    "attn_col": ("QKᵀ + ×V FLOPs", "QKᵀ + ×V FLOPs"),
    "proj_col": ("projection FLOPs", "投影 FLOPs"),
    "total_col": ("total FLOPs", "总 FLOPs"),
    "scores_col": ("score elements", "分数元素数"),
    "heads_conclusion": (
        "The attention cost is 4·B·Lq·Lk·d_model = {core} FLOPs for every head count: splitting "
        "d_model into h heads of d_model/h costs nothing extra, only the score matrices multiply (h of them).",
        "注意力的计算量是 4·B·Lq·Lk·d_model = {core} FLOPs，与头数无关：把 d_model 分成 h 个 "
        "d_model/h 维的头不增加计算，只是分数矩阵变成 h 个。",
    ),
    "step": ("step", "步骤"),
    "table_shape": ("shape", "形状"),
    "table_axes": ("axes", "轴"),
    "table_view": ("view", "view"),
    "meaning": ("meaning", "含义"),
    "yes": ("yes", "是"),
    "no": ("no", "否"),
}


def _pick(pair, lang: str) -> str:
    return pair[LANGS.index(lang)]


def word(key: str, lang: str, **fmt) -> str:
    """A fixed phrase of the walkthrough, formatted with ``fmt``."""
    text = _pick(_WORDS[key], lang)
    return text.format(**fmt) if fmt else text


def _mask_kinds(name: str) -> list[str] | None:
    """["causal", "padding"] for the step name "causal & padding mask", None for other steps."""
    if not name.endswith(" mask"):
        return None
    kinds = name[: -len(" mask")].split(" & ")
    return kinds if all(k in _MASK_KINDS for k in kinds) else None


def step_title(name: str, role: str, lang: str) -> str:
    """The localised title of a step ("split heads" + role "K" -> "分头（键 K）" in Chinese)."""
    kinds = _mask_kinds(name)
    if kinds is not None:
        if lang == "en":
            return name
        return " & ".join(_pick(_MASK_KINDS[k], lang) for k in kinds) + "掩码"
    if name in _TITLES:
        title = _pick(_TITLES[name], lang)
    elif lang == "en":
        title = name
    else:
        raise KeyError(f"no Chinese title for the step {name!r}; add it to multihead.explain.i18n")
    if role and role not in name:
        r = _ROLE[lang][role]
        title = f"{title} {r}" if lang == "en" else f"{title}（{r}）"
    return title


def step_meaning(name: str, lang: str, **sizes) -> str:
    """One line saying what the step means, with the example's sizes filled in."""
    kinds = _mask_kinds(name)
    if kinds is not None:
        key = "causal mask" if kinds == ["causal"] else "mask"
        sizes = dict(sizes, kinds=" & ".join(_pick(_MASK_KINDS[k], lang) for k in kinds))
    else:
        key = name
    if key not in _MEANINGS:
        return ""
    return _pick(_MEANINGS[key], lang).format(**sizes)


def trace_sizes(trace) -> dict:
    """The numbers the step meanings are written with, read from a module's trace.

    ``trace``: a :class:`multihead.Trace` of ``MultiHeadAttention`` with the attention steps
    (reference backend). B, Lq from the input step (B, Lq, d_in); Lk from the scores (B, H, Lq, Lk);
    the rest from the module's config that the trace recorded.
    """
    cfg = trace.config
    B, Lq = trace.step("input").shape[:2]
    Lk = trace.step("scores QKᵀ").shape[-1]
    H, Hkv, D = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    return dict(
        B=B, Lq=Lq, Lk=Lk, d_in=cfg["d_in"], kdim=cfg["kdim"], d_out=cfg["d_out"], kv_dim=Hkv * D,
        H=H, Hkv=Hkv, D=D, g=H // Hkv, scale=f"{D ** -0.5:.4g}", p=cfg["dropout"],
    )


def describe_step(step, lang: str, sizes: dict) -> str:
    """:func:`step_meaning` of a recorded step, told for that step: a head split says which
    features it cuts (Q's d_out or K/V's kv_dim), a causal mask with Lq != Lk says how it is aligned.

    ``sizes``: :func:`trace_sizes`. The step's note is not included (see :func:`note_text`).
    """
    if step.name == "split heads":
        kv = step.role in ("K", "V")
        sizes = dict(sizes, F=sizes["kv_dim"] if kv else sizes["d_out"], h=sizes["Hkv"] if kv else sizes["H"])
    text = step_meaning(step.name, lang, **sizes)
    if step.name == "causal mask" and sizes["Lq"] != sizes["Lk"]:
        off = sizes["Lk"] - sizes["Lq"]
        shift = f"i {'+' if off > 0 else '-'} {abs(off)}"
        extra = word("causal_offset", lang, Lq=sizes["Lq"], Lk=sizes["Lk"], shift=shift)
        text = f"{text} {extra}" if lang == "en" else text + extra
    return text


def note_text(note: str, lang: str) -> str:
    """The localised form of a note the forward pass recorded, or "" when it has none.

    Notes with numbers in them ("× 0.3536 (1/√D when D = 8)") are matched by their pattern;
    in English they read as recorded. Notes that are code (a mask's repr) have no text here.
    """
    if note in _NOTES:
        return _pick(_NOTES[note], lang)
    for pattern, zh in _NOTE_TEMPLATES:
        m = pattern.fullmatch(note)
        if m:
            return note if lang == "en" else zh.format(**m.groupdict())
    return ""


def check_name(name: str, lang: str) -> str:
    """The localised name of a check (English names are the keys)."""
    if lang == "en":
        return name
    if name not in _CHECKS:
        raise KeyError(f"no Chinese name for the check {name!r}; add it to multihead.explain.i18n")
    return _CHECKS[name]


def known_step_names() -> list[str]:
    """The step names with a title (mask steps are composed from their kinds)."""
    return list(_TITLES)
