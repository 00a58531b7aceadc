"""The examples in examples/ run as tests (kept to seconds: few training steps)."""

from __future__ import annotations

import importlib.util
import io
import pathlib
from contextlib import redirect_stdout

import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_gpt_learns_and_its_cached_generation_equals_full_forward_passes():
    gpt = load("tiny_gpt")
    torch.manual_seed(0)
    chars = sorted(set(gpt.TEXT))
    data = torch.tensor([chars.index(c) for c in gpt.TEXT])
    model = gpt.TinyGPT(len(chars))
    losses = gpt.train(model, data, 25, block=16, batch=8)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.4, losses   # it learns (from ln(vocab) ~ 2.9)

    prompt = data[:5][None]
    ids, step_logits = gpt.generate(model, prompt, 6)
    assert ids.shape == (1, 11)
    with torch.no_grad():
        full = model(ids[:, :-1])   # no cache: every position recomputed
    for t, logits in enumerate(step_logits):
        torch.testing.assert_close(logits, full[:, 4 + t])   # float32's default tolerance: reordered sums only
    assert ids[0, 5:].tolist() == full[0, 4:].argmax(-1).tolist()   # greedy, as the full passes choose


def test_tiny_gpt_runs_as_a_script():
    out = io.StringIO()
    with redirect_stdout(out):
        assert load("tiny_gpt").main(["--steps", "3", "--prompt", "the "]) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("loss: ") and lines[1].startswith("'the ")
