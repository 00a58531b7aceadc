"""``multihead explain``: the walkthrough (text/json/markdown), the visual formats, real models."""
