"""Run Hugging Face ``transformers`` models on ``multihead.attention``.

::

    from multihead.integrations.transformers import load
    model, tokenizer = load("path/to/model")              # a directory saved with save_pretrained
    model, tokenizer = load(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")   # a GGUF file

:func:`load` returns the model (a ``...ForCausalLM`` when the checkpoint is a causal LM, so
``model.generate`` works; else the ``AutoModel``) in eval mode with every attention layer
computed by :func:`multihead.attention`, and its tokenizer. Nothing is downloaded. A GGUF file is
read and de-quantised by transformers' own GGUF reader (the ``gguf`` package, in the ``hf``
extra); ``from_pretrained(gguf_file=...)`` would read it the same way but also asks for
``accelerate``, which this path does not need. Loading reports progress on stderr in a terminal
(`multihead._progress`).

Importing this module registers the attention under the name ``"multihead"`` (when transformers
is installed), so the transformers way works too::

    import multihead.integrations.transformers            # registers "multihead"
    model = AutoModel.from_pretrained(path, attn_implementation="multihead")

(Without that import transformers refuses ``attn_implementation="multihead"`` with its own list
of implementations.) ``register()`` does it again, e.g. under another name or with a backend.

``register()`` adds two entries named ``"multihead"``:

* to ``transformers.AttentionInterface``: :func:`attention_forward`, called by every attention
  layer with q (B, H, Lq, D), k and v (B, Hkv, Lk, D), the mask, the scaling and the dropout,
  like ``eager_attention_forward``; it returns ``(out (B, Lq, H, D), weights (B, H, Lq, Lk) or None)``.
* to ``transformers.masking_utils.AttentionMaskInterface``: transformers' ``sdpa_mask``, so the
  model builds boolean masks with True = may attend (multihead's convention, no conversion) and
  passes ``None`` plus ``module.is_causal`` when a causal mask without padding can be skipped.
  Without a mask entry transformers would build no mask at all and padding would be attended.

What :func:`to_mask` accepts (what transformers passes, or a user's own 4-D mask):

==========================  =====================================================================
mask                        becomes
==========================  =====================================================================
None, causal module, Lq>1   ``masks.causal(align="top_left")`` (the rule of SDPA's ``is_causal``,
                            which transformers relies on when it skips the mask)
None otherwise              no mask
bool (B|1, 1|H, Lq, Lk)     ``masks.keep(mask)`` (True = may attend, as in transformers' sdpa)
float, additive             entries ≤ finfo(dtype).min / 2 (eager's ``finfo.min``, or -inf) block
                            the key (``masks.keep``); any other non-zero entries are a
                            ``masks.bias`` added to the scores
flex ``BlockMask``          ``backends.flex.from_block_mask(mask, B, H)``: its mask_mod, with
                            its tiles as the plan (what transformers' flex path passes)
==========================  =====================================================================

Rows with no visible key. Eager attention fills blocked scores with ``finfo(dtype).min``; a row
where every key is blocked then becomes uniform (each score plus ``finfo.min`` rounds to the same
number) and the output is the mean of all values. multihead defines such a row as output 0 and
weights 0. On a row with at least one visible key the two agree exactly: ``exp(finfo.min)`` is
0, so the blocked keys get weight 0 in eager too. Encoders (BERT) never produce such rows (the
padding mask blocks keys, not queries: a padding query still sees the real tokens), so their
hidden states match eager on every position, padding included; a decoder with left padding
and a causal mask has them on its padding positions only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Any, Iterable, Optional

import torch

from ..backends import BackendName
from ..backends import flex as _flex
from .. import masks as _masks
from ..masks.convert import from_hf as _from_hf
from ..trace import current as _current_trace
from .._progress import Progress, progress
from ..functional import attention, attention_core, prepare_inputs

__all__ = ["NAME", "register", "attention_forward", "call_mask", "to_mask", "load", "from_gguf"]

NAME = "multihead"

_INSTALL = 'transformers is not installed; install it with: pip install "multihead[hf]"'


def register(name: str = NAME, *, backend: BackendName = "auto") -> str:
    """Register :func:`attention_forward` with transformers under ``name``; returns ``name``.

    ``backend`` picks the multihead backend for calls without ``output_attentions``
    (calls that return weights always run the ``reference`` backend). Registering again
    replaces the earlier entry.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError(_INSTALL) from e
    from ..backends import names

    if backend not in names():
        raise ValueError(f"backend must be one of {names()}, got {backend!r}")
    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def to_mask(
    attention_mask: Optional[torch.Tensor], lq: int, lk: int, *, is_causal: bool, softcap: Optional[float] = None,
    batch: Optional[int] = None, heads: Optional[int] = None,
) -> Optional[_masks.Mask]:
    """A multihead mask from what transformers passes to an attention function (table above).

    ``attention_mask`` is None, bool or float, of shape (B or 1, 1 or H, Lq, Lk') with Lk' >= Lk
    (a static cache's mask may be longer than the keys; it is cut to the first Lk columns).
    ``softcap`` (Gemma 2's ``attn_logit_softcapping``) squashes the scores before the mask is
    added, as eager does: a float mask's bias is added after the cap (a score mod after
    `masks.softcap`), its blocked entries select. A flex-attention ``BlockMask`` (what
    transformers' flex path passes) becomes `multihead.backends.flex.from_block_mask` of it,
    its tiles kept as the mask's plan; ``batch``/``heads``: the call's B and H, for a block mask
    made to broadcast over them.
    """
    if _is_block_mask(attention_mask):
        from_bm: _masks.Mask = _flex.from_block_mask(attention_mask, B=batch, H=heads)  # type: ignore[arg-type]
        return from_bm if softcap is None else _masks.softcap(softcap) & from_bm
    return _from_hf(attention_mask, lq, lk, is_causal=is_causal, softcap=softcap)


def _is_block_mask(x: object) -> bool:
    """Whether ``x`` is torch's flex-attention BlockMask (imported only when flex is available)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # a torch without flex attention has no BlockMask to pass
        return False
    return isinstance(x, BlockMask)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    is_causal: Optional[bool] = None,
    *,
    backend: BackendName = "auto",
    **kwargs,
):
    """transformers' attention-function signature, computed by :func:`multihead.attention`.

    Args:
        module: the calling attention layer (read: ``training``, ``is_causal``,
            ``num_key_value_groups``).
        query: (B, H, Lq, D).
        key: (B, Hkv, Lk, D); Hkv divides H (GQA: passed to multihead as they are).
        value: (B, Hkv, Lk, D), like ``key``.
        attention_mask: see :func:`to_mask`.
        scaling: multiplies q·kᵀ (default 1/√D).
        dropout: attention dropout, applied only when ``module.training``.
        is_causal: overrides ``module.is_causal`` when the mask is None (a module without
            that attribute counts as causal, as in transformers' sdpa integration).
        kwargs: ``output_attentions=True`` returns the weights (reference backend);
            ``softcap`` (Gemma 2) becomes `multihead.masks.softcap`, ``s_aux`` (gpt-oss's
            learned sinks, (H,)) `multihead.masks.sink`; ``sliding_window`` is already in the
            mask transformers builds; other entries (position ids, cache details) are not
            needed here. Score mods and sinks run on the backends that apply them
            (``auto`` picks one).

    Returns:
        ``(out, weights)``: out (B, Lq, H, D), weights (B, H, Lq, Lk) or None.
    """
    H, Hkv = query.shape[1], key.shape[1]
    groups = getattr(module, "num_key_value_groups", None)
    if groups is not None and Hkv * groups != H:
        raise ValueError(
            f"{type(module).__name__}.num_key_value_groups={groups} but q has H={H} heads and k has Hkv={Hkv}"
        )
    mask = call_mask(module, query, key, attention_mask, is_causal, **kwargs)
    dropout_p = float(dropout) if module.training else 0.0
    config = getattr(module, "config", None)
    want_weights = kwargs.get("output_attentions")
    if want_weights is None:
        want_weights = getattr(config, "output_attentions", False)
    tr = _current_trace()
    if tr is not None:  # the steps recorded below are this layer's: its path under the traced model
        tr.enter(module)
    if want_weights:
        out, weights = attention_core(*prepare_inputs(query, key, value, mask, scaling, dropout_p), returns="weights")
    else:
        out = attention(query, key, value, mask, scale=scaling, dropout_p=dropout_p, backend=backend)
        weights = None
    if tr is not None:
        tr.leave()
    return out.transpose(1, 2).contiguous(), weights


def call_mask(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
              is_causal: Optional[bool] = None, **kwargs) -> Optional[_masks.Mask]:
    """The multihead mask :func:`attention_forward` runs a call with: :func:`to_mask` of
    ``attention_mask`` (``is_causal`` None: ``module.is_causal``, default True), with the call's
    ``softcap`` and its sinks (``s_aux``) as mask parts. query (B, H, Lq, D), key (B, Hkv, Lk, D)."""
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask = to_mask(attention_mask, query.shape[2], key.shape[2], is_causal=bool(is_causal),
                   softcap=kwargs.get("softcap"), batch=query.shape[0], heads=query.shape[1])
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        mask = _masks.sink(sinks) if mask is None else mask & _masks.sink(sinks)
    return mask


# ---------------------------------------------------------------------------- the front door
def _require(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f'{why} needs the package {module}, which is not installed: pip install "multihead[hf]"')


def _check_load_args(path: object, gguf_file: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a directory (str or os.PathLike), got {type(path).__name__}")
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"path {folder!r} is not a directory; multihead's load reads a folder saved with "
                         "model.save_pretrained(...) (and its tokenizer), or the folder holding gguf_file; "
                         "nothing is downloaded")
    if gguf_file is not None:
        if not isinstance(gguf_file, str):
            raise TypeError(f"gguf_file must be a file name in {folder!r}, got {type(gguf_file).__name__}")
        if not os.path.isfile(os.path.join(folder, gguf_file)):
            found = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
            raise ValueError(f"gguf_file {gguf_file!r} is not in {folder!r} (GGUF files there: "
                             f"{', '.join(found) or 'none'})")
    elif not os.path.isfile(os.path.join(folder, "config.json")):
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        hint = f"; for a GGUF file pass gguf_file={ggufs[0]!r}" if ggufs else ""
        raise ValueError(f"path {folder!r} has no config.json; save the model with save_pretrained{hint}")
    return folder


def _dtype_keyword() -> str:
    """``from_pretrained``'s name for the dtype: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _model_class(config: Any) -> Any:
    """AutoModelForCausalLM for a causal LM (by the config's architectures, or, when it names none
    as a GGUF file's config does, by whether transformers has a causal LM for its model type),
    else AutoModel."""
    from transformers import AutoModel, AutoModelForCausalLM

    archs = getattr(config, "architectures", None) or []
    causal_lm = any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)
    if not archs:
        causal_lm = type(config) in AutoModelForCausalLM._model_mapping and not getattr(config, "is_encoder_decoder", False)
    return AutoModelForCausalLM if causal_lm else AutoModel


def _check_backend_compatible(cls: Any, config: Any, folder: str) -> None:
    mapping = cls._model_mapping
    if type(config) not in mapping:
        raise ValueError(f"{folder!r}: transformers has no {cls.__name__} for model_type "
                         f"{getattr(config, 'model_type', '?')!r}")
    model_cls = mapping[type(config)]
    if not model_cls.is_backend_compatible():
        raise ValueError(f"{folder!r}: {model_cls.__name__}'s attention cannot run on multihead: it does not call "
                         "transformers' AttentionInterface (BERT-, Llama-, GPT-2-style models do)")


def load(path: "str | os.PathLike[str]", gguf_file: Optional[str] = None, *, backend: BackendName = "auto",
         dtype: Optional[torch.dtype] = None, model_class: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a local checkpoint, with every attention layer on multihead.

    >>> model, tokenizer = load(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    >>> ids = tokenizer("The capital of France is", return_tensors="pt")               # doctest: +SKIP
    >>> tokenizer.decode(model.generate(**ids, max_new_tokens=5, do_sample=False)[0])  # doctest: +SKIP

    Args:
        path: a directory saved with ``save_pretrained`` (config.json, weights, tokenizer), or
            the folder holding ``gguf_file``.
        gguf_file: a GGUF file's name in ``path`` (llama.cpp's format; config, tokenizer and
            quantised tensors in one file, de-quantised to float32 here).
        backend: the multihead backend of calls without ``output_attentions`` (see
            :func:`register`).
        dtype: the parameters' dtype (default: the checkpoint's; float32 for GGUF).
        model_class: a transformers auto class or model class (default: ``AutoModelForCausalLM``
            for a causal LM, else ``AutoModel``).

    Returns:
        the model in eval mode (``model.config._attn_implementation == "multihead"``) and its
        tokenizer.

    Raises:
        ImportError: transformers, tokenizers or (for a GGUF file) gguf is missing; the message
            names ``pip install "multihead[hf]"``.
        ValueError / TypeError: a path that is not a checkpoint directory, a ``gguf_file`` not
            there, a model whose attention does not go through transformers' AttentionInterface.
    """
    folder = _check_load_args(path, gguf_file)
    _require("transformers", "multihead's load")
    _require("tokenizers", "multihead's load")
    if gguf_file is not None:
        _require("gguf", f"reading {gguf_file}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    register(backend=backend)
    name = gguf_file or os.path.basename(os.path.normpath(folder))
    source = {"gguf_file": gguf_file} if gguf_file is not None else {}
    with progress(f"loading {name}", total=4) as bar, reading_gguf_once():
        bar.update(note="config")
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **source)
        cls = model_class or _model_class(config)
        if hasattr(cls, "_model_mapping"):
            _check_backend_compatible(cls, config, folder)
        bar.update(note="tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **source)
        bar.update(note="weights")
        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()   # ours is the one bar
        try:
            if gguf_file is None:
                model = cls.from_pretrained(folder, local_files_only=True, attn_implementation=NAME,
                                            **({_dtype_keyword(): dtype} if dtype is not None else {}))
            else:
                model = from_gguf(cls, config, os.path.join(folder, gguf_file), bar=bar)
                if dtype is not None:
                    model = model.to(dtype)
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()
        bar.update()
    return model.eval(), tokenizer


def from_gguf(cls: Any, config: Any, file: str, *, attn_implementation: str = NAME,
              bar: Optional[Progress] = None) -> Any:
    """A model of ``cls`` (an auto class or a model class) built from ``config`` (read from the
    GGUF ``file`` with ``AutoConfig.from_pretrained(folder, gguf_file=...)``) without random
    initialisation, holding the file's tensors: transformers' reader de-quantises them (to
    float32) and puts llama.cpp's q/k rows back in rotate-half order; tied weights (an LM head
    sharing the embedding) are tied again. Progress goes to ``bar``, or to a bar of its own."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = cls.from_config(config, attn_implementation=attn_implementation)
    with contextlib.ExitStack() as stack:
        if bar is None:   # its own bar, or a note on the bar of a task around it
            bar = stack.enter_context(progress(f"reading {os.path.basename(file)}"))
        stack.enter_context(_reporting_tensors(gguf_utils, bar))
        tensors = gguf_utils.load_gguf_checkpoint(file, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)
            if any(p is q for n, q in model.named_parameters() if n != name)}
    untied = [m for m in missing if m not in tied]
    if untied or unexpected:
        raise ValueError(f"{os.path.basename(file)} does not fit {type(model).__name__}: missing {untied[:5]}, "
                         f"unexpected {list(unexpected)[:5]}")
    return model


@contextlib.contextmanager
def reading_gguf_once() -> Any:
    """Inside the block, each GGUF file is parsed once and gguf's tensor-name table built once.

    >>> with reading_gguf_once():  # doctest: +SKIP
    ...     config = AutoConfig.from_pretrained(folder, gguf_file=name)
    ...     tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    transformers' GGUF reader parses the whole file (its metadata holds the vocabulary) for the
    config, again for the tokenizer and again with the tensors, and builds gguf's table of tensor
    names once per module of the model; both are pure functions of their arguments, so inside the
    block the first result is kept (``gguf.GGUFReader`` and ``gguf.get_tensor_name_map``, which
    transformers imports at each call, are wrapped, then restored). Without gguf it does nothing."""
    try:
        import gguf as _gguf
    except ImportError:
        yield
        return
    gguf: Any = _gguf  # its names are rebound below, which its own annotations forbid
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: "str | os.PathLike[str]", mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


@contextlib.contextmanager
def _reporting_tensors(gguf_utils: Any, bar: Progress) -> Any:
    """transformers' GGUF reader loops over the tensors under its own ``tqdm``; while it runs, that
    name counts them into ``bar`` instead (nothing is changed when the reader has no such name)."""
    if not hasattr(gguf_utils, "tqdm"):
        yield
        return

    def counted(items: Iterable[Any], *args: Any, **kwargs: Any) -> Any:
        items = list(items)
        for i, item in enumerate(items):
            yield item
            bar.update(0, note=f"de-quantising {i + 1}/{len(items)}")

    saved = gguf_utils.tqdm
    gguf_utils.tqdm = counted
    try:
        yield
    finally:
        gguf_utils.tqdm = saved


if importlib.util.find_spec("transformers") is not None:
    register()
