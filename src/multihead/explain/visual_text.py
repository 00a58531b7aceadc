"""The HTML page's own labels (headings, buttons, legends), in English and Chinese.

``UI[lang][key]``; the page's script reads the same table. What the steps, checks and notes
say comes from :mod:`multihead.explain.i18n`, shared with the text walkthrough.
"""

from __future__ import annotations

from .i18n import LANGS

__all__ = ["LANGS", "UI"]

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
        "attention_layer": "Attention of one layer",
        "batch": "batch element",
        "layer": "layer",
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
        "worked": "One score worked out by hand",
        "worked_hint": "Hover over (or tap) a cell of the scores: its q · k is summed here term by term, then scaled.",
        "worked_sum": "sum of the {D} products",
        "worked_scaled": "scaled",
        "model_view": "Every layer and head",
        "model_view_intro": "One thumbnail per head (columns) of every layer (rows), as in bertviz's model view: "
        "click one to show it in the heat maps above.",
        "nav_model_view": "Layers × heads",
        "reopened": "Where these steps come from",
        "fused": "fused",
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
        "attention_layer": "一层的注意力",
        "batch": "批次元素",
        "layer": "层",
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
        "worked": "手算一个分数",
        "worked_hint": "将鼠标悬停（或轻点）在分数格子上：这里逐项累加它的 q · k，再乘以缩放因子。",
        "worked_sum": "{D} 个乘积之和",
        "worked_scaled": "缩放后",
        "model_view": "所有层与所有头",
        "model_view_intro": "每层（行）的每个头（列）一个缩略图，类似 bertviz 的 model view：点击一个即可在上方热力图中查看。",
        "nav_model_view": "层 × 头",
        "reopened": "这些步骤从何而来",
        "fused": "融合",
    },
}
