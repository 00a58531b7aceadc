"""Short reprs for what a notebook or a terminal echoes (a 30-layer model's page is about a
megabyte), and explain_model on a (model, tokenizer) pair the user has loaded."""

from __future__ import annotations

import pytest
import torch

import multihead

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from multihead.explain.real_model import explain_model  # noqa: E402
from tiny_hf import SENTENCE, save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")


def test_a_loaded_pair_explains_as_its_directory_does_and_keeps_its_attention(llama_dir):
    net = transformers.AutoModel.from_pretrained(llama_dir, local_files_only=True, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    page = explain_model((net, tokenizer), SENTENCE, neuron=True, layer=1, head=2)
    by_path = explain_model(llama_dir, SENTENCE, neuron=True, layer=1, head=2)
    assert page.run.tokens == by_path.run.tokens
    torch.testing.assert_close(page.run.weights, by_path.run.weights, rtol=0, atol=0)   # the same computation
    assert net.config._attn_implementation == "sdpa"   # switched for the run only


@pytest.mark.parametrize("bad, message", [
    (("not a model", None), r"model must be a transformers model .* got str"),
    (3, r"model must be a name \(minilm, smollm2\), a directory, or a \(model, tokenizer\) pair, got int"),
])
def test_explain_model_names_what_it_takes(bad, message):
    with pytest.raises(TypeError, match=message):
        explain_model(bad, SENTENCE)


def test_pages_runs_records_and_traces_repr_in_one_line(llama_dir):
    page = explain_model(llama_dir, SENTENCE)
    for obj, start in ((page, "<multihead.ModelPage: llama, 2 layers x 4 heads, 7 tokens, a "),
                       (page.run, "<RealRun: llama, 7 tokens, 2 layers x 4 heads"),
                       (page.run.layers[0], "<LayerRecord: q (4, 7, 16), k (2, 7, 16), v (2, 7, 16), weights (4, 7, 7)")):
        text = repr(obj)
        assert text.startswith(start) and "\n" not in text and len(text) < 160, text
    mha = multihead.MultiHeadAttention(8, 2)
    with multihead.trace() as tr:
        mha(torch.randn(1, 3, 8))
    assert repr(tr).startswith(f"<multihead.Trace: {len(tr.steps)} steps in 1 call, checks ")


def test_outputs_attentions_and_tokens_make_a_page_as_bertviz_takes_them(llama_dir):
    """Weights any implementation computed (torch's eager here), labelled as explain_model labels
    the same weights recorded on multihead."""
    from multihead.explain.real_model import explain_attentions

    net = transformers.AutoModel.from_pretrained(llama_dir, local_files_only=True, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    ids = tokenizer(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        outputs = net(**ids, output_attentions=True)
    tokens = tokenizer.convert_ids_to_tokens(ids["input_ids"][0])
    page = explain_attentions(outputs.attentions, tokens, title="tiny llama")
    recorded = explain_model(llama_dir, SENTENCE).run.weights
    torch.testing.assert_close(page.weights, recorded, rtol=0, atol=1e-6)   # eager's float32 softmax vs multihead's
    assert "tiny llama" in page.html() and repr(page).startswith("<multihead.AttentionsPage: 2 layers x 4 heads, 7 tokens")
    with pytest.raises(ValueError, match=r"attentions are \(7, 7\) per head but tokens has 3"):
        explain_attentions(outputs.attentions, tokens[:3])
    with pytest.raises(TypeError, match=r"attentions must be outputs.attentions"):
        explain_attentions("weights", tokens)
