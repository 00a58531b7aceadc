"""Bridges to other libraries; each submodule imports its library only when used.

* :mod:`multihead.integrations.torch_mha` -- state-dict keys of ``nn.MultiheadAttention`` <-> ``MultiHeadAttention``.
* :mod:`multihead.integrations.transformers` -- run Hugging Face models on ``multihead.attention``.
"""
