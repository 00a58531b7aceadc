"""In a real notebook: a Jupyter kernel (ipykernel) runs the cells a learner writes, through nbclient,
and the outputs it saves are what Jupyter would show.

``multihead.explain_module(mha, x)`` and a ``multihead.Trace`` display as text/html: one sandboxed
``<iframe>`` whose ``srcdoc`` is the whole walkthrough page, escaped, so the page's CSS, script and
language switch stay out of the notebook. The page inside carries the numbers of the learner's
own module: the test rebuilds the same module in this process (same seed) and compares.

Skips only when nbclient or ipykernel is not installed (both are in the test extra).
"""

from __future__ import annotations

import base64
import html
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import multihead

nbformat = pytest.importorskip("nbformat", reason="nbformat is in the test extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="nbclient is in the test extra: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="ipykernel is in the test extra: pip install -e '.[test]'")

SRC = Path(__file__).resolve().parents[2] / "src"

SETUP = """\
import torch, multihead
torch.manual_seed(0)
mha = multihead.MultiHeadAttention(8, 2, causal=True)            # backend "auto": sdpa, one fused step
x = torch.randn(1, 3, 8)
"""
CELLS = [
    SETUP,
    "e = multihead.explain_module(mha, x)\ne",
    "ref = multihead.MultiHeadAttention(8, 2, causal=True, backend='reference')\n"
    "ref.load_state_dict(mha.state_dict())\n"
    "with torch.no_grad(), multihead.trace() as tr:\n"
    "    ref(x)\n"
    "tr",
    "print(e.text(lang='zh'))",
]


def _module_and_input():
    """What SETUP builds, in this process."""
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(8, 2, causal=True)
    return mha, torch.randn(1, 3, 8)


#: a real model's page with its neuron view (layer 1, head 3, query token 4), on the tiny random
#: Llama of tests/tiny_hf.py saved at {path!r}: 4 query heads sharing 2 kv heads, RoPE
MODEL_CELL = """\
from multihead.explain.real_model import explain_model
page = explain_model({path!r}, {text!r}, layer=1, head=3, neuron=True, token=4)
page"""


def _has_hf() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "tokenizers"))


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook of CELLS (and MODEL_CELL when transformers is installed), run by a fresh
    ipykernel on this checkout's src."""
    tmp = tmp_path_factory.mktemp("notebook")
    cells = list(CELLS)
    if _has_hf():
        import tiny_hf

        path = tiny_hf.save_tiny("llama", tmp / "tiny-llama")
        cells.append(MODEL_CELL.format(path=path, text=tiny_hf.SENTENCE))
    spec = tmp / "jupyter" / "kernels" / "mh-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "multihead test", "language": "python",
        "env": {"PYTHONPATH": str(SRC), "IPYTHONDIR": str(tmp / "ipython")},
    }), encoding="utf-8")
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(tmp / "jupyter"))
    mp.setenv("JUPYTER_RUNTIME_DIR", str(tmp / "runtime"))
    mp.setenv("JUPYTER_DATA_DIR", str(tmp / "data"))
    try:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        client = nbclient.NotebookClient(nb, kernel_name="mh-test", timeout=120, resources={"metadata": {"path": str(tmp)}})
        client.execute()
    finally:
        mp.undo()
    path = tmp / "walkthrough.ipynb"
    nbformat.write(nb, path)
    return nbformat.read(path, as_version=4)  # what a notebook file holds, read back


def _html_output(cell) -> str:
    outputs = [o for o in cell.outputs if o.output_type in ("execute_result", "display_data")]
    assert len(outputs) == 1, cell.outputs
    assert "text/plain" in outputs[0].data  # a terminal or a plain viewer still gets text
    return outputs[0].data["text/html"]


def _page_in(frame: str) -> str:
    """The document inside the one iframe of ``frame``, checking that nothing else is outside it."""
    m = re.fullmatch(r'<iframe class="multihead-walkthrough" title="[^"<>]*" sandbox="allow-scripts" style="[^"<>]*" srcdoc="([^"<>]*)"></iframe>', frame)
    assert m, frame[:300]
    return html.unescape(m[1])


def _data(page: str) -> dict:
    blocks = re.findall(r'<script type="application/json" id="mh-data">(.*?)</script>', page, re.S)
    assert len(blocks) == 1
    return json.loads(blocks[0])


def test_cells_ran_without_errors(executed):
    errors = [o for c in executed.cells for o in c.outputs if o.output_type == "error"]
    assert errors == []


def test_explain_shows_the_walkthrough_of_the_learners_module_in_an_isolated_frame(executed):
    page = _page_in(_html_output(executed.cells[1]))
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page and 'id="lang-toggle"' in page
    data = _data(page)
    mha, x = _module_and_input()
    with torch.no_grad():
        _, weights = mha(x, return_weights=True)
    shown = torch.tensor(data["maps"][0]["weights"], dtype=torch.float32)
    assert torch.equal(shown, weights[0])     # the page's numbers are the float32 weights, exactly
    # the sdpa call was fused: the page says it re-ran the inputs on the reference backend
    assert data["config"]["backend"] == "reference"
    assert 'id="reopened"' in page and "sdpa" in page
    labels = [s["name"] for s in data["steps"]]
    assert "softmax" in labels and "scores QKᵀ" in labels


def test_a_trace_displays_as_its_page(executed):
    page = _page_in(_html_output(executed.cells[2]))
    data = _data(page)
    mha, x = _module_and_input()
    ref = multihead.MultiHeadAttention(8, 2, causal=True, backend="reference")
    ref.load_state_dict(mha.state_dict())
    with torch.no_grad(), multihead.trace() as tr:
        ref(x)
    assert [s["name"] for s in data["steps"]] == [s.label for s in tr.steps]
    assert torch.equal(torch.tensor(data["maps"][0]["scores"], dtype=torch.float32), tr.step("scale").tensor[0])


def test_text_in_chinese_from_the_kernel(executed):
    out = "".join(o.text for o in executed.cells[3].outputs if o.output_type == "stream")
    assert "sdpa 后端把这次调用作为一个融合步骤运行" in out and "reference" in out
    mha, x = _module_and_input()
    with torch.no_grad():
        _, weights = mha(x, return_weights=True)
    assert f"{weights[0, 0, 1, 0].item():.4f}" in out   # the softmax rows of the learner's module


def test_a_trace_too_long_for_heat_maps_still_shows_its_steps():
    from multihead.explain.notebook import trace_html

    mha = multihead.MultiHeadAttention(8, 2, backend="reference")
    with torch.no_grad(), multihead.trace() as tr:
        mha(torch.randn(1, 65, 8))
    page = _page_in(trace_html(tr))
    assert 'id="steps"' in page and 'id="attention"' not in page and _data(page)["maps"] == []
    with torch.no_grad(), multihead.trace() as tr:
        mha(torch.randn(1, 64, 8))
    assert len(_data(_page_in(trace_html(tr)))["maps"]) == 1


def test_a_real_models_page_and_neuron_view_display_inline(executed):
    """``explain_model(DIR, text, neuron=True)`` in a cell: the page in its isolated frame, with
    the model's weights on every layer (exact on the layer it opens at, else one byte each), the worked score's operands (q after RoPE, keys per kv
    head) of the layer it opens at (only: the cell stays light) and the neuron view's numbers, the same as this process computes from the saved model."""
    if len(executed.cells) == len(CELLS):
        pytest.skip("transformers and tokenizers are in the hf extra: pip install -e '.[hf]'")
    import tiny_hf

    from multihead.explain import models
    from multihead.explain.neuron import neuron_view

    source = executed.cells[len(CELLS)].source
    path = re.search(r"explain_model\('([^']+)'", source)[1]
    real = models.load(path).run(tiny_hf.SENTENCE)
    page = _page_in(_html_output(executed.cells[len(CELLS)]))
    data = _data(page)
    assert data["group"] == "layer" and (data["start"], data["head"]) == (1, 3)
    assert len(data["maps"]) == 2
    for layer, (m, rec) in enumerate(zip(data["maps"], real.layers)):
        if layer != data["start"]:   # the cell embeds the operands and exact weights of the layer it opens at only
            assert m["q"] is None and m["k"] is None and m["scores"] is None and m["weights"] is None
            w8 = torch.tensor(list(base64.b64decode(m["w8"])), dtype=torch.float64).view(m["shape"]) / 255
            assert (w8 - rec.weights.double()).abs().max().item() <= 1 / 510 + 1e-7   # one byte per weight
            continue
        assert torch.equal(torch.tensor(m["weights"], dtype=torch.float32), rec.weights.float())
        assert torch.equal(torch.tensor(m["q"], dtype=torch.float32), rec.q.float())    # after RoPE
        assert torch.equal(torch.tensor(m["k"], dtype=torch.float32), rec.k.float())    # (Hkv = 2, L, D)
        assert m["scale"] == rec.scale
    view = neuron_view(real, 1, 3, 4)
    section = re.search(r'<section id="neuron">(.*?)</section>', page, re.S)
    assert section is not None
    nums = re.findall(r'<td class="num(?: w)?">([^<]*?)\s*(?:<|$)', section[1])
    visible = view.keep.nonzero().flatten().tolist()
    expected = [x for j in visible for x in (f"{view.dots[j].item():+.3f}", f"{view.scaled[j].item():+.3f}",
                                             f"{view.weights[j].item():.3f}")]
    assert nums == expected * 2    # the English and the Chinese copy, one shown by the language switch
    assert 'data-l="zh"' in section[1] and "第 3 个头读取第 1 个键/值头" in section[1]


def test_a_smollm2_page_at_the_limit_is_a_light_notebook_cell(smollm2_model):
    """Issue 24 item 5: SmolLM2 (30 layers x 9 heads) on a text of MAX_TOKENS tokens, as a notebook
    cell: the opening layer exact, the others' weights one byte each and masks as bits."""
    from multihead.explain import models
    from multihead.explain.real_model import explain_model

    words = "the cat sat on the mat while a dog ran past".split()
    text = ""
    for n in range(1, 200):
        longer = " ".join(words[i % len(words)] for i in range(n))
        if len(smollm2_model.tokenizer(longer)["input_ids"]) > models.MAX_TOKENS:
            break
        text = longer
    page = explain_model("smollm2", text)
    L = len(page.run.tokens)
    assert L >= models.MAX_TOKENS - 2
    cell = page._repr_html_()
    size = len(cell.encode())
    whole = len(page.html().encode())
    print(f"SmolLM2 at {L} tokens: notebook cell {size / 2**20:.2f} MiB (whole page {whole / 2**20:.2f} MiB)")
    assert size <= 4 * 2**20
