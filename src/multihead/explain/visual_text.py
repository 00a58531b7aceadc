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
    },
}
