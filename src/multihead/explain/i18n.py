"""Every word of the walkthrough, in English and Chinese.

What each step and check is called and means lives with the step kinds, in
:mod:`multihead.steps` (one table that producers and consumers share); this module renders a
recorded step with it and holds the walkthrough's own phrases (:func:`word`). The Chinese
follows the tutorials' vocabulary: 查询/键/值, 分头, 转置, 注意力分数, 缩放, 因果掩码, 拼接, 输出投影.

The sizes the meanings are written with (:func:`trace_sizes`): B, Lq, Lk, d_in, kdim, d_out,
kv_dim, H, Hkv, D, g (query heads per key/value head), F (features being split), scale, p (dropout).
"""

from __future__ import annotations

from typing import Optional

from .. import steps as _steps
from .._numerics import default_scale
from ..trace import Step, Trace

LANGS = _steps.LANGS

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
    "backend_fused_line": (
        "{backend}: one fused call from the scores to weights × V, so those steps are one step here "
        '(backend="reference" shows each of them)',
        "{backend}：从注意力分数到加权求和是一次融合调用，因此这里只有一步"
        '（backend="reference" 会显示其中每一步）',
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
    "reopened": (
        "The {backend} backend ran this call as one fused step, with no scores or weights to show: the steps "
        "below are the same inputs run again on the reference backend. max |{backend} - reference| = {diff}; "
        "the {backend} output is {err} from a float64 run, within the tolerance {tol}.",
        "{backend} 后端把这次调用作为一个融合步骤运行，没有可展示的分数和权重：下面的步骤是同样的输入在 reference "
        "后端上重新运行的结果。max |{backend} − reference| = {diff}；{backend} 的输出与 float64 的结果相差 {err}，"
        "在容差 {tol} 之内。",
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


def step_title(step: Step, lang: str) -> str:
    """The localised title of a recorded step ("split heads" of K -> "分头（键 K）" in Chinese)."""
    return step.title(lang)


def _config(trace: Trace, step: Optional[Step]) -> dict:
    if step is not None and step.call is not None:
        return trace.calls[step.call].config
    return trace.config


def trace_sizes(trace: Trace, step: Optional[Step] = None) -> dict:
    """The numbers the step meanings are written with, read from a module's trace (for ``step``:
    from the forward call it belongs to, in a trace of several).

    B, Lq from the input step (B, Lq, d_in); Lk from the scores (B, H, Lq, Lk), or the key
    length a fused backend or the weighted sum recorded, or the keys' projection; the rest from
    the module's config that the trace recorded. A size the trace does not tell is left out
    (the texts write it "?").
    """
    cfg = _config(trace, step)
    call = None if step is None else step.call
    mine = trace.select(call=call) if call is not None else trace.steps
    sizes: dict = {}
    first = next((s for s in mine if s.kind is _steps.INPUT), None)
    if first is not None:
        sizes.update(B=first.shape[0], Lq=first.shape[1])
    for s in mine:
        if s.kind is _steps.SCORES:
            sizes["Lk"] = s.shape[-1]
        elif s.kind in (_steps.WEIGHTED_SUM, _steps.FUSED_ATTENTION) and "lk" in s.params:
            sizes.setdefault("Lk", s.params["lk"])
    if "Lk" not in sizes:
        keys = next((s for s in mine if s.kind is _steps.PROJECT and s.role == "K"), None)
        if keys is not None:
            sizes["Lk"] = keys.shape[1]
    if "num_heads" in cfg:
        H, D = cfg["num_heads"], cfg["head_dim"]
        Hkv = cfg.get("num_kv_heads") or H
        sizes.update(d_in=cfg["d_in"], kdim=cfg["kdim"], d_out=cfg["d_out"] or H * D, kv_dim=Hkv * D,
                     H=H, Hkv=Hkv, D=D, g=H // Hkv, scale=default_scale(D), p=cfg["dropout"])
    return sizes


def describe_step(step: Step, lang: str, sizes: dict) -> str:
    """The meaning of a recorded step, told for that step: a head split says which features it
    cuts (Q's d_out or K/V's kv_dim), a causal mask with Lq != Lk says how it is aligned.

    ``sizes``: :func:`trace_sizes`. The step's note is not included (see :func:`note_text`).
    """
    if step.kind is _steps.SPLIT_HEADS:
        kv = step.role in ("K", "V")
        if "H" in sizes:
            sizes = dict(sizes, F=sizes["kv_dim"] if kv else sizes["d_out"], h=sizes["Hkv"] if kv else sizes["H"])
        if step.role == "":  # heads.split_heads called by hand: the step's own sizes
            sizes = dict(sizes, F=step.shape[2] * step.shape[3], h=step.shape[2], D=step.shape[3])
    return step.meaning(lang, sizes)


def note_text(step: Step, lang: str) -> str:
    """The localised note of a recorded step (written from its params), or "" when it has none."""
    return step.note_text(lang)


def check_name(name: str, lang: str) -> str:
    """The localised name of a check (English names are the keys of :data:`multihead.steps.CHECKS`)."""
    return _steps.check_text(name, lang)
