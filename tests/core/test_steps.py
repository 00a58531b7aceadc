"""The step catalogue (multihead.steps): every step any code path records is in it, has its
params, and renders in every format (text, Markdown, JSON, HTML, PNG) and both languages, with
no English left in the Chinese output."""

from __future__ import annotations

import html
import json
import re

import pytest
import torch

import multihead
from multihead import masks, steps
from multihead.explain import cost
from multihead.explain.visual import HeadMaps, head_maps_from_trace, render_html
from multihead.explain.walkthrough import Walkthrough, render_json, render_markdown, render_text
from multihead.heads import merge_heads, split_heads


def _run(mha, *inputs, train=False, **kw):
    mha.train(train)
    with multihead.trace() as tr:
        y = mha(*inputs, **kw)
    return tr, mha, inputs, y


def _mha(*args, seed=0, **kw):
    torch.manual_seed(seed)
    return multihead.MultiHeadAttention(*args, **kw)


def _self_causal():
    return _run(_mha(8, 2, causal=True, backend="reference"), torch.randn(2, 3, 8))


def _cross_gqa():
    return _run(_mha(8, 4, 16, num_kv_heads=2, backend="reference"), torch.randn(1, 3, 8), torch.randn(1, 5, 8))


def _masks_of_every_kind():
    pad = torch.tensor([[True, True, True, False]])
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    mask = masks.bias(torch.randn(4, 4)) & masks.key_padding(pad) & masks.window(2) & masks.keep(keep)
    return _run(_mha(8, 2, backend="reference"), torch.randn(1, 4, 8), mask=mask)


def _new_mask_kinds():
    """documents, chunked_local, mask_mod, a window with a sink token, alibi (a bias), score_mod,
    softcap and a sink on the reference backend: the mask step names every part, and the
    score_mod step is recorded after the score mods."""
    table = torch.randn(5)
    mask = (masks.from_seqlens([3, 2]) & masks.chunked_local(2) & masks.window(1, sinks=1)
            & masks.mask_mod(lambda b, h, q, kv: kv <= q) & masks.alibi(masks.alibi_slopes(2))
            & masks.score_mod(lambda s, b, h, q, kv: s + table[(q - kv).abs()]) & masks.softcap(2.0)
            & masks.sink(torch.zeros(2)))
    return _run(_mha(8, 2, backend="reference"), torch.randn(1, 5, 8), mask=mask)


def _dropout():
    torch.manual_seed(1)
    return _run(_mha(8, 2, dropout=0.5, backend="reference"), torch.randn(1, 3, 8), train=True)


def _rope():
    return _run(_mha(8, 2, causal=True, rope=True, backend="reference"), torch.randn(1, 4, 8))


def _cache_and_rope():
    mha = _mha(8, 2, num_kv_heads=1, causal=True, rope=True, backend="reference")
    cache = multihead.KVCache(8)
    with torch.no_grad():
        mha(torch.randn(1, 3, 8), cache=cache)
        return _run(mha, torch.randn(1, 1, 8), cache=cache)


def _backend(name):
    def run():
        with torch.no_grad():  # inference, which every backend runs (flex has no CPU backward)
            return _run(_mha(8, 2, causal=True, backend=name), torch.randn(1, 5, 8))
    return run


def _functional_only():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    with multihead.trace() as tr:
        y = multihead.attention(q, k, v, mask=masks.causal(), backend="reference", scale=0.3)
    return tr, None, (q, k, v), y


def _heads_by_hand():
    x = torch.randn(1, 3, 8)
    with multihead.trace() as tr:
        y = merge_heads(split_heads(x, 2))
    return tr, None, (x,), y


def _real_layer(kind):
    """Layer 0 of a tiny random transformers model (tests/tiny_hf.py) as the ``--token``
    walkthrough records it: q/k norm (qwen3), the scale folded into q (opt), softcap (gemma2),
    sinks (gpt_oss)."""
    def run():
        import tempfile

        from multihead.explain import models
        from multihead.explain.real_model import layer_trace
        from tiny_hf import SENTENCE, save_tiny

        path = save_tiny(kind, tempfile.mkdtemp(prefix=f"steps-{kind}-"))
        return layer_trace(models.load(path).run(SENTENCE), 0), None, (), None
    return run


def _have_hf():
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "tokenizers"))


#: the kinds only a real model's layer records (the ``--token`` walkthrough of explain --model)
REAL_ONLY = {steps.QK_NORM, steps.SCALE_Q}

PRODUCERS = {
    "self-causal": _self_causal,
    "cross-gqa": _cross_gqa,
    "masks": _masks_of_every_kind,
    "new-mask-kinds": _new_mask_kinds,
    "dropout": _dropout,
    "rope": _rope,
    "cache-rope": _cache_and_rope,
    # every registered backend (a new one joins the test by registering)
    **{f"backend-{name}": _backend(name) for name in multihead.backends.names()},
    "functional": _functional_only,
    "heads-by-hand": _heads_by_hand,
    **({f"real-{k}": _real_layer(k) for k in ("qwen3", "opt", "gemma2", "gpt_oss")} if _have_hf() else {}),
}


@pytest.fixture(scope="module")
def runs():
    """name -> (trace, module or None, inputs, output)"""
    return {name: make() for name, make in PRODUCERS.items()}


@pytest.fixture(scope="module")
def traces(runs):
    return {name: run[0] for name, run in runs.items()}


# ------------------------------------------------------------------------------ the catalogue itself
def test_every_kind_is_recorded_by_some_producer(traces):
    recorded = {s.kind for tr in traces.values() for s in tr.steps}
    assert recorded == set(steps.KINDS.values()) - (set() if _have_hf() else REAL_ONLY)


def test_every_recorded_step_carries_its_kinds_params_role_and_checks(traces):
    for name, tr in traces.items():
        for s in tr.steps:
            missing = set(s.kind.params) - set(s.params)
            if s.kind is steps.PROJECT:
                assert set(s.params) == {"f_in", "bias", "fused"}, name
            assert not missing, (name, s.label, missing)
            assert s.role in s.kind.roles or (s.role == "" and not s.kind.roles) or (
                s.role == "" and s.kind in (steps.SPLIT_HEADS, steps.MOVE_HEADS_FORWARD)), (name, s.label)
            assert set(s.checks) <= set(s.kind.checks), (name, s.label, s.checks)
            assert s.pattern == s.kind.pattern and len(s.axes) == len(s.shape), (name, s.label)
            json.dumps(s.to_dict(), allow_nan=False)  # params are plain values


def test_every_mask_kind_has_words():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    kinds = {getattr(c, "kind", None) for c in subclasses(masks.Mask)} - {None}
    assert kinds and kinds <= set(steps.MASK_KINDS), kinds - set(steps.MASK_KINDS)


def test_every_check_has_chinese_and_every_kind_a_cost_rule():
    for kind in steps.KINDS.values():
        assert kind.cost in steps.COST_RULES
        for c in kind.checks:
            assert steps.check_text(c, "zh") != c
    with pytest.raises(ValueError, match="unknown step kind 'scores QKᵀ'"):
        multihead.Trace().record("scores QKᵀ", torch.zeros(1))
    with pytest.raises(KeyError, match="steps.CHECKS"):
        steps.check_text("a check nobody named", "zh")


def test_notes_are_written_from_params_not_recorded_as_text(traces):
    rope = traces["rope"].step(steps.ROPE, role="K")
    assert rope.params == {"positions": "offset", "start": 0, "stop": 3, "base": 10000.0, "layout": "rotate-half"}
    assert rope.note == "positions 0..3, base 10000, rotate-half layout"
    assert rope.note_text("zh") == "位置 0..3，base 10000，rotate_half 布局"
    cache = traces["cache-rope"].step(steps.CACHE_APPEND, role="V")
    assert cache.params == {"length": 4, "max_len": 8, "kv_heads": 1, "new": 1}
    assert "4 of max_len=8" in cache.note and "已缓存 4 个 token" in cache.note_text("zh")
    scale = traces["functional"].step("scale")
    assert scale.params == {"scale": 0.3, "head_dim": 4, "default": False}
    assert scale.note == "× 0.3 (given; 1/√D would be 0.5)"
    fused = traces["backend-chunked"].step(steps.FUSED_ATTENTION)
    assert fused.params["backend"] == "chunked" and fused.params["lk"] == 5 and fused.params["head_dim"] == 4
    sdpa = traces["backend-sdpa"].step(steps.FUSED_ATTENTION).params
    assert sdpa["backend"] == "sdpa" and sdpa["mask"] in ("is_causal", "tensor") and sdpa["kernel"]
    mask = traces["masks"].step(steps.MASK)
    assert mask.params["kinds"] == ("padding", "window", "keep") and mask.label == "padding & window & keep mask"


# ------------------------------------------------------------------------------ cost
def test_the_cost_of_every_recorded_step_follows_its_rule(traces):
    for tr in traces.values():
        costs = cost.trace_cost(tr)
        assert len(costs) == len(tr.steps)
        for s, c in zip(tr.steps, costs):
            assert c.flops >= 0 and c.bytes >= 0
            assert (c.bytes == 0) == (s.kind.cost in ("none", "view", "sink")), s.label
    # a fused step counts what the reference's steps count, less the score matrix's round trips
    ref, fused = traces["self-causal"], _backend("sdpa")()[0]
    ref_costs = {c.label: c for c in cost.trace_cost(ref)}
    fused_cost = cost.trace_cost(fused)[[s.kind for s in fused.steps].index(steps.FUSED_ATTENTION)]
    B, H, L, D = 2, 2, 3, 4
    # same sizes: rebuild the sdpa trace on the reference example's input for a like-for-like count
    sdpa = _run(_mha(8, 2, causal=True, backend="sdpa"), torch.randn(B, L, 8))[0]
    f = cost.trace_cost(sdpa)[[s.kind for s in sdpa.steps].index(steps.FUSED_ATTENTION)]
    arithmetic = ref_costs["scores QKᵀ"].flops + ref_costs["scale"].flops + ref_costs["softmax"].flops + ref_costs["weights × V"].flops
    assert f.flops == arithmetic == 2 * B * H * L * L * D * 2 + 6 * B * H * L * L
    assert fused_cost.flops > 0


# ------------------------------------------------------------------------------ rendering
_WORDS = re.compile(r"[A-Za-z]{2,}(?:[ '-]+[A-Za-z]{2,})+")


def _code_of(tr, module) -> list[str]:
    """What the outputs show as code, the same in both languages: patterns, axes, params' strings
    (a mask's repr, a kernel's name), the module's repr."""
    code = ["multihead explain"] + ([f"MultiHeadAttention({module.config.summary()})"] if module is not None else [])
    for s in tr.steps:
        code += [s.pattern or "", " ".join(s.axes)]
        code += [v for v in s.params.values() if isinstance(v, str)]
    return sorted(filter(None, code), key=len, reverse=True)


def _english_left(text: str, code: list[str]) -> list[str]:
    for c in code:
        text = text.replace(c, " ")
    text = re.sub(r"-?\b(inf|nan)\b", " ", text)  # numbers
    return _WORDS.findall(text)


def _zh_spans(page: str) -> str:
    return " ".join(html.unescape(t) for t in re.findall(r'<span data-l="zh" lang="zh">(.*?)</span>', page))


def _maps(tr):
    try:
        return head_maps_from_trace(tr)
    except ValueError:  # a fused backend records no weights: any maps of the right shape
        out = tr.steps[-1]
        lq = tr.steps[0].shape[1]
        return [HeadMaps(weights=torch.full((2, lq, lq), 1 / lq))]


def _all_traces(runs):
    return {name: (tr, mod) for name, (tr, mod, _, _) in runs.items()}


@pytest.fixture(scope="module")
def everything(runs):
    return _all_traces(runs)


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("name", list(PRODUCERS))
def test_every_step_renders_in_every_format(everything, name, lang):
    tr, module = everything[name]
    w = Walkthrough(None, module, (), tr, tr.steps[-1].tensor, costs=cost.trace_cost(tr))
    code = _code_of(tr, module)
    text = render_text(w, lang=lang)
    md = render_markdown(w, lang=lang)
    data = json.loads(render_json(w, lang=lang))
    assert [d["kind"] for d in data["steps"]] == [s.kind.id for s in tr.steps]
    assert [d["name"] for d in data["steps"]] == [s.label for s in tr.steps]
    for s in tr.steps:
        assert s.title(lang) in text and s.title(lang) in md
    if lang == "zh":
        assert _english_left(text, code) == [], name
        assert _english_left(md, code) == [], name
        shown = [d[k] for d in data["steps"] for k in ("title", "meaning")] + [c["text"] for c in data["checks"]]
        shown += [v["caption"] for d in data["steps"] for v in d.get("values", [])]
        assert _english_left(" ".join(shown), code) == [], name
    maps = _maps(tr) if any(s.kind is steps.SOFTMAX for s in tr.steps) or tr.steps[0].kind is steps.INPUT else None
    if maps is not None:
        page = render_html(tr, maps, lang=lang)
        for s in tr.steps:
            assert html.escape(s.title(lang)) in page
        if lang == "zh":
            assert _english_left(_zh_spans(page), code) == [], name


def test_png_of_every_trace_with_weights(traces):
    pytest.importorskip("matplotlib")
    from multihead.explain.visual_png import png_bytes

    drawn = 0
    for name, tr in traces.items():
        if not any(s.kind is steps.SOFTMAX for s in tr.steps):
            continue
        data = png_bytes(head_maps_from_trace(tr)[0])
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        drawn += 1
    assert drawn >= 5


# ------------------------------------------------------------------------------ a stack: paths, layers
class _Block(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = multihead.MultiHeadAttention(8, 2, causal=True, backend="reference")

    def forward(self, x):
        return x + self.attn(x)


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(i) for i in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_stack_keeps_the_module_path_and_layer_of_every_step():
    model, x = _Stack(), torch.randn(1, 3, 8)
    with multihead.trace(model) as tr:
        model(x)
    assert {s.path for s in tr.steps} == {f"blocks.{i}.attn" for i in range(3)}
    assert [c.path for c in tr.calls] == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    for i in range(3):
        mine = tr.select(layer=i)
        assert len(mine) == len(tr.steps) // 3 and all(s.path == f"blocks.{i}.attn" for s in mine)
    # the layer-1 softmax is block 1's own: recomputed from its input by hand
    h1 = x + model.blocks[0].attn(x)
    with multihead.trace() as alone:
        model.blocks[1].attn(h1)
    assert torch.equal(tr.step("softmax", layer=1).tensor, alone.step("softmax").tensor)
    assert not torch.equal(tr.step("softmax", layer=1).tensor, tr.step("softmax", layer=0).tensor)
    assert tr.step(steps.SOFTMAX, path="blocks.2.attn") is tr.select(steps.SOFTMAX)[2]
    assert tr.to_dict()["steps"][-1]["path"] == "blocks.2.attn" and tr.to_dict()["steps"][-1]["layer"] == 2
    assert "blocks.1.attn" in str(tr)
    with pytest.raises(KeyError, match=r"no step named 'softmax' with \{'layer': 7\}"):
        tr.step("softmax", layer=7)


def test_without_a_root_layers_count_the_modules_in_order_and_calls_repeat():
    model, x = _Stack(), torch.randn(1, 3, 8)
    with multihead.trace() as tr:
        model(x)
        model.blocks[0].attn(x)  # the first module again: layer 0, a fourth call
    assert [c.layer for c in tr.calls] == [0, 1, 2, 0]
    assert {s.path for s in tr.steps} == {""}
    assert len(tr.select(steps.SOFTMAX, layer=0)) == 2
    assert tr.step("softmax", call=3) is tr.select(steps.SOFTMAX)[3]
    # steps outside a module call carry no layer
    q = torch.randn(1, 2, 3, 4)
    with multihead.trace() as bare:
        multihead.attention(q, q, q, backend="reference")
    assert {s.layer for s in bare.steps} == {None} and bare.calls == []


def test_each_call_keeps_its_own_config():
    a, b = _mha(8, 2, backend="reference"), _mha(8, 4, 16, num_kv_heads=2, backend="reference")
    x = torch.randn(1, 3, 8)
    with multihead.trace() as tr:
        b(a(x))
    assert [c.config["num_heads"] for c in tr.calls] == [2, 4]
    assert tr.config["num_heads"] == 2  # the trace's own config: the first call's, as before
    from multihead.explain.i18n import trace_sizes

    assert trace_sizes(tr, tr.step("softmax", layer=1))["H"] == 4


def test_a_hugging_face_model_on_multihead_keeps_each_layers_path():
    transformers = pytest.importorskip("transformers")
    from multihead.integrations import transformers as mh_tf

    name = mh_tf.register(backend="reference")
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=48, num_hidden_layers=2, vocab_size=50,
                                      max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaModel._from_config(config, attn_implementation=name).eval()
    with torch.no_grad(), multihead.trace(model) as tr:
        model(torch.tensor([[3, 7, 11, 2]]))
    assert [c.path for c in tr.calls] == ["layers.0.self_attn", "layers.1.self_attn"]
    weights = tr.select(steps.SOFTMAX)
    assert [s.layer for s in weights] == [0, 1] and tr.step("softmax", layer=1) is weights[1]
    assert tr.step(steps.REPEAT_KV, role="K", layer=1).params == {"groups": 2}


def test_the_mask_step_records_every_part_and_the_score_mod_step_follows_the_mods(traces):
    tr = traces["new-mask-kinds"]
    order = [s.kind for s in tr.steps]
    assert order.index(steps.ADD_BIAS) < order.index(steps.SCORE_MOD) < order.index(steps.MASK) < order.index(steps.SOFTMAX)
    mask_step = tr.select(steps.MASK)[0]
    parts = mask_step.params["parts"]
    assert [p["kind"] for p in parts] == ["documents", "chunked_local", "window", "mask_mod", "alibi", "score_mod", "softcap", "sink"]
    assert parts[0]["lengths"] == [3, 2] and parts[1]["chunk"] == 2 and parts[2]["sinks"] == 1
    assert parts[4]["slopes"] == masks.alibi_slopes(2).tolist() and parts[6]["cap"] == 2.0 and parts[7]["logits"] == [0.0, 0.0]
    assert tuple(mask_step.params["kinds"]) == ("documents", "chunked_local", "window", "mask_mod")
    assert mask_step.params["sink"] is True
    mod = tr.select(steps.SCORE_MOD)[0]
    assert tuple(mod.params["kinds"]) == ("score_mod", "softcap")
    assert [p["kind"] for p in mod.params["parts"]] == ["score_mod", "softcap"]


#: one call of every public constructor in multihead.masks that returns a Mask (a new
#: constructor fails the test below until it is added here, and its kind to steps.MASK_KINDS)
_CONSTRUCTED = {
    "causal": lambda: masks.causal(),
    "window": lambda: masks.window(2, sinks=1),
    "key_padding": lambda: masks.key_padding(torch.ones(1, 4, dtype=torch.bool)),
    "keep": lambda: masks.keep(torch.ones(4, 4, dtype=torch.bool)),
    "bias": lambda: masks.bias(torch.zeros(4, 4)),
    "documents": lambda: masks.documents(torch.tensor([0, 0, 1, 1])),
    "from_seqlens": lambda: masks.from_seqlens([2, 2]),
    "from_cu_seqlens": lambda: masks.from_cu_seqlens([0, 2, 4]),
    "chunked_local": lambda: masks.chunked_local(2),
    "mask_mod": lambda: masks.mask_mod(lambda b, h, q, kv: kv <= q),
    "score_mod": lambda: masks.score_mod(lambda s, b, h, q, kv: s * 2),
    "softcap": lambda: masks.softcap(3.0),
    "sink": lambda: masks.sink(torch.zeros(2)),
    "alibi": lambda: masks.alibi(masks.alibi_slopes(2)),
    "from_torch": lambda: masks.from_torch(torch.ones(4, 4, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)),
    "as_mask": lambda: masks.as_mask(torch.ones(4, 4, dtype=torch.bool)),
}


def test_the_mask_kinds_table_names_every_kind_masks_constructs():
    import inspect
    returning_masks = {
        n for n in masks.__all__
        if inspect.isfunction(getattr(masks, n)) and n != "split_additive"  # it splits a mask, makes none
        and "Mask" in str(inspect.signature(getattr(masks, n)).return_annotation)
    }
    assert returning_masks == set(_CONSTRUCTED), "add the new constructor to _CONSTRUCTED"
    for name, make in _CONSTRUCTED.items():
        for part in make().parts:
            assert part.kind in steps.MASK_KINDS, (name, part.kind)
            steps.mask_words([part.kind], "zh")


@pytest.mark.parametrize("backend", ["chunked", "flex"])
def test_the_fused_steps_name_the_mask_kinds(backend):
    if backend not in multihead.backends.names():
        pytest.skip(f"{backend} is not registered")
    mask = masks.from_seqlens([3, 2]) & masks.softcap(2.0)
    with torch.no_grad():
        tr, *_ = _run(_mha(8, 2, causal=True, backend=backend), torch.randn(1, 5, 8), mask=mask)
    fused = tr.select(steps.FUSED_ATTENTION)[0]
    assert tuple(fused.params["mask_kinds"]) == ("causal", "documents", "softcap")
