"""Every sentence a diagnosis writes, in English and Chinese: ``key -> (en, zh)`` format strings.

    >>> from multihead.diagnosis.words import say
    >>> say("kv_query_length", "en", role="K", lq=5, lk=7, shape=(2, 5, 2, 4), line=23, code="")
    'your K is reshaped with the query length Lq=5, but there are Lk=7 key tokens: ...'

Step names come from the step catalogue (:mod:`multihead.steps`); the words here say what went
wrong at a step and what it should have been. The Chinese follows the tutorials' vocabulary
(查询/键/值, 分头, 转置, 注意力分数, 缩放, 掩码, 拼接, 输出投影).
"""

from __future__ import annotations

from typing import Any

__all__ = ["WORDS", "say"]

WORDS: dict[str, tuple[str, str]] = {
    # -- headings
    "matches": ("matches the definition", "与定义一致"),
    "bug": ("first wrong step", "第一个出错的步骤"),
    "raised_head": ("the forward raised on the way to", "forward 在这一步之前抛出异常"),
    "error_line": ("largest output error against the float64 reference: {error:.1e} (the oracle's bound: {bound:.1e})",
                   "输出与 float64 参考实现的最大误差：{error:.1e}（容差上限：{bound:.1e}）"),
    "facts": ("found: {heads} heads of {head_dim}, {layout}, {proj}{causal}",
              "识别到：{heads} 个头、每头 {head_dim} 维，{layout}，{proj}{causal}"),
    "batch_first": ("batch first (B, L, E)", "批次在前 (B, L, E)"),
    "seq_first": ("sequence first (L, B, E)", "序列在前 (L, B, E)"),
    "causal": (", causal", "，因果"),
    "probes": ("probes: {probes}", "探针输入：{probes}"),
    "where": ("at {file}:{line}", "位置 {file}:{line}"),
    "on_probe": ("seen on the probe: {probe}", "在探针输入上发现：{probe}"),
    "probe_self": ("self-attention, B={B}, Lq={Lq}, Lk={Lk}", "自注意力，B={B}，Lq={Lq}，Lk={Lk}"),
    "probe_cross": ("cross-attention, B={B}, Lq={Lq}, Lk={Lk}", "交叉注意力，B={B}，Lq={Lq}，Lk={Lk}"),
    "probe_mask": ("self-attention with a mask, B={B}, Lq={Lq}, Lk={Lk}", "带掩码的自注意力，B={B}，Lq={Lq}，Lk={Lk}"),
    "conventions": ("conventions (not bugs; multihead's choice differs):", "约定差异（不是错误；multihead 的选择不同）："),
    "diagram": ("layout (batch 0): right vs yours", "布局（batch 0）：正确 vs 你的"),
    "right": ("right", "正确"),
    "yours": ("yours", "你的"),
    "mask_diagram": ("blocked keys (x) per query: right vs yours", "每个查询被遮蔽的键（x）：正确 vs 你的"),
    # -- findings
    "dropout_eval": ("your forward is random in eval mode: {func} at line {line} still drops weights "
                     "(F.dropout's training defaults to True: pass training=self.training, or use an nn.Dropout submodule)",
                     "你的 forward 在 eval 模式下仍有随机性：第 {line} 行的 {func} 仍在随机置零"
                     "（F.dropout 的 training 默认为 True：传入 training=self.training，或使用 nn.Dropout 子模块）"),
    "project_wrong_input": ("your {role} is projected from the {given} input; it should be projected from the {wanted} input",
                            "你的 {role} 由 {given} 输入投影得到；应当由 {wanted} 输入投影"),
    "project_unused": ("no tensor of your forward equals {role} = input · W_{role}ᵀ: the weight {weight} is never applied "
                       "(a copy-paste of another projection?)",
                       "你的 forward 中没有张量等于 {role} = 输入 · W_{role}ᵀ：权重 {weight} 从未被使用（是否复制粘贴了另一个投影？）"),
    "project_other": ("no tensor of your forward equals the projection {role} = input · W_{role}ᵀ + b",
                      "你的 forward 中没有张量等于投影 {role} = 输入 · W_{role}ᵀ + b"),
    "kv_query_length": ("your {role} is reshaped with the query length Lq={lq}, but there are Lk={lk} key tokens: "
                        "split the keys and values with their own length (key.shape[1], or -1)",
                        "你的 {role} 用查询的长度 Lq={lq} 做 reshape，但键有 Lk={lk} 个 token："
                        "键和值应按它们自己的长度分头（key.shape[1] 或 -1）"),
    "split_no_transpose": ("after your {func} to {shape}, head 0 holds tokens {tokens} of heads {heads}, "
                           "not one head of every token: view to (B, L, H, D) and then transpose(1, 2)",
                           "你的 {func} 得到 {shape} 之后，第 0 个头装的是 token {tokens} 的第 {heads} 个头，"
                           "而不是每个 token 的同一个头：应先 view 成 (B, L, H, D)，再 transpose(1, 2)"),
    "no_transpose": ("your {role} enters the scores with its heads still next to the head features ({form}): "
                     "the product multiplies heads, not tokens; a transpose(1, 2) is missing",
                     "你的 {role} 进入注意力分数时，头轴仍紧挨着每头特征（{form}）：矩阵乘法乘的是头而不是 token；缺少 transpose(1, 2)"),
    "heads_other": ("no tensor of your forward holds the heads of {role} in a layout a correct split gives",
                    "你的 forward 中没有张量以正确分头的布局保存 {role} 的各头"),
    "scores_other": ("no tensor of your forward equals the scores Q·Kᵀ of each head",
                     "你的 forward 中没有张量等于每个头的注意力分数 Q·Kᵀ"),
    "scale_wrong": ("your scores are multiplied by {factor:.4g}{guess_text} before the softmax; the definition multiplies "
                    "by 1/√D = {want:.4g} (D = {D})",
                    "你的注意力分数在 softmax 前乘以 {factor:.4g}{guess_text}；定义是乘以 1/√D = {want:.4g}（D = {D}）"),
    "mask_missing": ("the scores reach the softmax unmasked: the mask is not applied (masked_fill returns a new tensor: "
                     "assign its result, or use masked_fill_)",
                     "注意力分数未经掩码就进入了 softmax：掩码没有生效（masked_fill 返回新张量：要赋值，或用 masked_fill_）"),
    "mask_fill": ("blocked scores are filled with {fill:g}, which softmax does not turn into 0: fill with -inf "
                  "(or a very negative number such as -1e9)",
                  "被遮蔽的分数被填成 {fill:g}，softmax 之后不为 0：应填 -inf（或 -1e9 这样很小的数）"),
    "mask_inverted": ("your mask blocks exactly the keys that should be seen and lets through the ones that should be "
                      "blocked: its polarity is inverted (True/1 = may attend in multihead; fill where mask == 0)",
                      "你的掩码遮住的恰好是应当可见的键，放过的恰好是应当遮住的：极性反了（multihead 中 True/1 = 可见；应在 mask == 0 处填充）"),
    "mask_pattern": ("your mask blocks other keys than the definition's ({extra} extra blocked pairs in batch 0, head 0)",
                     "你的掩码遮住的键与定义不同（batch 0、head 0 中多遮住了 {extra} 个位置）"),
    "softmax_axis": ("your softmax normalises over the {axis_name} axis (dim={dim}{implicit_text}); it must run over the "
                     "keys, the last axis (dim=-1), so that each query's weights sum to 1",
                     "你的 softmax 在{axis_name}轴上归一化（dim={dim}{implicit_text}）；应在键轴即最后一维（dim=-1）上，"
                     "这样每个查询的权重和为 1"),
    "softmax_other": ("the weights after your softmax differ from softmax(scores) over the keys",
                      "你的 softmax 之后的权重与在键轴上做 softmax 的结果不同"),
    "weighted_other": ("no tensor of your forward equals weights × V per head", "你的 forward 中没有张量等于每个头的 权重 × V"),
    "merge_no_transpose": ("your {func} merges (B, H, L, D) straight into (B, L, H·D): token rows get pieces of other "
                           "tokens; transpose(1, 2) back to (B, L, H, D) first, then reshape",
                           "你的 {func} 把 (B, H, L, D) 直接合并成 (B, L, H·D)：每个 token 的行混进了别的 token；"
                           "应先 transpose(1, 2) 回到 (B, L, H, D)，再 reshape"),
    "merge_other": ("no tensor of your forward equals the heads concatenated per token (B, L, H·D)",
                    "你的 forward 中没有张量等于按 token 拼接各头的结果 (B, L, H·D)"),
    "out_unused": ("the merged heads are right, but the output projection {weight} is never applied",
                   "各头拼接结果正确，但输出投影 {weight} 从未被使用"),
    "out_per_head": ("the merged heads are right, but W_O is applied per head and the pieces are not summed as "
                     "one product with the concatenation: apply W_O once to the merged (B, L, H·D)",
                     "各头拼接结果正确，但 W_O 被逐头使用，结果不等于对拼接结果做一次乘法：应对合并后的 (B, L, H·D) 只做一次 W_O"),
    "out_other": ("the merged heads are right, but your output differs from merged · W_Oᵀ + b",
                  "各头拼接结果正确，但你的输出不等于 拼接结果 · W_Oᵀ + b"),
    "generic": ("your forward departs from the definition here", "你的 forward 在这里偏离了定义"),
    "raised": ("your forward raised {error}", "你的 forward 抛出了异常 {error}"),
    # -- axis names
    "axis_b": ("batch", "批次"), "axis_h": ("head", "头"), "axis_q": ("query", "查询"), "axis_k": ("key", "键"),
    "implicit": (", implicit: torch picks dim=1 for a 4-D tensor", "，未指定：4 维张量时 torch 默认 dim=1"),
    # -- conventions
    "mask_block": ("your mask argument takes True = blocked (nn.MultiheadAttention's convention); multihead's masks "
                   "take True = may attend", "你的掩码参数 True = 遮蔽（nn.MultiheadAttention 的约定）；multihead 的掩码 True = 可见"),
    "mask_additive": ("your mask argument is a float mask added to the scores (0 = see, -inf = blocked)",
                      "你的掩码参数是加到分数上的浮点掩码（0 = 可见，-inf = 遮蔽）"),
    "mask_4d": ("your mask argument has the shape (B, 1, Lq, Lk)", "你的掩码参数形状为 (B, 1, Lq, Lk)"),
    "row_uniform": ("a query that may see no key gets uniform weights over all keys (a finite fill such as -1e9); "
                    "multihead gives it weights 0, so its output is the output bias",
                    "没有可见键的查询得到所有键上的均匀权重（填充了 -1e9 这样的有限值）；multihead 给它全 0 权重，输出即输出偏置"),
    "row_nan": ("a query that may see no key gets NaN (softmax of a row of -inf); multihead gives it weights 0",
                "没有可见键的查询得到 NaN（整行 -inf 的 softmax）；multihead 给它全 0 权重"),
    "row_other": ("a query that may see no key gets an output neither 0-weighted nor uniform; that row is not "
                  "defined by the formula, multihead gives it weights 0",
                  "没有可见键的查询得到的输出既不是全 0 权重也不是均匀权重；公式没有定义这一行，multihead 给它全 0 权重"),
    "causal_self": ("causal: probed with self-attention only (a causal mask is for one sequence)",
                    "因果：只用自注意力探测（因果掩码针对同一个序列）"),
}


def say(key: str, lang: str, **params: Any) -> str:
    """The sentence ``key`` in ``lang`` ("en" or "zh"), filled with ``params``."""
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    en, zh = WORDS[key]
    return (en if lang == "en" else zh).format(**params)
