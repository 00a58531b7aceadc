"""Long texts for ``explain --model`` (issue 24 item 4): past ``MAX_TOKENS`` the chosen query rows'
weights are recomputed from the chunked backend's log-sum-exp, O(L) memory per head and row.

What is compared:

* the rows of :meth:`RealModel.run_rows` against the same rows of the whole-map run
  (:meth:`RealModel.run`, the reference backend's softmax) on tiny random models of every mask
  kind (causal, bidirectional, sliding window, softcap, sinks), within the bound of
  tests/explain/test_explain_architectures.py: 16 eps32 (D max|q| max|k| |scale| + L + 1); the masks exactly;
* O(L): a dispatch mode sees every tensor torch makes during the run; at L = 2000 none could
  hold an (L, L) map (L² elements, or two axes of at least L/2), while the same detector does
  see the (H, L, L) maps of the whole-map run (so it can fail);
* the CLI and ``explain_model`` on a 300-token text: text, html (parsed), refusals (one line, exit 2).

Legend: L tokens, R chosen rows, H query heads.
"""

import io
import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from multihead.cli import main  # noqa: E402
from multihead.explain import models  # noqa: E402
from multihead.explain.real_model import explain_model  # noqa: E402
from tiny_hf import SENTENCE, WORDS, _tokenizer, save_tiny  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
KINDS = ("llama", "bert", "mistral", "gemma2", "gpt_oss")


def _text(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """A tiny random Llama (2 layers, 4 query heads on 2 kv heads of 16) trained on 8192 positions."""
    import transformers as tf

    path = tmp_path_factory.mktemp("long") / "llama"
    torch.manual_seed(0)
    net = tf.LlamaModel(tf.LlamaConfig(vocab_size=len(WORDS) + 4, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                       max_position_embeddings=8192, rope_theta=500.0, initializer_range=0.2))
    net.eval().save_pretrained(path)
    _tokenizer(False).save_pretrained(path)
    return str(path)


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(["explain", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _bound(rec) -> float:
    D, L = rec.q.shape[-1], rec.q.shape[1]
    size = D * rec.q.abs().max().item() * rec.k.abs().max().item() * abs(rec.scale)
    return 16 * EPS32 * (size + L + 1)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_from_the_lse_equal_the_whole_maps_rows(tmp_path, kind):
    model = models.load(save_tiny(kind, tmp_path / kind))
    full = model.run(SENTENCE)
    L = len(full.tokens)
    rows = [0, 2, L - 1]
    long = model.run_rows(SENTENCE, rows)
    assert long.rows == rows and long.tokens == full.tokens
    for layer, (got, rec) in enumerate(zip(long.layers, full.layers)):
        assert got.weights.shape == (model.info.heads, 3, L)
        err = (got.weights - rec.weights.float()[:, rows]).abs().max().item()
        assert err <= _bound(rec), f"{kind} layer {layer}: {err:.3e} > {_bound(rec):.3e}"
        assert torch.equal(got.keep, rec.keep[:, rows]), f"{kind} layer {layer}: the rows' mask"
        assert got.scale == rec.scale


class _BigTensors(TorchDispatchMode):
    """Records (op, shape) of every tensor an op returns that could hold an (L, L) map: at least
    L² elements, or two axes of at least L/2 (tiles of rows x a key block are neither)."""

    def __init__(self, L: int):
        super().__init__()
        self.L, self.big = L, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and (t.numel() >= self.L ** 2
                                                or sum(n >= self.L / 2 for n in t.shape) >= 2):
                self.big.append((str(func), tuple(t.shape)))
        return out


def test_a_long_run_builds_no_L_by_L_map(long_dir):
    model = models.load(long_dir)
    L = 2000
    text = _text(L)
    with _BigTensors(L) as seen:
        long = model.run_rows(text, [0, 1000, L - 1])
    assert seen.big == [], f"tensors of (L, L) size were built: {seen.big[:5]}"
    w = long.weights                                   # (layers, H, R, L)
    assert w.shape == (2, 4, 3, L)
    causal = torch.arange(L)[None, :] <= torch.tensor([0, 1000, L - 1])[:, None]
    assert torch.equal(long.keep, causal.expand_as(long.keep))
    assert (w[~long.keep] == 0).all()
    assert (w.sum(-1) - 1).abs().max().item() <= (L + 2) * EPS32   # each row is a distribution
    # the detector sees the whole-map run's (H, L, L) maps: it can fail
    short = 40
    with _BigTensors(short) as control:
        model.run(_text(short))
    assert any(shape[-2:] == (short, short) and len(shape) >= 3 and shape[-3] == 4 for _, shape in control.big)


def test_short_texts_keep_the_whole_maps(long_dir):
    model = models.load(long_dir)
    real = model.run(_text(models.MAX_TOKENS))
    assert real.weights.shape == (2, 4, models.MAX_TOKENS, models.MAX_TOKENS)
    with pytest.raises(ValueError, match=rf"fit {models.MAX_TOKENS} \(every layer's \(L, L\) weights of every head\): use run_rows"):
        model.run(_text(models.MAX_TOKENS + 1))


def test_the_cli_shows_the_rows_and_every_heads_summary(long_dir):
    rc, out, err = cli("--model", long_dir, "--text", _text(300))
    assert rc == 0, err
    assert "300 tokens: past 60 explain shows the query rows 296:" in out
    assert "  L0 " in out and "  L1 " in out and "layer 0 head 0" in out
    rc, out, err = cli("--model", long_dir, "--text", _text(300), "--layer", "1", "--head", "2", "--token", "5")
    assert rc == 0, err
    rows = [line for line in out.splitlines() if re.match(r"\s+5\s+a\s", line)]
    assert len(rows) == 1 and "layer 1 head 2" in out
    # the listed top keys are the row's largest weights
    long = models.load(long_dir).run_rows(_text(300), [5])
    best = long.weights[1, 2, 0].topk(5)
    listed = [int(x.split(":")[0]) for x in rows[0].split("  ")[-1].split(", ")]
    assert listed == best.indices.tolist()


def test_the_long_page_holds_the_rows_of_one_layer_and_the_summary(long_dir, tmp_path):
    out_file = tmp_path / "long.html"
    rc, out, err = cli("--model", long_dir, "--text", _text(300), "--format", "html", "--out", str(out_file),
                       "--layer", "1")
    assert rc == 0, err
    page = out_file.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="mh-data">(.*?)</script>', page, re.S).group(1))
    assert len(data["maps"]) == 1
    weights = torch.tensor(data["maps"][0]["weights"])
    long = models.load(long_dir).run_rows(_text(300))
    assert weights.shape == (4, models.LONG_ROWS, 300)
    assert (weights - long.weights[1]).abs().max().item() <= 1e-3   # the page's digits
    assert 'id="long-summary"' in page and page.count("<tr><th>L") == 2 * 2   # 2 layers, en and zh


def test_explain_model_takes_a_long_text_and_its_rows(long_dir):
    page = explain_model(long_dir, _text(200), rows=[10, 199], layer=0)
    assert isinstance(page.run, models.LongRun) and page.run.rows == [10, 199]
    assert page._repr_html_().count("<iframe") == 1
    assert "200 tokens" in repr(page)
    with pytest.raises(ValueError, match="neuron=True draws up to 60 tokens"):
        explain_model(long_dir, _text(200), neuron=True)
    with pytest.raises(ValueError, match="drop rows"):
        explain_model(long_dir, SENTENCE, rows=[1])


@pytest.mark.parametrize("extra, says", [(["--neuron"], "--neuron draws up to 60 tokens"),
                                         (["--format", "png", "--out", "x.png"], "use --format html or text"),
                                         (["--token", "300"], "--token 300 is out of range")])
def test_long_refusals_are_one_line(long_dir, tmp_path, monkeypatch, extra, says):
    pytest.importorskip("matplotlib") if "png" in extra else None
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("--model", long_dir, "--text", _text(300), *extra)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_past_the_long_limit_the_refusal_says_it_and_why(long_dir):
    rc, out, err = cli("--model", long_dir, "--text", _text(models.LONG_MAX_TOKENS + 1))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"at most {models.LONG_MAX_TOKENS}" in err and "log-sum-exp" in err and "forward pass" in err


def test_smollm2_on_two_thousand_tokens(smollm2_model):
    """The 135M-parameter decoder (30 layers, 9 query heads on 3 kv heads, RoPE) on a long text:
    each chosen row's weights are a distribution over the keys up to its own position."""
    words = "the cat sat on the mat while a dog ran past the old house by the river".split()
    text = " ".join(words[i % len(words)] for i in range(2000))
    long = smollm2_model.run_rows(text, [0, 1000, 1999])
    L = len(long.tokens)
    assert L >= 2000
    w = long.weights
    assert w.shape == (30, 9, 3, L)
    causal = torch.arange(L)[None, :] <= torch.tensor([0, 1000, 1999])[:, None]
    assert torch.equal(long.keep, causal.expand_as(long.keep))
    assert (w[~long.keep] == 0).all()
    assert (w.sum(-1) - 1).abs().max().item() <= (L + 2) * EPS32
    s = long.summary()
    assert s["top"].shape == (30, 9) and (s["entropy"] >= 0).all()
