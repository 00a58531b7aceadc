"""``multihead.explain_module(module_or_trace, x, ...)``: the walkthrough of the user's own attention.

>>> import torch, multihead
>>> mha = multihead.MultiHeadAttention(8, 2, causal=True)            # backend="auto": one fused step
>>> e = multihead.explain_module(mha, torch.randn(1, 3, 8))
>>> e.reopened, e.agreement.ok, e.all_checks_hold
(True, True, True)
>>> "softmax" in e.text()
True

Any configuration of :class:`multihead.MultiHeadAttention` (self or cross attention, grouped
query heads, masks, rotary embeddings, a KV cache, any backend) runs once on the user's inputs
inside :func:`multihead.trace`, with values kept. A fused backend (sdpa, chunked, flex) records
one step, with no scores and no weights to show: the same inputs are then run again on the
reference backend (``return_weights=True``), every step of that run is shown, the output says so,
and a check holds both outputs to the project's tolerance rule: the fused output may differ from
a float64 run of the reference backend by at most twice the reference backend's own error in the
inputs' dtype, plus a floor of 4 eps x the largest value (:mod:`multihead.explain.checks`).

Nothing of the user's is changed: the module keeps its mode and weights, a cache given is copied
before the run (the user's keeps its length), torch's random state is restored.

The result, :class:`Explanation`, renders as ``.text(lang=)``, ``.markdown()``, ``.json()`` and
``.html()`` (a self-contained page), and shows itself inline in Jupyter (``_repr_html_``: the page
in an isolated ``<iframe srcdoc>``, :mod:`multihead.explain.notebook`).

Legend: B batch, Lq/Lk query/key lengths, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .. import steps
from ..module import MultiHeadAttention
from ..per_head import PerHeadAttention
from ..trace import Trace, trace
from .checks import Check, _floor, _max_abs_diff, walkthrough_checks
from .example import LIMITS
from .i18n import LANGS, word
from .walkthrough import Walkthrough, _wrap, render_json, render_markdown, render_text

#: the check the re-run adds (a key of :data:`multihead.steps.CHECKS`)
AGREEMENT_CHECK = "the fused backend's output equals the reference backend's within tolerance"
#: the check of :func:`.checks.walkthrough_checks` that holds the output to the tutorial's plain
#: code, which has no rotary embeddings, masks, cache or separate values
_PLAIN_CODE_CHECK = "output equals the tutorial's plain code in float64"

__all__ = ["Agreement", "Explanation", "explain_module"]


@dataclass(frozen=True)
class Agreement:
    """The fused backend's output against the reference backend's, on the same inputs.

    backend: the fused backend that ran; max_diff: max |fused - reference|; error: max |fused -
    float64 reference|; tolerance: the bound ``error`` is held to (2 x the reference backend's own
    float64 error + 4 eps x max |value|); ok: error <= tolerance.
    """

    backend: str
    max_diff: float
    error: float
    tolerance: float
    ok: bool


class Explanation:
    """What :func:`explain_module` found: the walkthrough shown, its checks, and its renderings.

    Attributes:
        walkthrough: the :class:`.walkthrough.Walkthrough` every format renders (its ``checks``
            is the one list the text, Markdown, JSON and HTML all show).
        trace: the :class:`multihead.Trace` whose steps are shown (the reference re-run when
            the module's backend fused the call).
        fused_trace: the trace of the user's own call when it was fused, else None.
        agreement: :class:`Agreement` of the fused and reference outputs, or None.
        output: the output of the user's call (B, Lq, d_out), or None for a trace given alone.
    """

    def __init__(self, walkthrough: Walkthrough, *, fused_trace: Optional[Trace] = None,
                 agreement: Optional[Agreement] = None):
        self.walkthrough = walkthrough
        self.fused_trace = fused_trace
        self.agreement = agreement
        if agreement is not None:
            out = walkthrough.trace.select(steps.OUTPUT_PROJECTION)[-1]
            walkthrough.extra_checks.append(Check(out.label, AGREEMENT_CHECK, agreement.ok, out))

    @property
    def trace(self) -> Trace:
        return self.walkthrough.trace

    @property
    def output(self) -> Optional[torch.Tensor]:
        return self.walkthrough.output

    @property
    def reopened(self) -> bool:
        """True when the steps shown are a reference-backend re-run of a fused call."""
        return self.fused_trace is not None

    @property
    def checks(self) -> list[Check]:
        """Every check, from one list (:attr:`.walkthrough.Walkthrough.checks`): each step's own,
        the recomputations of :mod:`multihead.explain.checks`, the fused/reference agreement."""
        return self.walkthrough.checks

    @property
    def all_checks_hold(self) -> bool:
        return all(c.ok for c in self.checks)

    def headline(self, lang: str = "en") -> str:
        """The sentence that says where the steps come from ("" for a call that was not fused)."""
        _check_lang(lang)
        a = self.agreement
        if a is None:
            return ""
        return word("reopened", lang, backend=a.backend, diff=f"{a.max_diff:.3g}", err=f"{a.error:.3g}", tol=f"{a.tolerance:.3g}")

    # -- renderings
    def _with_headline(self, text: str, lang: str, *, markdown: bool = False) -> str:
        head = self.headline(lang)
        if not head:
            return text
        first, _, rest = text.partition("\n")
        body = [head] if markdown else _wrap(head, "")
        return "\n".join([first, ""] + body + ([""] if not rest.startswith("\n") else []) + [rest])

    def text(self, lang: str = "en", *, values: bool = True) -> str:
        """The walkthrough as plain text, lines of at most :data:`.walkthrough.WIDTH` columns."""
        _check_lang(lang)
        return self._with_headline(render_text(self.walkthrough, lang=lang, values=values), lang)

    def markdown(self, lang: str = "en", *, values: bool = True) -> str:
        """The walkthrough as Markdown."""
        _check_lang(lang)
        return self._with_headline(render_markdown(self.walkthrough, lang=lang, values=values), lang, markdown=True)

    def json(self, lang: str = "en", *, values: bool = True) -> str:
        """The walkthrough as JSON (valid JSON: no NaN; infinities as strings)."""
        _check_lang(lang)
        data = json.loads(render_json(self.walkthrough, lang=lang, values=values))
        if self.agreement is not None:
            a = self.agreement
            data["reopened"] = {"backend": a.backend, "max_abs_diff": a.max_diff, "error": a.error,
                                "tolerance": a.tolerance, "ok": a.ok, "text": self.headline(lang)}
        return json.dumps(data, ensure_ascii=False, indent=1, allow_nan=False) + "\n"

    def _too_large_for_a_page(self) -> Optional[str]:
        """Why the page cannot draw this walkthrough (None when it can)."""
        limit = LIMITS["html"]
        scores = self.trace.select(steps.SCORES)
        if not scores:
            return None
        lq, lk = scores[0].shape[-2:]
        if max(lq, lk) > limit.tokens or scores[0].tensor is not None and scores[0].tensor.numel() > limit.scores:
            return (f"the page shows at most {limit.tokens} tokens and {limit.scores:,} scores ({limit.why}); "
                    f"this call has Lq={lq}, Lk={lk}: use .text() or .json(), or explain a shorter slice such as x[:, :{limit.tokens}]")
        return None

    def html(self, lang: str = "en") -> str:
        """One self-contained HTML page (inline CSS, JS and SVG; no network).

        Raises ValueError past the page's size (at most 64 query or key tokens)."""
        from . import visual

        _check_lang(lang)
        why = self._too_large_for_a_page()
        if why is not None:
            raise ValueError(why)
        found = visual.attention_steps(self.trace)
        maps = visual.head_maps_from_trace(self.trace) if found is not None and self.trace.keep_values else []
        note = {lg: self.headline(lg) for lg in LANGS} if self.agreement is not None else None
        return visual.render_html(self.walkthrough, maps, lang=lang, source_note=note)

    def _repr_html_(self) -> Optional[str]:
        """Jupyter's display: the page in an isolated iframe; None (Jupyter then shows the text
        repr) when the call is too large for the page."""
        from .notebook import iframe

        if self._too_large_for_a_page() is not None:
            return None
        return iframe(self.html())

    def __repr__(self) -> str:
        checks = self.checks
        held = sum(c.ok for c in checks)
        how = f", re-run on the reference backend from {self.agreement.backend}" if self.agreement else ""
        return (f"<multihead.Explanation: {len(self.trace.steps)} steps{how}, checks {held}/{len(checks)} hold; "
                f".text(), .markdown(), .json(), .html()>")


def _check_lang(lang: str) -> None:
    if lang not in LANGS:
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")


# ---------------------------------------------------------------------------------- running
def _float64(obj: Any) -> Any:
    """A float64 copy of a tensor, or of an object's floating tensor attributes (a KV cache);
    anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if obj is None or not hasattr(obj, "__dict__"):
        return obj
    out = copy.deepcopy(obj)
    for name, value in vars(out).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            setattr(out, name, value.double())
    return out


def _check_inputs(module: MultiHeadAttention, inputs: Sequence[Any], cache: Any) -> None:
    """Type and size checks before any work: the module's own forward checks the rest."""
    if not inputs:
        raise TypeError("explain_module(module, x, ...) needs the input x (B, Lq, d_in) to run the module on")
    if len(inputs) > 3:
        raise TypeError(f"explain_module(module, x, key=None, value=None) takes at most 3 tensors, got {len(inputs)}")
    for name, t in zip(("x", "key", "value"), inputs):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (B, L, features), got {type(t).__name__}")
    x = inputs[0]
    if x is None or x.dim() != 3:
        raise ValueError(f"x must be (B, Lq, d_in), got shape {None if x is None else tuple(x.shape)}")
    keys = inputs[1] if len(inputs) > 1 and inputs[1] is not None else x
    lq = x.shape[1]
    lk = keys.shape[1] if keys.dim() == 3 else lq
    if cache is not None:
        lk = len(cache) + lq
        if getattr(cache, "max_len", None) and type(cache).__name__ == "StaticKVCache":
            lk = cache.max_len
    limit = LIMITS["text"]
    elements = x.shape[0] * module.config.num_heads * lq * lk
    if max(lq, lk) > limit.tokens or elements > limit.scores:
        raise ValueError(
            f"x gives Lq={lq}, Lk={lk}, B*H*Lq*Lk={elements:,} score elements: the walkthrough shows at most "
            f"{limit.tokens} tokens and {limit.scores:,} elements ({limit.why}); explain a shorter slice such as x[:, :16]"
        )


def _run(module: MultiHeadAttention, inputs: tuple[Any, ...], mask: Any, cache: Any, *, reference: bool) -> tuple[Trace, torch.Tensor]:
    """``module(*inputs, mask=mask, cache=copy of cache)`` traced with values, under no_grad,
    torch's random state restored; ``reference``: run the reference backend (return_weights)."""
    devices = [inputs[0].device] if inputs[0].device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), trace(keep_values=True) as tr:
        kwargs: dict[str, Any] = {"mask": mask}
        if cache is not None:
            kwargs["cache"] = copy.deepcopy(cache)
        if reference:
            out, _ = module(*inputs, return_weights=True, **kwargs)
        else:
            out = module(*inputs, **kwargs)
    if reference:
        tr.config["backend"] = "reference"
    return tr, out


def _agreement(module: MultiHeadAttention, inputs: tuple[Any, ...], mask: Any, cache: Any, backend: str,
               fused: torch.Tensor, reference: torch.Tensor) -> Agreement:
    module64 = copy.deepcopy(module).double()
    _, ref64 = _run(module64, tuple(_float64(t) for t in inputs), _float64(mask), _float64(cache), reference=True)
    tolerance = 2 * _max_abs_diff(reference, ref64) + _floor(ref64, fused.dtype)
    error = _max_abs_diff(fused, ref64)
    return Agreement(backend, _max_abs_diff(fused, reference), error, tolerance, error <= tolerance)


def explain_module(source: Any, *inputs: Optional[torch.Tensor], mask: Any = None, cache: Any = None,
            layer: Optional[int] = None) -> Explanation:
    """The walkthrough of ``source``: a :class:`multihead.MultiHeadAttention` run on ``inputs``,
    or a :class:`multihead.Trace` the user recorded (then no inputs).

    Args:
        source: the module, or a trace recorded with ``keep_values=True`` (the default): its
            steps and own checks, plus every step recomputed in float64 when the trace knows its
            module (``multihead.trace(root=model)``, one layer's call).
        inputs: ``x`` (B, Lq, d_in), optionally ``key`` (B, Lk, kdim) and ``value`` (B, Lk, vdim),
            as for ``module(x, key, value)``.
        mask: as for the module's forward (a :mod:`multihead.masks` mask, a bool or float tensor).
        cache: a :class:`multihead.KVCache` / ``StaticKVCache``: the call runs on a copy (yours
            keeps its length).
        layer: for a trace of a stack (``multihead.trace(root=model)``), the layer whose steps
            to explain (``step.layer``); None = every step of the trace.

    Raises TypeError for a source that is neither, ValueError for inputs the module refuses or
    that are too long to show (at most 256 tokens).
    """
    if isinstance(source, Trace):
        if inputs or mask is not None or cache is not None:
            raise TypeError("explain_module(trace) takes no inputs, mask or cache: the trace already ran; "
                            "pass the module instead to run it on inputs")
        if not source.steps:
            raise ValueError("the trace recorded no steps: run the module inside `with multihead.trace() as tr:`")
        from .visual import as_walkthrough

        shown = _layer_of(source, layer) if layer is not None else source
        module = _traced_module(shown)
        if module is None:
            return Explanation(as_walkthrough(shown))
        x = shown.select(steps.INPUT)[0].tensor
        found = walkthrough_checks(shown, module, (x,)) if shown.keep_values and x is not None else []
        # the inputs beyond x and any mask given are not in the trace: no plain-code comparison
        extra = [c for c in found if c.name != _PLAIN_CODE_CHECK]
        return Explanation(Walkthrough(None, module, (x,), shown, as_walkthrough(shown).output, extra))
    if layer is not None:
        raise TypeError("layer= selects a layer of a traced stack: pass the trace (multihead.trace(root=model)), "
                        "not a single MultiHeadAttention")
    if isinstance(source, PerHeadAttention):   # the same function, one fused module (from_per_head)
        source = MultiHeadAttention.from_per_head(source)
    if isinstance(source, torch.nn.Module) and not isinstance(source, MultiHeadAttention):
        return _explain_any_module(source, inputs, mask, cache)
    if not isinstance(source, MultiHeadAttention):
        raise TypeError(
            "explain_module takes a multihead.MultiHeadAttention, a PerHeadAttention, a module that calls multihead.attention "
            f"(and its inputs) or a multihead.Trace, got {type(source).__name__}"
        )
    _check_inputs(source, inputs, cache)
    tr, out = _run(source, inputs, mask, cache, reference=False)
    from .visual import attention_steps

    if attention_steps(tr) is not None:
        return Explanation(_walkthrough(source, inputs, mask, cache, tr, out))
    backend = str(tr.config.get("backend", source.config.backend))
    if source.training and source.config.dropout:
        raise ValueError(
            f"the module is in training mode with dropout={source.config.dropout} on the {backend} backend, whose "
            "dropout draws the reference backend cannot replay: call module.eval() first, or build it with backend='reference'"
        )
    ref, ref_out = _run(source, inputs, mask, cache, reference=True)
    agreement = _agreement(source, inputs, mask, cache, backend, out, ref_out)
    return Explanation(_walkthrough(source, inputs, mask, cache, ref, out), fused_trace=tr, agreement=agreement)


def _explain_any_module(module: torch.nn.Module, inputs: tuple[Any, ...], mask: Any, cache: Any) -> Explanation:
    """A module of the user's (or ``multihead.nn.MultiheadAttention``) that calls
    :func:`multihead.attention`: run once on ``inputs`` under a trace rooted at it, explained as
    that trace (its steps, their own checks)."""
    if mask is not None or cache is not None:
        raise TypeError(f"explain_module({type(module).__name__}, ...) runs module(*inputs): pass the mask or cache the way "
                        "your module takes them, inside inputs (mask= and cache= are MultiHeadAttention's)")
    if not inputs:
        raise TypeError(f"explain_module({type(module).__name__}, ...) needs the inputs to run it on: explain_module(module, x)")
    with torch.no_grad(), trace(keep_values=True, root=module) as tr:
        module(*inputs)
    if not tr.steps:
        raise TypeError("explain_module takes a multihead.MultiHeadAttention (and its inputs), a PerHeadAttention, a module "
                        f"that calls multihead.attention or a multihead.Trace, got {type(module).__name__}, which did not call "
                        "multihead.attention (nothing was recorded)")
    return explain_module(tr)


def _walkthrough(module: MultiHeadAttention, inputs: tuple[Any, ...], mask: Any, cache: Any, tr: Trace,
                 out: torch.Tensor) -> Walkthrough:
    """The walkthrough of a reference-backend trace of ``module``: its steps recomputed one by
    one; the whole output against the tutorial's plain code only where that code is the
    module's definition (no rotary embeddings, mask, cache or separate values)."""
    found = walkthrough_checks(tr, module, tuple(t for t in inputs if t is not None))
    plain = module.rope is None and mask is None and cache is None and (len(inputs) < 3 or inputs[2] is inputs[1])
    if not plain:
        found = [c for c in found if c.name != _PLAIN_CODE_CHECK]
    return Walkthrough(None, module, inputs, tr, out, found)


def _layer_of(tr: Trace, layer: int) -> Trace:
    """The steps of ``tr`` that layer ``layer`` ran, as a trace of their own (the config of that
    layer's first call)."""
    layers = sorted({s.layer for s in tr.steps if s.layer is not None})
    if isinstance(layer, bool) or not isinstance(layer, int) or layer not in layers:
        raise ValueError(f"layer must be one of the trace's layers {layers}, got {layer!r}")
    picked = tr.select(layer=layer)
    first = next(s.call for s in picked if s.call is not None)
    picked = [s for s in picked if s.call == first]
    out = Trace(keep_values=tr.keep_values, root=tr.root)
    out.steps = list(picked)
    out.calls = tr.calls
    out.config = dict(tr.calls[first].config) if first is not None else dict(tr.config)
    return out


def _traced_module(tr: Trace) -> Optional[MultiHeadAttention]:
    """The module that ran every step of ``tr``, when the trace knows it (one call of a module
    under the trace's root); else None."""
    calls = {s.call for s in tr.steps}
    paths = {s.path for s in tr.steps}
    if tr.root is None or len(calls) != 1 or None in calls or len(paths) != 1:
        return None
    try:
        module = tr.root.get_submodule(paths.pop()) if "" not in paths else tr.root
    except AttributeError:  # the root changed since the trace ran
        return None
    return module if isinstance(module, MultiHeadAttention) else None
