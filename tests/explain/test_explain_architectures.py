"""``explain --model DIR`` states what each layer really did, for architectures that are not plain
causal or plain bidirectional: tiny random models built here (tests/tiny_hf.py, no downloads).

Each test is a regression test of issue 24's "Why" list (the item is named in the test). What
is compared:

* the layer description (``LayerRecord.attention``) against the mask the layer passed and the
  config it was built from (window, local layers, softcap, sinks, q/k norm, scale, RoPE);
* every shown step against the step before it, by the layer walkthrough's own checks
  (:func:`multihead.explain.checks.chain_checks`, the project's float64 rule), and the page's
  and the neuron view's weights against the weights of the model's own run, within a bound
  derived from the float32 rounding of the scores: 16 eps32 (D max|q| max|k| |scale| + L + 1);
* refusals: one line, exit 2.

Legend: L tokens, H query heads, Hkv key/value heads, D head dim.
"""

import base64
import html
import io
import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import multihead  # noqa: E402
from multihead import masks  # noqa: E402
from multihead.cli import main  # noqa: E402
from multihead.explain import checks, models  # noqa: E402
from multihead.explain.neuron import neuron_html, neuron_view, render_text  # noqa: E402
from multihead.explain.real_model import explain_model, layer_trace, layer_walkthrough, model_summary  # noqa: E402
from tiny_hf import SENTENCE, save_tiny  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
KINDS = ("mistral", "gemma2", "gpt_oss", "qwen3", "opt", "modernbert", "llama",
         "roberta", "distilbert", "gpt2", "gpt_neox", "qwen2", "phi3", "llama_mqa")
#: plain bidirectional / plain causal architectures: what matters is the weights, the mask and the layout
PLAIN = {"roberta": "encoder", "distilbert": "encoder", "gpt2": "decoder", "gpt_neox": "decoder",
         "qwen2": "decoder", "phi3": "decoder", "llama_mqa": "decoder"}
#: fused q/k/v projections (or a layout not recorded): the --token walkthrough is refused by name
FUSED = ("distilbert", "gpt2", "gpt_neox", "phi3")
#: transformers 5 loads a qwen2 directory's tokenizer as Qwen2Tokenizer (byte-level BPE over the saved
#: vocabulary), which keeps only the one-character words of tiny_hf.WORDS: 7 tokens made of those
TEXT = {"qwen2": "a . a a . . a"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch")
    return {kind: save_tiny(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def runs(dirs):
    return {kind: models.load(dirs[kind]).run(TEXT.get(kind, SENTENCE)) for kind in KINDS}


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(["explain", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _bound(rec) -> float:
    """16 eps32 (D max|q| max|k| |scale| + L + 1): the float32 rounding of a score and of its softmax."""
    D, L = rec.q.shape[-1], rec.q.shape[1]
    size = D * rec.q.abs().max().item() * rec.k.abs().max().item() * abs(rec.scale)
    return 16 * EPS32 * (size + L + 1)


def _band(L, left, right):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return (j <= i + right) & (j >= i - left)


# ---------------------------------------------------------------------------- Why 1: windows, local layers
def test_why1_windows_and_local_layers_are_described_per_layer(runs):
    L = len(SENTENCE.split())
    mistral = runs["mistral"]
    for rec in mistral.layers:
        assert torch.equal(rec.keep, _band(L, 2, 0).expand_as(rec.keep))
        assert (rec.attention.mask, rec.attention.window) == ("window", 3)
    summary = model_summary(mistral)
    assert summary[0].startswith("decoder") and "sliding window of 3" in summary[0]
    assert not any(line.startswith("encoder") for line in summary)

    gemma = runs["gemma2"]
    assert [(r.attention.mask, r.attention.window) for r in gemma.layers] == [("window", 3), ("causal", None)]
    text = "\n".join(model_summary(gemma))
    assert "layer 0: causal, sliding window of 3" in text and "layer 1: causal" in text

    modern = runs["modernbert"]
    L2 = L + 2
    assert torch.equal(modern.layers[1].keep, _band(L2, 2, 2).expand_as(modern.layers[1].keep))
    assert [(r.attention.mask, r.attention.window) for r in modern.layers] == [("bidirectional", None), ("local", 3)]
    text = "\n".join(model_summary(modern))
    assert "layer 1: bidirectional, local window |i - j| < 3" in text
    assert "rotary position embedding" in text and "160000" in text and "10000" in text


def test_why1_chinese_summary_says_the_same(runs):
    text = "\n".join(model_summary(runs["mistral"], "zh"))
    assert "滑动窗口" in text and "3" in text


# ---------------------------------------------------------------------------- Why 2: the page draws every mask
def _page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="mh-data">(.*?)</script>', page, re.S)
    assert m, "the page has no data block"
    return json.loads(m.group(1))


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "modernbert", "gpt2", "gpt_neox", "qwen2", "phi3", "llama_mqa"])
def test_why2_the_page_draws_the_mask_of_every_layer_that_blocks(dirs, runs, kind):
    data = _page_data(explain_model(dirs[kind], TEXT.get(kind, SENTENCE)).html())
    assert len(data["maps"]) == len(runs[kind].layers)
    for layer, rec in enumerate(runs[kind].layers):
        shown = torch.tensor(data["maps"][layer]["weights"], dtype=torch.float64)
        assert (shown - rec.weights.double()).abs().max() <= _bound(rec), (kind, layer)
        keep = data["maps"][layer]["keep"]
        if bool(rec.keep.all()):
            continue
        assert keep is not None, (kind, layer)
        assert torch.equal(torch.tensor(keep, dtype=torch.bool), rec.keep)


# ---------------------------------------------------------------------------- Why 3: softcap and sinks
def _softmax_with_sink(s, sink):
    if sink is None:
        return torch.softmax(s, -1).nan_to_num(0.0)
    return torch.softmax(torch.cat([s, s.new_full((*s.shape[:-1], 1), sink)], -1), -1)[..., :-1]


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_why3_the_pages_scores_give_its_weights(dirs, runs, kind):
    data = _page_data(explain_model(dirs[kind], SENTENCE).html())
    for layer, rec in enumerate(runs[kind].layers):
        m = data["maps"][layer]
        s = torch.tensor([[[float("-inf") if v is None else v for v in row] for row in h] for h in m["scores"]],
                         dtype=torch.float64)
        if m["keep"] is not None:
            s = s.masked_fill(~torch.tensor(m["keep"], dtype=torch.bool), float("-inf"))
        sinks = m.get("sink")
        assert (sinks is not None) == (kind == "gpt_oss")
        for h in range(s.shape[0]):
            w = _softmax_with_sink(s[h], None if sinks is None else sinks[h])
            assert (w - torch.tensor(m["weights"][h], dtype=torch.float64)).abs().max() <= _bound(rec), (layer, h)
        if kind == "gemma2":
            assert m["softcap"] == 1.5


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_why3_the_neuron_view_gives_the_models_weights(runs, kind):
    run = runs[kind]
    for layer, rec in enumerate(run.layers):
        view = neuron_view(run, layer, 1, 6)
        assert (view.weights - rec.weights[1, 6].double()).abs().max() <= _bound(rec)
        text = render_text(view)
        page = html.unescape(neuron_html(view))
        if kind == "gemma2":
            assert "softcap" in text and "1.5·tanh(s / 1.5)" in text and "1.5·tanh(s / 1.5)" in page
        else:
            assert "sink" in text and f"takes {view.sink_mass:.3f} of the row" in page
            sink_mass = 1 - view.weights.sum().item()
            assert sink_mass > 0.01
            assert f"{sink_mass:.3f}" in text


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "mistral", "qwen3", "opt", "llama", "roberta", "qwen2",
                                  "llama_mqa"])
def test_why3_every_step_of_the_layer_walkthrough_follows_from_the_one_before(runs, kind):
    run = runs[kind]
    for layer in range(len(run.layers)):
        tr = layer_trace(run, layer)
        found = checks.chain_checks(tr)
        names = {c.name for c in found}
        assert {"equals Q·Kᵀ in float64", "equals softmax in float64", "equals weights × V in float64"} <= names
        assert all(c.ok for c in found), [(c.step, c.name) for c in found if not c.ok]
        kinds = [s.kind.id for s in tr.steps]
        if kind == "gemma2":
            assert "score_mod" in kinds
        if kind == "gpt_oss":
            assert "sink" in kinds
    lines = "\n".join(layer_walkthrough(run, 0, 1, 5))
    if kind == "gpt_oss":
        assert "sink" in lines and "row 5 takes" in lines


def test_why3_a_sink_mask_is_a_step_and_the_explanations_checks_hold():
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(8, 2, causal=True, backend="reference")
    x = torch.randn(1, 4, 8)
    e = multihead.explain_module(mha, x, mask=masks.sink(torch.tensor([0.5, -1.0])))
    kinds = [s.kind.id for s in e.walkthrough.trace.steps]
    assert "sink" in kinds
    assert e.walkthrough.checks and all(c.ok for c in e.walkthrough.checks), \
        [(c.step, c.name) for c in e.walkthrough.checks if not c.ok]
    text = e.text()
    assert "sink" in text and "each row sums to less than 1" in text.replace("\n   ", " ").replace("  ", " ")
    assert "each row sums to 1," not in text.replace("\n   ", " ").replace("  ", " ")


# ---------------------------------------------------------------------------- Why 4: q/k norm
def test_why4_qk_norm_is_a_step_and_the_rotary_formula_holds(runs):
    run = runs["qwen3"]
    for layer, rec in enumerate(run.layers):
        assert rec.attention.qk_norm
        view = neuron_view(run, layer, 1, 6)
        r = view.rotary
        assert r is not None
        half = r.q_before.shape[0] // 2
        rot = torch.cat([-r.q_before[half:], r.q_before[:half]])
        exact = r.q_before * r.cos[6] + rot * r.sin[6]
        bound = 2 * EPS32 * (r.q_before.abs() * r.cos[6].abs() + rot.abs() * r.sin[6].abs()) + 1e-30
        assert ((view.q - exact).abs() <= bound).all()
        kinds = [s.kind.id for s in layer_trace(run, layer).steps]
        assert kinds.index("qk_norm") < kinds.index("rope")
    assert "q/k norm" in render_text(neuron_view(run, 0, 1, 6))
    assert "q/k norm" in "\n".join(model_summary(run))


# ---------------------------------------------------------------------------- Why 5: the real scale
def test_why5_the_scale_is_the_layers_own_and_where_it_is_applied(runs):
    gemma = render_text(neuron_view(runs["gemma2"], 0, 0, 3))
    assert "0.25" in gemma and "1/√8" not in gemma and "query_pre_attn_scalar" in gemma
    opt = runs["opt"]
    assert all(r.attention.q_scale == pytest.approx(8 ** -0.5) for r in opt.layers)
    text = render_text(neuron_view(opt, 1, 0, 3))
    assert "1/√8" not in text.replace("q_proj × 0.353553 (1/√8)", "")
    assert "q_proj × 0.353553 (1/√8)" in text
    walk = "\n".join(layer_walkthrough(opt, 1, 0, 3))
    assert "scale folded into q" in walk
    assert "× scale 1 (1/√8)" not in walk


# ---------------------------------------------------------------------------- Why 6: crashes, refusals
def test_why6_gpt_oss_neuron_view_with_half_width_rope_tables(dirs):
    rc, out, err = cli("--model", dirs["gpt_oss"], "--text", SENTENCE, "--neuron", "--layer", "1", "--head", "2")
    assert rc == 0, err
    assert "With RoPE, q = q_proj * cos" in out


def test_why6_an_image_model_with_a_tokenizer_is_refused_naming_the_modality(tmp_path):
    path = save_tiny("vit", tmp_path / "vit")
    rc, out, err = cli("--model", path, "--text", SENTENCE)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "image" in err and "Traceback" not in err


def test_why6_t5gemma_is_not_refused_with_transformers_message(tmp_path):
    enc = dict(vocab_size=13, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, head_dim=8)
    torch.manual_seed(0)
    net = transformers.T5GemmaModel(transformers.T5GemmaConfig(encoder=enc, decoder=enc, vocab_size=13))
    net.save_pretrained(tmp_path / "t5g")
    from tiny_hf import _tokenizer

    _tokenizer(False).save_pretrained(tmp_path / "t5g")
    rc, out, err = cli("--model", str(tmp_path / "t5g"), "--text", SENTENCE)
    assert "exactly one of input_ids" not in err
    assert rc == 0 and "cross-attention" in out, err
    run = models.load(str(tmp_path / "t5g")).run(SENTENCE)
    assert [r.role for r in run.layers] == ["encoder", "decoder", "cross"]
    eager = transformers.T5GemmaModel.from_pretrained(tmp_path / "t5g", attn_implementation="eager").eval()
    ids = torch.tensor([run.ids])
    with torch.no_grad():
        got = eager(input_ids=ids, decoder_input_ids=ids, output_attentions=True)
    want = [got.encoder_attentions[0], got.decoder_attentions[0], got.cross_attentions[0]]
    for rec, w in zip(run.layers, want):
        assert (rec.weights - w[0]).abs().max() <= _bound(rec)


# ---------------------------------------------------------------------------- Why 7: a stale model
def test_why7_a_directory_saved_again_is_loaded_again(tmp_path):
    path = save_tiny("llama", tmp_path / "m")
    before = models.load(path).run(SENTENCE).weights
    torch.manual_seed(1)
    net, _ = __import__("tiny_hf")._build("llama")
    net.save_pretrained(path)
    after = models.load(path).run(SENTENCE).weights
    assert not torch.equal(before, after)
    again = models.load(path)
    assert again is models.load(path)   # unchanged files: still loaded once


# ---------------------------------------------------------------------------- Why 8: traces of GQA, sizes
def test_why8_a_grouped_query_trace_of_a_hugging_face_model_draws(dirs):
    from multihead.integrations.transformers import register

    register("multihead_reference_test", backend="reference")
    net = transformers.AutoModel.from_pretrained(dirs["llama"], attn_implementation="multihead_reference_test").eval()
    with torch.no_grad(), multihead.trace(keep_values=True) as tr:
        net(input_ids=torch.arange(4, 9)[None])
    page = tr._repr_html_()
    assert "<iframe" in page


def test_why8_a_functional_trace_states_the_sizes_it_knows():
    with multihead.trace(keep_values=True) as tr:
        multihead.attention(*(torch.randn(1, 2, 3, 6) for _ in range(3)), backend="reference", scale=0.5)
    text = multihead.explain_module(tr).text()
    assert "?" not in text
    assert "Multiply by 1/sqrt(6)" not in text and "given scale 0.5" in text


# ---------------------------------------------------------------------------- Why 9: notebook weight
def test_why9_the_notebook_output_embeds_q_and_k_of_the_shown_layer_only(tmp_path):
    import transformers as tf
    from tiny_hf import _tokenizer

    torch.manual_seed(0)
    net = tf.LlamaModel(tf.LlamaConfig(vocab_size=13, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64))
    net.save_pretrained(tmp_path / "deep")
    _tokenizer(False).save_pretrained(tmp_path / "deep")
    page = explain_model(str(tmp_path / "deep"), SENTENCE, layer=2)
    cell = page._repr_html_()
    data = _page_data(html.unescape(re.search(r'srcdoc="(.*?)"', cell, re.S).group(1)))
    with_operands = [i for i, m in enumerate(data["maps"]) if m["q"] is not None]
    with_scores = [i for i, m in enumerate(data["maps"]) if m["scores"] is not None]
    with_exact = [i for i, m in enumerate(data["maps"]) if m["weights"] is not None]
    assert with_operands == with_scores == with_exact == [2]
    print(f"notebook cell: {len(cell.encode()) / 1024:.1f} KiB for 6 layers x 4 heads x {len(SENTENCE.split())} tokens")
    # the whole page (to a file) still holds every layer's operands and exact weights
    full = _page_data(page.html())
    assert all(m["q"] is not None and "w8" not in m for m in full["maps"])
    # the other layers' weights: one byte each, within half a step (1/510) of the exact ones; masks as bits
    for i, (light, whole) in enumerate(zip(data["maps"], full["maps"])):
        if i == 2:
            assert light["weights"] == whole["weights"]
            continue
        H, Lq, Lk = light["shape"]
        w8 = torch.tensor(list(base64.b64decode(light["w8"])), dtype=torch.float64).view(H, Lq, Lk) / 255
        assert (w8 - torch.tensor(whole["weights"], dtype=torch.float64)).abs().max().item() <= 1 / 510 + 1e-7
        raw = base64.b64decode(light["k8"])
        bits = torch.tensor([(raw[n // 8] >> (7 - n % 8)) & 1 for n in range(H * Lq * Lk)]).view(H, Lq, Lk)
        assert torch.equal(bits, torch.tensor(whole["keep"]))


def test_explain_model_is_a_top_level_name():
    assert multihead.explain_model is explain_model


# ---------------------------------------------------------------------------- explain(module, x) for more modules
def test_explain_takes_a_per_head_module_as_its_fused_equivalent():
    torch.manual_seed(0)
    p = multihead.PerHeadAttention(8, 2, causal=True)
    x = torch.randn(1, 4, 8)
    e = multihead.explain_module(p, x)
    assert e.walkthrough.checks and all(c.ok for c in e.walkthrough.checks)
    fused = multihead.MultiHeadAttention.from_per_head(p)
    _, tol, ok = checks.per_head_difference(fused, (x,))
    with torch.no_grad():
        want = p(x)
    assert ok and (e.walkthrough.output - want).abs().max().item() <= tol


def test_explain_runs_modules_that_call_multihead_attention():
    from multihead.nn import MultiheadAttention

    torch.manual_seed(0)
    x = torch.randn(1, 4, 8)
    m = MultiheadAttention(8, 2, batch_first=True)
    e = multihead.explain_module(m, x, x, x)
    assert [s.kind.id for s in e.walkthrough.trace.steps].count("softmax") == 1
    assert "?" not in e.text()

    class Mine(torch.nn.Module):
        def forward(self, x):
            q = x.view(1, 4, 2, 4).transpose(1, 2)
            return multihead.attention(q, q, q, backend="reference")

    e = multihead.explain_module(Mine(), x)
    assert [s.kind.id for s in e.walkthrough.trace.steps] == ["scores", "scale", "softmax", "weighted_sum"]
    assert all(c.ok for c in e.walkthrough.checks)
    with pytest.raises(TypeError, match="got Linear, which did not call multihead.attention"):
        multihead.explain_module(torch.nn.Linear(8, 8), x)


def test_rope_lines_only_for_rotary_models(tmp_path):
    path = save_tiny("bert", tmp_path / "bert")
    text = render_text(neuron_view(models.load(path).run(SENTENCE), 0, 1, 3))
    assert "RoPE" not in text and "rotate_half" not in text


def test_a_too_long_text_is_refused_with_the_limit_and_why(dirs):
    # past MAX_TOKENS a text is shown as chosen rows (tests/explain/test_explain_long.py), up to the
    # positions the model was trained on: the tiny llama's max_position_embeddings is 64
    long = " ".join(["the cat sat on the mat ."] * 10)    # 70 tokens
    rc, out, err = cli("--model", dirs["llama"], "--text", long)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "explain takes at most 64" in err and "max_position_embeddings is 64" in err
    rc, out, err = cli("--model", dirs["llama"], "--text", " ".join(["the cat sat on the mat ."] * 9))   # 63
    assert rc == 0 and "63 tokens: past 60" in out, err


# ---------------------------------------------------------------------------- cross-attention
@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    path = save_tiny("bart", tmp_path_factory.mktemp("bart") / "bart")
    return path, models.load(path).run(SENTENCE)


def test_an_encoder_decoder_shows_its_three_kinds_of_attention(bart):
    path, run = bart
    assert [r.role for r in run.layers] == ["encoder", "encoder", "decoder", "cross", "decoder", "cross"]
    assert [r.attention.mask for r in run.layers] == ["bidirectional", "bidirectional", "causal", "bidirectional",
                                                      "causal", "bidirectional"]
    eager = transformers.BartModel.from_pretrained(path, attn_implementation="eager").eval()
    ids = torch.tensor([run.ids])
    with torch.no_grad():
        out = eager(input_ids=ids, decoder_input_ids=ids, output_attentions=True)
    want = [*out.encoder_attentions, *[w for pair in zip(out.decoder_attentions, out.cross_attentions) for w in pair]]
    for rec, w in zip(run.layers, want):
        assert (rec.weights - w[0]).abs().max() <= _bound(rec)
        # cross-attention: the keys are the encoder output's projection
        if rec.role == "cross":
            assert rec.memory is not None and rec.memory.shape == out.encoder_last_hidden_state[0].shape
            assert torch.equal(rec.k_proj, rec.k)   # k_proj(encoder output) is the k the layer passed
    text = "\n".join(model_summary(run))
    assert "encoder self-attention" in text and "decoder self-attention" in text and "cross-attention" in text
    rc, out_text, err = cli("--model", path, "--text", SENTENCE)
    assert rc == 0 and "cross-attention" in out_text, err
    view = neuron_view(run, 3, 1, 4)
    assert torch.equal(view.k, run.layers[3].k[1].double())
    assert "encoder" in render_text(view)
    found = checks.chain_checks(layer_trace(run, 3))
    assert found and all(c.ok for c in found)
    page = _page_data(explain_model(path, SENTENCE).html())
    assert "cross-attention" in page["maps"][3]["title"]


def test_a_rotary_model_whose_projections_are_fused_says_the_rotation_is_not_shown(runs):
    text = render_text(neuron_view(runs["modernbert"], 1, 0, 4))
    assert "rotation itself is not shown" in text and "With RoPE, q = q_proj" not in text
    assert runs["modernbert"].layers[1].q_proj is None


# ---------------------------------------------------------------------------- the other architectures of the issue
@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_the_weights_equal_eagers_and_the_summary_states_the_mask(dirs, runs, kind):
    run = runs[kind]
    eager = transformers.AutoModel.from_pretrained(dirs[kind], attn_implementation="eager").eval()
    with torch.no_grad():
        want = eager(input_ids=torch.tensor([run.ids]), output_attentions=True).attentions
    assert len(want) == len(run.layers) == 2
    L = len(run.ids)
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    for rec, w in zip(run.layers, want):
        assert (rec.weights - w[0]).abs().max() <= _bound(rec)
        if PLAIN[kind] == "encoder":
            assert bool(rec.keep.all()) and rec.attention.mask == "bidirectional"
        else:
            assert torch.equal(rec.keep, tril.expand_as(rec.keep)) and rec.attention.mask == "causal"
        assert rec.attention.scale == pytest.approx(8 ** -0.5) and rec.attention.softcap is None
        assert rec.attention.sinks is None and not rec.attention.qk_norm
    summary = model_summary(run)
    assert summary[0].startswith(PLAIN[kind]), summary
    text = "\n".join(summary)
    assert ("rotary position embedding" in text) == (kind in ("gpt_neox", "qwen2", "phi3", "llama_mqa"))
    kv = {"qwen2": "2 key/value heads", "phi3": "2 key/value heads", "llama_mqa": "1 key/value head of dim 8; kv 0 → q 0-3"}
    assert kv.get(kind, "each with its own keys and values") in text


@pytest.mark.parametrize("kind", FUSED)
def test_the_token_walkthrough_of_a_fused_layout_is_refused_in_one_line(dirs, kind):
    rc, out, err = cli("--model", dirs[kind], "--text", SENTENCE, "--layer", "1", "--head", "2", "--token", "3")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "projections were not recorded" in err and "--neuron" in err
    rc, out, err = cli("--model", dirs[kind], "--text", SENTENCE, "--neuron", "--layer", "1", "--head", "2")
    assert rc == 0, err


@pytest.mark.parametrize("kind", ["qwen2", "llama_mqa"])
def test_the_neuron_view_of_a_grouped_query_rotary_model_holds(runs, kind):
    run = runs[kind]
    token = len(run.ids) - 1
    for layer, rec in enumerate(run.layers):
        assert (rec.attention.rope, rec.attention.rotary_dim) == ("full", 8)
        view = neuron_view(run, layer, 3, token)
        assert (view.weights - rec.weights[3, token].double()).abs().max() <= _bound(rec)
        kv = 0 if kind == "llama_mqa" else 1     # query head 3 reads key/value head 3 // (H / Hkv)
        assert torch.equal(view.k, rec.k[kv].double())
        r = view.rotary
        half = r.q_before.shape[0] // 2
        rot = torch.cat([-r.q_before[half:], r.q_before[:half]])
        exact = r.q_before * r.cos[token] + rot * r.sin[token]
        bound = 2 * EPS32 * (r.q_before.abs() * r.cos[token].abs() + rot.abs() * r.sin[token].abs()) + 1e-30
        assert ((view.q - exact).abs() <= bound).all()
    assert "With RoPE, q = q_proj * cos" in render_text(neuron_view(run, 0, 3, token))


def test_a_fused_projection_model_states_its_partial_rotary(dirs, runs):
    # GPT-NeoX: one query_key_value projection, RoPE on the first 4 of D = 8 dims (rotary_pct 0.5)
    neox = runs["gpt_neox"]
    assert [(r.attention.rope, r.attention.rotary_dim) for r in neox.layers] == [("partial", 4)] * 2
    assert "partial rotary: RoPE turns the first 4 of 8 dims; the other 4 pass unchanged" in model_summary(neox)
    # independent: q recomputed from the fused projection of the layer's own input, rotated on 4 dims only
    net = transformers.AutoModel.from_pretrained(dirs["gpt_neox"]).eval()
    seen = {}
    net.layers[1].attention.register_forward_pre_hook(
        lambda m, a, kw: seen.update(x=kw.get("hidden_states", a[0] if a else None)), with_kwargs=True)
    with torch.no_grad():
        net(input_ids=torch.tensor([neox.ids]))
        qkv = net.layers[1].attention.query_key_value(seen["x"][0]).double()
    q_proj = qkv.view(len(neox.ids), 4, 24)[..., :8].transpose(0, 1)            # (H, L, D)
    rec = neox.layers[1]
    cos, sin = rec.cos.double(), rec.sin.double()                               # (L, 4)
    turned = q_proj[..., :4] * cos + torch.cat([-q_proj[..., 2:4], q_proj[..., :2]], -1) * sin
    want = torch.cat([turned, q_proj[..., 4:]], -1)
    assert (want - rec.q.double()).abs().max() <= 64 * EPS32 * (q_proj.abs().max() + 1)
    # Phi-3: fused qkv_proj, RoPE on every dim (partial_rotary_factor 1)
    assert [(r.attention.rope, r.attention.rotary_dim) for r in runs["phi3"].layers] == [("full", 8)] * 2
    assert not any("partial rotary" in line for line in model_summary(runs["phi3"]))
    # no RoPE: no rotary statement
    assert all(r.attention.rope is None and r.cos is None for k in ("gpt2", "distilbert", "roberta")
               for r in runs[k].layers)
