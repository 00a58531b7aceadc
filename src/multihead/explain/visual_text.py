"""The words of the visual explainer, in English and Chinese, kept in one place.

``STEP_MEANINGS`` gives each trace step (keyed by ``Step.name``) a one-line meaning; ``UI`` holds
the page's own labels. :func:`meaning` looks a step up, treating every ``"... mask"`` step (the
name lists the mask kinds, e.g. ``"key_padding & causal mask"``) as ``"mask"``.
"""

from __future__ import annotations

LANGS = ("en", "zh")

STEP_MEANINGS: dict[str, dict[str, str]] = {
    "input": {
        "en": "The input: one row of d_in features per token.",
        "zh": "输入：每个词元一行，共 d_in 个特征。",
    },
    "project Q": {
        "en": "Multiply by W_q: for each token, what it is looking for.",
        "zh": "乘以 W_q：每个词元要找什么。",
    },
    "project K": {
        "en": "Multiply by W_k: for each token, what it offers to be found by.",
        "zh": "乘以 W_k：每个词元凭什么被找到。",
    },
    "project V": {
        "en": "Multiply by W_v: the content each token hands over when attended to.",
        "zh": "乘以 W_v：被关注时每个词元交出的内容。",
    },
    "split heads": {
        "en": "Read the feature axis as h heads of d numbers each; only the indexing changes.",
        "zh": "把特征轴看成 h 个头、每头 d 个数；只改变索引方式，数据不动。",
    },
    "move heads forward": {
        "en": "Swap the token and head axes, so each head holds its own (t, d) matrix.",
        "zh": "交换词元轴和头轴，让每个头拥有自己的 (t, d) 矩阵。",
    },
    "repeat kv heads": {
        "en": "Grouped-query attention: copy each key/value head to the query heads that share it.",
        "zh": "分组查询注意力：把每个键/值头复制给共用它的各个查询头。",
    },
    "scores QKᵀ": {
        "en": "Dot product of every query with every key, in every head.",
        "zh": "在每个头里，每个查询与每个键做点积。",
    },
    "scale": {
        "en": "Multiply by 1/√d so the scores do not grow with the head size and saturate the softmax.",
        "zh": "乘以 1/√d，使分数不随头维度变大，避免 softmax 饱和。",
    },
    "add bias": {
        "en": "Add the float mask (a bias) to the scores.",
        "zh": "把浮点掩码（偏置）加到分数上。",
    },
    "mask": {
        "en": "Blocked query/key pairs get −∞, so the softmax gives them weight 0.",
        "zh": "被屏蔽的查询/键位置设为 −∞，softmax 后权重为 0。",
    },
    "softmax": {
        "en": "Turn each row of scores into weights that are ≥ 0 and sum to 1.",
        "zh": "把每一行分数变成非负且和为 1 的权重。",
    },
    "dropout": {
        "en": "Training only: zero some weights at random and scale the kept ones by 1/(1−p).",
        "zh": "仅训练时：随机把部分权重置零，保留的乘以 1/(1−p)。",
    },
    "weights × V": {
        "en": "Each query's output is the weighted average of the value vectors.",
        "zh": "每个查询的输出是各值向量的加权平均。",
    },
    "move heads back": {
        "en": "Swap the head and token axes back: (b, t, h, d).",
        "zh": "把头轴和词元轴换回来：(b, t, h, d)。",
    },
    "merge heads": {
        "en": "Concatenate the heads into one d_out axis; this copies, because after the swap the heads are no longer contiguous.",
        "zh": "把各头拼接回一个 d_out 轴；因为交换后各头在内存中不再连续，这一步会复制数据。",
    },
    "output projection": {
        "en": "Multiply by W_O, which mixes what the heads found into the output.",
        "zh": "乘以 W_O，把各头的结果融合成输出。",
    },
}

UI: dict[str, dict[str, str]] = {
    "en": {
        "title": "Multi-head attention, step by step",
        "lang_button": "中文",
        "config": "Configuration",
        "backend": "Backend that ran",
        "steps": "The pipeline",
        "steps_intro": "Every step of the forward pass, with the shape of the tensor it produces. "
        "The sides of each block carry the axis names and sizes; a dashed arrow is a view (the same "
        "memory read another way), a solid one makes a new tensor.",
        "nav_steps": "Pipeline",
        "nav_attention": "Heat maps",
        "nav_checks": "Checks",
        "view": "view: no data moved",
        "copy": "copy: data moved",
        "compute": "computed",
        "pattern": "pattern",
        "attention": "Attention of one batch element",
        "batch": "batch element",
        "head": "head",
        "all_heads": "All heads side by side (click one to select it)",
        "scores": "Scores (scaled, before the mask)",
        "mask": "Mask (1 = may attend, 0 = blocked)",
        "weights": "Weights (after softmax)",
        "query": "query",
        "key": "key",
        "no_scores": "This source records no scores; only the weights are shown.",
        "checks": "Checks the trace ran",
        "checks_none": "No checks were recorded.",
        "hover": "Hover over (or tap) a cell to read its value.",
        "blocked": "blocked",
        "short_scores": "score",
        "short_mask": "mask",
        "short_weights": "weight",
    },
    "zh": {
        "title": "多头注意力，逐步拆解",
        "lang_button": "English",
        "config": "配置",
        "backend": "实际运行的后端",
        "steps": "计算流程",
        "steps_intro": "前向计算的每一步，以及它产生的张量形状。每个方块的边上标有轴名和大小；"
        "虚线箭头表示视图（同一块内存换一种读法），实线箭头表示生成新张量。",
        "nav_steps": "流程",
        "nav_attention": "热力图",
        "nav_checks": "检查",
        "view": "视图：数据未移动",
        "copy": "复制：数据被移动",
        "compute": "计算",
        "pattern": "模式",
        "attention": "一个批次元素的注意力",
        "batch": "批次元素",
        "head": "头",
        "all_heads": "所有头并排显示（点击选择）",
        "scores": "分数（已缩放，掩码之前）",
        "mask": "掩码（1 = 可关注，0 = 屏蔽）",
        "weights": "权重（softmax 之后）",
        "query": "查询",
        "key": "键",
        "no_scores": "该来源没有记录分数，只显示权重。",
        "checks": "追踪中运行的检查",
        "checks_none": "没有记录检查。",
        "hover": "将鼠标悬停（或轻点）在格子上查看数值。",
        "blocked": "已屏蔽",
        "short_scores": "分数",
        "short_mask": "掩码",
        "short_weights": "权重",
    },
}


def meaning(step_name: str) -> dict[str, str]:
    """``{"en": ..., "zh": ...}`` for a step name; empty strings for a step with no entry."""
    if step_name in STEP_MEANINGS:
        return STEP_MEANINGS[step_name]
    if step_name.endswith(" mask"):
        return STEP_MEANINGS["mask"]
    return {lang: "" for lang in LANGS}
