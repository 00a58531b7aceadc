"""Attention as a soft dictionary lookup (the analogy of tutorial 002), then the real thing.

A Python dict answers a query with exactly one value. Asking for "fruit" in
{apple: 10, banana: 5, chair: 2} should mix apple and banana and ignore chair: with weights
0.6 / 0.4 / 0 the answer is 0.6·10 + 0.4·5 + 0·2 = 8.

Attention computes such weights itself: every key is a vector, the query is a vector, their
dot products say how well they match, softmax turns the matches into weights that sum to 1,
and the answer is the weighted sum of the values. The same numbers then come out of
``multihead.attention``.

Run:  python examples/soft_lookup.py
"""

from __future__ import annotations

import math

import torch

import multihead

VALUES = {"apple": 10.0, "banana": 5.0, "chair": 2.0}
FRUIT_WEIGHTS = {"apple": 0.6, "banana": 0.4, "chair": 0.0}

# Two made-up features per word: (how much it is a fruit, how much it is furniture).
KEYS = {"apple": (2.0, 0.2), "banana": (1.6, 0.4), "chair": (-1.0, 2.0)}
FRUIT_QUERY = (1.0, -0.5)


def weighted_lookup(weights: dict, values: dict) -> float:
    """The soft lookup: the sum of every value times its weight."""
    return sum(weights[name] * values[name] for name in values)


def soft_lookup(query, keys: dict, values: dict) -> tuple[dict, dict, float]:
    """Scaled dot products, softmax, weighted sum, written out: ``(scores, weights, value)``."""
    d = len(query)
    scores = {name: sum(q * k for q, k in zip(query, key)) / math.sqrt(d) for name, key in keys.items()}
    top = max(scores.values())
    exps = {name: math.exp(s - top) for name, s in scores.items()}
    total = sum(exps.values())
    weights = {name: e / total for name, e in exps.items()}
    return scores, weights, weighted_lookup(weights, values)


def with_multihead(query, keys: dict, values: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The same lookup through ``multihead``: one batch, one head, one query, three keys.

    Returns (weights (3,), value ()) from ``multihead.attention_weights`` and ``multihead.attention``.
    """
    q = torch.tensor(query, dtype=torch.float64).view(1, 1, 1, -1)  # (B, H, Lq, D)
    k = torch.tensor(list(keys.values()), dtype=torch.float64).view(1, 1, len(keys), -1)  # (B, H, Lk, D)
    v = torch.tensor(list(values.values()), dtype=torch.float64).view(1, 1, len(values), 1)  # (B, H, Lk, 1)
    weights = multihead.attention_weights(q, k)
    out = multihead.attention(q, k, v, backend="reference")
    return weights.view(-1), out.view(())


def main() -> None:
    print("1. A dictionary lookup with soft weights")
    print("   values: " + ", ".join(f"{n} = {v:g}" for n, v in VALUES.items()))
    print("   query 'fruit' weights: " + ", ".join(f"{n} = {w:g}" for n, w in FRUIT_WEIGHTS.items()))
    terms = " + ".join(f"{FRUIT_WEIGHTS[n]:g}·{VALUES[n]:g}" for n in VALUES)
    print(f"   value = {terms} = {weighted_lookup(FRUIT_WEIGHTS, VALUES):g}")
    print()
    print("2. The weights computed by attention: dot product, scale 1/√d, softmax")
    print("   keys:  " + ", ".join(f"{n} = {k}" for n, k in KEYS.items()) + f"; query 'fruit' = {FRUIT_QUERY}")
    scores, weights, value = soft_lookup(FRUIT_QUERY, KEYS, VALUES)
    print("   scores q·k/√2: " + ", ".join(f"{n} = {s:.4f}" for n, s in scores.items()))
    print("   softmax weights: " + ", ".join(f"{n} = {w:.4f}" for n, w in weights.items())
          + f" (sum {sum(weights.values()):.4f})")
    print(f"   value = {value:.4f}")
    print()
    print("3. The same through multihead.attention (B=1, H=1, Lq=1, Lk=3)")
    w, out = with_multihead(FRUIT_QUERY, KEYS, VALUES)
    print("   weights: " + ", ".join(f"{n} = {float(x):.4f}" for n, x in zip(KEYS, w)))
    print(f"   value = {float(out):.4f}")


if __name__ == "__main__":
    main()
